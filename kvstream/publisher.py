"""A drop-in for vLLM's `EventPublisher`, backed by a kvstream pipeline.

For engines that cannot change their code path: vLLM's scheduler calls
`publisher.publish(batch)` once per step from its own thread and
`publisher.shutdown()` at exit. `EventPublisher` has that shape. Behind
it a [`Scheduler`][kvstream.scheduler.Scheduler] runs on an event loop in a daemon
thread (`LoopThread`), so every kvstream sink is
available, and vLLM's wire is one of them:

    publisher = EventPublisher.from_kv_events_config(
        '{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}',
        data_parallel_rank=0,
    )
    publisher.publish(KVEventBatch(ts=time.time(), events=events))   # engine thread
    publisher.shutdown()

It behaves as vLLM's `ZmqEventPublisher` does: one `publish` is one batch
with the next `seq` (an empty step too, so sequence numbers match vLLM's);
the batch keeps the caller's `ts` and `data_parallel_rank` (the
publisher's rank, default 0, when the batch has none);
`get_publisher_config()` returns the resolved
configuration; vLLM's `KVEventsConfig` objects, dicts and JSON text are
accepted; `inproc://` endpoints share the process's ZMQ context.

`publish` costs the engine's thread a list copy and a deque append: the
events are converted on the loop. vLLM's own event structs are trusted as
vLLM builds them (see `from_vllm_event()`); anything else goes through
kvstream's full validation. An event that fails is dropped, counted
(`statistics().events_refused`) and logged once per burst; `publish` does
not raise for it, so a bad event never stops the engine.

**What is checked on vLLM's wire.** When every sink is on vLLM's wire, a step
made only of vLLM's own structs goes out as those structs, encoded as vLLM
encodes them. `check="sample"` (the default) checks the type of every field
of the step's first and last event: what a vLLM version with other field
types (bytes hashes, numpy token ids) changes, it changes in every event, so
the first step shows it, and that step is converted event by event, each bad
event named and refused. A value msgspec cannot write anywhere in the step
does the same. What the sample does not see (one wrongly typed but writable
value in the middle of a step, which vLLM's code does not produce) goes out
as vLLM's own publisher would send it, and consumers refuse that event.
`check="all"` checks every field of every event, at about a fifth of the cost
of encoding them.

It never waits, except when `max_queue_size` steps are still queued (a full
sink with policy `block`, or an engine that outruns the pipeline that long;
vLLM's `publish` waits on its full queue the same way).

**Exit.** The loop runs in a daemon thread, so a process whose code never calls
`shutdown()` still exits. Such a publisher is shut down at interpreter exit
(or when it is garbage collected): what was published is delivered within
`close_timeout`, as `shutdown()` would. vLLM's publisher discards what is
still queued instead.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Literal, NamedTuple

import msgspec
from msgspec.structs import force_setattr

from kvstream._burst_log import BurstLog
from kvstream._event_loop import EventLoopName, resolve_event_loop
from kvstream._threadsafe import LoopThread
from kvstream._wire.vllm_zmq import (
    DEFAULT_MAX_QUEUE_SIZE,
    KVEventsConfig,
    offset_endpoint,
    parse_kv_events_config,
)
from kvstream.codecs.base import Refusal
from kvstream.errors import ConfigError, InvalidEventError, InvalidEventTypeError, shorten
from kvstream.events import (
    EVENT_TYPES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)
from kvstream.scheduler import Scheduler
from kvstream.sinks.base import Sink

__all__ = [
    "EventPublisher",
    "PublisherStatistics",
    "VllmWireCodec",
    "from_vllm_event",
    "to_kvstream_event",
]

log = logging.getLogger("kvstream.publisher")


class PublisherStatistics(NamedTuple):
    batches_published: int
    events_published: int
    #: Events dropped because they failed validation.
    events_refused: int


# -- vLLM's events to kvstream's ---------------------------------------------------------

_KV_TYPES: Final = frozenset(EVENT_TYPES.values())
_HASH_TYPES: Final = frozenset((int, bytes))
#: Tails a converter keeps templates for before it starts again.
_MAX_TEMPLATES: Final = 256
_STORED_FIELDS: Final = frozenset(BlockStored.__struct_fields__) - {"metadata"}
_REMOVED_FIELDS: Final = frozenset(BlockRemoved.__struct_fields__) - {"metadata"}
_CLEARED: Final = AllBlocksCleared()
_STORED_TEMPLATE: Final[Any] = BlockStored(
    block_hashes=[], parent_block_hash=None, token_ids=[], block_size=0
)
_REMOVED_TEMPLATE: Final[Any] = BlockRemoved(block_hashes=[])


def to_kvstream_event(event: object) -> KVCacheEvent:
    """A kvstream event from a vLLM-style event object, fully validated.

    kvstream events pass through unchanged. Matched by class name
    (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) and field names;
    fields kvstream's events lack (a newer vLLM's `storage_tier`, ...) travel
    in `metadata` when set. Raises [`InvalidEventError`][kvstream.errors.InvalidEventError]
    naming the field for anything else or an invalid field.
    """
    if isinstance(event, KVCacheEvent):
        return event
    tag = getattr(getattr(type(event), "__struct_config__", None), "tag", None)
    name = tag if isinstance(tag, str) else type(event).__name__
    cls = EVENT_TYPES.get(name)
    if cls is None:
        raise InvalidEventTypeError(
            f"publish: expected a BlockStored, BlockRemoved or AllBlocksCleared event, "
            f"got {name}: {shorten(event)}"
        )
    names = getattr(type(event), "__struct_fields__", None) or [
        f for f in cls.__struct_fields__ if hasattr(event, f)
    ]
    fields: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for field in names:
        value = getattr(event, field)
        if field in cls.__struct_fields__:
            fields[field] = value
        elif value is not None:
            extra[field] = value
    if extra:
        fields["metadata"] = {**(fields.get("metadata") or {}), **extra}
    return cls(**fields)


def _extras(cls: type, known: frozenset[str]) -> tuple[str, ...]:
    return tuple(f for f in getattr(cls, "__struct_fields__", ()) if f not in known)


def _plain_str(value: object) -> bool:
    """None or an ASCII str (others take the full path: it checks UTF-8)."""
    return value is None or (type(value) is str and value.isascii())


def _trusted_stored(extras: tuple[str, ...]) -> Callable[[Any], KVCacheEvent]:
    """The converter for one vLLM `BlockStored` class (see `from_vllm_event()`).

    Events mostly share a few tails (tier, group, cache spec, LoRA, how many
    `extra_keys`): each tail is checked and laid out once in a template
    event, and each event copies its template and sets its hashes, parent,
    tokens and block size.
    """
    set_ = force_setattr
    # Template events by tail: (medium, group_idx, kind, window, lora_id, lora_name,
    # locality, extra_keys count). A dict: safe to share between loops in threads.
    templates: dict[tuple[Any, ...], Any] = {}

    def convert(e: Any) -> KVCacheEvent:
        hashes = e.block_hashes
        tokens = e.token_ids
        size = e.block_size
        parent = e.parent_block_hash
        if (
            type(hashes) is not list
            or type(tokens) is not list
            or type(size) is not int
            or len(tokens) != size * len(hashes)
            or not hashes
            or size < 0
            or (parent is not None and type(parent) is not int and type(parent) is not bytes)
            or type(hashes[0]) is not int
            or type(hashes[-1]) is not int
            or (tokens and (type(tokens[0]) is not int or type(tokens[-1]) is not int))
        ):
            return to_kvstream_event(e)  # the rarer shapes, and errors: field by field
        try:
            array("Q").fromlist(hashes)  # in C: every hash an integer in [0, 2**64)
        except (TypeError, OverflowError):
            return to_kvstream_event(e)  # bytes or signed hashes, or the error named
        extra_keys = e.extra_keys
        n_extra = -1 if extra_keys is None else len(extra_keys) if type(extra_keys) is list else -2
        key = (
            e.medium,
            e.group_idx,
            e.kv_cache_spec_kind,
            e.kv_cache_spec_sliding_window,
            e.lora_id,
            e.lora_name,
            e.locality,
            n_extra,
        )
        try:
            template = templates.get(key)
        except TypeError:  # an unhashable value in a field: the full path names it
            return to_kvstream_event(e)
        if template is None:
            medium, group, kind, window, lora_id, lora_name, locality, _ = key
            if (
                not _plain_str(medium)
                or (group is not None and (type(group) is not int or group < 0))
                or not _plain_str(kind)
                or (window is not None and type(window) is not int)
                or (lora_id is not None and type(lora_id) is not int)
                or not _plain_str(lora_name)
                or not _plain_str(locality)
                or (extra_keys is not None and n_extra != len(hashes))
            ):
                return to_kvstream_event(e)
            template = _STORED_TEMPLATE.__copy__()
            set_(template, "medium", medium)
            set_(template, "group_idx", group)
            set_(template, "kv_cache_spec_kind", kind)
            set_(template, "kv_cache_spec_sliding_window", window)
            set_(template, "lora_id", lora_id)
            set_(template, "lora_name", lora_name)
            set_(template, "locality", locality)
            if extra_keys is not None:
                set_(template, "extra_keys", [None] * n_extra)
            if len(templates) >= _MAX_TEMPLATES:
                templates.clear()
            templates[key] = template
        if extra_keys is not None and extra_keys.count(None) != n_extra:
            return to_kvstream_event(e)  # keys of some block: normalised field by field
        for field in extras:
            if getattr(e, field) is not None:
                return to_kvstream_event(e)  # a field kvstream lacks: into metadata
        if parent is not None and type(parent) is int and not -(2**63) <= parent < 2**64:
            return to_kvstream_event(e)
        out = template.__copy__()
        set_(out, "block_hashes", hashes)
        set_(out, "parent_block_hash", parent)
        set_(out, "token_ids", tokens)
        set_(out, "block_size", size)
        return out  # type: ignore[no-any-return]

    return convert


def _trusted_removed(extras: tuple[str, ...]) -> Callable[[Any], KVCacheEvent]:
    copy = _REMOVED_TEMPLATE.__copy__
    set_ = force_setattr
    hash_types = _HASH_TYPES.issuperset

    def convert(e: Any) -> KVCacheEvent:
        hashes = e.block_hashes
        medium = e.medium
        group = e.group_idx
        locality = e.locality
        if (
            type(hashes) is not list
            or not _plain_str(medium)
            or (group is not None and (type(group) is not int or group < 0))
            or not _plain_str(locality)
            or not hash_types(map(type, hashes))
        ):
            return to_kvstream_event(e)
        for field in extras:
            if getattr(e, field) is not None:
                return to_kvstream_event(e)
        out = copy()
        set_(out, "block_hashes", hashes)
        set_(out, "medium", medium)
        if group is not None:
            set_(out, "group_idx", group)
        if locality is not None:
            set_(out, "locality", locality)
        return out  # type: ignore[no-any-return]

    return convert


def _cleared(e: Any) -> KVCacheEvent:
    return _CLEARED


def _passthrough(e: Any) -> KVCacheEvent:
    return e  # type: ignore[no-any-return]


def _converter_for(cls: type) -> Callable[[Any], KVCacheEvent]:
    if cls in _KV_TYPES:
        return _passthrough
    fields = frozenset(getattr(cls, "__struct_fields__", ()))
    if issubclass(cls, msgspec.Struct):
        tag = cls.__struct_config__.tag  # vLLM's structs are tagged with their class name
        name = tag if isinstance(tag, str) else cls.__name__
        if name == "BlockStored" and fields >= _STORED_FIELDS:
            return _trusted_stored(_extras(cls, _STORED_FIELDS))
        if name == "BlockRemoved" and {"block_hashes", "medium", "group_idx", "locality"} <= fields:
            return _trusted_removed(_extras(cls, _REMOVED_FIELDS))
        if name == "AllBlocksCleared" and not fields:
            return _cleared
    return to_kvstream_event


_CONVERTERS: dict[type, Callable[[Any], KVCacheEvent]] = {}


def from_vllm_event(event: object) -> KVCacheEvent:
    """A kvstream event from one of vLLM's event structs, cheaply where that is safe.

    vLLM's own `msgspec` structs (tagged `BlockStored`, `BlockRemoved` or
    `AllBlocksCleared`, with vLLM's fields) are trusted as vLLM builds them:
    each field's type is checked (`block_hashes` and `token_ids` lists,
    their lengths consistent, `block_size` an int, the parent an int or
    bytes, text fields ASCII `str`, ...), every hash is checked in C to be an
    integer in `[0, 2**64)`, and the first and last token id to be an
    `int`; then the event is copied from a template without revalidation.
    Token ids in between are not looked at one by one (a `str` or `float`
    there would cost as much to find as encoding the event does).
    Every other shape (bytes or signed hashes, `extra_keys` with keys,
    non-ASCII text, fields kvstream lacks, set) and every other object goes
    through `to_kvstream_event()`, which checks everything and names the
    bad field.
    """
    cls = type(event)
    convert = _CONVERTERS.get(cls)
    if convert is None:
        convert = _CONVERTERS[cls] = _converter_for(cls)
    return convert(event)


# -- vLLM's own structs, straight to vLLM's wire ---------------------------------------------

#: How long the publisher's loop, out of work, still looks for steps by itself:
#: an engine stepping faster hands its steps over without a wake-up each.
DEFAULT_IDLE_POLL: Final = 0.005

#: How much of a step of vLLM's structs is checked before it goes out as it is.
StepCheck = Literal["sample", "all"]
_STEP_CHECKS: Final = ("sample", "all")

_SCALARS: Final = frozenset((str, int, float, bool))


def _direct_stored(extras: tuple[str, ...]) -> Callable[[Any], bool]:
    """Whether a vLLM `BlockStored` can go to vLLM's wire as it is (see `VllmWireCodec`).

    The type of every field (and of the first and last hash and token id) is
    checked; False sends the event through the conversion, which names the
    bad field or accepts a rarer shape (bytes hashes, say).
    """
    scalars = _SCALARS

    def check(e: Any) -> bool:
        hashes = e.block_hashes
        tokens = e.token_ids
        size = e.block_size
        if (
            type(hashes) is not list
            or type(tokens) is not list
            or type(size) is not int
            or len(tokens) != size * len(hashes)
            or not hashes
            or size < 0
            or type(hashes[0]) is not int
            or type(hashes[-1]) is not int
            or (tokens and (type(tokens[0]) is not int or type(tokens[-1]) is not int))
        ):
            return False
        parent = e.parent_block_hash
        medium = e.medium
        group = e.group_idx
        kind = e.kv_cache_spec_kind
        window = e.kv_cache_spec_sliding_window
        lora_id = e.lora_id
        lora_name = e.lora_name
        locality = e.locality
        extra_keys = e.extra_keys
        if (
            (parent is not None and type(parent) is not int)
            or (medium is not None and type(medium) is not str)
            or (group is not None and (type(group) is not int or group < 0))
            or (kind is not None and type(kind) is not str)
            or (window is not None and type(window) is not int)
            or (lora_id is not None and type(lora_id) is not int)
            or (lora_name is not None and type(lora_name) is not str)
            or (locality is not None and type(locality) is not str)
            or (
                extra_keys is not None
                and (type(extra_keys) is not list or extra_keys.count(None) != len(hashes))
            )
        ):
            return False
        for field in extras:
            value = getattr(e, field)
            if value is not None and type(value) not in scalars:
                return False
        return True

    return check


def _direct_removed(extras: tuple[str, ...]) -> Callable[[Any], bool]:
    scalars = _SCALARS

    def check(e: Any) -> bool:
        hashes = e.block_hashes
        medium = e.medium
        group = e.group_idx
        locality = e.locality
        if (
            type(hashes) is not list
            or (hashes and (type(hashes[0]) is not int or type(hashes[-1]) is not int))
            or (medium is not None and type(medium) is not str)
            or (group is not None and (type(group) is not int or group < 0))
            or (locality is not None and type(locality) is not str)
        ):
            return False
        for field in extras:
            value = getattr(e, field)
            if value is not None and type(value) not in scalars:
                return False
        return True

    return check


def _never(e: Any) -> bool:
    return False


def _always(e: Any) -> bool:
    return True


def _direct_for(cls: type) -> Callable[[Any], bool]:
    convert = _converter_for(cls)
    if convert is _passthrough or convert is to_kvstream_event:
        return _never  # kvstream's own events, or not vLLM's: the conversion path
    if convert is _cleared:
        return _always
    tag = cls.__struct_config__.tag  # type: ignore[attr-defined]
    if tag == "BlockStored" or (tag is True and cls.__name__ == "BlockStored"):
        return _direct_stored(_extras(cls, _STORED_FIELDS))
    return _direct_removed(_extras(cls, _REMOVED_FIELDS))


_DIRECT: dict[type, Callable[[Any], bool]] = {}


class _DirectBatch(msgspec.Struct, array_like=True, gc=False):
    """vLLM's batch, `[ts, events, data_parallel_rank]`, with vLLM's own event structs."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None


class VllmWireCodec:
    """The msgpack codec (map profile) of vLLM's wire, taking vLLM's own event structs too.

    Batches of kvstream events are encoded by `MsgpackCodec`;
    a batch of vLLM's own structs, as `EventPublisher` hands them over on
    vLLM's wire alone, is encoded as vLLM's publisher encodes it: the structs
    themselves, so the bytes are vLLM's by construction.
    """

    name = "msgpack"
    self_delimiting = False
    strict = None

    __slots__ = ("_encode", "_inner")

    def __init__(self) -> None:
        from kvstream.codecs.msgpack import MsgpackCodec

        self._inner = MsgpackCodec()
        self._encode = msgspec.msgpack.Encoder().encode

    def encode(self, batch: Any) -> bytes:
        return self.encode_screened(batch)[0]

    def encode_screened(self, batch: Any) -> tuple[bytes, tuple[Refusal, ...]]:
        events = batch.events
        if events and type(events[0]) not in _KV_TYPES:
            # vLLM's own structs, checked on the loop (see _StepConverter): as they are.
            try:
                return self._encode(_DirectBatch(batch.ts, events, batch.data_parallel_rank)), ()
            except (TypeError, ValueError, OverflowError):
                # A value msgspec cannot write (a numpy int, an object): convert the
                # step event by event, so the others go and the bad one is named.
                return self._converted(batch)
        return self._inner.encode_screened(batch)

    def _converted(self, batch: Any) -> tuple[bytes, tuple[Refusal, ...]]:
        kept: list[KVCacheEvent] = []
        refused: list[Refusal] = []
        for i, event in enumerate(batch.events):
            try:
                kept.append(from_vllm_event(event))
            except InvalidEventError as exc:
                refused.append(Refusal(i, type(event).__name__, str(exc)))
        data, more = self._inner.encode_screened(batch.replace(events=kept))
        return data, (*refused, *more)

    def decode(self, data: bytes) -> EventBatch:
        return self._inner.decode(data)

    def decode_keyed(self, data: bytes, *, seq: int, origin: str, epoch: str) -> EventBatch:
        return self._inner.decode_keyed(data, seq=seq, origin=origin, epoch=epoch)

    def __repr__(self) -> str:
        return "VllmWireCodec()"


class _StepConverter:
    """The loop's side of `publish`: one step's raw events to what the sinks take, counted.

    When every sink is on vLLM's wire (`direct`), a step made of vLLM's own
    structs is handed to the sinks as it is; any other step becomes kvstream
    events.
    """

    __slots__ = ("_burst", "_sinks", "_sinks_count", "check", "direct", "events", "refused")

    def __init__(self, check: StepCheck = "sample") -> None:
        self.events = 0
        self.refused = 0
        self.check: StepCheck = check
        self.direct = False
        self._sinks: Sequence[Any] = ()
        self._sinks_count = 0
        self._burst = BurstLog(log)

    def go_direct(self, sinks: Sequence[Any]) -> None:
        """Send vLLM's structs as they are while `sinks` (a live list) keeps its length."""
        self.direct = True
        self._sinks = sinks
        self._sinks_count = len(sinks)

    def _direct_ok(self, raw: list[Any]) -> bool:
        """Whether the step can go to vLLM's wire as it is (see `EventPublisher`'s `check`)."""
        if not raw:
            return True
        checks = _DIRECT
        first, last = raw[0], raw[-1]
        kinds = (type(first),) if first is last else set(map(type, raw))
        for kind in kinds:
            if kind not in checks:
                checks[kind] = _direct_for(kind)
            if checks[kind] is _never:  # kvstream's events, or not vLLM's: convert
                return False
        if self.check == "sample":
            # Every event is one of vLLM's structs; the fields of the first and the
            # last are checked (a wrong type from a vLLM version skew is in every one).
            if first is last:
                return checks[type(first)](first)
            return checks[type(first)](first) and checks[type(last)](last)
        if len(kinds) == 1:  # the common step: one kind of event, checked in one pass
            return all(map(checks[type(raw[0])], raw))
        return all(checks[type(event)](event) for event in raw)

    def __call__(self, raw: list[Any]) -> list[KVCacheEvent]:
        if self.direct and len(self._sinks) == self._sinks_count and self._direct_ok(raw):
            self.events += len(raw)
            return raw
        converters = _CONVERTERS
        out: list[KVCacheEvent] = []
        append = out.append
        for i, event in enumerate(raw):
            convert = converters.get(type(event))
            if convert is None:
                convert = converters[type(event)] = _converter_for(type(event))
            try:
                append(convert(event))
            except InvalidEventError as exc:
                self.refused += 1
                self._burst.log("publish: event %d of a step dropped: %s", i, exc)
        self.events += len(out)
        return out


# -- the publisher ----------------------------------------------------------------------


class EventPublisher:
    """vLLM's `EventPublisher` shape (`publish`, `shutdown`) over kvstream sinks.

    `sinks`: sink objects or URLs (`zmq+tcp://*:5557?replay=tcp://*:5558`,
    `file:kv.jsonl`, ...). `origin` names the engine (default: the host
    name); `data_parallel_rank` goes on every batch that carries none (vLLM's
    default, 0). `max_queue_size` bounds the steps queued between the engine
    and the pipeline (vLLM's `max_queue_size`). `check`: `"sample"` or
    `"all"`, how much of a step of vLLM's own structs is checked before it
    goes out on vLLM's wire as it is (see the module doc). `idle_poll`: for
    how long (seconds) the loop, out of work, still looks for steps by itself,
    so that an engine stepping faster than that hands a step over without waking
    it (see [`ThreadsafeHandle.step()`][kvstream._threadsafe.ThreadsafeHandle.step];
    0 wakes it for every step after idle). The default, 5 ms, is also how long such
    a step may wait before it goes out. A longer poll saves the loop's thread CPU
    (fewer wake-ups, each costing it more than a step's own work) but costs a busy
    engine more; see the benchmarks page. `loop`: the event loop of that
    thread, `"asyncio"` (the default), `"uvloop"` or `"auto"` (uvloop when
    installed); the benchmarks page measures both.
    """

    def __init__(
        self,
        sinks: Sequence[Sink | str],
        *,
        origin: str | None = None,
        data_parallel_rank: int = 0,
        close_timeout: float = 5.0,
        max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
        check: StepCheck = "sample",
        idle_poll: float = DEFAULT_IDLE_POLL,
        loop: EventLoopName = "asyncio",
        config: object = None,
    ) -> None:
        from kvstream.config import open_sink

        if check not in _STEP_CHECKS:
            raise ConfigError(
                f"EventPublisher.check: expected one of {', '.join(_STEP_CHECKS)}, got {check!r}"
            )
        if type(data_parallel_rank) is not int or data_parallel_rank < 0:
            raise ConfigError(
                f"EventPublisher.data_parallel_rank: expected an int >= 0, "
                f"got {data_parallel_rank!r}"
            )
        if type(max_queue_size) is not int or max_queue_size < 1:
            raise ConfigError(
                f"EventPublisher.max_queue_size: expected an int >= 1, got {max_queue_size!r}"
            )
        loop_name = resolve_event_loop(loop, field="EventPublisher.loop")
        codecs: dict[str, Any] = {}
        built = [
            open_sink(s, codecs=codecs) if isinstance(s, str) else s for s in _sink_list(sinks)
        ]
        self.scheduler = Scheduler(
            sinks=built,
            origin=origin,
            data_parallel_rank=data_parallel_rank,
            close_timeout=close_timeout,
        )
        self.data_parallel_rank = data_parallel_rank
        self._config = config
        self._converter = _StepConverter(check)
        if built and all(isinstance(sink.codec, VllmWireCodec) for sink in built):
            self._converter.go_direct(self.scheduler._sinks)
        self._runner = LoopThread(
            self.scheduler,
            name=f"kvstream publisher {self.scheduler.origin}",
            max_pending=max_queue_size,
            convert=self._converter,
            idle_poll=idle_poll,
            loop=loop_name,
        )
        self._step = self._runner.handle.step
        self._batches = 0
        # Shut down at interpreter exit (or when collected) if the owner never does.
        self._finalizer = weakref.finalize(self, self._runner.close)

    @classmethod
    def from_kv_events_config(
        cls,
        config: str | Mapping[str, Any] | object,
        *,
        data_parallel_rank: int = 0,
        origin: str | None = None,
        sinks: Sequence[Sink | str] = (),
        sink_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> EventPublisher:
        """A publisher on vLLM's ZMQ wire, configured as vLLM's `--kv-events-config`.

        `config`: JSON text, a mapping, or vLLM's `KVEventsConfig` object
        (anything with its attributes). Endpoints are offset by
        `data_parallel_rank` as vLLM does; `max_queue_size` bounds the
        steps queued; `sinks` adds more destinations beside the ZMQ sink;
        `sink_options` go to the [`ZmqSink`][kvstream.sinks.zmq.ZmqSink]
        (`bind=True`, `policy`, ...).
        """
        from kvstream.sinks.zmq import ZmqSink

        parsed = _parse_config(config)
        zmq_options = {"codec": VllmWireCodec(), **(sink_options or {})}
        zmq_sink = ZmqSink.from_kv_events_config(
            parsed, data_parallel_rank=data_parallel_rank, **zmq_options
        )
        options.setdefault("max_queue_size", parsed.max_queue_size)
        resolved = _resolved_config(config, parsed, data_parallel_rank)
        return cls(
            [zmq_sink, *sinks],
            origin=origin,
            data_parallel_rank=data_parallel_rank,
            config=resolved,
            **options,
        )

    @classmethod
    def zmq(
        cls,
        data_parallel_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
        topic: str = "",
        **options: Any,
    ) -> EventPublisher:
        """vLLM's `ZmqEventPublisher(...)` arguments, so vLLM's factory can make one:

        EventPublisherFactory.register_publisher("kvstream", EventPublisher.zmq)
        """
        config = {
            "endpoint": endpoint,
            "replay_endpoint": replay_endpoint,
            "buffer_steps": buffer_steps,
            "hwm": hwm,
            "max_queue_size": max_queue_size,
            "topic": topic,
        }
        return cls.from_kv_events_config(config, data_parallel_rank=data_parallel_rank, **options)

    def publish(self, events: object) -> None:
        """Publish one step's events as one batch (from the engine's thread).

        `events`: a vLLM `KVEventBatch` (anything with `.events`, and
        optionally `.ts` and `.data_parallel_rank`), or an iterable of
        events. An empty step is a batch too. The events are copied (the
        caller may reuse its list) and converted on the loop. Raises
        [`ClosedError`][kvstream.errors.ClosedError] (a `RuntimeError`, as vLLM
        raises) after `shutdown()`.
        """
        raw = getattr(events, "events", events)
        raw = raw.copy() if type(raw) is list else _as_list(raw, events)
        ts = getattr(events, "ts", None)
        if ts is not None and type(ts) is not float:
            ts = _checked_ts(ts)
        rank = getattr(events, "data_parallel_rank", None)
        if rank is not None and (type(rank) is not int or rank < 0):
            raise InvalidEventTypeError(
                f"publish: data_parallel_rank: expected an int >= 0 or None, got {shorten(rank)}"
            )
        self._step(raw, ts, rank)
        self._batches += 1

    def get_publisher_config(self) -> Any:
        """The resolved configuration (endpoints offset by the rank), as vLLM's publisher gives.

        A vLLM `KVEventsConfig` given to `from_kv_events_config()` comes
        back as a copy of that object with the resolved endpoints; otherwise a
        `KVEventsConfig`. None for a publisher
        built from sinks.
        """
        return self._config

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every step published so far is sealed and handed to the sinks
        (written, or queued where a transport is full). Not on vLLM's publisher: a
        kvstream extra. Raises `TimeoutError` after `timeout` seconds."""
        self._runner.handle.flush(timeout)

    def shutdown(self) -> None:
        """Deliver what is pending (within `close_timeout`), close the sinks, stop the loop.

        Idempotent.
        """
        self._finalizer()

    def statistics(self) -> PublisherStatistics:
        return PublisherStatistics(self._batches, self._converter.events, self._converter.refused)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _sink_list(sinks: object) -> list[Sink | str]:
    """`EventPublisher`'s `sinks`, checked: a sequence of sinks and sink URLs.

    A lone URL or a mapping is refused rather than iterated (its characters or
    its keys would each become a file sink in the working directory).
    """
    if isinstance(sinks, str | bytes):
        raise ConfigError(
            f"EventPublisher.sinks: expected a list of sinks or sink URLs, got the "
            f"{type(sinks).__name__} {sinks!r:.80} (a single URL goes in a list: [url])"
        )
    if isinstance(sinks, Mapping) or hasattr(sinks, "endpoint") or not isinstance(sinks, Iterable):
        hint = (
            " (vLLM's --kv-events-config? use EventPublisher.from_kv_events_config(config))"
            if isinstance(sinks, Mapping) or hasattr(sinks, "endpoint")
            else ""
        )
        raise ConfigError(
            f"EventPublisher.sinks: expected a list of sinks or sink URLs, "
            f"got {type(sinks).__name__}{hint}"
        )
    out: list[Sink | str] = list(sinks)
    for i, sink in enumerate(out):
        if not isinstance(sink, Sink | str):
            raise ConfigError(
                f"EventPublisher.sinks[{i}]: expected a Sink or a sink URL, "
                f"got {type(sink).__name__} {sink!r:.80}"
            )
    return out


def _as_list(raw: object, batch: object) -> list[Any]:
    if isinstance(raw, str | bytes | Mapping) or not isinstance(raw, Iterable):
        if isinstance(raw, KVCacheEvent):
            return [raw]
        raise InvalidEventTypeError(
            f"publish: expected a batch with .events or a list of events, "
            f"got {type(batch).__name__}: {shorten(batch)}"
        )
    return list(raw)


def _checked_ts(ts: object) -> float:
    if type(ts) is int and -(2**53) < ts < 2**53:
        return float(ts)
    if type(ts) is float and math.isfinite(ts):
        return ts
    raise InvalidEventTypeError(
        f"publish: ts: expected a finite float (wall-clock seconds), got {shorten(ts)}"
    )


_CONFIG_KEYS: Final = tuple(f.name for f in dataclasses.fields(KVEventsConfig))


def _parse_config(config: object) -> KVEventsConfig:
    """vLLM's `--kv-events-config` as JSON text, a mapping or vLLM's config object."""
    if isinstance(config, KVEventsConfig):
        return config
    if isinstance(config, str | Mapping):
        return parse_kv_events_config(config)
    if config is None or not hasattr(config, "endpoint"):
        raise ConfigError(
            f"--kv-events-config: expected JSON text, a mapping or vLLM's KVEventsConfig, "
            f"got {type(config).__name__}"
        )
    values = {k: getattr(config, k) for k in _CONFIG_KEYS if hasattr(config, k)}
    if values.get("publisher") is None:  # vLLM's default: zmq when enabled
        values.pop("publisher", None)
    return parse_kv_events_config(values)


def _resolved_config(original: object, parsed: KVEventsConfig, rank: int) -> Any:
    endpoint = offset_endpoint(parsed.endpoint, rank)
    replay = parsed.replay_endpoint
    replay = None if replay is None else offset_endpoint(replay, rank)
    if not isinstance(original, str | Mapping | KVEventsConfig) and dataclasses.is_dataclass(
        original
    ):
        # vLLM's own config object: a copy of it, resolved, as vLLM's publisher returns.
        return dataclasses.replace(original, endpoint=endpoint, replay_endpoint=replay)  # type: ignore[type-var]
    return dataclasses.replace(parsed, endpoint=endpoint, replay_endpoint=replay)
