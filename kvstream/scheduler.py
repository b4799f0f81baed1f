"""The scheduler: inputs in, one numbered batch per origin per tick, out to the sinks.

`tick()` is on the host's hot path. It drains the synchronous inputs (the
host's `emit` buffer first, then the polled connectors and async sources of
each origin in the order they were added), swaps buffers, seals one
[`EventBatch`][kvstream.events.EventBatch] per origin with pending events, and offers
each batch to every sink. Handing a batch over encodes it, once per codec
(the scheduler's `EncodingGroup` shares the
bytes between sinks with equal codecs), and a sink whose transport has room
writes it at once (`Sink.write_nowait`); the others queue it for their writer
task. The tick does no other I/O and awaits only when a sink whose policy is
`block` is full.

A tick cancelled while it waits never loses a batch it sealed: the batch stays
in the dispatch backlog, in order, and the next tick (or `aclose`) hands it on;
a sink that is closed before it gets a batch counts that batch as dropped.

Everything with a lifetime runs in the scheduler's task group: the aiostream
merge driving the async sources, one lifetime task per sink, the ticker.
"""

from __future__ import annotations

import logging
import math
import secrets
import socket
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from typing import Any, Final, NamedTuple

import anyio
from anyio.abc import TaskGroup, TaskStatus

from kvstream._checks import function, seconds, text
from kvstream._dispatch import Dispatcher
from kvstream._threadsafe import ThreadsafeHandle
from kvstream.errors import ClosedError, ConfigError, InvalidEventTypeError
from kvstream.events import EventBatch, KVCacheEvent
from kvstream.lifetime import LifetimeState, TaskOwner
from kvstream.sinks._encoding import EncodingGroup
from kvstream.sinks.base import DeliveryReport, Sink, SinkStatistics
from kvstream.sources._base import (
    AsyncSource,
    PolledConnector,
    SourceHandle,
    SourceStatistics,
    TakeEventsConnector,
    check_events,
)
from kvstream.sources._merge import SourceMerger

__all__ = ["CloseReport", "Scheduler", "SchedulerStatistics", "every"]

log = logging.getLogger("kvstream.scheduler")


def every(interval: float) -> AsyncIterator[None]:
    """A ticker: yields every `interval` seconds, without drift."""
    if not interval > 0:  # checked now, not when the ticker task first iterates
        raise ConfigError(f"tick interval: expected seconds > 0, got {interval!r}")
    return _every(interval)


async def _every(interval: float) -> AsyncIterator[None]:
    deadline = anyio.current_time()
    while True:
        deadline += interval
        now = anyio.current_time()
        if deadline < now:  # fell behind: skip missed ticks rather than burst
            deadline = now
        await anyio.sleep(deadline - now)
        yield


class SchedulerStatistics(NamedTuple):
    origin: str
    epoch: str
    ticks: int
    batches_sealed: int
    events_sealed: int
    #: Events handed over with emit() or yielded by sources, by origin.
    events_accepted: int
    pending_events: int
    sources: tuple[SourceStatistics, ...]
    sinks: tuple[SinkStatistics, ...]
    #: The next sequence number of each origin.
    next_seq: dict[str, int]


class CloseReport(NamedTuple):
    """What `aclose` could not deliver, per sink."""

    sinks: tuple[DeliveryReport, ...]
    failed_sources: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return all(r.complete for r in self.sinks)

    @property
    def undelivered_batches(self) -> int:
        return sum(r.undelivered_batches for r in self.sinks)


def _leaf_errors(exc: BaseException) -> str:
    """`Type: message` of `exc`, or of the errors an exception group holds."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_leaf_errors(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


class _Origin:
    __slots__ = ("data_parallel_rank", "emitted", "emitted_count", "inputs", "name", "next_seq")

    def __init__(self, name: str, data_parallel_rank: int | None) -> None:
        self.name = name
        self.data_parallel_rank = data_parallel_rank
        self.next_seq = 0
        self.emitted: list[KVCacheEvent] = []
        self.emitted_count = 0
        self.inputs: list[SourceHandle] = []


_NEW: Final = LifetimeState.NEW
_RUNNING: Final = LifetimeState.RUNNING
_CLOSING: Final = LifetimeState.CLOSING
_CLOSED: Final = LifetimeState.CLOSED


class Scheduler(TaskOwner):
    """Merges an engine's event inputs into numbered batches and feeds the sinks.


        async with Scheduler(sinks=[FileSink("events.jsonl")]) as s:
            s.add_source(offload_connector_events())
            s.emit(BlockStored(...))        # from the engine's step, no await
            batch = await s.tick()          # one batch per step

    `origin` names the engine (default: the host name) and `epoch` is drawn
    at random unless given, so `(origin, epoch, seq)` names every batch for
    ever. Pass `tick_interval` (seconds) or any async iterable as `ticker`
    for hosts without a step loop; `clock` gives batch timestamps.
    """

    def __init__(
        self,
        *,
        sinks: Iterable[Sink] = (),
        origin: str | None = None,
        data_parallel_rank: int | None = None,
        epoch: str | None = None,
        tick_interval: float | None = None,
        ticker: AsyncIterable[Any] | None = None,
        clock: Callable[[], float] = time.time,
        max_pending_events: int = 65_536,
        close_timeout: float = 5.0,
    ) -> None:
        if isinstance(sinks, Sink | str | bytes) or not isinstance(sinks, Iterable):
            raise InvalidEventTypeError(
                f"sinks: expected a list of sinks, got {type(sinks).__name__} {sinks!r:.80}"
                + (" (one sink goes in a list: [sink])" if isinstance(sinks, Sink) else "")
            )
        if tick_interval is not None and ticker is not None:
            raise ConfigError("Scheduler: give tick_interval or ticker, not both")
        if origin is not None and (type(origin) is not str or not origin):
            raise ConfigError(f"Scheduler.origin: expected a non-empty str, got {origin!r}")
        if data_parallel_rank is not None and (
            type(data_parallel_rank) is not int or data_parallel_rank < 0
        ):
            raise ConfigError(
                f"Scheduler.data_parallel_rank: expected an int >= 0 or None, "
                f"got {data_parallel_rank!r}"
            )
        if type(max_pending_events) is not int or max_pending_events <= 0:
            raise ConfigError(
                f"Scheduler.max_pending_events: expected a positive int, got {max_pending_events!r}"
            )
        text("Scheduler.epoch", epoch)
        seconds("Scheduler.tick_interval", tick_interval)
        if ticker is not None and not isinstance(ticker, AsyncIterable):
            raise ConfigError(
                f"Scheduler.ticker: expected an async iterable (one tick per item), "
                f"got {ticker!r:.80}"
            )
        TaskOwner.__init__(self)
        self.origin: str = origin or socket.gethostname()
        self.epoch: str = epoch if epoch is not None else secrets.token_hex(8)
        self.data_parallel_rank = data_parallel_rank
        self._clock = function("Scheduler.clock", clock)
        self._ticker: AsyncIterable[Any] | None = (
            every(tick_interval) if tick_interval is not None else ticker
        )
        self._max_pending = max_pending_events
        self.close_timeout = seconds(
            "Scheduler.close_timeout", close_timeout, zero=True, infinite=True
        )
        self._sinks: list[Sink] = []
        #: One encoding per distinct codec, shared by the sinks using it.
        self._encodings = EncodingGroup()
        self._own = _Origin(self.origin, data_parallel_rank)
        self._origins: dict[str, _Origin] = {self.origin: self._own}
        self._handles: list[SourceHandle] = []
        self._merger = SourceMerger()
        self._tg: TaskGroup | None = None
        self._close_report: CloseReport | None = None
        self._closing = anyio.Event()
        self._drain_deadline = math.inf
        self._sinks_done: list[anyio.Event] = []
        #: Sealed batches to every sink, in order (the backlog of full `block` sinks).
        self._dispatch = Dispatcher(self._sinks, self._encodings)
        # The merger's and the ticker's own scopes: aclose() cancels these, never
        # the task group's scope, which the host's ``async with`` body runs in.
        self._task_scopes: list[anyio.CancelScope] = []
        self._merger_done = anyio.Event()
        #: call_at_barrier() callbacks for the next tick (snapshots for socket sinks)
        self._at_barrier: list[Callable[[str, str, int], None]] = []
        #: Handles of threads handing steps over (worked through before the last tick).
        self._thread_handles: list[ThreadsafeHandle] = []
        # counters
        self._ticks = 0
        self._batches_sealed = 0
        self._events_sealed = 0
        self._failed: list[str] = []
        self._forgotten_accepted = 0
        for sink in sinks:
            self._register_sink(sink)
            self._sinks.append(sink)

    # -- lifetime -----------------------------------------------------------------

    def reentry_error(self) -> ClosedError:
        return ClosedError("a Scheduler can be entered only once")

    @property
    def _closed(self) -> bool:
        """Closing or closed: the scheduler takes nothing new."""
        return self._state is _CLOSING or self._state is _CLOSED

    async def open_lifetime(self, stack: AsyncExitStack) -> None:
        """Start the merge, open every sink (each in a task), start the ticker.

        On exit the stack runs `aclose()` (shielded), then ends the tasks.
        """
        # Runs last: sinks not opened yet (a start that failed) hold resources too.
        stack.push_async_callback(self._close_sinks_after_failed_start)
        tg = self._tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        try:
            tg.start_soon(self._run_merger, name="kvstream source merge")
            for sink in self._sinks:
                await tg.start(self._sink_lifetime, sink, name=f"kvstream sink {sink.name}")
            if self._ticker is not None:
                tg.start_soon(self._run_ticker, name="kvstream ticker")
        except BaseException:
            # The caller gets the sink's own error (a TransportError), not an
            # exception group around it: the stack exits the group without it.
            self._set_state(_CLOSING)
            self._merger.close()
            for h in self._handles:
                h.cancel()
            self._closing.set()
            self._tg = None
            raise
        stack.push_async_callback(self._shielded_aclose)

    async def _shielded_aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.aclose()

    async def _close_sinks_after_failed_start(self) -> None:
        if self._close_report is None:
            with anyio.CancelScope(shield=True):
                for sink in self._sinks:
                    await sink.aclose()

    async def aclose(self, timeout: float | None = None) -> CloseReport:
        """Seal what is pending, deliver it to every healthy sink, close everything.

        Sources are stopped (what they yielded stays accepted), a last tick seals
        every pending event, and each sink gets until the deadline (`timeout`
        seconds, default `close_timeout`) to deliver its outbox. Returns,
        and logs, what could not be delivered. Idempotent.
        """
        if self._close_report is not None:
            return self._close_report
        if self._closed:  # a concurrent aclose() is running: wait for it
            await self._closing.wait()
            for done in self._sinks_done:
                await done.wait()
            return self._close_report or CloseReport((), tuple(self._failed))
        self._set_state(_CLOSING)
        limit = self.close_timeout if timeout is None else timeout
        deadline = anyio.current_time() + limit
        self._merger.close()
        for h in self._handles:
            if not h.polled:  # connectors are polled once more, by the last tick
                h.cancel()
        # Nothing waits for room in a full outbox any more: a tick waiting in
        # put() stops waiting, and every batch sealed from now on is queued past
        # the bounds, so that each sink's drain delivers it or reports it.
        self._dispatch.flush()
        for thread_handle in self._thread_handles:  # what threads handed over comes first
            with anyio.move_on_after(max(deadline - anyio.current_time(), 0)):
                await thread_handle._close_and_drain()
        # A last tick: everything accepted so far becomes a batch. (A scheduler
        # never entered accepted nothing: emit() and tick() refused.)
        if self._tg is not None:
            with anyio.move_on_after(max(deadline - anyio.current_time(), 0)):
                await self._tick()
        for h in self._handles:
            h.cancel()
        if self._tg is not None:
            # A source that was producing an item when that tick ran can still
            # hand it over before it notices the cancellation: wait for every
            # source to end, then seal what they handed over last.
            with anyio.move_on_after(max(deadline - anyio.current_time(), 0)):
                await self._merger_done.wait()
                if any(h.buffer for h in self._handles):
                    await self._tick()
        # Whatever a cancelled tick (or the deadline) left in the backlog reaches
        # every sink now: offers are forced, so this cannot wait for room.
        with anyio.CancelScope(shield=True):
            await self._dispatch.wait_all()
        self._encodings.forget()
        self._drain_deadline = deadline
        self._closing.set()
        if self._tg is None:  # never started: sinks were not opened
            for s in self._sinks:
                await s.aclose()
            reports = [s._drain_report or await s.drain(0) for s in self._sinks]
        else:
            for done in self._sinks_done:
                await done.wait()
            reports = [s._drain_report or await s.drain(0) for s in self._sinks]
        # Polled connectors fail inside a tick, not in the merge: add theirs.
        failed = self._failed + [h.name for h in self._handles if h.polled and h.error is not None]
        report = CloseReport(tuple(reports), tuple(failed))
        self._close_report = report
        self._set_state(_CLOSED)
        for scope in self._task_scopes:
            scope.cancel()
        return report

    async def _sink_lifetime(self, sink: Sink, *, task_status: TaskStatus[None]) -> None:
        done = anyio.Event()
        self._sinks_done.append(done)
        started = False
        try:
            async with sink:
                task_status.started()
                started = True
                await self._closing.wait()
                remaining = max(self._drain_deadline - anyio.current_time(), 0.0)
                await sink.drain(remaining)
        except Exception as exc:
            if not started:  # opening failed: the caller of start() gets the error
                raise
            # A sink failing (a task of its own crashed, or releasing its transport
            # failed) must not take the scheduler and the host's task down with it:
            # what it delivered is reported, and the batches after it are counted.
            why = _leaf_errors(exc)
            if self._closing.is_set():
                log.error("sink %s failed while closing: %s", sink.name, why, exc_info=exc)
            else:
                sink._ended = sink._ended or f"it failed: {why}"
                log.error(
                    "sink %s failed: %s; it takes no more batches (they are counted as "
                    "dropped), the other sinks go on",
                    sink.name,
                    why,
                    exc_info=exc,
                )
        finally:
            done.set()

    def _task_scope(self) -> anyio.CancelScope:
        """A cancel scope for one background task, cancelled by `aclose()`."""
        scope = anyio.CancelScope()
        if self._state is _CLOSED:
            scope.cancel()
        self._task_scopes.append(scope)
        return scope

    async def _run_merger(self) -> None:
        try:
            with self._task_scope():
                await self._merger.run(self._source_ended)
        finally:
            self._merger_done.set()

    def _source_ended(self, handle: SourceHandle) -> None:
        if handle.error is not None:
            self._failed.append(handle.name)

    async def _run_ticker(self) -> None:
        assert self._ticker is not None
        iterator = aiter(self._ticker)
        try:
            with self._task_scope():
                async for _ in iterator:
                    if self._closed:
                        break
                    await self._tick()
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()

    # -- inputs -------------------------------------------------------------------

    def _origin(self, origin: str | None, data_parallel_rank: int | None = None) -> _Origin:
        if origin is None:
            return self._own
        state = self._origins.get(origin)
        if state is None:
            if type(origin) is not str or not origin:
                raise ConfigError(f"origin: expected a non-empty str, got {origin!r}")
            state = self._origins[origin] = _Origin(origin, data_parallel_rank)
        return state

    def add_source(
        self,
        source: AsyncSource | PolledConnector | TakeEventsConnector,
        *,
        name: str | None = None,
        origin: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> SourceHandle:
        """Add an input; works before and while running.

        `source` is an async iterable of events or chunks of events, or a
        connector adapted with [`from_take_events()`][kvstream.sources._base.from_take_events] (an
        object with `take_events()` is adapted for you). `origin` names
        another engine whose events this input carries (a relay); by default the
        input is one of this engine's connectors.
        """
        if self._closed:
            raise ClosedError("add_source: the scheduler is closed")
        text("add_source: name", name)
        candidate: object = source
        adapted: AsyncSource | PolledConnector
        if isinstance(candidate, PolledConnector | AsyncIterable):
            adapted = candidate
        elif callable(getattr(candidate, "take_events", None)):
            adapted = PolledConnector(candidate)  # type: ignore[arg-type]
        else:
            raise InvalidEventTypeError(
                "add_source: expected an async iterable of events, or an object "
                f"with take_events(), got {type(candidate).__name__}"
            )
        source = adapted
        state = self._origin(origin, data_parallel_rank)
        n = len(self._handles)
        if name is None:
            name = getattr(source, "name", None) or getattr(source, "__name__", None)
            name = f"{name or type(source).__name__}#{n}"
        handle = SourceHandle(source, name=name, origin=state.name, max_pending=self._max_pending)
        self._handles.append(handle)
        state.inputs.append(handle)
        if not handle.polled:
            self._merger.add(handle)
        return handle

    def remove_source(self, handle: SourceHandle) -> None:
        """Stop an input. Events it already yielded stay accepted for the next tick."""
        if handle not in self._handles:
            raise ConfigError(f"remove_source: {handle!r} is not a source of this scheduler")
        handle.cancel()

    def emit(
        self, events: KVCacheEvent | Sequence[KVCacheEvent], *, origin: str | None = None
    ) -> None:
        """Accept events from the host's own task (the cache manager's stream).

        No await: the events are in the next tick's batch, ahead of every
        connector's events of that tick.
        """
        if self._state is not _RUNNING:  # _running(), inline: the hot path
            raise self._refusal("emit")
        state = self._own if origin is None else self._origin(origin)
        if isinstance(events, KVCacheEvent):
            state.emitted.append(events)
            state.emitted_count += 1
        else:
            checked = check_events(events, "emit")
            state.emitted.extend(checked)
            state.emitted_count += len(checked)

    async def add_sink(self, sink: Sink) -> None:
        """Add a sink; while running, it is opened now and gets every later batch."""
        if self._closed:
            raise ClosedError("add_sink: the scheduler is closed")
        self._register_sink(sink)
        if self._tg is not None:
            # The sink gets batches once it is open: ticks meanwhile pass it by.
            await self._tg.start(self._sink_lifetime, sink, name=f"kvstream sink {sink.name}")
        self._sinks.append(sink)

    def _register_sink(self, sink: Sink) -> None:
        if not isinstance(sink, Sink):
            raise InvalidEventTypeError(f"sinks: expected a Sink, got {type(sink).__name__}")
        if sink in self._sinks:
            raise ConfigError(f"sink {sink.name!r} was added twice")
        # Sinks whose codecs are equal share one encoding of every batch.
        sink.use_encoding(self._encodings.encoding_for(sink.codec))
        # Sinks that serve snapshots (the socket sink) need the tick barrier.
        bind = getattr(sink, "bind_barrier", None)
        if callable(bind):
            bind(self.call_at_barrier)

    @property
    def sinks(self) -> tuple[Sink, ...]:
        return tuple(self._sinks)

    @property
    def sources(self) -> tuple[SourceHandle, ...]:
        return tuple(self._handles)

    # -- the tick -----------------------------------------------------------------

    async def tick(self) -> EventBatch | None:
        """Seal one batch per origin with pending events and hand them to the sinks.

        Returns this engine's own batch, or None when it had nothing pending (no
        sequence number is used then).
        """
        if self._state is not _RUNNING:  # _running(), inline: the hot path
            raise self._refusal("tick")
        return await self._tick()

    def _running(self) -> bool:
        return self._state is _RUNNING

    def _refusal(self, what: str) -> ClosedError:
        if self._closed:
            return ClosedError(f"{what}: the scheduler is closed")
        if self._state is _NEW:
            return ClosedError(
                f"{what}: the scheduler was never entered; use it as "
                "`async with Scheduler(...) as s:` (nothing it took could be delivered)"
            )
        return ClosedError(f"{what}: the scheduler is still starting")

    async def _tick(self) -> EventBatch | None:
        self._ticks += 1
        batches = self._seal()
        if self._at_barrier:
            self._run_barrier_callbacks()
        if not batches:
            if self._dispatch.stalled:
                # A cancelled tick left batches behind: hand them on now.
                await self._dispatch.wait_all()
            return None
        if not self._dispatch.dispatch_now(batches):
            await self._dispatch.wait_all()
        own = batches[0]
        return own if own.origin == self.origin else None

    def call_at_barrier(self, callback: Callable[[str, str, int], None]) -> None:
        """Call `callback(origin, epoch, next_seq)` once, inside the next tick.

        It runs right after that tick seals, before anything else can run: the
        events the host reported so far are exactly this origin's batches
        `< next_seq`, so a snapshot of the host's state taken in the callback
        precedes `next_seq`. Keep callbacks short: they run on the host's tick.
        """
        self._at_barrier.append(function("call_at_barrier: callback", callback))

    def _run_barrier_callbacks(self) -> None:
        callbacks, self._at_barrier = self._at_barrier, []
        next_seq = self._own.next_seq
        for callback in callbacks:
            try:
                callback(self.origin, self.epoch, next_seq)
            except Exception:
                log.exception("barrier callback %r failed", callback)

    def _seal(self) -> list[EventBatch]:
        """Swap every input's buffer into one batch per origin. No awaits."""
        batches: list[EventBatch] = []
        ts = self._clock()
        epoch = self.epoch
        for state in self._origins.values():
            events = state.emitted
            if events:
                state.emitted = []
            for handle in state.inputs:
                if handle.polled or handle.buffer:
                    taken = handle.take()
                    if taken:
                        if events:
                            events.extend(taken)
                        else:
                            events = taken
            if events:
                seq = state.next_seq
                state.next_seq = seq + 1
                batches.append(
                    EventBatch._trusted(
                        seq, ts, events, state.data_parallel_rank, state.name, epoch
                    )
                )
                self._events_sealed += len(events)
        self._batches_sealed += len(batches)
        if len(self._handles) > 64:
            self._forget_finished()
        return batches

    def _forget_finished(self) -> None:
        ended = [h for h in self._handles if not h.running and not h.buffer and not h.polled]
        if ended:
            for h in ended:
                self._forgotten_accepted += h.accepted
                self._handles.remove(h)
                self._origins[h.origin].inputs.remove(h)

    # -- introspection ------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        pending = sum(len(o.emitted) for o in self._origins.values()) + sum(
            len(h.buffer) for h in self._handles
        )
        accepted = (
            sum(o.emitted_count for o in self._origins.values())
            + sum(h.accepted for h in self._handles)
            + self._forgotten_accepted
        )
        return SchedulerStatistics(
            origin=self.origin,
            epoch=self.epoch,
            ticks=self._ticks,
            batches_sealed=self._batches_sealed,
            events_sealed=self._events_sealed,
            events_accepted=accepted,
            pending_events=pending,
            sources=tuple(h.statistics() for h in self._handles),
            sinks=tuple(s.statistics() for s in self._sinks),
            next_seq={name: o.next_seq for name, o in self._origins.items()},
        )

    # -- the thread entry (ThreadsafeHandle: run_in_thread, EventPublisher) ------------------

    def threadsafe(self, **options: Any) -> ThreadsafeHandle:
        """A handle other threads use to `emit` and `tick`; call it on the loop.

        The scheduler must be running: the handle's entries are worked through
        by a task in its task group, and `aclose` works through what is still
        queued before its last tick. `options` go to `ThreadsafeHandle`.
        """
        if self._state is not _RUNNING:
            raise ClosedError(
                "threadsafe: the scheduler is not running; call it inside `async with scheduler:`"
            )
        assert self._tg is not None  # set while running
        handle = ThreadsafeHandle(self, **options)
        self._thread_handles.append(handle)
        scope = self._task_scope()

        async def run() -> None:
            with scope:
                await handle._run()

        self._tg.start_soon(run, name="kvstream thread hand-off")
        return handle

    def _emit_from_thread(self, events: list[KVCacheEvent]) -> None:
        # Checked in the caller's thread; accepted even while closing (the
        # handle took them before it closed).
        own = self._own
        own.emitted.extend(events)
        own.emitted_count += len(events)

    async def _tick_step(
        self, events: list[KVCacheEvent] | None, ts: float | None, rank: int | None
    ) -> EventBatch | None:
        """A tick for a step handed over from a thread (see `_seal_step()`)."""
        batches = self._seal_step(events, ts, rank)
        if not batches:
            return None
        if not self._dispatch.dispatch_now(batches):
            await self._dispatch.wait_all()
        head = batches[0]
        return head if head.origin == self.origin else None

    def _seal_step(
        self, events: list[KVCacheEvent] | None, ts: float | None, rank: int | None
    ) -> list[EventBatch]:
        """Seal a step handed over from a thread; the caller hands the batches on.

        `events` (a publisher's step) join this origin's pending events and
        this origin seals a batch even when it is empty (one step, one seq, as
        vLLM numbers them), stamped with `ts`/`rank` when given. With
        `events` None it is a plain tick.
        """
        self._ticks += 1
        batches = self._seal() if events is None or self._seal_needed() else []
        own = self._own
        if events is not None:
            first = batches[0] if batches and batches[0].origin == self.origin else None
            if first is None:  # nothing was pending: an empty batch, as vLLM sends
                first = EventBatch._trusted(
                    own.next_seq,
                    ts if ts is not None else self._clock(),
                    events,
                    own.data_parallel_rank if rank is None else rank,
                    own.name,
                    self.epoch,
                )
                own.next_seq += 1
                own.emitted_count += len(events)
                self._events_sealed += len(events)
                self._batches_sealed += 1
                batches.insert(0, first)
            else:
                # _seal took this origin's pending events; the step's come after them.
                # (The batch is not handed out yet: its list may still grow.)
                first.events.extend(events)
                own.emitted_count += len(events)
                self._events_sealed += len(events)
                if ts is not None or rank is not None:
                    batches[0] = EventBatch._trusted(
                        first.seq,
                        first.ts if ts is None else ts,
                        first.events,
                        first.data_parallel_rank if rank is None else rank,
                        first.origin,
                        first.epoch,
                    )
        if self._at_barrier:
            self._run_barrier_callbacks()
        return batches

    def _seal_needed(self) -> bool:
        """Whether anything but a step's own events is pending (other inputs, origins)."""
        return bool(self._own.emitted) or len(self._origins) > 1 or bool(self._own.inputs)

    def __repr__(self) -> str:
        return f"<Scheduler origin={self.origin!r} epoch={self.epoch!r}>"
