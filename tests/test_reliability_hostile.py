"""Hostile input, property-based: whatever arrives either becomes valid events or raises
kvstream's own error. Nothing else escapes, nothing hangs, nothing allocates without
bound.

Covers event construction, the JSON-lines and msgpack decoders, the socket
protocol's hello line and message reader (lines and frames), and vLLM's ZMQ live
and replay frames. The end-to-end versions (hostile peers on real sockets) are in
``test_reliability_peers.py``.
"""

from __future__ import annotations

import os
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import event as note
from hypothesis import strategies as st

from kvstream import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    InvalidEventError,
    JsonCodec,
    KVStreamError,
)
from kvstream._wire import socket_protocol as sp
from kvstream._wire import vllm_zmq as vz
from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.testing import SeededEvents

#: Examples per property; raise KVSTREAM_FUZZ_EXAMPLES for a longer hunt.
FUZZ = settings(
    max_examples=int(os.environ.get("KVSTREAM_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- strategies -------------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**63) - 2, max_value=2**64 + 2)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
#: Any Python data a decoder or a careless caller could hand over.
anything = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=5)
    ),
    max_leaves=20,
)
#: JSON-representable data (what a hostile JSON line can contain).
json_data = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=25,
)


def _json_bytes(value: object) -> bytes:
    """``value`` as JSON, or ``null`` when orjson cannot write it (an int past 64 bits)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return b"null"


_hash = st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.binary(min_size=1, max_size=32)
_plausible = {
    "block_hashes": st.lists(_hash, max_size=4),
    "parent_block_hash": st.none() | _hash,
    "token_ids": st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=16),
    "block_size": st.integers(min_value=-2, max_value=8),
    "lora_id": st.none() | st.integers(),
    "medium": st.none() | st.sampled_from(["GPU", "CPU", "DISK"]),
    "lora_name": st.none() | st.text(max_size=10),
    "extra_keys": st.none() | st.lists(st.none() | st.lists(_scalars, max_size=3), max_size=4),
    "group_idx": st.none() | st.integers(min_value=-2, max_value=4),
    "kv_cache_spec_kind": st.none() | st.text(max_size=10),
    "kv_cache_spec_sliding_window": st.none() | st.integers(),
    "locality": st.none() | st.sampled_from(["LOCAL", "REMOTE"]),
    "metadata": st.none() | st.dictionaries(st.text(max_size=5), json_data, max_size=3),
}


def _field(name: str) -> st.SearchStrategy[Any]:
    """Mostly plausible values (so many events are valid), sometimes anything at all."""
    return st.integers(0, 9).flatmap(lambda k: anything if k == 0 else _plausible[name])


_REQUIRED = {
    BlockStored: ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    BlockRemoved: ("block_hashes",),
    AllBlocksCleared: (),
}
_OPTIONAL = {
    BlockStored: (
        "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window", "locality", "metadata",
    ),
    BlockRemoved: ("medium", "group_idx", "locality", "metadata"),
    AllBlocksCleared: ("metadata",),
}  # fmt: skip


@st.composite
def event_kwargs(draw: st.DrawFn) -> tuple[type, dict[str, Any]]:
    cls = draw(st.sampled_from([BlockStored, BlockRemoved, AllBlocksCleared]))
    kwargs = {name: draw(_field(name)) for name in _REQUIRED[cls]}
    if cls is BlockStored and draw(st.booleans()):
        # Half the time, tokens that fit: block_size tokens per block.
        hashes = kwargs["block_hashes"]
        size = kwargs["block_size"] = draw(st.integers(0, 4))
        if type(hashes) is list:
            kwargs["token_ids"] = draw(
                st.lists(st.integers(0, 2**64 - 1), min_size=size * len(hashes),
                         max_size=size * len(hashes))
            )  # fmt: skip
    for name in _OPTIONAL[cls]:
        if draw(st.booleans()):
            kwargs[name] = draw(_field(name))
    return cls, kwargs


_CODECS: list[Any] = [
    JsonCodec(),
    JsonCodec(hashes_as_strings=True),
    MsgpackCodec(metadata=True),
]


def _round_trip(batch: EventBatch, codec: Any) -> EventBatch:
    data = codec.encode(batch)
    if isinstance(codec, MsgpackCodec):
        return codec.decode(data, seq=batch.seq, origin=batch.origin, epoch=batch.epoch)
    return codec.decode(data)  # type: ignore[no-any-return]


# -- event construction ------------------------------------------------------------------


@FUZZ
@given(event_kwargs())
def test_an_event_is_valid_and_survives_every_codec_or_is_refused(
    case: tuple[type, dict[str, Any]],
) -> None:
    cls, kwargs = case
    try:
        event = cls(**kwargs)
    except InvalidEventError:
        note("refused")
        return  # refused at the edge, with kvstream's error (a ValueError/TypeError too)
    note(f"valid {cls.__name__}")
    batch = EventBatch(seq=3, ts=1.5, events=[event], origin="o", epoch="e")
    for codec in _CODECS:
        assert _round_trip(batch, codec).events == [event], codec
    # The positional vLLM profile carries everything but metadata.
    positional = MsgpackCodec(profile="positional")
    back = _round_trip(batch, positional).events[0]
    assert msgspec.structs.replace(back, metadata=event.metadata) == event


# -- decoders ----------------------------------------------------------------------------

_json = JsonCodec()
_msgpack = MsgpackCodec()
_msgpack_positional = MsgpackCodec(profile="positional")


def _decodes_or_refuses(decode: Callable[[bytes], EventBatch], data: bytes) -> None:
    try:
        batch = decode(data)
    except DecodeError:
        note("refused")
        return
    note(f"decoded ({'empty' if not batch.events else 'with events'})")
    assert isinstance(batch, EventBatch)
    # What decodes is valid: it re-encodes, and decodes to the same batch again.
    assert _round_trip(batch, JsonCodec()) == batch


def _valid_payloads() -> list[tuple[bytes, bytes]]:
    """(json line, msgpack payload) of real batches, to mutate."""
    stream = SeededEvents(99)
    out = []
    for n in range(8):
        batch = EventBatch(seq=n, ts=1.0 + n, events=stream.events(n * 40, n * 40 + 5))
        out.append((_json.encode(batch), _msgpack.encode(batch)))
    return out


_VALID = _valid_payloads()


@st.composite
def mutated(draw: st.DrawFn, which: int) -> bytes:
    """A real payload with a few bytes flipped, cut, or inserted."""
    data = bytearray(draw(st.sampled_from(_VALID))[which])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[i : i + draw(st.integers(1, 16))]
        else:
            data[i:i] = draw(st.binary(min_size=1, max_size=9))
    return bytes(data)


def _paths(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a decoded document (dict keys and list indexes)."""
    out = [path]
    if type(obj) is dict:
        for k, v in obj.items():
            out.extend(_paths(v, (*path, k)))
    elif type(obj) is list:
        for i, v in enumerate(obj):
            out.extend(_paths(v, (*path, i)))
    return out


#: Values that often fit where they land (so some restructured batches stay valid).
_fitting = (
    st.none()
    | st.integers(0, 2**64 - 1)
    | st.integers(-(2**63), 16)
    | st.sampled_from(["GPU", "CPU", "BlockStored", "BlockRemoved", "AllBlocksCleared", ""])
    | st.lists(st.integers(0, 2**64 - 1), max_size=4)
    | st.floats(allow_nan=False)
)


@st.composite
def restructured(draw: st.DrawFn, which: int, values: st.SearchStrategy[Any]) -> bytes:
    """A real batch, decoded to plain data, with one part replaced or removed, re-encoded."""
    raw = draw(st.sampled_from(_VALID))[which]
    loads: Any = orjson.loads if which == 0 else msgspec.msgpack.decode
    dumps: Any = orjson.dumps if which == 0 else msgspec.msgpack.encode
    doc = loads(raw)
    for _ in range(draw(st.integers(1, 2))):
        path = draw(st.sampled_from(_paths(doc)))
        if not path:
            doc = draw(values)
            continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        choice = draw(st.integers(0, 5))
        if choice == 0:
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(values if choice == 1 else _fitting)
    try:
        return dumps(doc)  # type: ignore[no-any-return]
    except (TypeError, OverflowError, orjson.JSONEncodeError):
        return b"\xc1"


@FUZZ
@given(
    st.binary(max_size=300)
    | mutated(0)
    | restructured(0, json_data)
    | restructured(0, json_data)
    | restructured(0, json_data)
    | json_data.map(_json_bytes)
)
@example(b"[" * 100_000)  # nesting deeper than any parser's stack
@example(b'{"seq": 0, "ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": [1e400]}]}')
@example(b'{"seq": 18446744073709551616123, "ts": 1.0, "events": []}')
@example(b'{"seq": 0, "ts": NaN, "events": []}')
def test_the_json_decoder_returns_a_valid_batch_or_a_decode_error(data: bytes) -> None:
    _decodes_or_refuses(_json.decode, data)


@FUZZ
@given(
    st.binary(max_size=300)
    | mutated(1)
    | restructured(1, anything)
    | restructured(1, anything)
    | anything.map(lambda v: msgspec.msgpack.encode(v) if _packable(v) else b"\xc1")
)
def test_the_msgpack_decoder_returns_a_valid_batch_or_a_decode_error(data: bytes) -> None:
    _decodes_or_refuses(_msgpack.decode, data)
    _decodes_or_refuses(_msgpack_positional.decode, data)


def _packable(value: object) -> bool:
    try:
        msgspec.msgpack.encode(value)
    except (TypeError, OverflowError):
        return False
    return True


# Headers that claim about 4 GB (2**32 - 1 elements or bytes) and carry almost nothing.
_BOMBS = {
    "array32": b"\xdd\xff\xff\xff\xff",
    "map32": b"\xdf\xff\xff\xff\xff",
    "bin32": b"\xc6\xff\xff\xff\xff",
    "str32": b"\xdb\xff\xff\xff\xff",
    "batch-with-events-array32": b"\x93\xcb" + struct.pack(">d", 1.0) + b"\xdd\xff\xff\xff\xff",
    "event-hashes-array32": (
        b"\x93\xcb" + struct.pack(">d", 1.0) + b"\x91\x82\xa4type\xacBlockRemoved"
        b"\xacblock_hashes\xdd\xff\xff\xff\xff"
    ),
    "ext32": b"\xc9\xff\xff\xff\xff\x01",
}


@pytest.mark.parametrize("bomb", list(_BOMBS.values()), ids=list(_BOMBS))
def test_a_msgpack_length_claiming_4_gb_allocates_nothing_like_it(bomb: bytes) -> None:
    tracemalloc.start()
    try:
        for codec in (_msgpack, _msgpack_positional):
            with pytest.raises(DecodeError):
                codec.decode(bomb + b"\x00" * 64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # under a megabyte, for a claim of four gigabytes


# -- the socket protocol -------------------------------------------------------------------


@FUZZ
@given(
    st.binary(max_size=200)
    | json_data.map(_json_bytes)
    | st.fixed_dictionaries(
        {},
        optional={
            "from_seq": json_data | st.integers() | st.dictionaries(st.text(), json_data),
            "epoch": json_data,
            "token": json_data,
            "version": json_data,
        },
    ).map(_json_bytes)
    | st.fixed_dictionaries(  # plausible hellos, so that many are accepted
        {},
        optional={
            "from_seq": st.integers(-1, 2**63)
            | st.dictionaries(st.text(max_size=4), st.integers(-1, 99), max_size=3),
            "epoch": st.text(max_size=6)
            | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3),
            "token": st.text(max_size=10),
            "version": st.integers(0, 2),
        },
    ).map(_json_bytes)
)
@example(b'{"from_seq": -1}')
@example(b'{"from_seq": 9223372036854775808}')
@example(b'{"from_seq": {"": 1}}')
@example(b'{"version": 2}')
@example(b'{"token": "' + b"x" * 5000 + b'"}')
@example(b"{" + b'"a":1,' * 40_000 + b'"b":1}')  # over the size cap
def test_a_hello_line_parses_or_is_refused_with_a_protocol_error(line: bytes) -> None:
    try:
        hello = sp.parse_hello(line)
    except sp.ProtocolError as exc:
        refused: sp.ProtocolError | None = exc
    else:
        refused = None
    if refused is not None:
        note(f"refused: {refused.code}")
        assert refused.code in ("bad_hello", "version")
        assert "x" * 100 not in str(refused)  # a refused token is never echoed
        return
    note("accepted")
    assert isinstance(hello, sp.Hello)
    for name in hello.named_origins():
        hello.start_for(name)
        hello.epoch_for(name)


def _drain_reader(reader: sp.MessageReader, chunks: list[bytes]) -> int:
    """Feed chunks; read every message. Returns how many came out. ProtocolError ends it."""
    n = 0
    for chunk in chunks:
        reader.feed(chunk)
        while True:
            try:
                message = reader.next_message()
            except sp.ProtocolError:
                return n  # the stream is broken: the subscriber drops the connection
            except DecodeError:
                continue  # one bad message, consumed: skip it
            if message is None:
                break
            n += 1
        assert reader.buffered <= reader.max_message_bytes + 4 + max(map(len, chunks))
    return n


def _frame(header: bytes, payload: bytes) -> bytes:
    return struct.pack(">IH", 2 + len(header) + len(payload), len(header)) + header + payload


_good_frames = [
    sp.batch_message(_msgpack.encode(b), b, "frames")
    for b in (
        EventBatch(seq=i, ts=1.0, events=SeededEvents(5).events(i, i + 3), origin="o", epoch="e")
        for i in range(4)
    )
]


@FUZZ
@given(
    framing=st.sampled_from(["lines", "frames"]),
    parts=st.lists(
        st.binary(max_size=64)
        | st.sampled_from([line for line, _ in _VALID])
        | st.sampled_from(_good_frames)
        | st.builds(_frame, st.binary(max_size=20), st.binary(max_size=40))
        | st.builds(
            _frame,
            anything.map(lambda v: msgspec.msgpack.encode(v) if _packable(v) else b""),
            st.sampled_from([b""] + [p for _, p in _VALID]),
        ),
        max_size=8,
    ),
    cuts=st.lists(st.integers(1, 64), max_size=8),
)
def test_the_message_reader_never_fails_otherwise_than_with_a_decode_error(
    framing: str, parts: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(parts)
    chunks, i = [], 0
    for cut in cuts:
        chunks.append(stream[i : i + cut])
        i += cut
    chunks.append(stream[i:])
    reader = sp.MessageReader(max_message_bytes=4096)
    reader.use(framing, _json if framing == "lines" else _msgpack)
    _drain_reader(reader, chunks)


@pytest.mark.parametrize("framing", ["lines", "frames"])
def test_a_message_claiming_4_gb_is_refused_before_anything_is_buffered(framing: str) -> None:
    reader = sp.MessageReader(max_message_bytes=1 << 20)
    reader.use(framing, _json if framing == "lines" else _msgpack)
    tracemalloc.start()
    try:
        if framing == "frames":
            reader.feed(b"\xff\xff\xff\xff\x00\x10")  # length 4 GiB - 1
        else:
            for _ in range(20):  # a line that never ends: 20 x 64 KiB, no newline
                reader.feed(b"x" * 65536)
                try:
                    reader.next_message()
                except sp.ProtocolError:
                    break
        with pytest.raises(sp.ProtocolError):
            reader.next_message()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


# -- vLLM's ZMQ frames ------------------------------------------------------------------


_frames = st.lists(
    st.binary(max_size=12)
    | st.just(b"")
    | st.just(vz.END_SEQ)
    | st.integers(0, 2**64 - 1).map(lambda n: n.to_bytes(8, "big")),
    max_size=6,
)


@FUZZ
@given(_frames)
def test_zmq_frames_parse_or_raise_a_decode_error(frames: list[bytes]) -> None:
    parsers: list[Callable[[list[bytes]], object]] = [
        vz.parse_live,
        vz.parse_replay_request,
        vz.parse_replay_reply,
    ]
    for parse in parsers:
        try:
            parsed = parse(frames)
        except DecodeError:
            continue
        if parse is vz.parse_replay_request:
            _identity, start = parsed  # type: ignore[misc]
            assert 0 <= start < 2**64  # type: ignore[has-type]
        elif parsed is not None:
            assert 0 <= parsed.seq < 2**64 - 1  # type: ignore[attr-defined]


def test_every_error_above_is_a_kvstream_error() -> None:
    """The contract the tests above lean on: one root catches every refusal."""
    assert issubclass(DecodeError, KVStreamError)
    assert issubclass(sp.ProtocolError, DecodeError)
    assert issubclass(InvalidEventError, KVStreamError)
