"""Hypothesis strategies for valid events and batches, shared by the codec and event tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvstream import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

U64 = 2**64
I64_MIN = -(2**63)

hashes = st.one_of(st.integers(I64_MIN, U64 - 1), st.binary(max_size=33))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(I64_MIN, U64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)
metadata = st.none() | st.dictionaries(st.text(max_size=8), json_values, max_size=4)
texts = st.none() | st.text(max_size=10)
small_ints = st.none() | st.integers(0, U64 - 1)


@st.composite
def stored_fields(draw: st.DrawFn) -> dict[str, Any]:
    """Keyword arguments of a valid BlockStored, every optional field exercised."""
    n = draw(st.integers(0, 4))
    block_size = draw(st.integers(0, 6))
    if draw(st.booleans()):
        tokens = draw(
            st.lists(st.integers(0, U64 - 1), min_size=n * block_size, max_size=n * block_size)
        )
    else:
        tokens, block_size = [], 0
    extra_entry = st.none() | st.lists(st.one_of(scalars, st.binary(max_size=4)), max_size=3)
    return {
        "block_hashes": draw(st.lists(hashes, min_size=n, max_size=n)),
        "parent_block_hash": draw(st.none() | hashes),
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": draw(st.none() | st.integers(I64_MIN, U64 - 1)),
        "medium": draw(st.none() | st.sampled_from(["GPU", "CPU", "DISK"]) | st.text(max_size=5)),
        "lora_name": draw(texts),
        "extra_keys": draw(st.none() | st.lists(extra_entry, min_size=n, max_size=n)),
        "group_idx": draw(small_ints),
        "kv_cache_spec_kind": draw(texts),
        "kv_cache_spec_sliding_window": draw(st.none() | st.integers(0, 2**20)),
        "locality": draw(texts),
        "metadata": draw(metadata),
    }


block_stored = stored_fields().map(lambda fields: BlockStored(**fields))

events = st.one_of(
    block_stored,
    st.builds(
        BlockRemoved,
        block_hashes=st.lists(hashes, max_size=4),
        medium=texts,
        group_idx=st.none() | st.integers(0, 9),
        locality=texts,
        metadata=metadata,
    ),
    st.builds(AllBlocksCleared, metadata=metadata),
)

batches = st.builds(
    EventBatch,
    seq=st.integers(0, U64 - 1),
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(events, max_size=5),
    data_parallel_rank=st.none() | st.integers(0, 2**31),
    origin=st.text(max_size=10),
    epoch=st.text(max_size=10),
)
