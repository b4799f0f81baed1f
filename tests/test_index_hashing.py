"""The hasher's fast paths agree with a plain spelling of the documented hash."""

from __future__ import annotations

from array import array

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.index import BlockHasher

M64 = (1 << 64) - 1


def documented_chain(hasher: BlockHasher, tokens: list[int], salts: list[int]) -> list[int]:
    """The module doc of `kvstream.index._hashing`, one block and one word at a time."""
    size = hasher.block_size
    seeds = hasher._py_seeds
    k1, k2 = hasher._py_k1, hasher._py_k2
    h = hasher.root
    out = []
    for b, salt in enumerate(salts):
        block = tokens[b * size : (b + 1) * size]
        # two tokens per little-endian word, one when the block size is odd
        pairs = [block[i] | block[i + 1] << 32 for i in range(0, size - 1, 2)]
        words = block if size % 2 else pairs
        v = 0
        for w, s in zip(words, seeds, strict=True):
            x = (w ^ s) * k1 & M64
            v += x ^ (x >> 32)
        v = ((v & M64) ^ salt) * k2 & M64
        v ^= v >> 29
        h = (h * hasher.multiplier + v) & ((1 << 60) - 1)
        out.append(h)
    return out


@settings(max_examples=80, deadline=None, database=None)
@given(
    size=st.integers(1, 20),
    blocks=st.integers(1, 40),
    seed=st.integers(0, 3),
    salted=st.booleans(),
    data=st.data(),
)
def test_prompt_and_first_block_hashes_are_the_documented_chain(
    size: int, blocks: int, seed: int, salted: bool, data: st.DataObject
) -> None:
    hasher = BlockHasher(size, seed)
    tokens = data.draw(
        st.lists(
            st.integers(0, 2**32 - 1), min_size=size * blocks, max_size=size * blocks + size - 1
        )
    )
    salts = [hasher.salt("lora", [i]) if salted else 0 for i in range(blocks)]
    expected = documented_chain(hasher, tokens, salts)
    raw = array("I", tokens).tobytes()
    salt_array = np.array(salts, dtype=np.uint64) if salted else None
    assert hasher.prompt_hashes(raw, blocks, salt_array).tolist() == expected
    assert hasher.first_hash(raw, salts[0]) == expected[0]
    if not salted:
        assert hasher.chain(None, tokens) == expected
