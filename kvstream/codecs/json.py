"""JSON lines: kvstream's own format, one batch per line, encoded with orjson.

A line is one object:

    {"origin": "engine-0", "epoch": "3f9c...", "seq": 12, "ts": 1767225600.125,
     "data_parallel_rank": 0, "events": [{"type": "BlockStored", ...}, ...]}

Events carry `type` (the class name) and vLLM's field names. The fields vLLM
always sends are always present; the optional ones (`extra_keys`,
`group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`,
`locality`) and `metadata` only when set. Hash values that are `bytes`
are lowercase hex strings; other `bytes` values (inside `extra_keys`) are
`{"$bytes": "<hex>"}`.

`JsonCodec(hashes_as_strings=True)` writes every integer hash as a decimal
string, for consumers whose JSON numbers are doubles (JavaScript). Such a line
carries `"hash_encoding": "decimal"`, and in it a `bytes` hash is written
`{"$bytes": "<hex>"}` so the two cannot be confused. Decoders honour the key.
"""

from __future__ import annotations

import operator
from typing import Any, Final

import msgspec
import orjson

from kvstream.codecs._refusals import RefusalLog
from kvstream.codecs.base import Refusal
from kvstream.errors import DecodeError, KVStreamError, shorten
from kvstream.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)

__all__ = ["JsonCodec", "json_default"]

_OPTIONAL_STORED: Final = (
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
)
_MAX_DEPTH: Final = 32
_BATCH_KEYS: Final = frozenset(
    {"origin", "epoch", "seq", "ts", "data_parallel_rank", "events", "hash_encoding"}
)


def json_default(value: Any) -> Any:
    """orjson's `default=` for kvstream's values: bytes as hex, integer-likes as ints.

    The one rule wherever kvstream writes JSON (the codec, the socket protocol's
    headers, `kvstream tail`). orjson calls it only for what it cannot write
    itself; in the codec, bytes are a hash (other bytes were wrapped before).
    """
    if type(value) is bytes:
        return value.hex()
    try:
        return operator.index(value)  # numpy integers and the like
    except TypeError:
        raise TypeError(f"cannot encode {type(value).__name__} as JSON") from None


def _wrap_bytes(value: Any) -> Any:
    """Replace bytes inside `extra_keys` with `{"$bytes": hex}`."""
    if type(value) is bytes:
        return {"$bytes": value.hex()}
    if type(value) is list:
        return [_wrap_bytes(v) for v in value]
    return value


def _unwrap_bytes(value: Any, depth: int = 0) -> Any:
    if type(value) is dict:
        if len(value) == 1 and type(value.get("$bytes")) is str:
            return bytes.fromhex(value["$bytes"])
        raise ValueError(f"expected {{'$bytes': hex}}, got {shorten(value)}")
    if type(value) is list:
        if depth >= _MAX_DEPTH:  # events refuse deeper values anyway; never recurse unbounded
            raise ValueError(f"expected lists nested at most {_MAX_DEPTH} deep")
        return [_unwrap_bytes(v, depth + 1) for v in value]
    return value


def _decimal_hash(h: int | bytes) -> Any:
    return str(h) if type(h) is int else {"$bytes": h.hex()}  # type: ignore[union-attr]


def _read_hash(value: Any, decimal: bool) -> Any:
    """Undo the hash encodings; anything unexpected is left for validation to refuse."""
    t = type(value)
    if t is str:
        return int(value) if decimal else bytes.fromhex(value)
    if t is dict:
        return _unwrap_bytes(value)
    return value


# -- encoding: msgspec structs laid out as the lines are ---------------------------------
#
# ``encode`` writes each event through a struct whose fields are the line's keys
# in the line's order: the fields vLLM always sends have no default (always
# written), the optional ones and ``metadata`` default to None (left out when
# None). msgspec writes this faster than orjson writes the equivalent dict, and
# the same bytes: what msgspec would write differently is handed over already
# written by orjson (``msgspec.Raw``): floats with a large exponent (``1e+16``,
# in ``ts``, ``metadata`` or ``extra_keys``), metadata, and extra keys with
# values in them. Bytes (which msgspec would write as base64) are turned into
# hex strings first.


class _Stored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: Any
    parent_block_hash: Any
    token_ids: Any
    block_size: int
    lora_id: Any
    medium: Any
    lora_name: Any
    extra_keys: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None
    locality: Any = None
    metadata: Any = None


class _Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: Any
    medium: Any
    group_idx: Any = None
    locality: Any = None
    metadata: Any = None


class _Cleared(
    msgspec.Struct, tag="AllBlocksCleared", tag_field="type", omit_defaults=True, gc=False
):
    metadata: Any = None


class _Line(msgspec.Struct, gc=False):
    origin: str
    epoch: str
    seq: int
    ts: Any
    data_parallel_rank: Any
    events: list[Any]


class _DecimalLine(_Line):
    hash_encoding: str = "decimal"


_CLEARED: Final = _Cleared()
_INT: Final = frozenset((int,))


def _index_hook(value: Any) -> Any:
    try:
        return operator.index(value)  # numpy integers and the like, as json_default does
    except TypeError:
        raise TypeError(f"cannot encode {type(value).__name__} as JSON") from None


_ENCODER: Final = msgspec.json.Encoder(enc_hook=_index_hook)
_ENCODE: Final = _ENCODER.encode
#: One line and its newline in one buffer (no copy to append the newline).
_ENCODE_LINES: Final = _ENCODER.encode_lines


def _raw(value: Any) -> msgspec.Raw:
    return msgspec.Raw(orjson.dumps(value, default=json_default))


def _ts(ts: float) -> Any:
    # msgspec writes 1e16 where orjson (and the lines so far) write 1e+16.
    return ts if -1e15 < ts < 1e15 else _raw(ts)


def _hex_hashes(hashes: list[Any]) -> list[Any]:
    return [h.hex() if type(h) is bytes else h for h in hashes]


def _stored_line(e: BlockStored, decimal: bool) -> _Stored:
    hashes: Any = e.block_hashes
    parent: Any = e.parent_block_hash
    if decimal:
        hashes = [_decimal_hash(h) for h in hashes]
        if parent is not None:
            parent = _decimal_hash(parent)
    else:
        if not _INT.issuperset(map(type, hashes)):
            hashes = _hex_hashes(hashes)
        if type(parent) is bytes:
            parent = parent.hex()
    extra: Any = e.extra_keys
    if extra is not None and extra.count(None) != len(extra):
        extra = _raw(_wrap_bytes(extra))
    metadata: Any = e.metadata
    if metadata is not None:
        metadata = _raw(metadata)
    return _Stored(
        hashes,
        parent,
        e.token_ids,
        e.block_size,
        e.lora_id,
        e.medium,
        e.lora_name,
        extra,
        e.group_idx,
        e.kv_cache_spec_kind,
        e.kv_cache_spec_sliding_window,
        e.locality,
        metadata,
    )


def _removed_line(e: BlockRemoved, decimal: bool) -> _Removed:
    hashes: Any = e.block_hashes
    if decimal:
        hashes = [_decimal_hash(h) for h in hashes]
    elif not _INT.issuperset(map(type, hashes)):
        hashes = _hex_hashes(hashes)
    metadata = e.metadata
    return _Removed(
        hashes, e.medium, e.group_idx, e.locality, None if metadata is None else _raw(metadata)
    )


def _event_line(e: KVCacheEvent, decimal: bool) -> Any:
    t = type(e)
    if t is BlockStored:
        return _stored_line(e, decimal)  # type: ignore[arg-type]
    if t is BlockRemoved:
        return _removed_line(e, decimal)  # type: ignore[arg-type]
    if t is AllBlocksCleared:
        metadata = e.metadata  # type: ignore[attr-defined]
        return _CLEARED if metadata is None else _Cleared(_raw(metadata))
    raise TypeError(f"JsonCodec: expected a KV cache event, got {e!r:.80}")


class JsonCodec:
    """kvstream's JSON-lines codec (orjson). Pure and reusable; see the module doc."""

    name = "json"
    self_delimiting = True

    __slots__ = ("_decimal", "_refusals")

    def __init__(self, *, hashes_as_strings: bool = False) -> None:
        self._decimal = hashes_as_strings
        self._refusals = RefusalLog("JSON decode")

    @property
    def events_refused(self) -> int:
        """Events `decode()` / `batch_from_dict()` left out of the batches they returned."""
        return self._refusals.count

    def __repr__(self) -> str:
        return f"JsonCodec(hashes_as_strings={self._decimal})"

    def __eq__(self, other: object) -> bool:
        return type(other) is JsonCodec and other._decimal == self._decimal

    def __hash__(self) -> int:
        return hash((JsonCodec, self._decimal))

    # -- encoding ---------------------------------------------------------------

    def event_to_dict(self, event: KVCacheEvent) -> dict[str, Any]:
        """The JSON object of one event (before serialization)."""
        decimal = self._decimal
        if type(event) is BlockStored:
            hashes: Any = event.block_hashes
            parent: Any = event.parent_block_hash
            if decimal:
                hashes = [_decimal_hash(h) for h in hashes]
                if parent is not None:
                    parent = _decimal_hash(parent)
            d: dict[str, Any] = {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": event.token_ids,
                "block_size": event.block_size,
                "lora_id": event.lora_id,
                "medium": event.medium,
                "lora_name": event.lora_name,
            }
            if (
                event.extra_keys is not None
                or event.group_idx is not None
                or event.kv_cache_spec_kind is not None
                or event.kv_cache_spec_sliding_window is not None
                or event.locality is not None
            ):
                for key in _OPTIONAL_STORED:
                    value = getattr(event, key)
                    if value is not None:
                        d[key] = _wrap_bytes(value) if key == "extra_keys" else value
        elif type(event) is BlockRemoved:
            hashes = event.block_hashes
            if decimal:
                hashes = [_decimal_hash(h) for h in hashes]
            d = {"type": "BlockRemoved", "block_hashes": hashes, "medium": event.medium}
            if event.group_idx is not None:
                d["group_idx"] = event.group_idx
            if event.locality is not None:
                d["locality"] = event.locality
        elif type(event) is AllBlocksCleared:
            d = {"type": "AllBlocksCleared"}
        else:
            raise TypeError(f"JsonCodec: expected a KV cache event, got {event!r}")
        metadata = event.metadata
        if metadata is not None:
            d["metadata"] = metadata
        return d

    def batch_to_dict(self, batch: EventBatch) -> dict[str, Any]:
        """The JSON object of one batch (before serialization)."""
        to_dict = self.event_to_dict
        d: dict[str, Any] = {
            "origin": batch.origin,
            "epoch": batch.epoch,
            "seq": batch.seq,
            "ts": batch.ts,
            "data_parallel_rank": batch.data_parallel_rank,
            "events": [to_dict(e) for e in batch.events],
        }
        if self._decimal:
            d["hash_encoding"] = "decimal"
        return d

    def encode(self, batch: EventBatch) -> bytes:
        """One JSON line (ending in `\\n`) for `batch`.

        The same bytes as `orjson.dumps(self.batch_to_dict(batch))` plus the
        newline, written faster (see the structs above).
        """
        decimal = self._decimal
        events: list[Any] = []
        append = events.append
        for e in batch.events:
            if type(e) is BlockStored and not decimal:
                # The common event, inline: every hash an int, no extras to write.
                hashes = e.block_hashes
                parent = e.parent_block_hash
                extra = e.extra_keys
                metadata = e.metadata
                if (
                    type(parent) is not bytes
                    and (extra is None or extra.count(None) == len(extra))
                    and metadata is None
                    and _INT.issuperset(map(type, hashes))
                ):
                    # Nothing to rewrite: the event is laid out as `_Stored` is (the
                    # line's keys, in order, the same defaults left out), so as it is.
                    append(e)
                    continue
            append(_event_line(e, decimal))
        line = (_DecimalLine if decimal else _Line)(
            batch.origin, batch.epoch, batch.seq, _ts(batch.ts), batch.data_parallel_rank, events
        )
        return _ENCODE_LINES((line,))

    def encode_screened(self, batch: EventBatch) -> tuple[bytes, tuple[Refusal, ...]]:
        """`(encode(batch), ())`: JSON lines carry every event."""
        return self.encode(batch), ()

    # -- decoding ---------------------------------------------------------------

    def decode(self, data: bytes | bytearray | memoryview | str) -> EventBatch:
        """The batch on one line. Raises `DecodeError` for anything that is not a batch.

        Decoding is per event: an event that does not validate is left out,
        counted in `events_refused` and logged once per burst, and the
        rest of the batch is delivered (`decode_screened()` returns them).
        """
        batch, refused = self.decode_screened(data)
        self._refusals.note(refused, batch.seq, batch.origin)
        return batch

    def decode_screened(
        self, data: bytes | bytearray | memoryview | str
    ) -> tuple[EventBatch, tuple[Refusal, ...]]:
        """The batch on one line and the events refused in it."""
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise DecodeError(f"not a JSON line: {exc}") from None
        return self.batch_from_dict_screened(obj)

    def decode_keyed(self, data: bytes, *, seq: int, origin: str, epoch: str) -> EventBatch:
        """The batch on one line, checked to be `(origin, epoch, seq)` (lines carry it)."""
        batch = self.decode(data)
        if batch.key != (origin, epoch, seq):
            raise DecodeError(
                f"the transport names batch {origin}/{epoch}/{seq}, the line {batch.key}"
            )
        return batch

    def decode_lines(self, data: bytes) -> list[EventBatch]:
        """Every batch in `data` (JSON lines; blank lines are skipped).

        A bad line raises `DecodeError` naming its 1-based line number,
        and so does a line with an event that does not validate (this reads a
        whole file of kvstream's own, as `kvstream verify` does, where such an
        event means damage; the streaming decoders deliver the rest instead).
        """
        out: list[EventBatch] = []
        for lineno, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                batch, refused = self.decode_screened(line)
            except DecodeError as exc:
                raise DecodeError(f"line {lineno}: {exc}") from None
            if refused:
                first = refused[0]
                raise DecodeError(f"line {lineno}: events[{first.position}]: {first.reason}")
            out.append(batch)
        return out

    def batch_from_dict(self, obj: Any) -> EventBatch:
        """Validate a decoded JSON object and build the batch it describes (per event)."""
        batch, refused = self.batch_from_dict_screened(obj)
        self._refusals.note(refused, batch.seq, batch.origin)
        return batch

    def batch_from_dict_screened(self, obj: Any) -> tuple[EventBatch, tuple[Refusal, ...]]:
        """`batch_from_dict()` returning the refused events instead of counting them."""
        if type(obj) is not dict:
            raise DecodeError(f"expected a JSON object (a batch), got {type(obj).__name__}")
        unknown = obj.keys() - _BATCH_KEYS
        if unknown:
            raise DecodeError(f"batch: unknown field(s) {sorted(unknown)!r}")
        encoding = obj.get("hash_encoding")
        if encoding not in (None, "decimal"):
            raise DecodeError(f"batch.hash_encoding: expected 'decimal', got {shorten(encoding)}")
        decimal = encoding == "decimal"
        raw_events = obj.get("events")
        if type(raw_events) is not list:
            raise DecodeError(f"batch.events: expected a list, got {shorten(raw_events)}")
        events: list[KVCacheEvent] = []
        refused: list[Refusal] = []
        for i, raw in enumerate(raw_events):
            try:
                events.append(_event_from_dict(raw, decimal))
            except (KVStreamError, ValueError, TypeError, RecursionError) as exc:
                tag = raw.get("type") if type(raw) is dict else None
                name = tag if type(tag) is str and len(tag) <= 40 else "?"
                refused.append(Refusal(i, name, str(exc)))
        try:
            batch = EventBatch(
                seq=obj.get("seq"),  # type: ignore[arg-type]
                ts=obj.get("ts"),  # type: ignore[arg-type]
                events=events,
                data_parallel_rank=obj.get("data_parallel_rank"),
                origin=obj.get("origin", ""),
                epoch=obj.get("epoch", ""),
            )
        except KVStreamError as exc:
            raise DecodeError(str(exc)) from None
        return batch, tuple(refused)


def _event_from_dict(raw: Any, decimal: bool) -> KVCacheEvent:
    if type(raw) is not dict:
        raise DecodeError(f"expected an event object, got {shorten(raw)}")
    fields = dict(raw)
    tag = fields.pop("type", None)
    if tag == "BlockStored":
        hashes = fields.get("block_hashes")
        if type(hashes) is list and (decimal or str in set(map(type, hashes))):
            fields["block_hashes"] = [_read_hash(h, decimal) for h in hashes]
        parent = fields.get("parent_block_hash")
        if parent is not None and type(parent) is not int:
            fields["parent_block_hash"] = _read_hash(parent, decimal)
        extra = fields.get("extra_keys")
        if extra is not None:
            fields["extra_keys"] = _unwrap_bytes(extra)
        return BlockStored(**fields)
    if tag == "BlockRemoved":
        hashes = fields.get("block_hashes")
        if type(hashes) is list and (decimal or str in set(map(type, hashes))):
            fields["block_hashes"] = [_read_hash(h, decimal) for h in hashes]
        return BlockRemoved(**fields)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(**fields)
    raise DecodeError(
        f"type: expected 'BlockStored', 'BlockRemoved' or 'AllBlocksCleared', got {shorten(tag)}"
    )
