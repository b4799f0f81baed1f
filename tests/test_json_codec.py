"""The JSON-lines codec: exact line shape, round trips, and decode errors that never escape."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import batches

from kvstream import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Codec,
    DecodeError,
    EventBatch,
    JsonCodec,
    KVCacheEvent,
    KVStreamError,
)

U64 = 2**64
I64_MIN = -(2**63)


def batch_of(*events: KVCacheEvent, **fields: Any) -> EventBatch:
    base: dict[str, Any] = {"seq": 0, "ts": 0.0, "origin": "o", "epoch": "e"}
    base.update(fields)
    return EventBatch(events=list(events), **base)


# -- the line ---------------------------------------------------------------------------


def test_codec_contract() -> None:
    codec = JsonCodec()
    assert isinstance(codec, Codec)
    assert codec.name == "json"
    assert codec.self_delimiting
    assert codec == JsonCodec()
    assert hash(codec) == hash(JsonCodec())
    assert codec != JsonCodec(hashes_as_strings=True)
    assert "hashes_as_strings=True" in repr(JsonCodec(hashes_as_strings=True))


def test_exact_line_shape() -> None:
    batch = EventBatch(
        seq=7,
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[1, b"\xab\x01"],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
            ),
            BlockStored(
                block_hashes=[U64 - 1],
                parent_block_hash=b"\x0f",
                token_ids=[],
                block_size=0,
                medium="CPU",
                lora_id=3,
                lora_name="ad",
                group_idx=0,
                extra_keys=[[b"\x00\xff", "s", 1]],
            ),
            BlockRemoved(block_hashes=[I64_MIN], medium="GPU"),
            AllBlocksCleared(metadata={"why": "reset"}),
        ],
        data_parallel_rank=0,
        origin="e0",
        epoch="ab",
    )
    assert JsonCodec().encode(batch) == (
        b'{"origin":"e0","epoch":"ab","seq":7,"ts":1.5,"data_parallel_rank":0,"events":['
        b'{"type":"BlockStored","block_hashes":[1,"ab01"],"parent_block_hash":null,'
        b'"token_ids":[1,2,3,4],"block_size":2,"lora_id":null,"medium":null,"lora_name":null},'
        b'{"type":"BlockStored","block_hashes":[18446744073709551615],"parent_block_hash":"0f",'
        b'"token_ids":[],"block_size":0,"lora_id":3,"medium":"CPU","lora_name":"ad",'
        b'"extra_keys":[[{"$bytes":"00ff"},"s",1]],"group_idx":0},'
        b'{"type":"BlockRemoved","block_hashes":[-9223372036854775808],"medium":"GPU"},'
        b'{"type":"AllBlocksCleared","metadata":{"why":"reset"}}]}\n'
    )


def test_exact_line_shape_with_decimal_hashes() -> None:
    batch = batch_of(
        BlockStored(
            block_hashes=[U64 - 1, b"\xab"],
            parent_block_hash=-5,
            token_ids=[],
            block_size=0,
            metadata={"n": 12345678901234567890},
        ),
        BlockRemoved(block_hashes=[b"\x01", 2]),
    )
    assert JsonCodec(hashes_as_strings=True).encode(batch) == (
        b'{"origin":"o","epoch":"e","seq":0,"ts":0.0,"data_parallel_rank":null,"events":['
        b'{"type":"BlockStored","block_hashes":["18446744073709551615",{"$bytes":"ab"}],'
        b'"parent_block_hash":"-5","token_ids":[],"block_size":0,"lora_id":null,"medium":null,'
        b'"lora_name":null,"metadata":{"n":12345678901234567890}},'
        b'{"type":"BlockRemoved","block_hashes":[{"$bytes":"01"},"2"],"medium":null}],'
        b'"hash_encoding":"decimal"}\n'
    )


def test_one_line_per_batch_even_with_newlines_in_strings() -> None:
    line = JsonCodec().encode(batch_of(AllBlocksCleared(metadata={"s": "a\nb\r\n"})))
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1


@pytest.mark.parametrize("decimal", [False, True])
def test_round_trip_of_the_hard_cases(decimal: bool) -> None:
    batch = batch_of(
        BlockStored(
            block_hashes=[0, U64 - 1, I64_MIN, -1, b"", b"\x00" * 32],
            parent_block_hash=U64 - 1,
            token_ids=list(range(12)),
            block_size=2,
            extra_keys=[[b"\x01"], None, [["x", b"y"]], [], [1.5, None], [True]],
            metadata={"名前": "値 ✓", "emoji": "🙂", "nested": [{"k": [None, False]}]},
            medium="CPU",
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=128,
            locality="rack-1",
        ),
        BlockStored(block_hashes=[1], parent_block_hash=b"\xff", token_ids=[], block_size=0),
        BlockRemoved(block_hashes=[b"\xde\xad", I64_MIN], group_idx=2, locality="x"),
        AllBlocksCleared(),
        origin="引擎-0",
        epoch="ε",
        seq=2**63,
        ts=1767225600.125,
        data_parallel_rank=3,
    )
    codec = JsonCodec(hashes_as_strings=decimal)
    assert codec.decode(codec.encode(batch)) == batch


def test_decoders_accept_both_modes_and_every_buffer_type() -> None:
    batch = batch_of(BlockRemoved(block_hashes=[U64 - 1, b"\x01"]))
    for encoder in (JsonCodec(), JsonCodec(hashes_as_strings=True)):
        line = encoder.encode(batch)
        for decoder in (JsonCodec(), JsonCodec(hashes_as_strings=True)):
            for data in (line, bytearray(line), memoryview(line), line.decode()):
                assert decoder.decode(data) == batch


# -- hypothesis round trip ------------------------------------------------------------------


@settings(max_examples=200)
@given(batches, st.booleans())
def test_round_trip(batch: EventBatch, decimal: bool) -> None:
    codec = JsonCodec(hashes_as_strings=decimal)
    line = codec.encode(batch)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert codec.decode(line) == batch
    assert codec.decode_lines(line + line) == [batch, batch]


# -- decode errors -------------------------------------------------------------------------

GOOD_EVENT = {
    "type": "BlockStored",
    "block_hashes": [1],
    "parent_block_hash": None,
    "token_ids": [1, 2],
    "block_size": 2,
}


def line_with(**changes: Any) -> bytes:
    batch: dict[str, Any] = {"origin": "o", "epoch": "e", "seq": 0, "ts": 1.0, "events": []}
    batch.update(changes)
    return orjson.dumps(batch)


def deep(depth: int, leaf: str = "1") -> bytes:
    return b"[" * depth + leaf.encode() + b"]" * depth


BAD_LINES: list[tuple[bytes, str]] = [
    (b"", "not a JSON line"),
    (b"{", "not a JSON line"),
    (b"\xff\xfe", "not a JSON line"),
    (b"[]", "expected a JSON object"),
    (b'"x"', "expected a JSON object"),
    (line_with(extra=1), "unknown field(s) ['extra']"),
    (line_with(seq=None), "EventBatch.seq"),
    (line_with(seq=-1), "EventBatch.seq"),
    (line_with(ts="now"), "EventBatch.ts"),
    (line_with(origin=5), "EventBatch.origin"),
    (line_with(data_parallel_rank="0"), "EventBatch.data_parallel_rank"),
    (line_with(events={}), "batch.events"),
    (line_with(hash_encoding="hex"), "batch.hash_encoding"),
    (line_with(events=[1]), "events[0]: expected an event object"),
    (line_with(events=[{"type": "Nope"}]), "events[0]: type"),
    (line_with(events=[{}]), "events[0]: type"),
    (
        line_with(events=[GOOD_EVENT, {**GOOD_EVENT, "block_size": 3}]),
        "events[1]: BlockStored.token_ids",
    ),
    (line_with(events=[{**GOOD_EVENT, "block_hashes": ["zz"]}]), "events[0]"),
    (
        line_with(events=[{**GOOD_EVENT, "block_hashes": [1.5]}]),
        "events[0]: BlockStored.block_hashes[0]",
    ),
    (
        b'{"seq":0,"ts":1,"events":[{"type":"BlockRemoved","block_hashes":[18446744073709551616]}]}',
        "events[0]: BlockRemoved.block_hashes[0]",
    ),
    (line_with(events=[{**GOOD_EVENT, "parent_block_hash": {"$bytes": "0g"}}]), "events[0]"),
    (line_with(events=[{**GOOD_EVENT, "bogus": 1}]), "events[0]"),
    (
        line_with(
            events=[{"type": "AllBlocksCleared", "metadata": {"x": [1, 2]}, "medium": "GPU"}]
        ),
        "events[0]",
    ),
    (line_with(events=[{**GOOD_EVENT, "extra_keys": [{"a": 1}]}]), "events[0]"),
    (
        line_with(events=[{**GOOD_EVENT, "block_hashes": ["1"]}], hash_encoding="decimal", seq="x"),
        "EventBatch.seq",
    ),
    (
        line_with(events=[{**GOOD_EVENT, "block_hashes": ["1x"]}], hash_encoding="decimal"),
        "events[0]",
    ),
    # Deep nesting must not reach a RecursionError anywhere.
    (
        b'{"seq":0,"ts":1,"events":[{"type":"BlockStored","block_hashes":[1],"parent_block_hash":null,"token_ids":[],"block_size":0,"extra_keys":['
        + deep(900)
        + b"]}]}",
        "events[0]",
    ),
    (
        b'{"seq":0,"ts":1,"events":[{"type":"BlockRemoved","block_hashes":[' + deep(990) + b"]}]}",
        "events[0]",
    ),
    (b'{"seq":' + deep(1000) + b',"ts":1,"events":[]}', "EventBatch.seq"),
    (b'{"seq":0,"ts":1,"events":[' + deep(1000) + b"]}", "events[0]"),
    (b'{"seq":0,"ts":1,"events":[{"type":' + deep(1000) + b"}]}", "events[0]: type"),
    (deep(5000), "not a JSON line"),
]


@pytest.mark.parametrize(("line", "named"), BAD_LINES, ids=range(len(BAD_LINES)))
def test_bad_lines_raise_a_decode_error_naming_the_field(line: bytes, named: str) -> None:
    if named.startswith("events["):
        # A bad event costs that event only (issue 14.2): the batch is delivered
        # without it and the refusal names it; decode() counts it.
        codec = JsonCodec()
        batch, refused = codec.decode_screened(line)
        shown = "; ".join(f"events[{r.position}]: {r.reason}" for r in refused)
        assert named in shown
        assert len(batch.events) + len(refused) == len(orjson.loads(line)["events"])
        assert all(len(r.reason) < 500 for r in refused)
        codec.decode(line)
        assert codec.events_refused == len(refused)
        return
    with pytest.raises(DecodeError) as info:
        JsonCodec().decode(line)
    assert named in str(info.value)
    assert isinstance(info.value, KVStreamError)
    assert isinstance(info.value, ValueError)
    assert len(str(info.value)) < 500


def test_decode_lines_skips_blank_lines_and_names_the_bad_one() -> None:
    codec = JsonCodec()
    a = codec.encode(batch_of(AllBlocksCleared(), seq=0))
    b = codec.encode(batch_of(AllBlocksCleared(), seq=1))
    assert codec.decode_lines(b"\n" + a + b"\n  \n" + b) == [codec.decode(a), codec.decode(b)]
    assert codec.decode_lines(a + b.rstrip(b"\n")) == [codec.decode(a), codec.decode(b)]
    assert codec.decode_lines(b"") == []
    with pytest.raises(DecodeError, match=r"^line 3: .*EventBatch\.seq"):
        codec.decode_lines(a + b + line_with(seq=-1) + b"\n" + a)


# -- fuzz: nothing but DecodeError escapes a decoder -------------------------------------------

SCHEMA_WORDS = sorted(
    {"origin", "epoch", "seq", "ts", "data_parallel_rank", "events", "hash_encoding", "type"}
    | {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"}
    | {"lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "locality", "metadata"}
    | {"kv_cache_spec_sliding_window", "$bytes", "BlockStored", "BlockRemoved", "decimal"}
    | {"AllBlocksCleared"}
)
any_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(I64_MIN, U64 - 1),
        st.floats(),
        st.text(max_size=6),
        st.sampled_from(SCHEMA_WORDS),
        st.sampled_from(["ab", "00ff", "18446744073709551615", "-1", "zz", ""]),
    ),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(SCHEMA_WORDS) | st.text(max_size=4), inner, max_size=5)
    ),
    max_leaves=20,
)


def decode_or_refuse(codec: JsonCodec, data: bytes) -> None:
    try:
        batch = codec.decode(data)
    except DecodeError:
        return
    assert isinstance(batch, EventBatch)
    # What decodes is valid: it encodes again and reads back equal.
    assert codec.decode(codec.encode(batch)) == batch


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200), st.booleans())
def test_fuzz_arbitrary_bytes(data: bytes, decimal: bool) -> None:
    codec = JsonCodec(hashes_as_strings=decimal)
    decode_or_refuse(codec, data)
    try:
        codec.decode_lines(data)
    except DecodeError:
        pass


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(any_json)
def test_fuzz_arbitrary_json_values(value: Any) -> None:
    decode_or_refuse(JsonCodec(), orjson.dumps(value))


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside nested dicts and lists."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(batches, st.booleans(), st.data())
def test_fuzz_near_valid_lines(batch: EventBatch, decimal: bool, data: st.DataObject) -> None:
    """A valid line with one value replaced or removed: validation's every branch."""
    codec = JsonCodec(hashes_as_strings=decimal)
    obj = orjson.loads(codec.encode(batch))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths(obj)[1:] or [()]))
        if not path:
            break
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and data.draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(any_json)
    decode_or_refuse(codec, orjson.dumps(obj))
    line = codec.encode(batch)
    cut = data.draw(st.integers(0, len(line)))
    decode_or_refuse(codec, line[:cut])


def test_decode_lines_still_refuses_a_file_with_a_bad_event() -> None:
    # A whole file of kvstream's own (kvstream verify): a bad event is damage, named.
    codec = JsonCodec()
    good = codec.encode(batch_of(AllBlocksCleared(), seq=0))
    bad = line_with(events=[{"type": "Nope"}]) + b"\n"
    with pytest.raises(DecodeError, match=r"^line 2: events\[0\]: type"):
        codec.decode_lines(good + bad)
