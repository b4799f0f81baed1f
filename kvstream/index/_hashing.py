"""The index's own block hash: a seeded chain over token blocks, independent of the engine's.

Engines hash blocks with schemes a router cannot rely on (sha256 or xxhash, 64
bits or a 32-byte digest, signed or not, seeded per deployment). The index
therefore rehashes every block from its tokens, as Dynamo and llm-d do, so that
a prompt's blocks get the same hashes whichever engine reported them.

The hash is computed with numpy over a whole prompt (or a whole batch) at once,
which is what makes a pure-Python index fast. For a block of tokens
`t_0 .. t_{B-1}` (uint32):

* the tokens are read as little-endian uint32 and taken two at a time as one
  uint64 word `w_j` (one token per word when the block size is odd);
* each word is mixed: `x_j = (w_j XOR S_j) * K1`, `x_j ^= x_j >> 32`
  (`S_j`: per-position constants from the seed), and the block's value is
  `v = sum(x_j) XOR salt`, then `v *= K2`, `v ^= v >> 29` (all mod 2**64);
* the chain is a polynomial over the blocks: `h_k = (h_{k-1} * P + v_k) mod 2**60`
  with `h_{-1}` the *root*, derived from the seed. `h_k` is the block's hash.

`salt` is 0 for the usual block. A block with an adapter or extra keys, or
with a token at or above `2**32` (its words then hold the low 32 bits), gets
the low 64 bits of `blake2b(msgpack([lora_name, extra_keys, high_words]))`.
The chain's linear form lets a run of blocks be hashed with one cumulative sum,
and needs no block's depth: only its parent's hash.

Collisions: two different blocks after the same parent share a hash with
probability about `2**-60` for tokens that were not chosen against the seed;
a million indexed blocks collide with probability below `10**-6`. This is a
router's hash, not a cryptographic one: it is not meant to withstand an
adversary who knows the seed. 60 bits is the largest integer CPython keeps in
32 bytes.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import msgspec

from kvstream.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    U64 = npt.NDArray[np.uint64]

__all__ = ["HASH_BITS", "BlockHasher", "fold_engine_hash", "tokens_array"]

#: Bits of the index's own hashes.
HASH_BITS: Final = 60
_MASK: Final = (1 << HASH_BITS) - 1
_M64: Final = (1 << 64) - 1

#: Engine hashes are folded to 60 bits: the largest integers CPython keeps in 32 bytes.
_ENGINE_MASK: Final = (1 << 60) - 1

_encode_payload = msgspec.msgpack.Encoder().encode


def fold_engine_hash(h: int | bytes) -> int:
    """An engine's block hash as a compact dict key: its low 60 bits.

    Integers (vLLM's unsigned, SGLang's signed) keep their low 60 bits; a digest
    given as bytes keeps the low 60 bits of its last 8 bytes (llm-d also reads the
    last 8). Within one engine two different blocks then share a key with
    probability about `n**2 / 2**61`.
    """
    if type(h) is int:
        return h & _ENGINE_MASK
    return int.from_bytes(h[-8:], "big") & _ENGINE_MASK  # type: ignore[index]


def _seed_bytes(seed: int | str | bytes) -> bytes:
    if type(seed) is bytes:
        return seed
    if type(seed) is str:
        return seed.encode()
    if type(seed) is int:
        return str(seed).encode()
    raise ConfigError(f"seed: expected an int, str or bytes, got {seed!r}")


def tokens_array(token_ids: Sequence[int], what: str = "token_ids") -> tuple[array[int], bool]:
    """`token_ids` as a uint32 array, and whether some token needed more than 32 bits.

    Tokens of 32 bits or more keep their low 32 bits here (the hash salts their
    blocks with the rest). Anything but integers in `[0, 2**64)` is refused.
    """
    data = array("I")
    try:
        data.fromlist(token_ids if type(token_ids) is list else list(token_ids))
    except OverflowError:
        wide = array("Q")
        try:
            wide.fromlist(list(token_ids))
        except (OverflowError, TypeError):
            bad = next((t for t in token_ids if type(t) is not int or not 0 <= t < 2**64), None)
            raise ConfigError(f"{what}: expected integers in [0, 2**64), got {bad!r:.80}") from None
        data = array("I", [t & 0xFFFFFFFF for t in wide])
        return data, True
    except TypeError:
        bad = next((t for t in token_ids if type(t) is not int), None)
        raise ConfigError(f"{what}: expected integers in [0, 2**64), got {bad!r:.80}") from None
    if sys.byteorder == "big":  # pragma: no cover - the hash reads little-endian words
        data.byteswap()
    return data, False


class BlockHasher:
    """Chains the index's block hashes; see the module doc for the exact definition."""

    __slots__ = (
        "_ipow",
        "_k1",
        "_k2",
        "_mask",
        "_odd",
        "_ones",
        "_pack",
        "_pow",
        "_py_k1",
        "_py_k2",
        "_py_seeds",
        "_root",
        "_s29",
        "_s32",
        "_seeds",
        "_unpack",
        "_words",
        "block_size",
        "multiplier",
        "root",
    )

    def __init__(self, block_size: int, seed: int | str | bytes = 0) -> None:
        import numpy as np  # imported on first use: `import kvstream` stays light

        if type(block_size) is not int or block_size <= 0:
            raise ConfigError(f"block_size: expected a positive int, got {block_size!r}")
        self.block_size = block_size
        self._odd = block_size % 2 == 1
        self._words = block_size if self._odd else block_size // 2
        material = hashlib.blake2b(
            _seed_bytes(seed), digest_size=64, person=b"kvstream.index2"
        ).digest()
        stream = hashlib.shake_256(material).digest(8 * (self._words + 4))
        values = [int.from_bytes(stream[i : i + 8], "little") for i in range(0, len(stream), 8)]
        #: the parent of the first block of every chain
        self.root = values[0] & _MASK
        #: P, odd so that the chain is invertible
        self.multiplier = (values[1] & _MASK) | 1
        # Constants as 0-d arrays, not numpy scalars: an in-place ufunc with a 0-d array
        # operand costs about a third of one with a scalar (no scalar conversion), and a
        # short prompt's hash is a dozen such calls.
        self._k1 = np.array(values[2] | 1, dtype=np.uint64)
        self._k2 = np.array(values[3] | 1, dtype=np.uint64)
        self._root = np.array(self.root, dtype=np.uint64)
        self._mask = np.array(_MASK, dtype=np.uint64)
        #: the per-position constants, one row per block, grown on demand (xor with a
        #: slice of equal shape is cheaper than a broadcast of one row)
        self._seeds = np.array([values[4:]] * 64, dtype=np.uint64)
        #: the same constants as Python ints, for hashing one block without numpy
        self._py_k1 = values[2] | 1
        self._py_k2 = values[3] | 1
        self._py_seeds = values[4:]
        self._unpack = struct.Struct(
            f"<{block_size}I" if self._odd else f"<{self._words}Q"
        ).unpack_from
        self._pack = struct.Struct(f"<{block_size}I").pack
        #: a row sum as a matrix product: several times cheaper than sum(axis=1) in numpy
        self._ones = np.ones(self._words, dtype=np.uint64)
        self._s32 = np.array(32, dtype=np.uint64)
        self._s29 = np.array(29, dtype=np.uint64)
        self._pow: U64 = np.empty(0, dtype=np.uint64)
        self._ipow: U64 = np.empty(0, dtype=np.uint64)

    # -- pieces ------------------------------------------------------------------------------

    def _powers(self, n: int) -> tuple[U64, U64]:
        """`P**j` and `P**-j` for j = 1..n (mod 2**64), grown on demand."""
        import numpy as np  # imported on first use: `import kvstream` stays light

        if len(self._pow) < n:
            size = max(n, 2 * len(self._pow), 64)
            p = self.multiplier
            inv = pow(p, -1, 1 << 64)
            pw = [0] * size
            ipw = [0] * size
            a = b = 1
            for j in range(size):
                a = a * p & _M64
                b = b * inv & _M64
                pw[j] = a
                ipw[j] = b
            self._pow = np.array(pw, dtype=np.uint64)
            self._ipow = np.array(ipw, dtype=np.uint64)
        return self._pow[:n], self._ipow[:n]

    def values(self, data: Any, n_blocks: int) -> U64:
        """Each block's value `v` (before its salt is mixed in): `data` holds
        at least `n_blocks` blocks of uint32 little-endian tokens (bytes, an
        `array('I')` or a memoryview)."""
        import numpy as np  # imported on first use: `import kvstream` stays light

        if self._odd:
            words = np.frombuffer(data, dtype="<u4", count=n_blocks * self.block_size)
            x = words.astype(np.uint64).reshape(n_blocks, self._words)
        else:
            x = np.frombuffer(data, dtype="<u8", count=n_blocks * self._words).reshape(
                n_blocks, self._words
            )
        seeds = self._seeds
        if len(seeds) < n_blocks:
            self._seeds = seeds = np.tile(seeds[0], (max(n_blocks, 2 * len(seeds)), 1))
        x = x ^ seeds[:n_blocks]
        x *= self._k1
        x ^= x >> self._s32
        out: U64 = x @ self._ones  # mod 2**64, as the sum
        return out

    def first_hash(self, data: Any, salt: int = 0) -> int:
        """The own hash of the first block of `data` (as `values()` reads it), chained
        on the root, in pure Python: for one block, cheaper than numpy's fixed costs."""
        return self._one(self.root, self._unpack(data), salt)

    def block_hash(self, parent: int, tokens: Sequence[int], salt: int = 0) -> int:
        """The own hash of one block of `block_size` tokens (each below `2**32`)
        chained on `parent`, in pure Python. Raises `struct.error` for other tokens."""
        return self._one(parent, self._unpack(self._pack(*tokens)), salt)

    def _one(self, parent: int, words: Sequence[int], salt: int) -> int:
        k1 = self._py_k1
        v = 0
        for w, s in zip(words, self._py_seeds, strict=True):
            x = (w ^ s) * k1 & _M64
            v += x ^ x >> 32
        v = ((v & _M64) ^ salt) * self._py_k2 & _M64
        v ^= v >> 29
        return (parent * self.multiplier + v) & _MASK

    def prompt_hashes(self, data: Any, n: int, salts: U64 | None = None) -> U64:
        """The own hashes of the first `n` blocks of `data`, chained on the root:
        `values()`, the salts, `finish()` and `chain_array()` in one pass."""
        import numpy as np  # imported on first use: `import kvstream` stays light

        v = self.values(data, n)
        if salts is not None:
            v ^= salts
        v *= self._k2
        v ^= v >> self._s29
        pw, ipw = self._powers(n)
        v *= ipw
        np.add.accumulate(v, out=v)  # np.cumsum less its Python-level dispatch (1.5 µs)
        v += self._root
        v *= pw
        v &= self._mask
        return v

    def finish(self, v: U64) -> U64:
        """The last mixing steps of a block value (after its salt)."""
        v *= self._k2
        v ^= v >> self._s29
        return v

    def salt(
        self,
        lora_name: str | None,
        extra: Sequence[Any] | None,
        high: Sequence[int] | None = None,
    ) -> int:
        """A block's salt: 0 for the usual block (see the module doc)."""
        if lora_name is None and extra is None and high is None:
            return 0
        payload = _encode_payload([lora_name, extra, high])
        digest = hashlib.blake2b(payload, digest_size=8, person=b"kvstream.salt").digest()
        return int.from_bytes(digest, "little") | 1  # never 0

    def block_values(
        self,
        token_ids: Sequence[int],
        n_blocks: int,
        lora_name: str | None = None,
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
    ) -> U64:
        """The finished value of each of the first `n_blocks` blocks of `token_ids`."""
        data, wide = tokens_array(token_ids)  # the partial last block too: no copy
        v = self.values(data, n_blocks)
        salts = self.salts(token_ids, n_blocks, lora_name, extra_keys, wide)
        if salts is not None:
            v ^= salts
        return self.finish(v)

    def salts(
        self,
        token_ids: Sequence[int],
        n_blocks: int,
        lora_name: str | None,
        extra_keys: Sequence[Sequence[Any] | None] | None,
        wide: bool,
    ) -> U64 | None:
        """Per-block salts, or None when every block's is 0."""
        import numpy as np  # imported on first use: `import kvstream` stays light

        if lora_name is None and extra_keys is None and not wide:
            return None
        size = self.block_size
        out = []
        for i in range(n_blocks):
            extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
            high = None
            if wide:
                block = token_ids[i * size : (i + 1) * size]
                if any(t >> 32 for t in block):
                    high = [t >> 32 for t in block]
            out.append(self.salt(lora_name, extra, high))
        return np.array(out, dtype=np.uint64)

    def chain_values(self, parent: int, v: U64) -> list[int]:
        """The hashes of blocks of finished values `v` chained on the hash `parent`."""
        out: list[int] = self.chain_array(parent, v).tolist()
        return out

    def chain_array(self, parent: int, v: U64) -> U64:
        """`chain_values()` as a uint64 array."""
        import numpy as np  # imported on first use: `import kvstream` stays light

        n = len(v)
        pw, ipw = self._powers(n)
        acc = v * ipw
        np.add.accumulate(acc, out=acc)
        acc += np.uint64(parent)
        acc *= pw
        acc &= self._mask
        return acc

    # -- the reference spelling -------------------------------------------------------------

    def chain(
        self,
        parent: int | None,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
    ) -> list[int]:
        """The hashes of every full block of `token_ids` chained on `parent`.

        `parent` is an index hash (None: the root). `extra_keys` has one entry
        per block (None or a list), as the index keeps them (see
        `kvstream.index._keys.block_keys()`).
        """
        n = len(token_ids) // self.block_size
        v = self.block_values(token_ids, n, lora_name, extra_keys)
        return self.chain_values(self.root if parent is None else parent, v)
