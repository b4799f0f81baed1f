"""A numpy copy of the index's nodes (own hash -> holders) for lookups of a whole prompt at once.

A dict lookup per block costs three cache misses at a million blocks (the
dict's index, its entry, the key object), one after the other. This table is
two uint64 arrays (keys, values) of buckets of `BUCKET` slots, one 64-byte
cache line of keys per bucket: all of a prompt's hashes are looked up in one
vectorized pass (a gather of one bucket per hash, then one comparison), so
their misses overlap and numpy is called a fixed, small number of times per
prompt.

A key lives in its home bucket (its low 32 bits scaled to the count of buckets,
which can then be any) when that has a free slot, else
in the next bucket with one (linear probing over buckets, rare at the load
kept here: 2 to 5 keys per bucket of 8).

It is a cache, kept in step lazily: the index records which own hashes it
changed (`NodeTable.dirty`), and `NodeTable.sync()` writes their
current values before the next lookup. A key whose value became 0 stays, with
value 0 (a miss), so that the keys after it stay reachable; the table is
rebuilt from the dict when dead and live keys fill it. Holders wider than 64
bits (many streams times many tiers) cannot be stored: the index then looks
up in the dict.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from itertools import repeat
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    U64 = npt.NDArray[np.uint64]

__all__ = ["BUCKET", "EMPTY", "NodeTable"]

#: slots per bucket: 8 uint64 keys are one cache line (and a lookup reads a row of 8
#: booleans as one uint64)
BUCKET: Final = 8
_MIN_BUCKETS: Final = 1 << 9
#: keys per bucket right after a rebuild (43 bytes a key)
_FILL: Final = 3
#: keys (live and dead) per bucket that make the next sync rebuild (32 bytes a key); up to
#: there, about 0.1 to 0.3% of the keys live past their home bucket
_GROW: Final = 4
#: a row of BUCKET booleans, all True, read as one uint64
_ALL_TRUE: Final = 0x0101010101010101
#: times a row of booleans read as one uint64 with exactly one set (the byte at bits
#: 8i to 8i+7 is 1), leaves i in the top byte: byte j of this constant is 7 - j (j on
#: a big-endian machine, where the row's byte i sits at bits 56 - 8i)
_PICK: Final = 0x0001020304050607 if sys.byteorder == "little" else 0x0706050403020100
#: the key of an empty slot
EMPTY: Final = (1 << 64) - 1
#: keys left after a vectorized round that are entered one at a time instead
_FEW: Final = 8


class NodeTable:
    """Buckets of own hashes and their holders: `EMPTY` marks an empty slot (an own
    hash has 60 bits, so it is never one)."""

    __slots__ = (
        "_buckets",
        "_keys",
        "_low32",
        "_nbuckets",
        "_pick",
        "_s3",
        "_s32",
        "_s56",
        "_used",
        "_vals",
        "dirty",
    )

    def __init__(self) -> None:
        import numpy as np  # imported on first use: `import kvstream` stays light

        self._keys: Any = np.full((_MIN_BUCKETS, BUCKET), EMPTY, dtype=np.uint64)
        #: flat: slot `bucket * BUCKET + i`; one more, always 0, for slot -1 (no key)
        self._vals: Any = np.zeros(_MIN_BUCKETS * BUCKET + 1, dtype=np.uint64)
        self._buckets = _MIN_BUCKETS
        # `_home()`'s operands as 0-d arrays, not numpy scalars: an in-place ufunc costs
        # about a third of its time with a scalar operand
        self._nbuckets = np.array(_MIN_BUCKETS, dtype=np.uint64)
        self._low32 = np.array(0xFFFFFFFF, dtype=np.uint64)
        self._s32 = np.array(32, dtype=np.uint64)
        self._s3 = np.array(BUCKET.bit_length() - 1, dtype=np.intp)  # times BUCKET
        self._s56 = np.array(56, dtype=np.uint64)
        self._pick = np.array(_PICK, dtype=np.uint64)
        self._used = 0
        #: own hashes changed in the dict since the last sync (a dict of ints, None:
        #: unlike a set, the garbage collector does not track it)
        self.dirty: dict[int, None] = {}

    @property
    def nbytes(self) -> int:
        return int(self._keys.nbytes + self._vals.nbytes)

    def sync(self, nodes: Mapping[int, int]) -> bool:
        """Write the dirty keys' current values; False if one does not fit in 64 bits."""
        if not self.dirty:
            return True
        import numpy as np

        keys = list(self.dirty)
        values = list(map(nodes.get, keys, repeat(0)))
        self.dirty.clear()  # in place: the index holds this dict
        try:
            v = np.array(values, dtype=np.uint64)
        except OverflowError:
            return False
        k = np.array(keys, dtype=np.uint64)
        if self._used + len(k) > _GROW * len(self._keys):  # full enough: start afresh
            self.rebuild(nodes)
            return True
        self._upsert(k, v)
        return True

    def rebuild(self, nodes: Mapping[int, int]) -> None:
        """Start afresh from the dict's live entries (dead keys go). Raises
        OverflowError when a value does not fit in 64 bits."""
        import numpy as np

        n = len(nodes)
        buckets = max(_MIN_BUCKETS, -(-n // _FILL))
        self.dirty.clear()
        k = np.fromiter(nodes.keys(), dtype=np.uint64, count=n)
        v = np.fromiter(nodes.values(), dtype=np.uint64, count=n)
        self._keys = np.full((buckets, BUCKET), EMPTY, dtype=np.uint64)
        self._vals = np.zeros(buckets * BUCKET + 1, dtype=np.uint64)
        self._buckets = buckets
        self._nbuckets = np.array(buckets, dtype=np.uint64)
        self._used = 0
        if not n:
            return
        # Most keys go straight to their home bucket, in one pass: sorted by bucket, a
        # key's rank among its bucket's keys is its slot. The few past a bucket's end
        # are inserted one round at a time.
        home = self._home(k)
        order = np.argsort(home, kind="stable")
        home = home[order]
        starts = np.flatnonzero(np.r_[True, home[1:] != home[:-1]])
        counts = np.diff(np.r_[starts, n])
        rank = np.arange(n) - np.repeat(starts, counts)
        direct = rank < BUCKET
        placed = order[direct]
        self._keys[home[direct], rank[direct]] = k[placed]
        self._vals[home[direct] * BUCKET + rank[direct]] = v[placed]
        self._used = len(placed)
        rest = order[~direct]
        if len(rest):
            self._upsert(k[rest], v[rest], new=True)

    def _upsert(self, k: U64, v: U64, new: bool = False) -> None:
        """Set `k -> v` for distinct keys `k` (`new`: none of them is in the table).

        One vectorized round per bucket distance, the keys still pending all at once:
        each looks at its bucket (its home bucket first); a key found there takes its
        value; a key not found in a bucket with a free slot is not in the table (keys
        are never taken out, so none lives past a bucket with room) and claims the
        first free slot (several claiming one slot: one wins, read back, the others
        try the same bucket again); a key not found in a full bucket goes on to the
        next one. A key not in the table whose value is 0 (a node gone again) is not
        entered.
        """
        import numpy as np

        keys = self._keys
        flat_keys = keys.reshape(-1)
        vals = self._vals
        bucket = self._home(k)
        pending = np.arange(len(k))
        while len(pending):
            if len(pending) <= _FEW:  # the last few: one at a time is cheaper than a round
                for i in pending.tolist():
                    self._upsert_one(int(k[i]), int(v[i]), int(bucket[i]), new)
                return
            b = bucket[pending]
            want = k[pending]
            rows = keys.take(b, axis=0)
            done = np.zeros(len(pending), dtype=bool)
            if not new:
                hit = (rows == want[:, None]).view(np.uint64).ravel()
                found = hit != 0
                if found.any():
                    vals[b[found] * BUCKET + self._byte_index(hit[found])] = v[pending[found]]
                    done = found
            free = (rows == EMPTY).view(np.uint64).ravel()
            room = free != 0
            open_ = room & ~done
            if not new:
                dead = open_ & (v[pending] == 0)  # absent, and stays so
                done |= dead
                open_ &= ~dead
            if open_.any():
                first = free[open_]
                first &= np.negative(first)  # the first free slot's byte alone
                at = b[open_] * BUCKET + self._byte_index(first)
                claim = want[open_]
                flat_keys[at] = claim  # several on one slot: one of them stays
                won = flat_keys[at] == claim
                vals[at[won]] = v[pending[open_][won]]
                self._used += int(np.count_nonzero(won))
                done[np.flatnonzero(open_)[won]] = True
            on = ~room & ~done  # not found in a full bucket: the next one
            if on.any():
                bucket[pending[on]] = (b[on] + 1) % self._buckets
            pending = pending[~done]

    def _upsert_one(self, key: int, value: int, bucket: int, new: bool) -> None:
        """`_upsert()` of one key, from `bucket` on, in Python."""
        at, found = self._locate(key, bucket)
        if not found:
            if not value and not new:
                return  # absent, and stays so
            self._keys.reshape(-1)[at] = key
            self._used += 1
        self._vals[at] = value

    def _locate(self, key: int, bucket: int) -> tuple[int, bool]:
        """From `bucket` on: the flat slot of `key` and True, or, where it would be
        entered (the first free slot of the first bucket with room), and False."""
        keys = self._keys
        while True:
            row: list[int] = keys[bucket].tolist()
            if key in row:
                return bucket * BUCKET + row.index(key), True
            if EMPTY in row:
                return bucket * BUCKET + row.index(EMPTY), False
            bucket = (bucket + 1) % self._buckets

    def _home(self, k: U64) -> Any:
        """Each key's home bucket (as intp): its low 32 bits times the count of buckets,
        over 2**32 (so that the count need not be a power of two)."""
        import numpy as np

        h = k & self._low32
        h *= self._nbuckets
        h >>= self._s32
        return h.view(np.intp)  # below 2**32: the same as signed

    def _byte_index(self, rows: Any) -> Any:
        """Per row of BUCKET booleans read as one uint64 with exactly one True (or
        none: 0), the index of that True, as intp: a multiplication moves it to the top
        byte (`argmax(axis=1)` over the booleans costs about three times more)."""
        import numpy as np

        pos = rows * self._pick
        pos >>= self._s56
        return pos.view(np.intp)  # below 8: the same as signed

    def _slots(self, k: U64) -> Any:
        """The flat slot of each key `k`; -1 where it is not in the table.

        One gather of each key's home bucket (a cache line of keys) and one
        comparison; the few keys not found in a full bucket are searched for on,
        one bucket at a time.
        """
        import numpy as np

        bucket = self._home(k)
        rows = self._keys.take(bucket, axis=0)  # take: much faster than keys[bucket]
        # A row's 8 booleans read as one uint64 (much cheaper than any(axis=1)): 0 = no
        # match, else one byte is set (a key is at most once in the table).
        hit = (rows == k[:, None]).view(np.uint64).ravel()
        at = bucket << self._s3
        at += self._byte_index(hit)
        if np.count_nonzero(hit) == len(k):
            return at
        missing = (hit == 0).nonzero()[0]
        at[missing] = -1
        if len(missing) > 8:  # a prompt that leaves the index: most end in a bucket with room
            full = (rows[missing] != EMPTY).view(np.uint64).ravel() == _ALL_TRUE
            missing = missing[full]
        for i in missing.tolist():
            row: list[int] = rows[i].tolist()
            if EMPTY not in row:
                at[i] = self._probe_on(int(k[i]), int(bucket[i]))
        return at

    def _probe_on(self, key: int, bucket: int) -> int:
        """The flat slot of `key`, which is not in the full bucket `bucket`; -1 if absent."""
        at, found = self._locate(key, (bucket + 1) % self._buckets)
        return at if found else -1

    def lookup(self, own: Any) -> Any:
        """Holders of each own hash (a uint64 array), 0 where none: `_slots()`,
        then one gather of the values (slot -1 is the last value, always 0)."""
        return self._vals.take(self._slots(own))
