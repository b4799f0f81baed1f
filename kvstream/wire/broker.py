"""Broker-side rules shared by both ends (sink and source) of NATS and Redis.

One message (a NATS JetStream message or a Redis Streams entry) carries one
batch: its payload is the batch encoded by the sink's codec, and the batch's
name ``(origin, epoch, seq)`` and the codec's name ride beside it, as NATS
headers or Redis fields, so a consumer can route, deduplicate and check
continuity without decoding, and can decode payloads that do not carry the
name themselves (vLLM's msgpack has no origin, epoch or seq):

=========  ===============  =============  ==========================================
what       NATS header      Redis field    value
=========  ===============  =============  ==========================================
origin     ``Kv-Origin``    ``origin``     the batch's origin
epoch      ``Kv-Epoch``     ``epoch``      the producer's epoch
seq        ``Kv-Seq``       ``seq``        decimal sequence number
codec      ``Kv-Codec``     ``codec``      ``json`` or ``msgpack``
id         ``Nats-Msg-Id``  (entry id)     ``<origin>:<epoch>:<seq>`` (NATS only)
payload    (message body)   ``payload``    the encoded batch
=========  ===============  =============  ==========================================

NATS header values are text on one line, so origin and epoch are
percent-encoded there (``urllib.parse.quote``; letters, digits and ``-._~@/``
stay as they are, so usual names read unchanged). The same encoding is used
inside the message id, where it also keeps ``:`` unambiguous. Redis fields are
binary-safe and carry the UTF-8 text as is.

The default NATS subject of a batch is ``kv.events.<token>`` where ``<token>``
is the origin with every character other than ASCII letters, digits, ``-``
and ``_`` replaced by ``_`` (a NATS subject token may not contain ``.``,
``*``, ``>`` or white space), so ``node-1.example:0`` publishes to
``kv.events.node-1_example_0``. The mapping can merge two origins into one
subject; that is harmless because consumers read the origin from the header.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Final
from urllib.parse import quote, unquote, urlsplit

from kvstream.codecs.base import Codec
from kvstream.codecs.json import JsonCodec
from kvstream.errors import ConfigError, DecodeError, KVStreamError
from kvstream.events import EventBatch

__all__ = [
    "DEFAULT_NATS_STREAM",
    "DEFAULT_REDIS_STREAM",
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
    "SUBJECT_PREFIX",
    "BatchKey",
    "FromSeq",
    "PayloadDecoder",
    "check_from_seq",
    "check_subject",
    "client_url",
    "default_subject",
    "key_from_fields",
    "key_from_headers",
    "message_id",
    "nats_headers",
    "nats_headers_size",
    "redis_fields",
    "start_seq",
    "subject_covers",
    "subject_token",
]

#: ``(origin, epoch, seq)``: a batch's name for ever.
BatchKey = tuple[str, str, int]
#: Where a reader starts: None (live batches only), a seq for every origin, or
#: ``{origin: seq}`` with ``"*"`` for the others (as ``kvstream.subscribe``).
FromSeq = int | Mapping[str, int] | None

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

_SAFE: Final = "-._~@/"
_NOT_TOKEN: Final = re.compile(r"[^A-Za-z0-9_-]")
_BAD_SUBJECT_CHARS: Final = re.compile(r"[\s\x00-\x1f]")


# -- identity ---------------------------------------------------------------------


def message_id(batch: EventBatch) -> str:
    """``<origin>:<epoch>:<seq>`` (origin and epoch percent-encoded, see the module doc).

    A retry of the same batch has the same id (the broker drops it); a restarted
    producer has a new epoch, so its ``seq 0`` is never taken for a duplicate.
    """
    return f"{quote(batch.origin, safe=_SAFE)}:{quote(batch.epoch, safe=_SAFE)}:{batch.seq}"


def nats_headers(batch: EventBatch, codec_name: str) -> dict[str, str]:
    """The NATS headers of a message carrying ``batch``."""
    return {
        HEADER_MSG_ID: message_id(batch),
        HEADER_ORIGIN: quote(batch.origin, safe=_SAFE),
        HEADER_EPOCH: quote(batch.epoch, safe=_SAFE),
        HEADER_SEQ: str(batch.seq),
        HEADER_CODEC: codec_name,
    }


def nats_headers_size(headers: Mapping[str, str]) -> int:
    """Bytes the headers take on the wire (``NATS/1.0`` block), for the max_payload check."""
    size = len(b"NATS/1.0\r\n") + 2
    for key, value in headers.items():
        size += len(key.encode()) + 2 + len(value.encode()) + 2
    return size


def redis_fields(batch: EventBatch, data: bytes, codec_name: str) -> dict[Any, Any]:
    """The fields of a Redis Streams entry carrying ``batch`` (payload first)."""
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
    """Read ``(origin, epoch, seq)`` back from NATS headers; DecodeError if missing."""
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
    """Read ``(origin, epoch, seq)`` back from a Redis entry's fields; DecodeError if missing."""
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
    """``origin`` as one NATS subject token (see the module doc for the mapping)."""
    return _NOT_TOKEN.sub("_", origin) or "_"


def default_subject(origin: str) -> str:
    """``kv.events.<token>``: where a batch of ``origin`` goes when the URL names no subject."""
    return SUBJECT_PREFIX + subject_token(origin)


def check_subject(subject: str, *, wildcards: bool, where: str) -> str:
    """Return ``subject`` if it is a valid NATS subject, else raise :class:`ConfigError`.

    ``wildcards`` allows ``*`` tokens and a final ``>`` (filters; not for publishing).
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
    """True when every subject matching ``subject`` also matches ``pattern``.

    Both may hold wildcards: ``kv.events.>`` covers ``kv.events.a`` and
    ``kv.events.*``; ``kv.*.a`` does not cover ``kv.events.>``.
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


def _msgpack_codec() -> Codec:
    try:
        from kvstream.codecs.msgpack import MsgpackCodec
    except ImportError as exc:
        raise DecodeError(f"codec 'msgpack' is not available here: {exc}") from None
    codec: Codec = MsgpackCodec()
    return codec


_DECODERS: Final[dict[str, Callable[[], Codec]]] = {
    "json": JsonCodec,
    "msgpack": _msgpack_codec,
}


class PayloadDecoder:
    """Turns a message's payload and its ``(origin, epoch, seq)`` back into a batch.

    The codec is chosen per message by its codec header/field (so one consumer
    reads a stream written with several codecs), falling back to ``default``
    when the message names none. A payload that carries its own name (JSON
    lines) must agree with the headers; one that does not (vLLM's msgpack) gets
    the headers' name. Everything wrong is a :class:`DecodeError`.
    """

    def __init__(self, default: Codec | None = None) -> None:
        self.default: Codec = default if default is not None else JsonCodec()
        self._codecs: dict[str, Codec] = {self.default.name: self.default}

    def codec(self, name: str | None) -> Codec:
        """The decoder for codec ``name`` (None: the default)."""
        if name is None or name == "":
            return self.default
        codec = self._codecs.get(name)
        if codec is None:
            factory = _DECODERS.get(name)
            if factory is None:
                known = ", ".join(sorted(_DECODERS))
                raise DecodeError(f"codec: expected one of {known}, got {name!r:.40}")
            codec = self._codecs[name] = factory()
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
        """The batch in ``data``, named ``key``."""
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


def client_url(raw: str, scheme: str, default_port: int) -> str:
    """``scheme://[userinfo@]host:port`` of a sink/source URL: what a client connects to.

    The path (subject or stream) and the query (kvstream's options) are left out;
    credentials stay (they are never shown in messages).
    """
    parts = urlsplit(raw.partition("?")[0])
    netloc = parts.netloc or f"127.0.0.1:{default_port}"
    return f"{scheme}://{netloc}"


# -- where a reader starts ----------------------------------------------------------


def check_from_seq(from_seq: object, where: str) -> FromSeq:
    """Return ``from_seq`` if it is a valid :data:`FromSeq`, else raise ConfigError."""
    if from_seq is None:
        return None
    if type(from_seq) is int and from_seq >= 0:
        return from_seq
    if isinstance(from_seq, Mapping) and all(
        type(k) is str and k and type(v) is int and v >= 0 for k, v in from_seq.items()
    ):
        return from_seq
    raise ConfigError(
        f"{where}: from_seq: expected an int >= 0, {{origin: seq >= 0}} or None, got {from_seq!r}"
    )


def start_seq(from_seq: FromSeq, origin: str) -> int | None:
    """The first seq of ``origin`` a reader wants (None: no lower bound).

    A broker keeps history, so a reader that asks for ``from_seq`` reads the
    stream from its start and skips, in the first epoch it sees of each
    origin, the batches below this number.
    """
    if from_seq is None or isinstance(from_seq, int):
        return from_seq
    n = from_seq.get(origin)
    return from_seq.get("*") if n is None else n
