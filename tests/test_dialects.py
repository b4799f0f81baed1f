"""Every engine's dialect in, each consumer's out (issue 14): golden messages, round trips, relay.

The far side of the wire is tests/dialect_wire.py and tests/vllm_wire.py:
structs declared from each dialect's documented shape, independent of
kvstream's codec. tests/golden/dialects.json holds one message per dialect,
written by those structs (``python tests/dialect_wire.py`` regenerates it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import dialect_wire as dw
import msgspec
import pytest
import vllm_wire as vllm
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import events as any_event
from test_relay import VllmStylePublisher, read_out, stop, wait_for

from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.config import open_sink, open_subscriber
from kvstream.errors import ConfigError, InvalidEventError
from kvstream.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVCacheEvent
from kvstream.media import CANONICAL_MEDIA, MEDIA_ALIASES, canonical_medium

GOLDEN = {c["name"]: c for c in json.loads(dw.GOLDEN.read_text())}
DIGEST = bytes(range(32))
H = 0xDAB89BAA7B585700


def golden_bytes(name: str) -> bytes:
    return bytes.fromhex(GOLDEN[name]["msgpack_hex"])


def wire(**fields: Any) -> dict[str, Any]:
    return {"wire": fields}


#: What kvstream reads from each golden message, written out by hand.
EXPECTED: dict[str, tuple[list[KVCacheEvent], int | None]] = {
    "vllm-map-sliding-window-and-digest": (
        [
            BlockStored(
                block_hashes=[H],
                parent_block_hash=None,
                token_ids=dw.SLIDING,
                block_size=4,
                medium="GPU",
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=4,
            ),
            BlockStored(
                block_hashes=[DIGEST],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=4,
                medium="STORAGE",
            ),
            BlockRemoved(block_hashes=[H], medium="GPU", group_idx=1),
            AllBlocksCleared(),
        ],
        0,
    ),
    "vllm-positional-every-length": (
        [
            BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[1, 2], block_size=2),
            BlockStored(
                block_hashes=[8], parent_block_hash=7, token_ids=[3, 4], block_size=2, medium="CPU"
            ),
            BlockStored(
                block_hashes=[9],
                parent_block_hash=8,
                token_ids=[5, 6],
                block_size=2,
                medium="GPU",
                locality="LOCAL",
            ),
            BlockRemoved(block_hashes=[7], medium="CPU"),
            AllBlocksCleared(),
        ],
        1,
    ),
    "sglang-map-eagle-partial-signed": (
        [
            BlockStored(
                block_hashes=[-4242],
                parent_block_hash=None,
                token_ids=[11, 12, 13, 14],
                block_size=4,
                medium="GPU",
                metadata=wire(cache_salt="salt-1", session_id="sess-9", token_pairs_next=15),
            ),
            BlockStored(
                block_hashes=[-17],
                parent_block_hash=-4242,
                token_ids=[21, 22, 23],
                block_size=3,
                medium="CPU_PINNED",
            ),
            BlockRemoved(block_hashes=[-17], medium="CPU_PINNED"),
            AllBlocksCleared(),
        ],
        2,
    ),
    "sglang-positional-metadata": (
        [
            BlockStored(
                block_hashes=[31, 32],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                medium="DISK",
                metadata=wire(sglang_metadata={"priority": 3, "tier": "l2"}),
            ),
            BlockStored(block_hashes=[33], parent_block_hash=32, token_ids=[5], block_size=1),
            BlockRemoved(block_hashes=[31], medium="DISK"),
        ],
        0,
    ),
    "trtllm-vllm-wire": (
        [
            BlockStored(
                block_hashes=[5, 6],
                parent_block_hash=None,
                token_ids=list(range(64)),
                block_size=32,
                medium="GPU",
            ),
            BlockRemoved(block_hashes=[5], medium="GPU"),
        ],
        None,
    ),
}
# sglang-positional's second event: medium GPU.
EXPECTED["sglang-positional-metadata"][0][1] = BlockStored(
    block_hashes=[33], parent_block_hash=32, token_ids=[5], block_size=1, medium="GPU"
)

#: The profile that writes each golden message back byte for byte.
WRITTEN_BACK = {
    "vllm-map-sliding-window-and-digest": "map",
    "sglang-map-eagle-partial-signed": "sglang",
    "sglang-positional-metadata": "sglang-positional",
    "trtllm-vllm-wire": "map",
}


# -- golden messages -------------------------------------------------------------------------------


def test_the_golden_file_is_what_the_dialect_structs_write() -> None:
    assert [c["name"] for c in dw.golden()] == list(GOLDEN)
    for case in dw.golden():
        assert case == GOLDEN[case["name"]]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_dialect_is_read_auto_detected(name: str) -> None:
    events, rank = EXPECTED[name]
    for codec in (MsgpackCodec(), MsgpackCodec(profile="positional")):
        batch, refused = codec.decode_screened(golden_bytes(name), seq=7)
        assert refused == ()
        assert batch.events == events
        assert (batch.data_parallel_rank, batch.seq) == (rank, 7)


@pytest.mark.parametrize("name", list(WRITTEN_BACK))
def test_every_dialect_is_written_back_byte_for_byte(name: str) -> None:
    batch = MsgpackCodec().decode(golden_bytes(name))
    assert MsgpackCodec(profile=WRITTEN_BACK[name]).encode(batch) == golden_bytes(name)  # type: ignore[arg-type]


def test_a_pinned_dialect_refuses_the_other_ones_shapes_naming_the_field() -> None:
    batch, refused = MsgpackCodec(dialect="vllm").decode_screened(
        golden_bytes("sglang-map-eagle-partial-signed")
    )
    assert [r.position for r in refused] == [0]
    assert "BlockStored.cache_salt" in refused[0].reason
    assert len(batch.events) == 3  # the rest delivered
    _, refused = MsgpackCodec(dialect="vllm").decode_screened(
        golden_bytes("sglang-positional-metadata")
    )
    assert [r.position for r in refused] == [0]
    assert "lora_name (element 7)" in refused[0].reason
    assert (
        MsgpackCodec(dialect="sglang").decode_screened(golden_bytes("sglang-positional-metadata"))[
            1
        ]
        == ()
    )
    with pytest.raises(ConfigError, match="dialect"):
        MsgpackCodec(dialect="tgi")  # type: ignore[arg-type]


# -- each consumer's profile -----------------------------------------------------------------------


def test_a_vllm_only_consumer_reads_sglang_through_profile_map() -> None:
    batch = MsgpackCodec().decode(golden_bytes("sglang-map-eagle-partial-signed"))
    got = vllm.decoder.decode(MsgpackCodec(profile="map").encode(batch))  # unknown fields refused
    assert got.data_parallel_rank == 2
    assert got.events[0] == vllm.BlockStored([-4242], None, [11, 12, 13, 14], 4, None, "GPU", None)
    assert got.events[1].medium == "CPU_PINNED"  # type: ignore[union-attr]


def test_sglang_consumers_read_their_profiles() -> None:
    for name in EXPECTED:
        batch = MsgpackCodec().decode(golden_bytes(name))
        if name.startswith("vllm-map"):  # a 32-byte digest: SGLang reads int hashes only
            batch = EventBatch(seq=0, ts=1.0, events=MsgpackCodec(strict="convert").screen(
                batch.events)[0])  # fmt: skip
        got = dw.sglang_map_decoder.decode(MsgpackCodec(profile="sglang").encode(batch))
        assert len(got.events) == len(batch.events)  # type: ignore[attr-defined]
        data = MsgpackCodec(profile="sglang-positional").encode(batch)
        assert len(dw.sglang_pos_decoder.decode(data).events) == len(batch.events)  # type: ignore[attr-defined]
        # SGLang's structs without the map read past it (msgspec ignores trailing elements).
        assert len(dw.sglang_pos_no_meta_decoder.decode(data).events) == len(batch.events)  # type: ignore[attr-defined]


def _llm_d_key(h: int | bytes) -> int:
    """The uint64 key llm-d's Dec-2025 reader makes of a hash (getHashAsUint64)."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    return h % 2**64


def test_llm_d_dec_2025_indexes_every_hash_of_its_profile() -> None:
    for name in EXPECTED:
        batch = MsgpackCodec().decode(golden_bytes(name))
        kept, skipped = dw.llm_d_2025_12_read(MsgpackCodec(profile="llm-d-2025-12").encode(batch))
        assert skipped == [], name
        assert [e.tag for e in kept] == [type(e).__name__ for e in batch.events]
        for got, sent in zip(kept, batch.events, strict=True):
            if isinstance(sent, BlockStored):
                assert got.keys == [_llm_d_key(h) for h in sent.block_hashes]
                parent = sent.parent_block_hash
                assert got.parent == (None if parent is None else _llm_d_key(parent))
                assert (got.token_ids, got.block_size) == (sent.token_ids, sent.block_size)
                assert (got.lora_id, got.medium) == (sent.lora_id, sent.medium)
            elif isinstance(sent, BlockRemoved):
                assert (got.keys, got.medium) == (
                    [_llm_d_key(h) for h in sent.block_hashes],
                    sent.medium,
                )


def test_llm_d_dec_2025_skips_the_other_layouts() -> None:
    batch = MsgpackCodec().decode(golden_bytes("trtllm-vllm-wire"))  # hashes 5 and 6
    kept, skipped = dw.llm_d_2025_12_read(MsgpackCodec(profile="positional").encode(batch))
    assert kept == []
    assert skipped == [
        "event 0: BlockStored has 6 fields, got 11",
        "event 1: BlockRemoved has 2 fields, got 3",
    ]
    # llm-d's layout from Jan 2026 (v0.5.0) adds lora_name: tag + 7, refused by this one.
    with_lora_name = LLM_D_TRTLLM.replace("97ab", "98ab", 1).replace("a3475055", "a3475055c0", 1)
    kept, skipped = dw.llm_d_2025_12_read(bytes.fromhex(with_lora_name))
    assert skipped == ["event 0: BlockStored has 6 fields, got 7"]
    assert [e.keys for e in kept] == [[5]]
    # Hashes in their shortest msgpack form (as msgspec writes 5 and 6) are not indexed.
    data = msgspec.msgpack.encode([1.0, [["BlockRemoved", [5, 2**40], "GPU"]], None])
    kept, skipped = dw.llm_d_2025_12_read(data)
    assert kept[0].keys == [2**40]
    assert skipped == ["event 0: BlockRemoved hash 0: unsupported form 05"]
    with pytest.raises(ValueError, match="3 elements expected, got 2"):
        dw.llm_d_2025_12_read(msgspec.msgpack.encode([1.0, []]))


#: The llm-d-2025-12 profile of the TensorRT-LLM golden message, byte for byte:
#: [ts, [[BlockStored, [u64 5, u64 6], nil, tokens 0..63, 32, nil, "GPU"],
#: [BlockRemoved, [u64 5], "GPU"]], nil].
LLM_D_TRTLLM = (
    "93cb41da556e4100000092"
    "97ab426c6f636b53746f72656492cf0000000000000005cf0000000000000006c0"
    "dc0040" + bytes(range(64)).hex() + "20c0a3475055"
    "93ac426c6f636b52656d6f76656491cf0000000000000005a3475055"
    "c0"
)


def test_the_llm_d_profile_writes_the_golden_bytes() -> None:
    batch = MsgpackCodec().decode(golden_bytes("trtllm-vllm-wire"))
    assert MsgpackCodec(profile="llm-d-2025-12").encode(batch).hex() == LLM_D_TRTLLM


def test_profiles_are_url_options_and_refuse_metadata() -> None:
    sink = open_sink("zmq+tcp://127.0.0.1:1?profile=sglang")
    assert sink.codec.profile == "sglang"  # type: ignore[union-attr]
    sub = open_subscriber("zmq+tcp://127.0.0.1:1?dialect=sglang&media=normalize")
    assert (sub.codec.dialect, sub.codec.media) == ("sglang", "normalize")  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="cannot carry metadata"):
        MsgpackCodec(profile="sglang", metadata=True)


# -- media -----------------------------------------------------------------------------------------


def test_the_media_table_maps_every_alias_and_keeps_the_canonical_names() -> None:
    for name in CANONICAL_MEDIA:
        assert canonical_medium(name) == name
        assert canonical_medium(name.lower()) == name
    for alias, canon in MEDIA_ALIASES.items():
        assert canonical_medium(alias) == canon
    assert canonical_medium("cpu-tier2") == "DISK"
    assert canonical_medium("device(type='cuda', index=0)") == "GPU"
    assert canonical_medium("MARS") is None
    assert set(CANONICAL_MEDIA) <= MsgpackCodec(strict="refuse").strict_media


def test_normalized_media_keep_the_raw_spelling_and_write_it_back() -> None:
    data = golden_bytes("sglang-map-eagle-partial-signed")
    batch = MsgpackCodec(media="normalize").decode(data)
    assert [getattr(e, "medium", None) for e in batch.events] == ["GPU", "CPU", "CPU", None]
    assert batch.events[1].metadata == wire(medium="CPU_PINNED")  # type: ignore[attr-defined]
    assert MsgpackCodec(profile="sglang").encode(batch) == data  # SGLang gets its spelling back
    # The map fast path normalises too.
    mapped = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1],
                                            "medium": "NVME"}], 0])  # fmt: skip
    (event,) = MsgpackCodec(media="normalize").decode(mapped).events
    assert (event.medium, event.metadata) == ("DISK", wire(medium="NVME"))  # type: ignore[attr-defined]


# -- shapes: accepted where an engine sends them, refused where none does --------------------------


def test_token_shapes_engines_send_are_accepted() -> None:
    # vLLM's sliding-window/Mamba groups: all blocks null, tokens kept.
    assert (
        BlockStored(
            block_hashes=[], parent_block_hash=None, token_ids=[1] * 8, block_size=4
        ).block_hashes
        == []
    )
    # EAGLE pairs that do not chain keep every second element.
    e = BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[(1, 9), (2, 8)],  # type: ignore[list-item]
        block_size=2,
    )
    assert (e.token_ids, e.metadata) == ([1, 2], wire(token_pairs_second=[9, 8]))
    assert MsgpackCodec(profile="sglang").encode(EventBatch(seq=0, ts=1.0, events=[e]))


@pytest.mark.parametrize(
    ("tokens", "size", "hashes", "named"),
    [
        ([1, 2, 3], 2, [1], "token_ids: expected whole blocks"),  # a partial block
        ([1, 2], 2, [1, 2], "at least one block per hash"),  # more hashes than blocks
        ([[1, 2], [2]], 2, [1], "token_ids[1]"),  # a broken pair
        ([[1, 2], 3], 2, [1], "token_ids[1]"),
        ([1, 2, True, 4], 4, [1], "token_ids[2]"),  # bool in the middle
        ([1, 2, 3.0, 4], 4, [1], "token_ids[2]"),
    ],
)
def test_shapes_no_engine_sends_are_refused_naming_the_field(
    tokens: list[Any], size: int, hashes: list[int | bytes], named: str
) -> None:
    with pytest.raises(InvalidEventError, match=named.replace("[", r"\[").replace("]", r"\]")):
        BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=size)


def test_numpy_token_ids_become_ints() -> None:
    np = pytest.importorskip("numpy")
    e = BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[1, np.int32(2), np.uint64(3), 4],
        block_size=4,
    )
    assert [type(t) for t in e.token_ids] == [int] * 4
    assert MsgpackCodec().decode(MsgpackCodec().encode(EventBatch(seq=0, ts=1.0, events=[e])))


# -- property: A -> kvstream -> B keeps what both carry --------------------------------------------

_VLLM = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
)
CARRIES: dict[str, dict[str, tuple[str, ...]]] = {
    "map": {
        "BlockStored": _VLLM,
        "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality"),
    },
    "sglang": {"BlockStored": _VLLM[:7], "BlockRemoved": ("block_hashes", "medium")},
    "sglang-positional": {"BlockStored": _VLLM[:6], "BlockRemoved": ("block_hashes", "medium")},
    "llm-d-2025-12": {"BlockStored": _VLLM[:6], "BlockRemoved": ("block_hashes", "medium")},
}
CARRIES["positional"] = CARRIES["map"]


def _through(profile: str, events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    data = MsgpackCodec(profile=profile).encode(EventBatch(seq=0, ts=1.0, events=events))  # type: ignore[arg-type]
    batch, refused = MsgpackCodec().decode_screened(data)
    assert refused == ()
    return batch.events


@settings(max_examples=60, deadline=None)
@given(
    st.lists(any_event, max_size=4),
    st.sampled_from(sorted(CARRIES)),
    st.sampled_from(sorted(CARRIES)),
)
def test_any_event_survives_dialect_a_to_kvstream_to_dialect_b(
    events: list[KVCacheEvent], a: str, b: str
) -> None:
    events = [msgspec.structs.replace(e, metadata=None) for e in events]
    out = _through(b, _through(a, events))
    assert [type(e) for e in out] == [type(e) for e in events]
    for before, after in zip(events, out, strict=True):
        name = type(before).__name__
        both = set(CARRIES[a].get(name, ())) & set(CARRIES[b].get(name, ()))
        for field in both:
            assert getattr(after, field) == getattr(before, field), (a, b, field)


# -- the relay: a stream of each dialect, refused shapes mixed in, into a file ---------------------

#: Events no dialect reads, mixed into the streams: each costs only itself.
FOREIGN = [
    ["BlockEvicted", [1]],
    {"type": "BlockStored", "block_hashes": [1]},
    ["BlockStored", [1], None, [1, 2, 3], 2, None, "GPU", None],  # a partial block
]


def _dialect_payload(name: str, k: int) -> bytes:
    """The golden message of ``name`` as batch ``k``, one foreign event mixed in."""
    ts, events, rank = msgspec.msgpack.decode(golden_bytes(name))
    mixed = [*events]
    mixed.insert(k % (len(events) + 1), FOREIGN[k % len(FOREIGN)])
    return msgspec.msgpack.encode([ts + k, mixed, rank])


def test_relay_carries_every_dialect_with_refused_shapes_once_and_in_order(
    tmp_path: Path,
) -> None:
    import os
    import subprocess
    import sys

    names = list(EXPECTED)
    publishers = [VllmStylePublisher() for _ in names]
    for pub in publishers:
        pub.start()
        assert pub.ready.wait(10)
    out = tmp_path / "out.jsonl"
    n = 8
    lost = 5  # the SGLang positional publisher loses batch 5 everywhere: an upstream gap
    gapped = "sglang-positional-metadata"
    try:
        for name, pub in zip(names, publishers, strict=True):
            for k in range(3):  # before the relay: only the rings have them
                pub.publish_raw(k, _dialect_payload(name, k), live=False)
        args = [sys.executable, "-m", "kvstream", "relay", "--interval", "0.02"]
        for name, pub in zip(names, publishers, strict=True):
            args += [
                "--source",
                f"zmq+tcp://127.0.0.1:{pub.pub_port}?replay=tcp://127.0.0.1:{pub.replay_port}"
                f"&origin={name}",
            ]
        args += ["--sink", f"file:{out}"]
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        try:
            # The relay started after 0..2 went out and hears 3 first: a fresh publisher
            # first heard at seq > 0, so it asks each ring from 0 (issue 14.6). Batch 3 is
            # sent again until then (ZMQ's slow joiner drops what precedes the connection):
            # a repeated seq is a duplicate, never a restart (15.7).
            deadline = time.monotonic() + 30
            while not all(p.requests for p in publishers) and time.monotonic() < deadline:
                for name, pub in zip(names, publishers, strict=True):
                    if not pub.requests:
                        pub.publish_raw(3, _dialect_payload(name, 3))
                time.sleep(0.05)
            for k in range(4, n):
                for name, pub in zip(names, publishers, strict=True):
                    if name == gapped and k == lost:
                        continue
                    pub.publish_raw(k, _dialect_payload(name, k))
                time.sleep(0.005)
            want_total = (
                sum(len(EXPECTED[name][0]) * (n - (name == gapped)) for name in names) + 1
            )  # the gap marker
            wait_for(lambda: sum(len(b) for b in read_out(out)) >= want_total, proc)
        finally:
            code, err = stop(proc)
    finally:
        for pub in publishers:
            pub.stopping.set()
            pub.join(10)
    assert code == 0, err
    by_origin: dict[str, list[KVCacheEvent]] = {}
    for batch in read_out(out):
        by_origin.setdefault(batch.origin, []).extend(batch.events)
    assert set(by_origin) == set(names)
    for name in names:
        want: list[KVCacheEvent] = []
        for k in range(n):
            if name == gapped and k == lost:
                continue
            if name == gapped and k == lost + 1:
                want.append("gap")  # type: ignore[arg-type]
            want.extend(EXPECTED[name][0])
        got = by_origin[name]
        if name == gapped:
            at = want.index("gap")  # type: ignore[arg-type]
            marker = got[at]
            assert type(marker) is AllBlocksCleared
            gap = marker.metadata["upstream_gap"]  # type: ignore[index]
            assert (gap["first_missing"], gap["next_seq"]) == (lost, lost + 1)
            got = got[:at] + got[at + 1 :]
            want.remove("gap")  # type: ignore[arg-type]
        assert got == want, name  # every event once, in order; the foreign ones refused
    summary = err.strip().splitlines()[-1]
    assert "1 upstream gap(s) (1 batches, 1 marked)" in summary
    assert "0 restart(s)" in summary
    # One foreign event in each batch that arrived, each refused alone.
    assert f"{len(names) * n - 1} event(s) refused" in summary


# -- property: an engine's own dialect round-trips through kvstream byte for byte ------------------

I64 = st.integers(-(2**63), 2**63 - 1)
TOKEN = st.integers(0, 2**32 - 1)
SGLANG_MEDIA = st.sampled_from(
    [None, "GPU", "CPU_PINNED", "DISK", "EXTERNAL", "cpu", "device(type='cuda', index=0)", "X"]
)


@st.composite
def sglang_stored(draw: st.DrawFn) -> dw.SglangStored:
    n = draw(st.integers(0, 3))
    size = draw(st.integers(1, 4))
    blocks = draw(st.integers(n, n + 2))
    tokens: list[Any] = draw(st.lists(TOKEN, min_size=blocks * size, max_size=blocks * size))
    if tokens and draw(st.booleans()):  # type: ignore[arg-type]  # EAGLE pages: (token, next) pairs
        if draw(st.booleans()):
            tail = draw(TOKEN)
            tokens = [(t, u) for t, u in zip(tokens, [*tokens[1:], tail], strict=True)]
        else:
            tokens = [(t, draw(TOKEN)) for t in tokens]
    return dw.SglangStored(
        draw(st.lists(I64, min_size=n, max_size=n)),
        draw(st.none() | I64),
        tokens,
        size,
        draw(st.none() | I64),
        draw(SGLANG_MEDIA),
        draw(st.none() | st.text(max_size=6)),
        cache_salt=draw(st.none() | st.text(max_size=6)),
        session_id=draw(st.none() | st.text(max_size=6)),
    )


sglang_events = st.one_of(
    sglang_stored(),
    st.builds(dw.SglangRemoved, st.lists(I64, max_size=3), SGLANG_MEDIA),
    st.just(dw.SglangCleared()),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(sglang_events, max_size=5), st.none() | st.integers(0, 7), st.booleans())
def test_sglang_events_round_trip_through_kvstream_byte_for_byte(
    events: list[Any], rank: int | None, normalize: bool
) -> None:
    data = msgspec.msgpack.encode(dw.SglangBatch(1767225600.25, events, rank))
    codec = MsgpackCodec(media="normalize" if normalize else "keep")
    batch, refused = codec.decode_screened(data)
    assert refused == ()
    assert MsgpackCodec(profile="sglang").encode(batch) == data


@settings(max_examples=80, deadline=None)
@given(st.lists(any_event, max_size=5))
def test_vllm_map_events_round_trip_through_kvstream_byte_for_byte(
    events: list[KVCacheEvent],
) -> None:
    # What a vLLM engine publishes (its structs), through kvstream's reader and map profile.
    wire_events = [vllm.to_vllm(e) for e in events]
    data = msgspec.msgpack.encode(vllm.KVEventBatch(1767225600.5, wire_events, 0))
    batch, refused = MsgpackCodec().decode_screened(data)
    assert refused == ()
    assert MsgpackCodec().encode(batch) == data


def test_eagle_pairs_as_tuples_of_tuples_are_read_too() -> None:
    e = BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=((1, 2), (2, 3)),  # type: ignore[arg-type]
        block_size=2,
    )
    assert (e.token_ids, e.metadata) == ([1, 2], wire(token_pairs_next=3))


def test_relay_lets_a_vllm_only_consumer_read_sglang(tmp_path: Path) -> None:
    """``kvstream relay --source <sglang> --sink zmq+tcp://...?profile=map`` (issue 14.4)."""
    import os
    import socket
    import subprocess
    import sys

    import zmq

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    source = VllmStylePublisher()
    source.start()
    assert source.ready.wait(10)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    name = "sglang-map-eagle-partial-signed"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvstream", "relay", "--interval", "0.02"),
            *("--source", f"zmq+tcp://127.0.0.1:{source.pub_port}?origin=sglang-0&join=live"),
            *("--sink", f"zmq+tcp://127.0.0.1:{port}?bind=true&profile=map"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    got: list[Any] = []
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        seq = 0
        # Batches go out until the vLLM-only reader has three: the first ones may be lost
        # to either slow joiner (this test checks what is read, not continuity).
        while len(got) < 3 and time.monotonic() < deadline and proc.poll() is None:
            source.publish_raw(seq, golden_bytes(name))
            seq += 1
            try:
                frames = sub.recv_multipart()
            except zmq.Again:
                continue
            got.append(vllm.decoder.decode(frames[2]))  # unknown fields refused
    finally:
        code, err = stop(proc)
        sub.close(linger=0)
        ctx.term()
        source.stopping.set()
        source.join(10)
    assert code == 0, err
    assert len(got) >= 3, err
    for batch in got:
        assert batch.events[0] == vllm.BlockStored(
            [-4242], None, [11, 12, 13, 14], 4, None, "GPU", None
        )
        assert batch.events[1].medium == "CPU_PINNED"
        assert batch.data_parallel_rank == 2


def test_a_non_map_wire_entry_costs_only_its_event_when_normalizing() -> None:
    bad = {"type": "BlockRemoved", "block_hashes": [1], "medium": "NVME", "metadata": {"wire": 3}}
    good = {"type": "BlockRemoved", "block_hashes": [2], "medium": "NVME"}
    data = msgspec.msgpack.encode([1.0, [bad, good], 0])
    batch, refused = MsgpackCodec(media="normalize").decode_screened(data)
    assert [r.position for r in refused] == [0]
    assert "metadata.wire" in refused[0].reason
    assert batch.events == [
        BlockRemoved(block_hashes=[2], medium="DISK", metadata=wire(medium="NVME"))
    ]
    with pytest.raises(InvalidEventError, match=r"metadata\.wire"):
        BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=[[1, 2]], block_size=1,  # type: ignore[list-item]
            metadata={"wire": 3},
        )  # fmt: skip
