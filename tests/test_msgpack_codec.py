"""The vLLM msgpack codec: golden bytes from vLLM's own structs, both profiles, both ways."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.codecs.base import Codec
from kvstream.codecs.msgpack import STRICT_MEDIA, MsgpackCodec
from kvstream.config import Options, make_codec
from kvstream.errors import ConfigError, DecodeError
from kvstream.events import (
    EVENT_TYPES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)
from kvstream.sim import SimulatedEngine

# Batches encoded by vLLM's own structs (a copy of the project's shared golden
# vectors, kept beside the tests so a checkout anywhere can run them).
GOLDEN = Path(__file__).parent / "golden" / "vllm_batches.json"
CASES: list[dict[str, Any]] = json.loads(GOLDEN.read_text())["cases"]

_enc = msgspec.msgpack.encode


def _unwrap(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"$bytes"}:
        return bytes.fromhex(value["$bytes"])
    if isinstance(value, list):
        return [_unwrap(v) for v in value]
    return value


def golden_batch(case: dict[str, Any]) -> EventBatch:
    events: list[KVCacheEvent] = []
    for raw in case["batch"]["events"]:
        fields = {k: _unwrap(v) for k, v in raw.items() if k != "type"}
        events.append(EVENT_TYPES[raw["type"]](**fields))
    return EventBatch(
        seq=0,
        ts=case["batch"]["ts"],
        events=events,
        data_parallel_rank=case["batch"]["data_parallel_rank"],
    )


def stored(**kw: Any) -> BlockStored:
    base: dict[str, Any] = {
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "medium": "GPU",
    }
    base.update(kw)
    return BlockStored(**base)


def batch_of(*events: KVCacheEvent, rank: int | None = 0) -> EventBatch:
    return EventBatch(seq=0, ts=1.5, events=list(events), data_parallel_rank=rank)


def strip_metadata(batch: EventBatch) -> list[KVCacheEvent]:
    return [msgspec.structs.replace(e, metadata=None) for e in batch.events]


# -- golden vectors ------------------------------------------------------------------------


def test_golden_file_has_both_profiles() -> None:
    profiles = {c["profile"] for c in CASES}
    assert profiles == {"map", "positional"}
    assert len(CASES) == 15


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_encode_matches_vllm_bytes(case: dict[str, Any]) -> None:
    codec = MsgpackCodec(profile=case["profile"])
    assert codec.encode(golden_batch(case)).hex() == case["msgpack_hex"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
@pytest.mark.parametrize("reader", ["map", "positional"])
def test_decode_vllm_bytes(case: dict[str, Any], reader: str) -> None:
    """Either codec reads either profile, and carries the transport's seq/origin/epoch."""
    codec = MsgpackCodec(profile=reader)  # type: ignore[arg-type]
    got = codec.decode(bytes.fromhex(case["msgpack_hex"]), seq=7, origin="e0", epoch="x")
    want = golden_batch(case)
    assert got.events == want.events
    assert got.ts == want.ts
    assert got.data_parallel_rank == want.data_parallel_rank
    assert (got.seq, got.origin, got.epoch) == (7, "e0", "x")


def test_decode_defaults_seq_origin_epoch() -> None:
    got = MsgpackCodec().decode(bytes.fromhex(CASES[0]["msgpack_hex"]))
    assert (got.seq, got.origin, got.epoch) == (0, "", "")


def test_batch_is_always_three_elements() -> None:
    data = MsgpackCodec().encode(batch_of(AllBlocksCleared(), rank=None))
    assert data[0] == 0x93
    assert msgspec.msgpack.decode(data)[2] is None


# -- round trips ---------------------------------------------------------------------------


def _engine_batches(n: int = 30) -> list[EventBatch]:
    engine = SimulatedEngine(seed=3, gpu_blocks=64, cpu_blocks=128, remote_blocks=256)
    out = []
    for i in range(n):
        events = engine.step_events()
        if events:
            out.append(EventBatch(seq=i, ts=1000.0 + i, events=events, data_parallel_rank=1))
    return out


@pytest.mark.parametrize("profile", ["map", "positional"])
def test_round_trip_simulated_engine(profile: str) -> None:
    codec = MsgpackCodec(profile=profile)  # type: ignore[arg-type]
    batches = _engine_batches()
    assert sum(len(b) for b in batches) > 100
    for b in batches:
        back = codec.decode(codec.encode(b), seq=b.seq)
        assert back == b


@pytest.mark.parametrize("profile", ["map", "positional"])
def test_round_trip_every_optional_field(profile: str) -> None:
    codec = MsgpackCodec(profile=profile)  # type: ignore[arg-type]
    events: list[KVCacheEvent] = [
        stored(
            block_hashes=[b"\x01" * 32, 2**64 - 1],
            parent_block_hash=-5,
            lora_id=3,
            lora_name="ad",
            extra_keys=[["k", 1, b"\x00"], None],
            group_idx=2,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=128,
            locality="REMOTE",
        ),
        stored(token_ids=[], block_size=0, medium="CPU"),
        BlockRemoved(block_hashes=[-(2**63)], medium="DISK", group_idx=0, locality="LOCAL"),
        BlockRemoved(block_hashes=[3], medium=None),
        AllBlocksCleared(),
    ]
    b = batch_of(*events, rank=None)
    assert codec.decode(codec.encode(b)) == b


def test_positional_locality_takes_the_longer_layout() -> None:
    codec = MsgpackCodec(profile="positional")
    plain = msgspec.msgpack.decode(codec.encode(batch_of(stored())))[1][0]
    local = msgspec.msgpack.decode(codec.encode(batch_of(stored(locality="REMOTE"))))[1][0]
    assert len(plain) == 12  # tag + 11, as vLLM before `locality`
    assert len(local) == 13
    assert local[-1] == "REMOTE"
    removed = msgspec.msgpack.decode(
        codec.encode(batch_of(BlockRemoved(block_hashes=[1], medium="GPU", locality="LOCAL")))
    )[1][0]
    assert removed == ["BlockRemoved", [1], "GPU", None, "LOCAL"]


def test_metadata_left_out_unless_asked() -> None:
    b = batch_of(
        stored(metadata={"tenant": "a", "n": [1, 2.5]}),
        BlockRemoved(block_hashes=[1], medium="GPU", metadata={"why": "evict"}),
        AllBlocksCleared(metadata={"reason": "reset"}),
    )
    for codec in (MsgpackCodec(), MsgpackCodec(profile="positional")):
        data = codec.encode(b)
        assert b"metadata" not in data
        assert codec.decode(data).events == strip_metadata(b)
    with_meta = MsgpackCodec(metadata=True)
    data = with_meta.encode(b)
    assert data.count(b"\xa8metadata") == 3
    assert with_meta.decode(data) == b
    # A plain reader still reads it (extra key), keeping what it carries.
    assert MsgpackCodec().decode(data) == b
    # Without metadata the bytes are exactly the vLLM bytes.
    plain = batch_of(stored())
    assert with_meta.encode(plain) == MsgpackCodec().encode(plain)


_OPTIONAL_STORED: dict[str, Any] = {
    "lora_id": 3,
    "medium": "CPU",
    "lora_name": "adapter",
    "extra_keys": [None, ["salt"]],
    "group_idx": 1,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 128,
    "locality": "LOCAL",
    "metadata": {"tenant": "t"},
}


def _vllm_bytes(batch: EventBatch) -> bytes:
    """The batch as vLLM's own declarations write it (`tests/vllm_wire.py`), metadata left out."""
    import vllm_wire as vllm

    events = [vllm.to_vllm(e) for e in batch.events]
    return _enc(vllm.KVEventBatch(batch.ts, events, batch.data_parallel_rank))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["stored", "removed", "cleared"]),
            # per optional field: left out, given as None, or set
            st.lists(st.sampled_from(["out", "none", "set"]), min_size=9, max_size=9),
        ),
        max_size=6,
    ),
    st.sampled_from([None, 0, 3]),
)
def test_events_encode_as_vllm_declares_them(
    shapes: list[tuple[str, list[str]]], rank: int | None
) -> None:
    # kvstream's events are encoded as they are (no wire struct per event): whatever
    # was left out, given as None or set, the bytes are those of vLLM's declarations,
    # lora_id, medium and lora_name always written, metadata never (unless asked).
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for kind, choice in shapes:
        given_ = {
            f: None if c == "none" else v
            for (f, v), c in zip(_OPTIONAL_STORED.items(), choice, strict=True)
            if c != "out"
        }
        if kind == "stored":
            events.append(
                BlockStored(
                    block_hashes=[1, 2],
                    parent_block_hash=7,
                    token_ids=[5, 6, 7, 8],
                    block_size=2,
                    **given_,
                )
            )
        elif kind == "removed":
            keep = {
                k: v
                for k, v in given_.items()
                if k in ("medium", "group_idx", "locality", "metadata")
            }
            events.append(BlockRemoved(block_hashes=[1], **keep))
        else:
            events.append(AllBlocksCleared(metadata=given_.get("metadata")))
    batch = batch_of(*events, rank=rank)
    assert MsgpackCodec().encode(batch) == _vllm_bytes(batch)
    with_meta = MsgpackCodec(metadata=True)
    assert with_meta.decode(with_meta.encode(batch)).events == batch.events
    if all(e.metadata is None for e in events):
        assert with_meta.encode(batch) == _vllm_bytes(batch)


def test_fields_left_out_read_none() -> None:
    # The wire's always-written fields default to msgspec's UNSET, turned into None.
    e = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=1)
    assert (e.lora_id, e.medium, e.lora_name) == (None, None, None)
    assert BlockRemoved(block_hashes=[1]).medium is None
    assert e == BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[1],
        block_size=1,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    assert msgspec.structs.replace(e, block_size=1).lora_id is None


# -- decoding what vLLM versions produced ---------------------------------------------------

_STORED_VALUES: list[Any] = [
    [11, 12],
    None,
    [1, 2, 3, 4],
    2,
    None,
    "GPU",
    None,
    None,
    None,
    None,
    None,
    "LOCAL",
]


@pytest.mark.parametrize("fields", range(5, 13))
def test_decode_positional_stored_of_every_length(fields: int) -> None:
    raw = ["BlockStored", *_STORED_VALUES[:fields]]
    got = MsgpackCodec().decode(_enc([2.0, [raw], 0]))
    event = got.events[0]
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [11, 12]
    assert event.medium == ("GPU" if fields >= 6 else None)
    assert event.locality == ("LOCAL" if fields == 12 else None)


@pytest.mark.parametrize("fields", range(1, 5))
def test_decode_positional_removed_of_every_length(fields: int) -> None:
    raw = ["BlockRemoved", *[[7], "CPU", 1, "REMOTE"][:fields]]
    event = MsgpackCodec().decode(_enc([2.0, [raw]])).events[0]
    assert event == BlockRemoved(
        block_hashes=[7],
        medium="CPU" if fields >= 2 else None,
        group_idx=1 if fields >= 3 else None,
        locality="REMOTE" if fields >= 4 else None,
    )


def test_decode_keeps_what_a_later_version_appends_in_metadata() -> None:
    # Fields a later version appends are read past and kept, losslessly, in
    # metadata["wire"] (issue 14.3), never dropped.
    raw = ["BlockStored", *_STORED_VALUES, "a-future-field", 42]
    event = MsgpackCodec().decode(_enc([2.0, [raw], 0])).events[0]
    assert event.locality == "LOCAL"  # type: ignore[attr-defined]
    assert event.metadata == {"wire": {"extra_positional": ["a-future-field", 42]}}  # type: ignore[attr-defined]
    mapped = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "future": b"\x01"}
    assert MsgpackCodec().decode(_enc([2.0, [mapped], 0])).events[0] == BlockRemoved(
        block_hashes=[1], medium="GPU", metadata={"wire": {"extra": {"future": {"$bytes": "01"}}}}
    )


def test_decode_batch_written_as_a_map_and_mixed_events() -> None:
    data = _enc(
        {
            "ts": 3.0,
            "events": [
                ["AllBlocksCleared"],
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
            ],
            "data_parallel_rank": 2,
        }
    )
    got = MsgpackCodec().decode(data, seq=4)
    assert (got.ts, got.data_parallel_rank, got.seq) == (3.0, 2, 4)
    assert got.events == [AllBlocksCleared(), BlockRemoved(block_hashes=[1], medium="GPU")]
    # Two elements (no rank) and an integer ts, as some producers write.
    two = MsgpackCodec(profile="positional").decode(_enc([3, [["AllBlocksCleared"]]]))
    assert (two.ts, two.data_parallel_rank) == (3.0, None)
    # A later version's extra batch element is ignored, as msgspec ignores it.
    assert MsgpackCodec(profile="positional").decode(_enc([3.0, [], 0, "x"])).ts == 3.0


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b"", "not a msgpack batch"),
        (b"\x93\xcb", "not a msgpack batch"),
        (_enc("hello"), "batch: expected an array"),
        (_enc([1.0]), "3 elements, got 1"),
        (_enc([float("nan"), [], 0]), "batch.ts"),
        (_enc(["now", [], 0]), "batch.ts"),
        (_enc([1.0, {}, 0]), "batch.events"),
        (_enc([1.0, [], "zero"]), "data_parallel_rank"),
        (_enc({"ts": 1.0}), "'ts' and 'events'"),
        (_enc({"ts": 1.0, "events": [], "seq": 3}), "unknown key"),
    ],
)
def test_decode_errors_name_what_was_wrong(payload: bytes, expected: str) -> None:
    for codec in (MsgpackCodec(), MsgpackCodec(profile="positional")):
        with pytest.raises(DecodeError) as info:
            codec.decode(payload)
        assert expected in str(info.value)


@pytest.mark.parametrize(
    ("raw", "tag", "expected"),
    [
        (["BlockEvicted", [1]], "BlockEvicted", "tag (element 0)"),
        ({"type": "Nope"}, "Nope", "type: expected"),
        ([], "?", "empty array"),
        (7, "?", "expected an event"),
        (["BlockStored", [1], None], "BlockStored", "at least 5 fields"),
        (["BlockStored", [1], None, [1, 2, 3], 2, None], "BlockStored", "token_ids"),
        (["BlockRemoved", ["x"]], "BlockRemoved", "block_hashes[0]"),
        ({"type": "BlockStored", "block_hashes": [1]}, "BlockStored", "parent_block_hash"),
        (["BlockStored", [1], None, [1, True, 3, 4], 4, None, "GPU"], "BlockStored", "[1]"),
    ],
)
def test_one_bad_event_costs_that_event_only(raw: object, tag: str, expected: str) -> None:
    # Issue 14.2 / 15.11: decoding is per event; the refused one is named, the rest delivered.
    good = ["BlockRemoved", [5], "GPU"]
    payload = _enc([1.0, [good, raw, good], 0])
    for codec in (MsgpackCodec(), MsgpackCodec(profile="positional")):
        batch, refused = codec.decode_screened(payload, seq=3)
        assert batch.events == [BlockRemoved(block_hashes=[5], medium="GPU")] * 2
        assert [(r.position, r.event_type) for r in refused] == [(1, tag)]
        assert expected in refused[0].reason
        before = codec.events_refused
        assert codec.decode(payload).events == batch.events  # decode() delivers the rest too
        assert codec.events_refused == before + 1


def test_decode_refuses_a_bad_seq() -> None:
    with pytest.raises(DecodeError, match="seq"):
        MsgpackCodec().decode(bytes.fromhex(CASES[0]["msgpack_hex"]), seq=-1)


# -- fuzzing: every input decodes or raises DecodeError ---------------------------------------

_CODECS = (MsgpackCodec(), MsgpackCodec(profile="positional"))


def _decodes_or_refuses(data: bytes) -> None:
    for codec in _CODECS:
        try:
            batch = codec.decode(data)
        except DecodeError:
            continue
        assert isinstance(batch, EventBatch)
        assert math.isfinite(batch.ts)
        assert all(isinstance(e, KVCacheEvent) for e in batch.events)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decodes_or_refuses(data)


_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "type", "ts"])
    | st.text(max_size=5)
    | st.binary(max_size=8)
)
_value = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(
            st.text(max_size=6)
            | st.sampled_from(["type", "ts", "events", "block_hashes", "medium"]),
            inner,
            max_size=5,
        )
    ),
    max_leaves=20,
)
_event = st.one_of(
    st.tuples(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    .map(list)
    .flatmap(lambda tag: st.lists(_value, max_size=13).map(lambda rest: tag + rest)),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"])},
        optional={
            "block_hashes": _value,
            "parent_block_hash": _value,
            "token_ids": _value,
            "block_size": _value,
            "medium": _value,
            "extra_keys": _value,
            "metadata": _value,
        },
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_value, st.tuples(_value, st.lists(_event, max_size=4), _value).map(list)))
def test_fuzz_structured_msgpack(obj: Any) -> None:
    _decodes_or_refuses(_enc(obj))


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([bytes.fromhex(c["msgpack_hex"]) for c in CASES]),
    st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), max_size=4),
    st.integers(min_value=0),
)
def test_fuzz_mutated_golden_bytes(data: bytes, flips: list[tuple[int, int]], cut: int) -> None:
    mutated = bytearray(data)
    for pos, value in flips:
        mutated[pos % len(mutated)] = value
    _decodes_or_refuses(bytes(mutated[: len(mutated) - cut % 8]))


# -- strict profile -----------------------------------------------------------------------------


def test_strict_refuse_leaves_out_what_strict_consumers_reject() -> None:
    codec = MsgpackCodec(strict="refuse")
    good = stored(block_hashes=[5, 6])
    events: list[KVCacheEvent] = [
        good,
        stored(block_hashes=[b"\x00" * 31 + b"\x07", 6]),
        stored(parent_block_hash=-1),
        stored(medium="NVME"),
        BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU"),
        BlockRemoved(block_hashes=[9], medium="TAPE"),
        BlockRemoved(block_hashes=[9], medium="CPU_PINNED"),
        AllBlocksCleared(),
    ]
    data, refused = codec.encode_screened(batch_of(*events))
    assert [r.position for r in refused] == [1, 2, 3, 4, 5]
    assert "block_hashes[0] is 32 bytes" in refused[0].reason
    assert "parent_block_hash is negative" in refused[1].reason
    assert "'NVME'" in refused[2].reason
    assert refused[3].event_type == "BlockRemoved"
    assert codec.encode(batch_of(*events)) == data  # encode() applies the same screen
    back = MsgpackCodec().decode(data)
    assert back.events == [good, events[6], AllBlocksCleared()]


def test_strict_convert_sends_the_low_64_bits() -> None:
    digest = bytes(range(32))
    codec = MsgpackCodec(strict="convert")
    events: list[KVCacheEvent] = [
        stored(block_hashes=[digest, 3], parent_block_hash=digest),
        BlockRemoved(block_hashes=[-2], medium="GPU"),
        stored(medium="NVME"),  # cannot be converted: refused
    ]
    data, refused = codec.encode_screened(batch_of(*events))
    assert [r.position for r in refused] == [2]
    back = MsgpackCodec().decode(data)
    low = int.from_bytes(digest, "big") & (2**64 - 1)
    assert back.events[0].block_hashes == [low, 3]  # type: ignore[attr-defined]
    assert back.events[0].parent_block_hash == low  # type: ignore[attr-defined]
    assert back.events[1].block_hashes == [2**64 - 2]  # type: ignore[attr-defined]
    assert b"\xc4" not in data  # no msgpack bin anywhere


def test_strict_media_is_configurable_and_none_passes() -> None:
    codec = MsgpackCodec(strict="refuse", strict_media=["GPU", "STORAGE"])
    _, refused = codec.encode_screened(
        batch_of(stored(medium="STORAGE"), stored(medium=None), stored(medium="CPU"))
    )
    assert [r.position for r in refused] == [2]
    # Every canonical tier name (kvstream.media), STORAGE included, plus SGLang's CPU_PINNED.
    assert {"GPU", "CPU", "CPU_PINNED", "DISK", "EXTERNAL", "STORAGE"} == STRICT_MEDIA


def test_not_strict_sends_everything_as_vllm_would() -> None:
    b = batch_of(stored(block_hashes=[b"\x01" * 32, 2], medium="NVME"))
    data, refused = MsgpackCodec().encode_screened(b)
    assert refused == ()
    assert MsgpackCodec().decode(data) == b


# -- configuration ------------------------------------------------------------------------------


def test_codec_identity_and_protocol() -> None:
    assert isinstance(MsgpackCodec(), Codec)
    assert MsgpackCodec().name == "msgpack"
    assert MsgpackCodec().self_delimiting is False
    assert MsgpackCodec() == MsgpackCodec(profile="map")
    assert hash(MsgpackCodec(strict="refuse")) == hash(MsgpackCodec(strict="refuse"))
    assert MsgpackCodec() != MsgpackCodec(profile="positional")
    assert MsgpackCodec(strict="refuse") != MsgpackCodec(strict="convert")
    assert MsgpackCodec(strict="refuse") != MsgpackCodec(strict="refuse", strict_media=["GPU"])
    assert len({MsgpackCodec(), MsgpackCodec(), MsgpackCodec(metadata=True)}) == 2
    assert "positional" in repr(MsgpackCodec(profile="positional"))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"profile": "array"}, "profile"),
        ({"profile": "positional", "metadata": True}, "positional"),
        ({"strict": "lenient"}, "strict"),
        ({"strict": "refuse", "metadata": True}, "metadata"),
        ({"metadata": "yes"}, "metadata"),
        ({"strict": "refuse", "strict_media": "GPU"}, "strict_media"),
    ],
)
def test_bad_configuration(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        MsgpackCodec(**kwargs)


def test_make_codec_from_url_options() -> None:
    opts = Options("x", {"profile": "positional", "strict": "convert", "strict_media": "GPU, CPU"})
    codec = make_codec("msgpack", opts)
    opts.finish()
    assert codec == MsgpackCodec(
        profile="positional", strict="convert", strict_media=["GPU", "CPU"]
    )
    assert make_codec("msgpack") == MsgpackCodec()
    with pytest.raises(ConfigError, match="strict"):
        make_codec("msgpack", Options("x", {"strict": "maybe"}))
