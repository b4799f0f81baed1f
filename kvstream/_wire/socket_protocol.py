"""The socket protocol, version 1: every rule both ends of a TCP/Unix stream share.

The sink (`kvstream.sinks.socket`) and the subscriber
(`kvstream.consumers.socket`) import their wire knowledge from here and
nowhere else; `docs/socket-protocol.md` is the prose version of this module.
Everything here is sans-IO: byte strings in, byte strings and values out.

The conversation:

    subscriber                                   sink
    ──────────                                   ────
    hello line (JSON) ──────────────►   checks it (token, from_seq)
                      ◄──────────────   welcome line (JSON), or one error line and close
                      ◄──────────────   gap notices or snapshot, replayed batches, live batches
                      ◄──────────────   end (the sink is closing), then close

**Hello** (subscriber to sink, one JSON object on one line, at most
`MAX_HELLO_BYTES` bytes with its `\\n`; every key optional):

    {"from_seq": 42, "epoch": "3f9c...", "token": "...", "version": 1,
     "max_message_bytes": 1048576}

`from_seq` is an integer (every origin from that seq) or an object mapping
origins to integers, where the key `"*"` gives the default for origins not
named; without it the subscriber gets live batches only. `epoch` (a string,
or an object mapping origins to strings) says which epoch those numbers count
in: for an origin whose current epoch differs, the sink starts at seq 0 of the
current epoch. `token` is the shared secret when the sink has one.
`max_message_bytes` is the largest line or frame body the subscriber reads
(`DEFAULT_MAX_MESSAGE_BYTES` when absent): the sink never sends it a bigger
batch, but a gap notice with reason `too_large` in its place.

**Welcome** (sink to subscriber, always one JSON line, before anything else):

    {"type": "welcome", "version": 1, "codec": "json", "framing": "lines",
     "snapshot": true,
     "origins": {"engine-0": {"epoch": "3f9c...", "oldest": 17, "newest": 41}}}

`oldest`/`newest` are the first and last seq of the origin's current epoch
that the sink can replay (`oldest` is null when the ring holds none of it;
`newest` is the last seq the sink published).

**Messages after the welcome.** With `framing: "lines"` (the `json` codec)
every message is one JSON line. With `framing: "frames"` (any other codec,
such as `msgpack`) every message is one frame:

    frame  = length (uint32, big-endian) body          length = len(body) <= the reader's cap
    body   = header_length (uint16, big-endian) header payload
    header = a msgpack map: the same keys a JSON line would have, minus the events
    payload = the codec's bytes (a batch, or a snapshot part's events); empty for control

The rule that tells batches from control messages is the same in both
framings: **a message whose object (line or header) has a `seq` key is a
batch; every other message is a control message, named by its `type`**
(`welcome`, `gap`, `snapshot`, `end`, `error`). A reader skips control
types it does not know. In frames, a batch header is `{"origin", "epoch",
"seq"}`, because vLLM's msgpack batch `[ts, events, data_parallel_rank]`
carries none of them.

Control messages:

    {"type": "gap", "origin": O, "epoch": E, "first_missing": 3, "next_seq": 17,
     "reason": "evicted"}               batches [3, 17) of O will never come
    {"type": "snapshot", "origin": O, "epoch": E, "next_seq": 42, "first_missing": 3,
     "part": 0, "last": true, "ts": ..., "data_parallel_rank": ..., "events": [...]}
                                        the state before seq 42 (AllBlocksCleared, then
                                        the blocks held, parents first); in frames the
                                        events are the payload, as the codec's batch
    {"type": "end", "reason": "sink closed"}
    {"type": "error", "code": "unauthorized", "message": "..."}    then the sink closes
    {"type": "heartbeat", "origin": O, "epoch": E, "last_seq": 41, "interval": 5.0,
     "beat": 7}                         O is idle, not gone (sinks with `heartbeat=`;
                                        `last_seq`, not `seq`: it is no batch)
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple, TypeAlias, TypeVar

import msgspec
import orjson

from kvstream._wire.broker import Heartbeat
from kvstream._wire.codec_names import CodecByName, builtin_codec
from kvstream._wire.from_seq import ANY_ORIGIN, FromSeq, start_seq
from kvstream.codecs.base import Codec
from kvstream.codecs.json import JsonCodec, json_default
from kvstream.errors import ConfigError, DecodeError, shorten
from kvstream.events import EventBatch, KVCacheEvent

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "FATAL_ERRORS",
    "MAX_CONTROL_LINE_BYTES",
    "MAX_HELLO_BYTES",
    "MIN_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "SNAPSHOT_PART_EVENTS",
    "BatchMessage",
    "ControlMessage",
    "Hello",
    "MessageReader",
    "OriginInfo",
    "ProtocolError",
    "SnapshotPart",
    "Welcome",
    "batch_message",
    "codec_by_name",
    "control_message",
    "encode_hello",
    "error_line",
    "framing_of",
    "heartbeat_message",
    "message_size",
    "parse_heartbeat",
    "parse_hello",
    "parse_welcome",
    "snapshot_messages",
    "token_matches",
    "welcome_line",
]

_V = TypeVar("_V")

#: The version this module speaks. A hello naming a higher one is refused.
PROTOCOL_VERSION: Final = 1
#: The hello line, `\n` included, is at most this long: a peer cannot make
#: the sink buffer more before it has said who it is.
MAX_HELLO_BYTES: Final = 64 * 1024
#: The welcome and error lines (before the framing is known) are at most this long.
MAX_CONTROL_LINE_BYTES: Final = 4 * 1024 * 1024
#: Default cap on one message (a batch line or a frame body) a subscriber accepts.
DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
#: Events per snapshot message: a large cache is sent in parts.
SNAPSHOT_PART_EVENTS: Final = 1024
#: Error codes after which retrying cannot help: the subscriber gives up.
FATAL_ERRORS: Final = frozenset({"bad_hello", "unauthorized", "version", "from_seq_ahead"})

_MAX_ORIGINS_IN_HELLO: Final = 4096
_MAX_NAME: Final = 1024
_SEQ_LIMIT: Final = 2**63
_HELLO_KEYS: Final = frozenset({"from_seq", "epoch", "token", "version", "max_message_bytes"})
#: The smallest message cap a reader takes (a gap notice must always fit).
MIN_MESSAGE_BYTES: Final = 1024
_FRAME_HEAD: Final = struct.Struct(">IH")
_LENGTH: Final = struct.Struct(">I")
_HEADER_LENGTH: Final = struct.Struct(">H")

_msgpack_encode = msgspec.msgpack.Encoder().encode
_msgpack_decode = msgspec.msgpack.Decoder().decode


class ProtocolError(DecodeError):
    """The peer broke the socket protocol (a bad hello, an oversized frame, ...).

    `code` is the error code the sink sends back (`bad_hello`, `version`, ...).
    """

    def __init__(self, message: str, code: str = "protocol") -> None:
        super().__init__(message)
        self.code = code


# -- the hello ------------------------------------------------------------------------


class Hello(NamedTuple):
    """A subscriber's validated hello line."""

    #: int, {origin: int} (`"*"`: every other origin), or None (live only)
    from_seq: int | dict[str, int] | None = None
    #: str, {origin: str}, or None (the sink's current epoch)
    epoch: str | dict[str, str] | None = None
    token: str | None = None
    version: int = PROTOCOL_VERSION
    #: the largest line or frame body the subscriber reads
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def start_for(self, origin: str) -> int | None:
        """The seq `origin` is asked from, or None for live only."""
        return start_seq(self.from_seq, origin)

    def epoch_for(self, origin: str) -> str | None:
        """The epoch the subscriber's seq for `origin` counts in, if it said."""
        e = self.epoch
        if e is None or isinstance(e, str):
            return e
        return e.get(origin)

    def named_origins(self) -> list[str]:
        """Origins the hello names explicitly (in `from_seq` or `epoch`)."""
        names: list[str] = []
        for part in (self.from_seq, self.epoch):
            if isinstance(part, dict):
                names.extend(k for k in part if k != ANY_ORIGIN)
        return names


def _check_name(value: object, where: str) -> str:
    if type(value) is not str or not value or len(value) > _MAX_NAME:
        raise ProtocolError(
            f"hello.{where}: expected a non-empty string of at most {_MAX_NAME} characters, "
            f"got {shorten(value)}",
            "bad_hello",
        )
    return value


def _per_origin(raw: Any, field: str, check: Callable[[Any, str], _V]) -> _V | dict[str, _V] | None:
    """A hello field given once for every origin, or as `{origin: value}`."""
    if raw is None:
        return None
    if type(raw) is not dict:
        return check(raw, field)
    if len(raw) > _MAX_ORIGINS_IN_HELLO:
        raise ProtocolError(
            f"hello.{field}: expected at most {_MAX_ORIGINS_IN_HELLO} origins, got {len(raw)}",
            "bad_hello",
        )
    return {_check_name(k, f"{field} key"): check(v, f"{field}[{k!r:.40}]") for k, v in raw.items()}


def _check_seq(value: object, where: str) -> int:
    if type(value) is not int or not 0 <= value < _SEQ_LIMIT:
        raise ProtocolError(
            f"hello.{where}: expected an integer in [0, 2**63), got {shorten(value)}", "bad_hello"
        )
    return value


def parse_hello(line: bytes) -> Hello:
    """Validate one hello line (with or without its `\\n`); raise `ProtocolError`."""
    if len(line) > MAX_HELLO_BYTES:
        raise ProtocolError(
            f"hello: expected at most {MAX_HELLO_BYTES} bytes, got {len(line)}", "bad_hello"
        )
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(
            f"hello: expected one JSON object, got invalid JSON ({exc})", "bad_hello"
        ) from None
    if type(obj) is not dict:
        raise ProtocolError(f"hello: expected a JSON object, got {type(obj).__name__}", "bad_hello")
    unknown = obj.keys() - _HELLO_KEYS
    if unknown:
        raise ProtocolError(
            f"hello: unknown key(s) {sorted(unknown)!r}; expected from_seq, epoch, token, "
            "version, max_message_bytes",
            "bad_hello",
        )
    version = obj.get("version", PROTOCOL_VERSION)
    if type(version) is not int or version < 1:
        raise ProtocolError(
            f"hello.version: expected an integer >= 1, got {shorten(version)}", "bad_hello"
        )
    if version > PROTOCOL_VERSION:
        raise ProtocolError(
            f"hello.version: this sink speaks version {PROTOCOL_VERSION}, got {version}", "version"
        )
    from_seq: int | dict[str, int] | None = _per_origin(obj.get("from_seq"), "from_seq", _check_seq)
    epoch: str | dict[str, str] | None = _per_origin(obj.get("epoch"), "epoch", _check_name)
    token = obj.get("token")
    if token is not None and (type(token) is not str or len(token) > 4096):
        # The value is a secret: never echo it.
        raise ProtocolError(
            "hello.token: expected a string of at most 4096 characters", "bad_hello"
        )
    cap = obj.get("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES)
    if type(cap) is not int or not MIN_MESSAGE_BYTES <= cap < _SEQ_LIMIT:
        raise ProtocolError(
            f"hello.max_message_bytes: expected an integer >= {MIN_MESSAGE_BYTES}, "
            f"got {shorten(cap)}",
            "bad_hello",
        )
    return Hello(from_seq, epoch, token, version, cap)


def encode_hello(
    from_seq: FromSeq = None,
    *,
    epoch: str | Mapping[str, str] | None = None,
    token: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> bytes:
    """The hello line a subscriber sends (`\\n` included).

    `max_message_bytes` is said only when it is not the default, so a sink
    that predates the key still takes a default subscriber's hello.
    """
    obj: dict[str, Any] = {"version": PROTOCOL_VERSION}
    if from_seq is not None:
        obj["from_seq"] = from_seq if type(from_seq) is int else dict(from_seq)  # type: ignore[arg-type]
    if epoch is not None:
        obj["epoch"] = epoch if type(epoch) is str else dict(epoch)  # type: ignore[arg-type]
    if token is not None:
        obj["token"] = token
    if max_message_bytes != DEFAULT_MAX_MESSAGE_BYTES:
        obj["max_message_bytes"] = max_message_bytes
    line = orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE)
    if len(line) > MAX_HELLO_BYTES:
        raise ConfigError(
            f"hello: {len(line)} bytes is more than the protocol's {MAX_HELLO_BYTES} "
            "(too many origins in from_seq?)"
        )
    return line


def token_matches(expected: bytes, given: str | None) -> bool:
    """Constant-time comparison of a hello's token with the sink's.

    Both sides are hashed first, so the comparison takes the same time whatever
    the lengths are.
    """
    if given is None:
        return False
    a = hashlib.sha256(expected).digest()
    b = hashlib.sha256(given.encode("utf-8", "surrogatepass")).digest()
    return hmac.compare_digest(a, b)


# -- the welcome ----------------------------------------------------------------------


class OriginInfo(NamedTuple):
    """What the sink can replay of one origin (its current epoch)."""

    epoch: str
    #: first seq in the ring, or None when the ring holds none of this epoch
    oldest: int | None
    #: last seq the sink published, or None
    newest: int | None


class Welcome(NamedTuple):
    version: int
    codec: str
    framing: str
    snapshot: bool
    origins: dict[str, OriginInfo]


def framing_of(codec: Codec) -> str:
    """`lines` for kvstream's JSON codec, `frames` for every other codec."""
    return "lines" if isinstance(codec, JsonCodec) else "frames"


def welcome_line(codec: Codec, origins: Mapping[str, OriginInfo], *, snapshot: bool) -> bytes:
    obj = {
        "type": "welcome",
        "version": PROTOCOL_VERSION,
        "codec": codec.name,
        "framing": framing_of(codec),
        "snapshot": snapshot,
        "origins": {
            name: {"epoch": o.epoch, "oldest": o.oldest, "newest": o.newest}
            for name, o in origins.items()
        },
    }
    return orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE)


def error_line(code: str, message: str) -> bytes:
    """An error as one JSON line (the form used before the framing is known)."""
    return orjson.dumps(
        {"type": "error", "code": code, "message": message}, option=orjson.OPT_APPEND_NEWLINE
    )


def _opt_seq(value: object, where: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise ProtocolError(f"{where}: expected an integer >= 0 or null, got {shorten(value)}")
    return value


def parse_welcome(obj: Mapping[str, Any]) -> Welcome:
    """Validate the sink's first line (already parsed); an error line raises."""
    kind = obj.get("type")
    if kind == "error":
        code = obj.get("code")
        raise ProtocolError(f"the sink refused: {obj.get('message')!s:.300}", str(code))
    if kind != "welcome":
        raise ProtocolError(f"expected a welcome line first, got type {shorten(kind)}")
    version = obj.get("version")
    if type(version) is not int or version < 1:
        raise ProtocolError(f"welcome.version: expected an integer >= 1, got {shorten(version)}")
    codec = obj.get("codec")
    framing = obj.get("framing")
    if type(codec) is not str or framing not in ("lines", "frames"):
        raise ProtocolError(
            f"welcome: expected codec (str) and framing lines|frames, got {shorten(codec)}, "
            f"{shorten(framing)}"
        )
    raw = obj.get("origins", {})
    if type(raw) is not dict:
        raise ProtocolError(f"welcome.origins: expected an object, got {shorten(raw)}")
    origins: dict[str, OriginInfo] = {}
    for name, info in raw.items():
        if type(info) is not dict or type(info.get("epoch")) is not str:
            raise ProtocolError(
                f"welcome.origins[{name!r:.40}]: expected {{epoch, oldest, newest}}"
            )
        origins[name] = OriginInfo(
            info["epoch"],
            _opt_seq(info.get("oldest"), f"welcome.origins[{name!r:.40}].oldest"),
            _opt_seq(info.get("newest"), f"welcome.origins[{name!r:.40}].newest"),
        )
    return Welcome(version, codec, framing, bool(obj.get("snapshot", False)), origins)


def codec_by_name(name: str, codecs: CodecByName = builtin_codec) -> Codec:
    """The decoder for a codec the welcome names, found by `codecs`."""
    try:
        return codecs(name)
    except ConfigError as exc:
        raise ProtocolError(f"welcome.{exc}") from None


# -- messages on the sink's side ------------------------------------------------------------


def _frame(header: Mapping[str, Any], payload: bytes = b"") -> bytes:
    head = _msgpack_encode(header)
    if len(head) > 0xFFFF:
        raise DecodeError(f"frame header: {len(head)} bytes, expected at most 65535")
    return _FRAME_HEAD.pack(2 + len(head) + len(payload), len(head)) + head + payload


def batch_message(data: bytes, batch: EventBatch, framing: str) -> bytes:
    """The bytes of one batch on the wire, from its encoding `data`.

    Lines: the codec's JSON line itself. Frames: `{origin, epoch, seq}` header
    and the codec's bytes as the payload.
    """
    if framing == "lines":
        return data
    return _frame({"origin": batch.origin, "epoch": batch.epoch, "seq": batch.seq}, data)


def message_size(message: bytes, framing: str) -> int:
    """What a reader compares with its `max_message_bytes`: a line with its
    newline, a frame's body (its length field)."""
    return len(message) if framing == "lines" else len(message) - _LENGTH.size


def control_message(obj: Mapping[str, Any], framing: str) -> bytes:
    """A control message (`gap`, `end`, `error`) in the connection's framing."""
    if "seq" in obj or "type" not in obj:
        raise ValueError("a control message has a type and no seq")
    if framing == "lines":
        return orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE)
    return _frame(obj)


def heartbeat_message(heartbeat: Heartbeat) -> dict[str, Any]:
    """The fields of a `heartbeat` control message (`last_seq`: a `seq` key is a batch's)."""
    return {
        "type": "heartbeat",
        "origin": heartbeat.origin,
        "epoch": heartbeat.epoch,
        "last_seq": heartbeat.seq,
        "interval": heartbeat.interval,
        "beat": heartbeat.beat,
    }


def parse_heartbeat(fields: Mapping[str, Any]) -> Heartbeat:
    """A `heartbeat` control message's `Heartbeat`; `DecodeError` naming what is wrong."""
    obj = {k: v for k, v in fields.items() if k not in ("type", "last_seq")}
    obj["seq"] = fields.get("last_seq")
    return Heartbeat.from_mapping(obj)


def snapshot_messages(
    codec: Codec,
    *,
    origin: str,
    epoch: str,
    next_seq: int,
    first_missing: int,
    ts: float,
    data_parallel_rank: int | None,
    events: list[KVCacheEvent],
) -> list[bytes]:
    """A snapshot as messages of at most `SNAPSHOT_PART_EVENTS` events each."""
    framing = framing_of(codec)
    parts = [
        events[i : i + SNAPSHOT_PART_EVENTS] for i in range(0, len(events), SNAPSHOT_PART_EVENTS)
    ] or [[]]
    out: list[bytes] = []
    for n, part in enumerate(parts):
        pseudo = EventBatch(
            seq=max(next_seq - 1, 0),
            ts=ts,
            events=part,
            data_parallel_rank=data_parallel_rank,
            origin=origin,
            epoch=epoch,
        )
        header: dict[str, Any] = {
            "type": "snapshot",
            "origin": origin,
            "epoch": epoch,
            "next_seq": next_seq,
            "first_missing": first_missing,
            "part": n,
            "last": n == len(parts) - 1,
        }
        if framing == "lines":
            assert isinstance(codec, JsonCodec)
            body = codec.batch_to_dict(pseudo)
            del body["seq"], body["origin"], body["epoch"]
            header.update(body)
            out.append(orjson.dumps(header, option=orjson.OPT_APPEND_NEWLINE, default=json_default))
        else:
            out.append(_frame(header, codec.encode(pseudo)))
    return out


# -- messages on the subscriber's side ------------------------------------------------------


class BatchMessage(NamedTuple):
    batch: EventBatch


class ControlMessage(NamedTuple):
    """A message without `seq`; `type` says which (unknown types are for skipping)."""

    type: str
    fields: dict[str, Any]


class SnapshotPart(NamedTuple):
    origin: str
    epoch: str
    next_seq: int
    first_missing: int
    part: int
    last: bool
    batch: EventBatch  # the part's events (its seq means nothing)


Message: TypeAlias = BatchMessage | ControlMessage | SnapshotPart


class MessageReader:
    """Splits the bytes a subscriber receives into messages, and decodes them.

    It starts in `lines` mode capped at `MAX_CONTROL_LINE_BYTES` (for the
    welcome); `use()` switches to the framing and codec the welcome names,
    keeping what is already buffered. Lines and frames longer than
    `max_message_bytes` raise `ProtocolError` before anything that size
    is buffered, so a claimed 4 GB frame allocates nothing.
    """

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        if type(max_message_bytes) is not int or max_message_bytes < MIN_MESSAGE_BYTES:
            raise ConfigError(
                f"max_message_bytes: expected an int >= {MIN_MESSAGE_BYTES}, "
                f"got {max_message_bytes!r}"
            )
        self.max_message_bytes = max_message_bytes
        self.framing = "lines"
        self.codec: Codec | None = None
        self._limit = min(MAX_CONTROL_LINE_BYTES, max_message_bytes)
        self._buffer = bytearray()
        self._scan = 0  # lines: where to resume looking for b"\n"

    def use(self, framing: str, codec: Codec) -> None:
        if framing not in ("lines", "frames"):
            raise ProtocolError(f"framing: expected lines or frames, got {framing!r:.40}")
        if framing == "lines" and not isinstance(codec, JsonCodec):
            raise ProtocolError(f"framing lines needs the json codec, got {codec.name!r}")
        self.framing = framing
        self.codec = codec
        self._limit = self.max_message_bytes

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def next_raw(self) -> tuple[dict[str, Any], bytes] | None:
        """The next complete message as (object or header, payload), or None."""
        if self.framing == "lines":
            return self._next_line()
        buf = self._buffer
        if len(buf) < 4:
            return None
        (length,) = _LENGTH.unpack_from(buf)
        if length > self._limit or length < 2:
            raise ProtocolError(f"frame: length {length}, expected 2 to {self._limit} bytes")
        if len(buf) < 4 + length:
            return None
        (head_len,) = _HEADER_LENGTH.unpack_from(buf, 4)
        if head_len > length - 2:
            raise ProtocolError(f"frame: header length {head_len} exceeds the frame ({length})")
        head = bytes(buf[6 : 6 + head_len])
        payload = bytes(buf[6 + head_len : 4 + length])
        del buf[: 4 + length]
        try:
            header = _msgpack_decode(head)
        except (msgspec.DecodeError, ValueError) as exc:
            raise ProtocolError(f"frame header: not msgpack ({exc})") from None
        if type(header) is not dict:
            raise ProtocolError(f"frame header: expected a map, got {type(header).__name__}")
        return header, payload

    def _next_line(self) -> tuple[dict[str, Any], bytes] | None:
        buf = self._buffer
        while True:
            end = buf.find(b"\n", self._scan)
            if end < 0:
                if len(buf) > self._limit:
                    raise ProtocolError(f"line: more than {self._limit} bytes without a newline")
                self._scan = len(buf)
                return None
            if end + 1 > self._limit:
                raise ProtocolError(f"line: {end + 1} bytes, expected at most {self._limit}")
            line = bytes(buf[:end])
            del buf[: end + 1]
            self._scan = 0
            if line.strip():
                break
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ProtocolError(f"line: not JSON ({exc})") from None
        if type(obj) is not dict:
            raise ProtocolError(f"line: expected a JSON object, got {type(obj).__name__}")
        return obj, b""

    def next_message(self) -> Message | None:
        """The next decoded message, or None when more bytes are needed.

        `ProtocolError` means the stream itself is broken (framing,
        oversize): drop the connection. Any other `DecodeError` is about
        one message, which has been consumed: skip it and go on.
        """
        raw = self.next_raw()
        if raw is None:
            return None
        obj, payload = raw
        if "seq" in obj:
            return BatchMessage(self._batch(obj, payload))
        kind = obj.get("type")
        if type(kind) is not str:
            raise DecodeError(f"message: no seq and no type ({shorten(obj)})")
        if kind == "snapshot":
            return self._snapshot(obj, payload)
        return ControlMessage(kind, obj)

    def _batch(self, obj: dict[str, Any], payload: bytes) -> EventBatch:
        codec = self.codec
        if codec is None:
            raise ProtocolError("a batch arrived before the welcome")
        if self.framing == "lines":
            assert isinstance(codec, JsonCodec)
            return codec.batch_from_dict(obj)
        return _decode_payload(codec, payload, obj.get("origin"), obj.get("epoch"), obj.get("seq"))

    def _snapshot(self, obj: dict[str, Any], payload: bytes) -> SnapshotPart:
        origin = obj.get("origin")
        epoch = obj.get("epoch")
        next_seq = obj.get("next_seq")
        first = obj.get("first_missing")
        part = obj.get("part", 0)
        if (
            type(origin) is not str
            or type(epoch) is not str
            or type(next_seq) is not int
            or next_seq < 0
            or type(first) is not int
            or type(part) is not int
        ):
            raise DecodeError(f"snapshot: bad header {shorten(obj)}")
        codec = self.codec
        if codec is None:
            raise ProtocolError("a snapshot arrived before the welcome")
        seq = max(next_seq - 1, 0)
        if self.framing == "lines":
            assert isinstance(codec, JsonCodec)
            body: dict[str, Any] = {
                k: obj[k]
                for k in ("ts", "data_parallel_rank", "events", "hash_encoding")
                if k in obj
            }
            body.update(seq=seq, origin=origin, epoch=epoch)
            batch = codec.batch_from_dict(body)
        else:
            batch = _decode_payload(codec, payload, origin, epoch, seq)
        return SnapshotPart(
            origin, epoch, next_seq, first, part, bool(obj.get("last", True)), batch
        )


def _decode_payload(
    codec: Codec, payload: bytes, origin: object, epoch: object, seq: object
) -> EventBatch:
    if type(origin) is not str or type(epoch) is not str or type(seq) is not int or seq < 0:
        raise DecodeError(
            f"frame header: expected origin (str), epoch (str), seq (int >= 0), got "
            f"{shorten(origin)}, {shorten(epoch)}, {shorten(seq)}"
        )
    # The codec checks the name where its bytes carry one (the Codec contract).
    return codec.decode_keyed(payload, seq=seq, origin=origin, epoch=epoch)
