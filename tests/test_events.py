"""Events and batches: keyword-only, validated when made, immutable, comparable."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import hashes, metadata, stored_fields, texts

from kvstream import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    InvalidEventError,
    InvalidEventTypeError,
    JsonCodec,
    KVCacheEvent,
    KVStreamError,
)

U64 = 2**64
I64_MIN = -(2**63)


def stored(**changes: Any) -> BlockStored:
    fields: dict[str, Any] = {
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
    }
    fields.update(changes)
    return BlockStored(**fields)


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


# -- keyword-only ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "args"),
    [
        (BlockStored, ([1], None, [], 0)),
        (BlockRemoved, ([1],)),
        (AllBlocksCleared, (None,)),
    ],
)
def test_fields_are_keyword_only(cls: type[KVCacheEvent], args: tuple[Any, ...]) -> None:
    with pytest.raises(TypeError):
        cls(*args)


def test_event_batch_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        EventBatch(0, 0.0, [])  # type: ignore[call-arg]


def test_the_base_class_is_not_an_event() -> None:
    with pytest.raises(InvalidEventTypeError, match="KVCacheEvent"):
        KVCacheEvent()


# -- validation: every refusal names the field, the value and what was expected -------

BAD_STORED: list[tuple[dict[str, Any], type[Exception], str, str, str]] = [
    # (changes, error, field, value as shown, expected)
    ({"block_hashes": [U64, 2]}, InvalidEventError, "block_hashes[0]", str(U64), "2**64"),
    (
        {"block_hashes": [1, I64_MIN - 1]},
        InvalidEventError,
        "block_hashes[1]",
        "-9223372036854775809",
        "-2**63",
    ),
    ({"block_hashes": [1.5, 2]}, InvalidEventTypeError, "block_hashes[0]", "1.5", "int"),
    ({"block_hashes": [True, 2]}, InvalidEventTypeError, "block_hashes[0]", "True", "int"),
    ({"block_hashes": [1, "ab"]}, InvalidEventTypeError, "block_hashes[1]", "'ab'", "bytes"),
    ({"block_hashes": "ab"}, InvalidEventTypeError, "block_hashes", "'ab'", "list"),
    ({"block_hashes": None}, InvalidEventTypeError, "block_hashes", "None", "list"),
    ({"parent_block_hash": U64}, InvalidEventError, "parent_block_hash", str(U64), "2**64"),
    ({"parent_block_hash": "x"}, InvalidEventTypeError, "parent_block_hash", "'x'", "bytes"),
    ({"token_ids": [-1, *range(7)]}, InvalidEventError, "token_ids[0]", "-1", "non-negative"),
    (
        {"token_ids": [0, 1, 2.0, 3, 4, 5, 6, 7]},
        InvalidEventTypeError,
        "token_ids[2]",
        "2.0",
        "int",
    ),
    ({"token_ids": [True, *range(7)]}, InvalidEventTypeError, "token_ids", "True", "int"),
    ({"token_ids": [0, *range(6), U64]}, InvalidEventError, "token_ids[7]", str(U64), "2**64"),
    ({"token_ids": "abc"}, InvalidEventTypeError, "token_ids", "'abc'", "list of int"),
    ({"token_ids": list(range(7))}, InvalidEventError, "token_ids", "got 7", "4 * 2 = 8"),
    # empty token_ids is only the placeholder form when block_size is 0
    ({"token_ids": []}, InvalidEventError, "token_ids", "got 0", "block_size 0"),
    ({"token_ids": [1], "block_size": 0}, InvalidEventError, "token_ids", "got 1", "= 0"),
    ({"block_size": -1, "token_ids": []}, InvalidEventError, "block_size", "-1", ">= 0"),
    ({"block_size": "4"}, InvalidEventTypeError, "block_size", "'4'", "int"),
    ({"block_size": True}, InvalidEventTypeError, "block_size", "True", "int"),
    (
        {"block_hashes": [], "token_ids": [], "block_size": U64},
        InvalidEventError,
        "block_size",
        str(U64),
        "2**64",
    ),
    ({"lora_id": "7"}, InvalidEventTypeError, "lora_id", "'7'", "int or None"),
    ({"lora_id": U64}, InvalidEventError, "lora_id", str(U64), "2**64"),
    ({"medium": 3}, InvalidEventTypeError, "medium", "3", "str or None"),
    ({"lora_name": b"x"}, InvalidEventTypeError, "lora_name", "b'x'", "str or None"),
    ({"group_idx": -1}, InvalidEventError, "group_idx", "-1", "[0, 2**64)"),
    ({"group_idx": "0"}, InvalidEventTypeError, "group_idx", "'0'", "int"),
    ({"kv_cache_spec_kind": 1}, InvalidEventTypeError, "kv_cache_spec_kind", "1", "str"),
    (
        {"kv_cache_spec_sliding_window": 1.0},
        InvalidEventTypeError,
        "kv_cache_spec_sliding_window",
        "1.0",
        "int",
    ),
    ({"locality": ["x"]}, InvalidEventTypeError, "locality", "['x']", "str"),
    ({"extra_keys": "ab"}, InvalidEventTypeError, "extra_keys", "'ab'", "list"),
    ({"extra_keys": [None]}, InvalidEventError, "extra_keys", "got 1", "one entry per block (2)"),
    ({"extra_keys": ["x", None]}, InvalidEventTypeError, "extra_keys[0]", "'x'", "list or None"),
    (
        {"extra_keys": [[{"a": 1}], None]},
        InvalidEventTypeError,
        "extra_keys[0][0]",
        "{'a': 1}",
        "list of them",
    ),
    ({"extra_keys": [None, [math.nan]]}, InvalidEventError, "extra_keys[1][0]", "nan", "finite"),
    ({"extra_keys": [None, [U64]]}, InvalidEventError, "extra_keys[1][0]", str(U64), "2**64"),
    ({"metadata": {1: "x"}}, InvalidEventTypeError, "metadata key", "1", "str keys"),
    ({"metadata": {"a": math.nan}}, InvalidEventError, "metadata.a", "nan", "finite"),
    ({"metadata": {"a": [1, -math.inf]}}, InvalidEventError, "metadata.a[1]", "-inf", "finite"),
    (
        {"metadata": {"a": {"b": {1, 2}}}},
        InvalidEventTypeError,
        "metadata.a.b",
        "{1, 2}",
        "JSON data",
    ),
    ({"metadata": {"a": b"x"}}, InvalidEventTypeError, "metadata.a", "b'x'", "JSON data"),
    ({"metadata": {"a": U64}}, InvalidEventError, "metadata.a", str(U64), "2**64"),
    ({"metadata": [("a", 1)]}, InvalidEventTypeError, "metadata", "[('a', 1)]", "mapping"),
    ({"metadata": {"a": nested(32)}}, InvalidEventError, "metadata.a", "", "at most 32 deep"),
]


@pytest.mark.parametrize(
    ("changes", "error", "field", "shown", "expected"),
    BAD_STORED,
    ids=[f"{next(iter(c))}-{i}" for i, (c, *_) in enumerate(BAD_STORED)],
)
def test_block_stored_refuses_bad_fields(
    changes: dict[str, Any], error: type[Exception], field: str, shown: str, expected: str
) -> None:
    with pytest.raises(error) as info:
        stored(**changes)
    message = str(info.value)
    assert f"BlockStored.{field}" in message
    assert shown in message
    assert expected in message
    # The project's tree, and the built-in category that fits.
    assert isinstance(info.value, KVStreamError)
    assert isinstance(info.value, ValueError)
    if error is InvalidEventTypeError:
        assert isinstance(info.value, TypeError)
    else:
        assert type(info.value) is InvalidEventError  # type: ignore[comparison-overlap,unreachable]


@pytest.mark.parametrize(
    ("cls", "fields", "field", "shown"),
    [
        (BlockRemoved, {"block_hashes": [U64]}, "block_hashes[0]", str(U64)),
        (BlockRemoved, {"block_hashes": [-1, 0.5]}, "block_hashes[1]", "0.5"),
        (BlockRemoved, {"block_hashes": [1], "medium": 1}, "medium", "1"),
        (BlockRemoved, {"block_hashes": [1], "group_idx": -2}, "group_idx", "-2"),
        (BlockRemoved, {"block_hashes": [1], "locality": 1}, "locality", "1"),
        (BlockRemoved, {"block_hashes": [1], "metadata": {"x": math.inf}}, "metadata.x", "inf"),
        (AllBlocksCleared, {"metadata": {2: 1}}, "metadata key", "2"),
        (AllBlocksCleared, {"metadata": "x"}, "metadata", "'x'"),
    ],
)
def test_other_events_refuse_bad_fields(
    cls: type[KVCacheEvent], fields: dict[str, Any], field: str, shown: str
) -> None:
    with pytest.raises(InvalidEventError) as info:
        cls(**fields)
    assert f"{cls.__name__}.{field}" in str(info.value)
    assert shown in str(info.value)


def test_a_deeply_nested_bad_value_still_gets_a_short_message() -> None:
    deep = nested(2000)
    with pytest.raises(InvalidEventTypeError) as info:
        BlockRemoved(block_hashes=[deep])
    assert "block_hashes[0]" in str(info.value)
    assert len(str(info.value)) < 300


def test_valid_edges_are_accepted() -> None:
    e = stored(block_hashes=[I64_MIN, U64 - 1], parent_block_hash=b"\x00" * 32)
    assert e.block_hashes == [I64_MIN, U64 - 1]
    # vLLM's placeholder form: no tokens, block_size 0.
    assert stored(token_ids=[], block_size=0).token_ids == []
    assert stored(block_hashes=[], token_ids=[], block_size=16).block_hashes == []
    assert stored(token_ids=[0, *range(6), U64 - 1]).token_ids[-1] == U64 - 1
    assert BlockRemoved(block_hashes=[b"", b"\xff"]).block_hashes == [b"", b"\xff"]
    assert stored(metadata={"a": nested(31)}).metadata == {"a": nested(31)}


def test_sequences_and_tuples_are_normalised_to_lists() -> None:
    e = stored(
        block_hashes=(1, 2),
        token_ids=tuple(range(8)),
        extra_keys=((b"k", ("x", 1)), None),
        metadata={"t": (1, (2, 3)), "d": {"u": ()}},
    )
    assert e.block_hashes == [1, 2]
    assert type(e.block_hashes) is list
    assert e.token_ids == list(range(8))
    assert type(e.token_ids) is list
    assert e.extra_keys == [[b"k", ["x", 1]], None]
    assert e.metadata == {"t": [1, [2, 3]], "d": {"u": []}}
    assert BlockRemoved(block_hashes=(3,)).block_hashes == [3]  # type: ignore[arg-type]


def test_metadata_is_copied_so_later_changes_to_the_callers_dict_do_not_leak_in() -> None:
    meta: dict[str, Any] = {"a": [1]}
    e = AllBlocksCleared(metadata=meta)
    meta["b"] = 2
    meta["a"].append(2)
    assert e.metadata == {"a": [1]}


# -- immutability and equality ---------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "field", "value"),
    [
        (stored(), "block_size", 8),
        (stored(), "metadata", {"a": 1}),
        (BlockRemoved(block_hashes=[1]), "medium", "GPU"),
        (AllBlocksCleared(), "metadata", None),
    ],
)
def test_events_are_frozen(event: KVCacheEvent, field: str, value: Any) -> None:
    with pytest.raises(AttributeError):
        setattr(event, field, value)


def test_equality_is_by_type_and_value() -> None:
    assert stored() == stored()
    assert stored(medium="GPU") != stored(medium="CPU")
    assert stored(metadata={"a": (1,)}) == stored(metadata={"a": [1]})
    assert stored(metadata={"a": 1}) != stored()
    assert BlockRemoved(block_hashes=[1]) == BlockRemoved(block_hashes=[1])
    assert BlockRemoved(block_hashes=[1]) != BlockRemoved(block_hashes=[b"\x01"])
    assert AllBlocksCleared() == AllBlocksCleared()
    assert AllBlocksCleared() != BlockRemoved(block_hashes=[])  # type: ignore[comparison-overlap]


# -- EventBatch ---------------------------------------------------------------------------


def test_event_batch_defaults_and_key() -> None:
    b = EventBatch(seq=3, ts=1, events=(AllBlocksCleared(),), data_parallel_rank=0)  # type: ignore[arg-type]
    assert (b.origin, b.epoch) == ("", "")
    assert b.ts == 1.0
    assert type(b.ts) is float
    assert b.events == [AllBlocksCleared()]
    assert b.key == ("", "", 3)
    assert len(b) == 1
    assert "<1 events>" in repr(b)
    assert b == EventBatch(seq=3, ts=1.0, events=[AllBlocksCleared()], data_parallel_rank=0)
    assert b != EventBatch(seq=3, ts=1.0, events=[AllBlocksCleared()], data_parallel_rank=1)


@pytest.mark.parametrize(
    ("fields", "field", "error"),
    [
        ({"seq": -1}, "seq", InvalidEventError),
        ({"seq": 1.0}, "seq", InvalidEventError),
        ({"ts": "now"}, "ts", InvalidEventTypeError),
        ({"ts": math.nan}, "ts", InvalidEventError),
        ({"ts": math.inf}, "ts", InvalidEventError),
        ({"ts": 10**400}, "ts", InvalidEventError),
        ({"events": 5}, "events", InvalidEventTypeError),
        ({"data_parallel_rank": "0"}, "data_parallel_rank", InvalidEventTypeError),
        ({"origin": None}, "origin", InvalidEventTypeError),
        ({"epoch": 1}, "epoch", InvalidEventTypeError),
    ],
)
def test_event_batch_refuses_bad_fields(
    fields: dict[str, Any], field: str, error: type[Exception]
) -> None:
    base: dict[str, Any] = {"seq": 0, "ts": 0.0, "events": []}
    base.update(fields)
    with pytest.raises(error, match=rf"EventBatch\.{field}"):
        EventBatch(**base)


# -- property: any valid construction keeps its fields and round-trips -------------------


@given(stored_fields())
def test_valid_block_stored_keeps_its_fields_and_round_trips(fields: dict[str, Any]) -> None:
    event = BlockStored(**fields)
    assert msgspec.structs.asdict(event) == fields
    assert BlockStored(**msgspec.structs.asdict(event)) == event
    batch = EventBatch(seq=0, ts=0.0, events=[event])
    codec = JsonCodec()
    assert codec.decode(codec.encode(batch)).events == [event]


@given(
    st.lists(hashes, max_size=5),
    texts,
    st.none() | st.integers(0, U64 - 1),
    texts,
    metadata,
)
def test_valid_block_removed_and_cleared_round_trip(
    block_hashes: list[Any], medium: str | None, group: int | None, locality: str | None, meta: Any
) -> None:
    removed = BlockRemoved(
        block_hashes=block_hashes, medium=medium, group_idx=group, locality=locality, metadata=meta
    )
    cleared = AllBlocksCleared(metadata=meta)
    assert removed.block_hashes == block_hashes
    assert removed.metadata == meta
    codec = JsonCodec()
    batch = EventBatch(seq=1, ts=2.5, events=[removed, cleared])
    assert codec.decode(codec.encode(batch)) == batch


@given(st.one_of(st.integers(max_value=I64_MIN - 1), st.integers(min_value=U64)))
def test_any_out_of_range_hash_is_refused(h: int) -> None:
    with pytest.raises(InvalidEventError, match=r"block_hashes\[0\]"):
        BlockRemoved(block_hashes=[h])
    with pytest.raises(InvalidEventError, match="parent_block_hash"):
        stored(parent_block_hash=h)
