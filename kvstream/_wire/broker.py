"""Broker-side rules shared by both ends (sink and source) of NATS and Redis.

One message (a NATS JetStream message or a Redis Streams entry) carries one
batch: its payload is the batch encoded by the sink's codec, and the batch's
name `(origin, epoch, seq)` and the codec's name ride beside it, as NATS
headers or Redis fields, so a consumer can route, deduplicate and check
continuity without decoding, and can decode payloads that do not carry the
name themselves (vLLM's msgpack has no origin, epoch or seq):

=========  ===============  =============  ==========================================
what       NATS header      Redis field    value
=========  ===============  =============  ==========================================
origin     `Kv-Origin`    `origin`     the batch's origin
epoch      `Kv-Epoch`     `epoch`      the producer's epoch
seq        `Kv-Seq`       `seq`        decimal sequence number
codec      `Kv-Codec`     `codec`      `json` or `msgpack`
id         `Nats-Msg-Id`  (entry id)     `<origin>:<epoch>:<seq>` (NATS only)
payload    (message body)   `payload`    the encoded batch
=========  ===============  =============  ==========================================

NATS header values are text on one line, so origin and epoch are
percent-encoded there (`urllib.parse.quote`; letters, digits and `-._~@/`
stay as they are, so usual names read unchanged). The same encoding is used
inside the message id, where it also keeps `:` unambiguous. Redis fields are
binary-safe and carry the UTF-8 text as is.

The default NATS subject of a batch is `kv.events.<token>` where `<token>`
is the origin with every character other than ASCII letters, digits, `-`
and `_` replaced by `_` (a NATS subject token may not contain `.`,
`*`, `>` or white space), so `node-1.example:0` publishes to
`kv.events.node-1_example_0`. The mapping can merge two origins into one
subject; that is harmless because consumers read the origin from the header.

Snapshots (see `docs/recovery.md`) are stored beside the stream, the latest
one per origin, as one *envelope*: the line `KVSNAP1`, one JSON line of
`SnapshotInfo` (with the byte length of every part), then the parts,
each the snapshot's `AllBlocksCleared` / `BlockStored` events of one slice
encoded as the batch `resume_seq - 1` with the JSON codec. `position` is
where the batch `resume_seq - 1` sits in the stream (a JetStream stream
sequence, or a Redis entry id), so a reader continues right after it.

* NATS: stream `KV_SNAPSHOTS` (subjects `kv.snapshot.>`, rollup allowed).
  An origin's envelope is cut into messages on `kv.snapshot.<key>.part`, then
  its head (the `SnapshotInfo` with the stream sequences of the first
  and last part) goes to `kv.snapshot.<key>.head` with `Nats-Rollup: sub`,
  so the subject keeps only the latest head; then the older parts are purged.
  A reader gets the head, then the parts by sequence. A publisher that dies
  mid-snapshot leaves parts without a head: the previous head stays valid.
* Redis: the envelope is the string `<stream>:snapshot:<origin>` (one
  `SET`: the old value is replaced at once), and the set
  `<stream>:snapshots` names the origins that have one.

Heartbeats (opt-in) are `Heartbeat` records in JSON: on NATS core
(never stored) on `kv.heartbeat.<token>`, on Redis in the hash
`<stream>:heartbeats` (field: origin).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any, Final, NamedTuple
from urllib.parse import quote, unquote

import anyio
import anyio.abc
import anyio.lowlevel
import orjson

from kvstream._burst_log import BurstLogs
from kvstream._wire.codec_names import CodecByName, builtin_codec
from kvstream.codecs.base import Codec
from kvstream.codecs.json import JsonCodec
from kvstream.errors import ConfigError, DecodeError, KVStreamError
from kvstream.events import BlockStored, EventBatch, KVCacheEvent
from kvstream.state import Snapshot, SnapshotSchedule, StateError, StateKeeper, StateLimitError

__all__ = [
    "DEFAULT_NATS_STREAM",
    "DEFAULT_REDIS_STREAM",
    "DEFAULT_SNAPSHOT_STREAM",
    "DEFAULT_SUBJECT_FILTER",
    "FIELD_CODEC",
    "FIELD_EPOCH",
    "FIELD_ORIGIN",
    "FIELD_PAYLOAD",
    "FIELD_SEQ",
    "HEADER_CODEC",
    "HEADER_EPOCH",
    "HEADER_MSG_ID",
    "HEADER_ORIGIN",
    "HEADER_SEQ",
    "HEARTBEAT_SUBJECT_PREFIX",
    "SNAPSHOT_HEADS",
    "SNAPSHOT_PART_BLOCKS",
    "SNAPSHOT_SUBJECT_PREFIX",
    "SUBJECT_PREFIX",
    "BatchKey",
    "Heartbeat",
    "Heartbeats",
    "PayloadDecoder",
    "SinkSnapshots",
    "SnapshotInfo",
    "check_subject",
    "default_subject",
    "heartbeat_subject",
    "key_from_fields",
    "key_from_headers",
    "message_id",
    "nats_headers",
    "nats_headers_size",
    "read_envelope",
    "read_envelope_info",
    "redis_fields",
    "redis_heartbeats_key",
    "redis_position",
    "redis_snapshot_index",
    "redis_snapshot_key",
    "snapshot_envelope",
    "snapshot_key",
    "snapshot_parts",
    "snapshot_subjects",
    "subject_covers",
    "subject_token",
]

#: `(origin, epoch, seq)`: a batch's name for ever.
BatchKey = tuple[str, str, int]

HEADER_ORIGIN: Final = "Kv-Origin"
HEADER_EPOCH: Final = "Kv-Epoch"
HEADER_SEQ: Final = "Kv-Seq"
HEADER_CODEC: Final = "Kv-Codec"
#: JetStream's de-duplication header.
HEADER_MSG_ID: Final = "Nats-Msg-Id"

FIELD_PAYLOAD: Final = b"payload"
FIELD_ORIGIN: Final = b"origin"
FIELD_EPOCH: Final = b"epoch"
FIELD_SEQ: Final = b"seq"
FIELD_CODEC: Final = b"codec"

SUBJECT_PREFIX: Final = "kv.events."
#: What covers every default subject: a stream or a consumer of all origins.
DEFAULT_SUBJECT_FILTER: Final = SUBJECT_PREFIX + ">"
#: The JetStream stream a sink creates when asked and none covers its subject.
DEFAULT_NATS_STREAM: Final = "KV_EVENTS"
#: The Redis stream key when the URL names none.
DEFAULT_REDIS_STREAM: Final = "kv:events"

log = logging.getLogger("kvstream.sinks")

_SAFE: Final = "-._~@/"
_NOT_TOKEN: Final = re.compile(r"[^A-Za-z0-9_-]")
_BAD_SUBJECT_CHARS: Final = re.compile(r"[\s\x00-\x1f]")


# -- identity ---------------------------------------------------------------------


def message_id(batch: EventBatch) -> str:
    """`<origin>:<epoch>:<seq>` (origin and epoch percent-encoded, see the module doc).

    A retry of the same batch has the same id (the broker drops it); a restarted
    producer has a new epoch, so its `seq 0` is never taken for a duplicate.
    """
    return f"{quote(batch.origin, safe=_SAFE)}:{quote(batch.epoch, safe=_SAFE)}:{batch.seq}"


def nats_headers(batch: EventBatch, codec_name: str) -> dict[str, str]:
    """The NATS headers of a message carrying `batch`."""
    return {
        HEADER_MSG_ID: message_id(batch),
        HEADER_ORIGIN: quote(batch.origin, safe=_SAFE),
        HEADER_EPOCH: quote(batch.epoch, safe=_SAFE),
        HEADER_SEQ: str(batch.seq),
        HEADER_CODEC: codec_name,
    }


def nats_headers_size(headers: Mapping[str, str]) -> int:
    """Bytes the headers take on the wire (`NATS/1.0` block), for the max_payload check."""
    size = len(b"NATS/1.0\r\n") + 2
    for key, value in headers.items():
        size += len(key.encode()) + 2 + len(value.encode()) + 2
    return size


def redis_fields(batch: EventBatch, data: bytes, codec_name: str) -> dict[Any, Any]:
    """The fields of a Redis Streams entry carrying `batch` (payload first)."""
    return {
        FIELD_PAYLOAD: data,
        FIELD_ORIGIN: batch.origin.encode(),
        FIELD_EPOCH: batch.epoch.encode(),
        FIELD_SEQ: str(batch.seq).encode(),
        FIELD_CODEC: codec_name.encode(),
    }


def _parse_seq(value: object, where: str) -> int:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str) or not (value.isascii() and value.isdigit()):
        raise DecodeError(f"{where}: expected a decimal sequence number >= 0, got {value!r:.40}")
    return int(value)


def key_from_headers(headers: Mapping[str, str] | None) -> BatchKey:
    """Read `(origin, epoch, seq)` back from NATS headers; DecodeError if missing."""
    if not headers:
        raise DecodeError(f"message has no headers; expected {HEADER_ORIGIN}, {HEADER_SEQ}, ...")
    origin = headers.get(HEADER_ORIGIN)
    epoch = headers.get(HEADER_EPOCH)
    if origin is None or epoch is None:
        raise DecodeError(
            f"headers: expected {HEADER_ORIGIN} and {HEADER_EPOCH}, got {sorted(headers)!r:.80}"
        )
    return unquote(origin), unquote(epoch), _parse_seq(headers.get(HEADER_SEQ), HEADER_SEQ)


def key_from_fields(fields: Mapping[Any, Any] | None) -> BatchKey:
    """Read `(origin, epoch, seq)` back from a Redis entry's fields; DecodeError if missing."""
    if not fields:
        raise DecodeError("entry: has no fields (deleted?)")
    origin = fields.get(FIELD_ORIGIN)
    epoch = fields.get(FIELD_EPOCH)
    if type(origin) is not bytes or type(epoch) is not bytes:
        names = sorted(repr(k) for k in fields)
        raise DecodeError(f"entry: expected fields origin, epoch and seq, got {names!r:.80}")
    try:
        return origin.decode(), epoch.decode(), _parse_seq(fields.get(FIELD_SEQ), "field seq")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"entry: origin/epoch are not UTF-8: {exc}") from None


# -- subjects ---------------------------------------------------------------------


def subject_token(origin: str) -> str:
    """`origin` as one NATS subject token (see the module doc for the mapping)."""
    return _NOT_TOKEN.sub("_", origin) or "_"


def default_subject(origin: str) -> str:
    """`kv.events.<token>`: where a batch of `origin` goes when the URL names no subject."""
    return SUBJECT_PREFIX + subject_token(origin)


def check_subject(subject: str, *, wildcards: bool, where: str) -> str:
    """Return `subject` if it is a valid NATS subject, else raise `ConfigError`.

    `wildcards` allows `*` tokens and a final `>` (filters; not for publishing).
    """
    tokens = subject.split(".")
    problem = None
    if not subject:
        problem = "it is empty"
    elif _BAD_SUBJECT_CHARS.search(subject):
        problem = "it contains white space or control characters"
    elif any(not t for t in tokens):
        problem = "it has an empty token (two dots, or a leading or trailing dot)"
    else:
        for i, token in enumerate(tokens):
            if token == "*" or (token == ">" and i == len(tokens) - 1):
                if not wildcards:
                    problem = "wildcards (* and >) cannot be published to"
                    break
            elif "*" in token or ">" in token:
                problem = f"token {token!r} mixes a wildcard with other characters"
                break
    if problem is not None:
        raise ConfigError(f"{where}: subject: expected a NATS subject, got {subject!r}: {problem}")
    return subject


def subject_covers(pattern: str, subject: str) -> bool:
    """True when every subject matching `subject` also matches `pattern`.

    Both may hold wildcards: `kv.events.>` covers `kv.events.a` and
    `kv.events.*`; `kv.*.a` does not cover `kv.events.>`.
    """
    want = pattern.split(".")
    have = subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have):
            return False
        if have[i] == ">":
            return False
        if token != "*" and token != have[i]:
            return False
    return len(have) == len(want)


# -- payloads ---------------------------------------------------------------------


class PayloadDecoder:
    """Turns a message's payload and its `(origin, epoch, seq)` back into a batch.

    The codec is chosen per message by its codec header/field (so one consumer
    reads a stream written with several codecs), falling back to `default`
    when the message names none. A payload that carries its own name (JSON
    lines) must agree with the headers; one that does not (vLLM's msgpack) gets
    the headers' name. `codecs` finds a codec by name (default: kvstream's own,
    see `kvstream._wire.codec_names`). Everything wrong is a
    [`DecodeError`][kvstream.errors.DecodeError].
    """

    def __init__(self, default: Codec | None = None, codecs: CodecByName | None = None) -> None:
        self.default: Codec = default if default is not None else JsonCodec()
        self._by_name: CodecByName = codecs if codecs is not None else builtin_codec
        self._codecs: dict[str, Codec] = {self.default.name: self.default}

    def codec(self, name: str | None) -> Codec:
        """The decoder for codec `name` (None: the default)."""
        if name is None or name == "":
            return self.default
        codec = self._codecs.get(name)
        if codec is None:
            try:
                codec = self._by_name(name)
            except ConfigError as exc:
                raise DecodeError(str(exc)) from None
            self._codecs[name] = codec
        return codec

    def decode_message(self, data: bytes, headers: Mapping[str, str] | None) -> EventBatch:
        """The batch of a NATS message: its body, named and typed by its headers."""
        key = key_from_headers(headers)
        assert headers is not None  # key_from_headers raised otherwise
        return self.decode(data, key, headers.get(HEADER_CODEC))

    def decode_entry(self, fields: Mapping[Any, Any] | None) -> EventBatch:
        """The batch of a Redis Streams entry: its payload, named and typed by its fields."""
        key = key_from_fields(fields)
        assert fields is not None  # key_from_fields raised otherwise
        payload = fields.get(FIELD_PAYLOAD)
        if type(payload) is not bytes:
            raise DecodeError("entry: expected a payload field")
        codec = fields.get(FIELD_CODEC)
        if isinstance(codec, bytes):
            codec = codec.decode("utf-8", "replace")
        return self.decode(payload, key, str(codec) if codec else None)

    def decode(self, data: bytes, key: BatchKey, codec_name: str | None) -> EventBatch:
        """The batch in `data`, named `key`."""
        origin, epoch, seq = key
        codec = self.codec(codec_name)
        if codec.name == "msgpack":  # the payload has no name: the transport gives it
            decode: Any = codec.decode
            batch: EventBatch = decode(data, seq=seq, origin=origin, epoch=epoch)
            return batch
        batch = codec.decode(data)
        if batch.origin == origin and batch.epoch == epoch and batch.seq == seq:
            return batch
        if batch.origin == "" and batch.epoch == "":
            # The payload does not name the batch (vLLM msgpack): the headers do.
            try:
                return EventBatch(
                    seq=seq,
                    ts=batch.ts,
                    events=batch.events,
                    data_parallel_rank=batch.data_parallel_rank,
                    origin=origin,
                    epoch=epoch,
                )
            except KVStreamError as exc:
                raise DecodeError(str(exc)) from None
        raise DecodeError(
            f"payload names batch {batch.origin}/{batch.epoch} seq {batch.seq} "
            f"but its headers name {origin}/{epoch} seq {seq}"
        )


# -- snapshots --------------------------------------------------------------------

#: The JetStream stream NATS sinks keep snapshots in (created when missing).
DEFAULT_SNAPSHOT_STREAM: Final = "KV_SNAPSHOTS"
SNAPSHOT_SUBJECT_PREFIX: Final = "kv.snapshot."
HEARTBEAT_SUBJECT_PREFIX: Final = "kv.heartbeat."
#: Blocks per encoded part of a snapshot, about (what one slice of work handles).
SNAPSHOT_PART_BLOCKS: Final = 2048
_MAGIC: Final = b"KVSNAP1\n"


class SnapshotInfo(NamedTuple):
    """What a stored snapshot is: whose, up to where, and how to read it."""

    origin: str
    epoch: str
    #: The first seq of the epoch the snapshot does not include.
    resume_seq: int
    #: Where batch `resume_seq - 1` is in the stream: a JetStream stream
    #: sequence (decimal) or a Redis entry id.
    position: str
    #: The subject (NATS) or stream key (Redis) the origin's batches go to.
    where: str
    blocks: int
    ts: float
    #: Byte length of each encoded part, in order.
    parts: tuple[int, ...] = ()
    codec: str = "json"

    def to_json(self) -> bytes:
        return orjson.dumps(self._asdict())

    @classmethod
    def from_json(cls, data: bytes | memoryview, where: str) -> SnapshotInfo:
        try:
            obj = orjson.loads(data)
            info = cls(**obj)
            ok = (
                type(info.origin) is str
                and type(info.epoch) is str
                and type(info.resume_seq) is int
                and info.resume_seq >= 1
                and type(info.position) is str
                and type(info.where) is str
                and type(info.blocks) is int
                and isinstance(info.ts, float | int)
                and all(type(n) is int and n >= 0 for n in info.parts)
                and type(info.codec) is str
            )
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise DecodeError(f"{where}: not a snapshot record: {exc}") from None
        if not ok:
            raise DecodeError(
                f"{where}: snapshot record has a field of the wrong type: {obj!r:.120}"
            )
        return info._replace(parts=tuple(info.parts), ts=float(info.ts))


def snapshot_parts(
    snapshot: Snapshot,
    events: Iterable[KVCacheEvent] | None = None,
    codec: Codec | None = None,
) -> Iterator[bytes]:
    """The snapshot's events (`events`, else `snapshot.events`) in slices of about
    `SNAPSHOT_PART_BLOCKS` blocks, each slice encoded as the batch
    `resume_seq - 1` by `codec` (the JSON codec by default). A generator, so
    that a caller can let other tasks run between parts (and `events` can be
    made as they are encoded).
    """
    if codec is None:
        codec = JsonCodec()
    seq = snapshot.resume_seq - 1
    chunk: list[KVCacheEvent] = []
    blocks = 0
    for event in snapshot.events if events is None else events:
        chunk.append(event)
        if type(event) is BlockStored:
            blocks += len(event.block_hashes)
        if blocks >= SNAPSHOT_PART_BLOCKS:
            yield codec.encode(_part(snapshot, seq, chunk))
            chunk, blocks = [], 0
    if chunk:
        yield codec.encode(_part(snapshot, seq, chunk))


def _part(snapshot: Snapshot, seq: int, events: list[KVCacheEvent]) -> EventBatch:
    return EventBatch._trusted(
        seq, snapshot.ts, events, snapshot.data_parallel_rank, snapshot.origin, snapshot.epoch
    )


def snapshot_envelope(info: SnapshotInfo, parts: list[bytes]) -> bytes:
    """`KVSNAP1`, the info line (with the parts' lengths), then the parts."""
    info = info._replace(parts=tuple(len(p) for p in parts))
    out = bytearray(_MAGIC)
    out += info.to_json()
    out += b"\n"
    for p in parts:
        out += p
    return bytes(out)


def read_envelope_info(head: bytes, where: str) -> SnapshotInfo | None:
    """The info of an envelope from its first bytes; None when `head` ends before it."""
    if not head.startswith(_MAGIC):
        raise DecodeError(f"{where}: not a kvstream snapshot (expected {_MAGIC[:-1]!r} first)")
    end = head.find(b"\n", len(_MAGIC))
    if end < 0:
        return None
    return SnapshotInfo.from_json(head[len(_MAGIC) : end], where)


def read_envelope(data: bytes, where: str) -> tuple[SnapshotInfo, list[memoryview]]:
    """The info and the parts of an envelope; `DecodeError` if it is not one."""
    if not data.startswith(_MAGIC):
        raise DecodeError(f"{where}: not a kvstream snapshot (expected {_MAGIC[:-1]!r} first)")
    end = data.find(b"\n", len(_MAGIC))
    if end < 0:
        raise DecodeError(f"{where}: snapshot envelope without its info line")
    info = SnapshotInfo.from_json(data[len(_MAGIC) : end], where)
    view = memoryview(data)
    parts: list[memoryview] = []
    at = end + 1
    for n in info.parts:
        parts.append(view[at : at + n])
        at += n
    if at != len(data):
        raise DecodeError(
            f"{where}: snapshot of {len(data)} bytes, its info announces {at} (truncated?)"
        )
    return info, parts


def snapshot_key(origin: str) -> str:
    """A subject token unique to `origin`: its readable token and a digest of its name."""
    digest = hashlib.blake2b(origin.encode(), digest_size=6).hexdigest()
    return f"{subject_token(origin)}-{digest}"


def snapshot_subjects(origin: str) -> tuple[str, str]:
    """`(head subject, part subject)` of `origin`'s snapshot on NATS."""
    base = SNAPSHOT_SUBJECT_PREFIX + snapshot_key(origin)
    return base + ".head", base + ".part"


#: What covers every snapshot head.
SNAPSHOT_HEADS: Final = SNAPSHOT_SUBJECT_PREFIX + "*.head"


def redis_snapshot_key(stream: str, origin: str) -> str:
    return f"{stream}:snapshot:{origin}"


def redis_snapshot_index(stream: str) -> str:
    return f"{stream}:snapshots"


def redis_heartbeats_key(stream: str) -> str:
    return f"{stream}:heartbeats"


def heartbeat_subject(origin: str) -> str:
    return HEARTBEAT_SUBJECT_PREFIX + subject_token(origin)


def redis_position(entry_id: str) -> tuple[int, int]:
    """A Redis entry id as a comparable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


# -- heartbeats ---------------------------------------------------------------------


class Heartbeat(NamedTuple):
    """An idle publisher's sign of life: who, which epoch, its last seq, how often."""

    origin: str
    epoch: str
    #: The last seq delivered (-1: none yet).
    seq: int
    #: Seconds between heartbeats; a reader deems the origin gone after two of them.
    interval: float
    #: Counts up with every heartbeat (a reader that polls sees it change).
    beat: int = 0

    def to_json(self) -> bytes:
        return orjson.dumps(self._asdict())

    @classmethod
    def from_json(cls, data: bytes | str) -> Heartbeat:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise DecodeError(f"not a heartbeat: {exc}") from None
        if not isinstance(obj, dict):
            raise DecodeError(f"not a heartbeat: expected a JSON object, got {obj!r:.60}")
        return cls.from_mapping(obj)

    @classmethod
    def from_mapping(cls, obj: Mapping[str, Any]) -> Heartbeat:
        """A heartbeat of exactly these fields, each of its type; `DecodeError` otherwise."""
        try:
            hb = cls(**obj)
        except TypeError as exc:
            raise DecodeError(f"not a heartbeat: {exc}") from None
        if not (
            type(hb.origin) is str
            and type(hb.epoch) is str
            and type(hb.seq) is int
            and isinstance(hb.interval, int | float)
            and hb.interval > 0
            and type(hb.beat) is int
        ):
            raise DecodeError(f"heartbeat has a field of the wrong type: {obj!r:.120}")
        return hb._replace(interval=float(hb.interval))


# -- the sink's side of snapshots and heartbeats ----------------------------------------


class SinkSnapshots:
    """What a broker sink keeps to publish snapshots: the state of the batches it
    delivered, where each origin's last one is in the stream, and when the next
    snapshot is due (`SnapshotSchedule`).

    The sink calls `delivered()` after each batch the broker acknowledged, in
    stream order, and `take()` when it is due: the snapshot is taken at that
    batch boundary, from exactly the batches delivered, so its `resume_seq` and
    `position` agree. A batch the sink discarded never reaches the keeper: the
    origin's state is then unknown (a gap) until its next clear, and it gets no
    snapshot meanwhile (a reader sees the gap as readers of the stream do).
    """

    def __init__(
        self,
        where: str,
        *,
        every: int | None,
        interval: float | None,
        max_bytes: int,
        clock: Callable[[], float],
    ) -> None:
        self.where = where
        self.keeper = StateKeeper(max_bytes=max_bytes)
        self.schedule = SnapshotSchedule(every, interval, clock=clock)
        self._positions: dict[str, str] = {}
        self._unknown_log: BurstLogs[str] = BurstLogs(log, math.inf)
        #: Snapshots published, and publications that failed (tried again when next due).
        self.published = 0
        self.failed = 0

    def delivered(self, batch: EventBatch, position: str) -> bool:
        """Keep `batch` (acknowledged at `position`); True when a snapshot is due."""
        try:
            self.keeper.apply(batch)
        except StateLimitError as exc:
            log.error("%s: no more snapshots of this origin for now: %s", self.where, exc)
        self._positions[batch.origin] = position
        return self.schedule.due(batch)

    def take(self, origin: str) -> tuple[Snapshot, str] | None:
        """The origin's snapshot header (its events: `keeper.snapshot_events`) and its
        position, or None (logged once) if its state is unknown."""
        try:
            snap = self.keeper.snapshot_header(origin)
        except StateError as exc:
            self._unknown_log.log(origin, "%s: cannot publish a snapshot: %s", self.where, exc)
            return None
        self._unknown_log.clear(origin)
        return snap, self._positions[origin]

    async def encode(self, origin: str) -> tuple[Snapshot, str, list[bytes]] | None:
        """`take()` and the snapshot encoded as its parts, a slice at a time.

        Other tasks run between slices. Nothing changes the state meanwhile: only
        the sink's writer gives it batches, and the writer is the caller.
        """
        taken = self.take(origin)
        if taken is None:
            return None
        snap, position = taken
        parts: list[bytes] = []
        for part in snapshot_parts(snap, self.keeper.snapshot_events(origin)):
            parts.append(part)
            await anyio.lowlevel.checkpoint()
        return snap, position, parts

    def stored(self, origin: str, epoch: str, failure: str | None = None) -> bool:
        """Count a snapshot as stored, or as failed (logged); True when it was stored.

        Either way the next one of `origin` is due by the schedule again, not at once.
        """
        self.schedule.taken(origin, epoch)
        if failure is not None:
            self.failed += 1
            log.warning(
                "%s: snapshot of %s not stored (tried again when the next is due): %s",
                self.where,
                origin,
                failure,
            )
            return False
        self.published += 1
        return True

    def origins(self) -> dict[str, tuple[str, int]]:
        """`{origin: (epoch, last seq delivered)}`: what heartbeats announce."""
        out: dict[str, tuple[str, int]] = {}
        for origin in self.keeper.origins():
            pos = self.keeper.position(origin)
            if pos is not None:
                out[origin] = (pos[0], pos[1] - 1)
        return out


class Heartbeats:
    """A broker sink's heartbeats: every `interval` seconds, each origin that
    delivered no batch for that long is announced with `beat(heartbeat)`.

    Heartbeats start with an origin's first delivered batch (before it, the sink
    does not know the origin's epoch). The first beat after an origin's epoch
    changed is sent even when batches are flowing, so a reader learns a restart
    within one interval (on vLLM's ZMQ wire the batches do not carry the epoch).
    `run()` is a task of the sink's (started by `Sink.start_tasks`, cancelled
    when the sink closes); a failed beat is logged at debug level and the next
    one is tried.
    """

    def __init__(
        self,
        interval: float,
        where: str,
        beat: Callable[[Heartbeat], Awaitable[None]],
        *,
        clock: Callable[[], float],
    ) -> None:
        self.interval = interval
        self.where = where
        self._beat = beat
        self._clock = clock
        self._last: dict[str, tuple[str, int, float]] = {}
        #: The epoch each origin was last announced with.
        self._announced: dict[str, str] = {}
        self._beats = 0
        #: Heartbeats sent.
        self.sent = 0

    def delivered(self, batch: EventBatch) -> None:
        self._last[batch.origin] = (batch.epoch, batch.seq, self._clock())

    async def run(self) -> None:
        """Send heartbeats until cancelled (the sink runs this in its task group)."""
        while True:
            await anyio.sleep(self.interval)
            now = self._clock()
            for origin, (epoch, seq, when) in list(self._last.items()):
                if now - when < self.interval * 0.5 and self._announced.get(origin) == epoch:
                    continue  # a recent batch was the sign of life (silence stays <= 1.5 x)
                self._announced[origin] = epoch
                self._beats += 1
                try:
                    await self._beat(Heartbeat(origin, epoch, seq, self.interval, self._beats))
                    self.sent += 1
                except Exception as exc:  # the next beat tries again; batches report outages
                    log.debug("%s: heartbeat failed: %s", self.where, exc)
