"""vLLM's msgpack wire: the batch `[ts, events, data_parallel_rank]`, byte for byte.

The payload frame vLLM (and SGLang, TensorRT-LLM) publish over ZMQ is one
msgpack array of exactly three elements (Dynamo fails on two):

    [ts, [event, ...], data_parallel_rank]

Events come in two profiles, both produced here with msgspec Structs that mirror
vLLM's declarations field for field, so the bytes are the ones vLLM's own
structs write:

* `map` (current vLLM, the default): `{"type": "BlockStored", ...}`. The
  seven fields vLLM declares without a default are always present; the later,
  optional ones only when set.
* `positional` (legacy vLLM, SGLang): an array, tag
  first, then every field in declaration order, trailing nils included, laid
  out as vLLM did before `locality` existed (`BlockStored` 12 elements,
  `BlockRemoved` 4). An event whose `locality` is set gets the later,
  one-longer layout (13 and 5 elements) instead of losing it.

`metadata` is not part of vLLM's format: it is left out unless
`metadata=True`, which adds it as one more map key (never in `positional`).

`strict` shapes the stream for consumers that drop what they dislike (Dynamo
rejects bytes hashes, cannot read negative ones, and maps an unknown `medium`
to GPU). `strict="refuse"` leaves such events out of the batch;
`strict="convert"` turns a bytes hash into the low 64 bits of the digest (what
vLLM does by default) and a negative one into its unsigned 64-bit form, and
refuses only what it cannot convert. The batch itself is never refused: its
`seq` stays used. `MsgpackCodec.encode_screened()` returns what was
refused, so a sink can count and log it (the ZMQ sink does).

Three more output profiles write the other consumers' dialects: `sglang`,
`sglang-positional` and `llm-d-2025-12`; their encoders live in
`kvstream.codecs._dialects` and are picked by the profile dispatch in
[`MsgpackCodec`][kvstream.codecs.msgpack.MsgpackCodec]'s constructor.

Decoding reads every engine dialect (`kvstream.codecs._dialects`: vLLM map
and positional of every historical length, SGLang map and positional,
TensorRT-LLM's vLLM wire), batches of 2 elements (no rank) and a batch written
as a map. It is per event: an event no dialect reads is left out and counted,
the rest is delivered (`MsgpackCodec.decode_screened()` returns the
refusals). `dialect=` pins a dialect; `media="normalize"` maps `medium`
through `kvstream.media`'s table.

msgpack carries no `seq`, `origin` or `epoch`: the transport knows them,
so `MsgpackCodec.decode()` takes them as keyword arguments (0 and "" when
not given). Bytes that are not a batch at all raise
[`DecodeError`][kvstream.errors.DecodeError] naming what was wrong, and nothing else.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, Final, Literal, TypeAlias, get_args

import msgspec

from kvstream.codecs import _dialects as dialects
from kvstream.codecs._dialects import DIALECTS, Dialect, check_dialect, read_event
from kvstream.codecs._refusals import RefusalLog
from kvstream.codecs._strict import (
    STRICT_MEDIA,
    bad_hash_reason,
    hashes_ok,
    medium_reason,
    u64,
)
from kvstream.codecs._vllm_structs import (
    MAP_META_TO_WIRE,
    MAP_TO_WIRE,
    TO_WIRE,
    MapBatchIn,
    WireBatch,
)
from kvstream.codecs.base import Refusal
from kvstream.errors import ConfigError, DecodeError, KVStreamError, shorten
from kvstream.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    with_wire,
)
from kvstream.media import MEDIA_POLICIES, MediaPolicy, canonical_medium

__all__ = [
    "STRICT_MEDIA",
    "MsgpackCodec",
    "Profile",
    "Refusal",
    "Strictness",
]

Profile: TypeAlias = Literal["map", "positional", "sglang", "sglang-positional", "llm-d-2025-12"]
#: `None`: write what vLLM would; `refuse`: leave out what strict consumers
#: reject; `convert`: convert hashes where vLLM converts, refuse the rest.
Strictness: TypeAlias = Literal["refuse", "convert"] | None

PROFILES: Final[tuple[str, ...]] = get_args(Profile)
STRICTNESS: Final[tuple[str, ...]] = ("refuse", "convert")

# -- decoding ---------------------------------------------------------------------------

#: What a foreign decoder or a validator may raise on bad input.
_BAD_INPUT: Final = (
    msgspec.DecodeError,
    msgspec.ValidationError,
    KVStreamError,
    ValueError,
    TypeError,
    OverflowError,
    RecursionError,
    KeyError,
    IndexError,
)


def _event_type_of(raw: Any) -> str:
    """The tag a refused event claimed, for the refusal record (`?` when none)."""
    tag = raw.get("type") if type(raw) is dict else raw[0] if type(raw) is list and raw else None
    return tag if type(tag) is str and len(tag) <= 40 else "?"


def _batch_parts(obj: Any) -> tuple[Any, Any, Any]:
    """`(ts, events, data_parallel_rank)` of a decoded batch, array or map."""
    if type(obj) is list:
        # vLLM always writes 3; some producers 2 (no rank); more is a later
        # version's addition, ignored as msgspec (vLLM's own decoder) ignores it.
        if len(obj) < 2:
            raise DecodeError(
                "batch: expected an array [ts, events, data_parallel_rank] of 3 "
                f"elements, got {len(obj)} element(s)"
            )
        return obj[0], obj[1], obj[2] if len(obj) >= 3 else None
    if type(obj) is dict:
        unknown = obj.keys() - {"ts", "events", "data_parallel_rank"}
        if unknown:
            raise DecodeError(f"batch: unknown key(s) {shorten(sorted(map(str, unknown)))}")
        if "ts" not in obj or "events" not in obj:
            raise DecodeError("batch: a map batch needs the keys 'ts' and 'events'")
        return obj["ts"], obj["events"], obj.get("data_parallel_rank")
    raise DecodeError(
        f"batch: expected an array [ts, events, data_parallel_rank], got {shorten(obj)}"
    )


class MsgpackCodec:
    """vLLM's msgpack batch; see the module doc for profiles and strictness.


        codec = MsgpackCodec()                       # map events, as vLLM v0.26+
        codec = MsgpackCodec(profile="positional")   # tagged arrays, older readers
        payload = codec.encode(batch)
        batch = codec.decode(payload, seq=12, origin="engine-0", epoch="e1")

    Pure and reusable; equal configurations compare equal, so sinks sharing a
    configuration share encodings.
    """

    name = "msgpack"
    self_delimiting = False

    __slots__ = (
        "_map_decoder",
        "_media",
        "_refusals",
        "_to_wire",
        "dialect",
        "media",
        "metadata",
        "profile",
        "strict",
    )

    def __init__(
        self,
        *,
        profile: Profile = "map",
        metadata: bool = False,
        strict: Strictness = None,
        strict_media: Sequence[str] | None = None,
        dialect: Dialect = "auto",
        media: MediaPolicy = "keep",
    ) -> None:
        if profile not in PROFILES:
            raise ConfigError(
                f"msgpack codec: profile: expected one of {', '.join(PROFILES)}, got {profile!r}"
            )
        if type(metadata) is not bool:
            raise ConfigError(f"msgpack codec: metadata: expected a bool, got {metadata!r}")
        if metadata and profile != "map":
            raise ConfigError(
                f"msgpack codec: metadata: the {profile} profile cannot carry metadata "
                "(its readers know only their own fields); use profile=map"
            )
        if dialect not in DIALECTS:
            raise ConfigError(
                f"msgpack codec: dialect: expected one of {', '.join(DIALECTS)}, got {dialect!r}"
            )
        if media not in MEDIA_POLICIES:
            raise ConfigError(
                f"msgpack codec: media: expected one of {', '.join(MEDIA_POLICIES)}, got {media!r}"
            )
        if strict is not None and strict not in STRICTNESS:
            raise ConfigError(
                f"msgpack codec: strict: expected one of {', '.join(STRICTNESS)} or None, "
                f"got {strict!r}"
            )
        if strict is not None and metadata:
            raise ConfigError(
                "msgpack codec: metadata: strict consumers must not see metadata; "
                "use metadata=False with strict"
            )
        if strict_media is None:
            strict_set = STRICT_MEDIA
        else:
            if isinstance(strict_media, str) or not all(type(m) is str and m for m in strict_media):
                raise ConfigError(
                    f"msgpack codec: strict_media: expected a list of tier names, "
                    f"got {strict_media!r}"
                )
            strict_set = frozenset(strict_media)
        self.profile: Profile = profile
        self.metadata = metadata
        self.strict: Strictness = strict
        self._media: frozenset[str] = strict_set
        self.dialect: Dialect = check_dialect(dialect)
        self.media: MediaPolicy = media
        self._refusals = RefusalLog("msgpack decode")
        # -- profile dispatch: vLLM's profiles here, the other dialects' in dialects.py
        to_wire = TO_WIRE.get((profile, metadata))
        self._to_wire = to_wire if to_wire is not None else dialects.ENCODERS[profile]
        self._map_decoder = msgspec.msgpack.Decoder(MapBatchIn)

    @property
    def strict_media(self) -> frozenset[str]:
        """The `medium` values a strict codec lets through (besides None)."""
        return self._media

    def _key(self) -> tuple[object, ...]:
        return (self.profile, self.metadata, self.strict, self._media, self.dialect, self.media)

    @property
    def events_refused(self) -> int:
        """Events `decode()` left out of the batches it returned (see `decode()`)."""
        return self._refusals.count

    def __eq__(self, other: object) -> bool:
        return type(other) is MsgpackCodec and other._key() == self._key()

    def __hash__(self) -> int:
        return hash((MsgpackCodec, *self._key()))

    def __repr__(self) -> str:
        media = "" if self._media == STRICT_MEDIA else f", strict_media={sorted(self._media)!r}"
        if self.dialect != "auto":
            media += f", dialect={self.dialect!r}"
        if self.media != "keep":
            media += f", media={self.media!r}"
        return (
            f"MsgpackCodec(profile={self.profile!r}, metadata={self.metadata}, "
            f"strict={self.strict!r}{media})"
        )

    # -- encoding ---------------------------------------------------------------------

    def encode(self, batch: EventBatch) -> bytes:
        """The payload frame of `batch`: `[ts, events, data_parallel_rank]`."""
        if self.strict is not None:
            return self.encode_screened(batch)[0]
        return self._payload(batch.ts, batch.events, batch.data_parallel_rank)

    def _payload(self, ts: float, events: Sequence[Any], rank: int | None) -> bytes:
        to_wire = self._to_wire
        if (
            (to_wire is MAP_TO_WIRE or to_wire is MAP_META_TO_WIRE)
            and _KV_TYPES.issuperset(map(type, events))
            and (
                to_wire is MAP_META_TO_WIRE
                or list(map(_METADATA, events)).count(None) == len(events)
            )
        ):
            # kvstream's events are laid out as vLLM's map events (`kvstream.events`):
            # a batch with nothing to leave out is encoded as it is, no call per event.
            return _ENCODE(WireBatch(ts, events, rank))  # type: ignore[arg-type]
        try:
            wire = [to_wire[type(e)](e) for e in events]
        except KeyError:
            bad = next(e for e in events if type(e) not in to_wire)
            raise TypeError(f"MsgpackCodec: expected a KV cache event, got {bad!r:.80}") from None
        return _ENCODE(WireBatch(ts, wire, rank))

    def encode_screened(self, batch: EventBatch) -> tuple[bytes, tuple[Refusal, ...]]:
        """Encode `batch` through the strict screen; return the bytes and what was refused.

        Without `strict` nothing is refused (the same bytes as `encode()`).
        """
        if self.strict is None:
            return self._payload(batch.ts, batch.events, batch.data_parallel_rank), ()
        kept, refused = self.screen(batch.events)
        return self._payload(batch.ts, kept, batch.data_parallel_rank), refused

    def screen(
        self, events: Sequence[KVCacheEvent]
    ) -> tuple[list[KVCacheEvent], tuple[Refusal, ...]]:
        """Apply the strict profile: the events to send (converted) and those refused."""
        strict = self.strict
        if strict is None:
            return list(events), ()
        media = self._media
        convert = strict == "convert"
        kept: list[KVCacheEvent] = []
        refused: list[Refusal] = []
        for i, e in enumerate(events):
            t = type(e)
            if t is BlockStored:
                stored: BlockStored = e  # type: ignore[assignment]
                if stored.medium is not None and stored.medium not in media:
                    refused.append(Refusal(i, "BlockStored", medium_reason(stored.medium, media)))
                    continue
                parent = stored.parent_block_hash
                parent_ok = parent is None or (type(parent) is int and parent >= 0)
                if not (parent_ok and hashes_ok(stored.block_hashes)):
                    if not convert:
                        refused.append(
                            Refusal(
                                i,
                                "BlockStored",
                                bad_hash_reason("BlockStored", stored.block_hashes, parent),
                            )
                        )
                        continue
                    e = msgspec.structs.replace(
                        stored,
                        block_hashes=[u64(h) for h in stored.block_hashes],
                        parent_block_hash=None if parent is None else u64(parent),
                    )
            elif t is BlockRemoved:
                removed: BlockRemoved = e  # type: ignore[assignment]
                if removed.medium is not None and removed.medium not in media:
                    refused.append(Refusal(i, "BlockRemoved", medium_reason(removed.medium, media)))
                    continue
                if not hashes_ok(removed.block_hashes):
                    if not convert:
                        refused.append(
                            Refusal(
                                i,
                                "BlockRemoved",
                                bad_hash_reason("BlockRemoved", removed.block_hashes, None),
                            )
                        )
                        continue
                    e = msgspec.structs.replace(
                        removed, block_hashes=[u64(h) for h in removed.block_hashes]
                    )
            elif t is not AllBlocksCleared:
                refused.append(Refusal(i, t.__name__, f"not a KV cache event: {e!r:.80}"))
                continue
            kept.append(e)
        return kept, tuple(refused)

    # -- decoding ---------------------------------------------------------------------

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        *,
        seq: int = 0,
        origin: str = "",
        epoch: str = "",
    ) -> EventBatch:
        """The batch in one payload frame; `seq`/`origin`/`epoch` come from the transport.

        Decoding is per event: an event no dialect reads is left out of the
        batch, counted in `events_refused` and logged once per burst, and
        the rest is delivered (`decode_screened()` returns the refusals).
        Raises `DecodeError` (and nothing else) for bytes that are not a
        batch at all.
        """
        batch, refused = self.decode_screened(data, seq=seq, origin=origin, epoch=epoch)
        self._refusals.note(refused, seq, origin)
        return batch

    def decode_screened(
        self,
        data: bytes | bytearray | memoryview,
        *,
        seq: int = 0,
        origin: str = "",
        epoch: str = "",
    ) -> tuple[EventBatch, tuple[Refusal, ...]]:
        """The batch in one payload frame and the events refused in it (position, tag, why)."""
        if type(seq) is not int or seq < 0:
            raise DecodeError(f"seq: expected an int >= 0, got {seq!r}")
        try:
            # Fast path: every event a map kvstream's events read as they are
            # (they refuse unknown fields, so a foreign field takes the general path).
            fast = self._map_decoder.decode(data)
        except _BAD_INPUT:
            pass  # positional or foreign events, a map batch, a bad event, or bad bytes
        else:
            ts = fast.ts
            if math.isfinite(ts):
                events: list[KVCacheEvent] = fast.events  # type: ignore[assignment]
                try:
                    if self.media == "normalize":
                        events = [_normalized(e) for e in events]
                except KVStreamError:
                    pass  # the general path refuses that event alone, naming it
                else:
                    try:
                        batch = EventBatch(
                            seq=seq,
                            ts=ts,
                            events=events,
                            data_parallel_rank=fast.data_parallel_rank,
                            origin=origin,
                            epoch=epoch,
                        )
                    except KVStreamError as exc:
                        raise DecodeError(str(exc)) from None
                    return batch, ()
        try:
            obj = _DECODE_ANY(data)
        except _BAD_INPUT as exc:
            raise DecodeError(f"not a msgpack batch: {exc}") from None
        return self._batch_from_wire(obj, seq, origin, epoch)

    def decode_keyed(
        self, data: bytes | bytearray | memoryview, *, seq: int, origin: str, epoch: str
    ) -> EventBatch:
        """The batch in one payload frame, named by its transport (the Codec contract)."""
        return self.decode(data, seq=seq, origin=origin, epoch=epoch)

    def _batch_from_wire(
        self, obj: Any, seq: int, origin: str, epoch: str
    ) -> tuple[EventBatch, tuple[Refusal, ...]]:
        ts, raw_events, rank = _batch_parts(obj)
        if type(ts) is int and not isinstance(ts, bool):
            ts = float(ts)
        if type(ts) is not float or not math.isfinite(ts):
            raise DecodeError(f"batch.ts: expected a finite float (seconds), got {shorten(ts)}")
        if rank is not None and type(rank) is not int:
            raise DecodeError(
                f"batch.data_parallel_rank: expected an int or nil, got {shorten(rank)}"
            )
        if type(raw_events) is not list:
            raise DecodeError(f"batch.events: expected an array, got {shorten(raw_events)}")
        events: list[KVCacheEvent] = []
        refused: list[Refusal] = []
        dialect = self.dialect
        media = self.media
        for i, raw in enumerate(raw_events):
            try:
                events.append(read_event(raw, dialect, media))
            except _BAD_INPUT as exc:
                refused.append(Refusal(i, _event_type_of(raw), str(exc)))
        try:
            batch = EventBatch(
                seq=seq,
                ts=ts,
                events=events,
                data_parallel_rank=rank,
                origin=origin,
                epoch=epoch,
            )
        except KVStreamError as exc:
            raise DecodeError(str(exc)) from None
        return batch, tuple(refused)


def _normalized(e: KVCacheEvent) -> KVCacheEvent:
    """`e` with its `medium` in canonical spelling, the raw one kept in metadata."""
    medium = getattr(e, "medium", None)
    if medium is None:
        return e
    canon = canonical_medium(medium)
    if canon is None or canon == medium:
        return e
    meta = with_wire(e.metadata, {"medium": medium}, type(e).__name__)  # type: ignore[attr-defined]
    return msgspec.structs.replace(e, medium=canon, metadata=meta)


_ENCODE: Final = msgspec.msgpack.Encoder().encode
#: The events `encode()` writes as they are in the map profile (exactly these
#: types: a subclass may lay its fields out otherwise).
_KV_TYPES: Final = frozenset((BlockStored, BlockRemoved, AllBlocksCleared))
_METADATA: Final = operator.attrgetter("metadata")
_DECODE_ANY: Final = msgspec.msgpack.Decoder().decode
