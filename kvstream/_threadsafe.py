"""Reaching a scheduler from a synchronous engine running in another thread.

vLLM's scheduler runs in a thread of its own. `ThreadsafeHandle` is the
one bridge from such a thread to a scheduler whose event loop runs elsewhere;
`run_in_thread()` and `EventPublisher` both use
it, over `LoopThread` (a scheduler on an event loop in a daemon thread).

The hand-off costs the engine's thread about what appending to a deque costs:
every call (`emit`, `tick`, a publisher's step) appends one entry to a
deque under a lock, and wakes the loop only when the loop side is parked (one
`call_soon_threadsafe` per idle-to-busy transition, not one per step). One
task on the loop works through the deque in order: an `emit` entry joins the
scheduler's pending events, a `tick` entry seals, so each thread-side tick
seals exactly the events its thread emitted before it, one batch per step
however fast the engine goes.

The engine's thread waits only when `max_pending` steps are still queued,
which happens when a sink with policy `block` is full, or when the engine
outruns the loop for that long (vLLM's publisher waits on its full queue the
same way): that is backpressure, and nothing else ever blocks the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.lowlevel

from kvstream._event_loop import EventLoopName, backend_options, resolve_event_loop
from kvstream.errors import ClosedError, ConfigError
from kvstream.events import EventBatch, KVCacheEvent
from kvstream.sources._base import check_events

if TYPE_CHECKING:
    from kvstream.scheduler import CloseReport, Scheduler

__all__ = ["LoopThread", "ThreadsafeHandle", "run_in_thread"]

log = logging.getLogger("kvstream.threadsafe")

#: Entry kinds in the hand-off deque (the first element of each entry).
_EMIT: Final = 0  # (_EMIT, events)
_TICK: Final = 1  # (_TICK, future)
_STEP: Final = 2  # (_STEP, raw events, ts, data_parallel_rank)
_FLUSH: Final = 3  # (_FLUSH, threading.Event)

#: Steps worked through before the loop lets its other tasks run.
_TURN: Final = 64

#: Converts a step's raw events (on the loop) into checked kvstream events.
StepConverter = Callable[[list[Any]], list[KVCacheEvent]]


def _no_conversion(events: list[Any]) -> list[KVCacheEvent]:
    return events


class ThreadsafeHandle:
    """`emit` and `tick` from any thread into a scheduler on its loop.

    Create it on the loop's thread with `Scheduler.threadsafe()` (the
    scheduler must be running). Entries from several threads are taken in the
    order they were handed over; each thread's own order is kept.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        max_pending: int = 65_536,
        convert: StepConverter = _no_conversion,
        idle_poll: float = 0.0,
    ) -> None:
        if type(max_pending) is not int or max_pending < 1:
            raise ConfigError(
                f"ThreadsafeHandle.max_pending: expected an int >= 1, got {max_pending!r}"
            )
        if type(idle_poll) not in (int, float) or not 0 <= idle_poll <= 1:
            raise ConfigError(
                f"ThreadsafeHandle.idle_poll: expected seconds in [0, 1], got {idle_poll!r}"
            )
        self._scheduler = scheduler
        self._loop = asyncio.get_running_loop()
        self._max_pending = max_pending
        self._convert = convert
        self._entries: deque[tuple[Any, ...]] = deque()
        self._lock = threading.Lock()
        #: True while the loop side waits for work: the next hand-off wakes it.
        self._idle = False
        #: `idle_poll`: how long the loop side, once out of work, still looks for more
        #: by itself (see `step()`); `_lingering` is True during that time.
        self._linger = float(idle_poll)
        self._lingering = False
        #: Whether the loop side polls (`idle_poll`) the next time it runs out of work:
        #: not after a poll found nothing, until a step comes within `idle_poll` of the
        #: loop running out of work (a slower engine would pay an empty poll per step).
        self._poll_next = True
        #: When the loop side last ran out of work (the loop's clock).
        self._idle_since = 0.0
        #: What the loop side waits on while idle; a wake resolves it.
        self._waiter: asyncio.Future[None] | None = None
        #: The `idle_poll` timer while the loop side lingers.
        self._timer: asyncio.TimerHandle | None = None
        #: A step worked through in the timer's callback left batches in the
        #: scheduler's backlog (a full `block` sink): the task must see them on.
        self._dispatch_pending = False
        self._closed = False
        self._done = asyncio.Event()
        # Steps handed over and steps taken: each counter written by one side only.
        self._pushed = 0
        self._taken = 0
        self._room_wanted = False
        self._room = threading.Event()
        self._wake_set = self._wake
        #: Events handed over but never sealed (the scheduler stopped before it got to them).
        self.events_abandoned = 0
        #: Times a hand-off had to wake the loop side (see `idle_poll` in `step()`).
        self.wakeups = 0
        #: Bursts of steps the loop side worked through in its `idle_poll` timer,
        #: without a task switch.
        self.bursts_inline = 0
        #: `idle_poll` timers that found nothing to do (each one a wake-up for nothing).
        self.polls_empty = 0

    # -- the engine's side (any thread) ---------------------------------------------------

    def emit(self, events: KVCacheEvent | Sequence[KVCacheEvent]) -> None:
        """Hand events to the scheduler; returns at once.

        Events emitted before `tick()` (in the same thread) are in that
        tick's batch. The handle copies the list: the caller may reuse it.
        Raises [`ClosedError`][kvstream.errors.ClosedError] once the handle is closed.
        """
        checked = check_events(events, "emit")
        self._hand_over(
            (_EMIT, list(checked) if checked is events else checked), False, urgent=False
        )

    def tick(self) -> concurrent.futures.Future[EventBatch | None]:
        """Seal what this thread emitted so far; returns a future of this engine's batch.

        The batch is None when nothing was pending (no sequence number is used).
        """
        future: concurrent.futures.Future[EventBatch | None] = concurrent.futures.Future()
        self._hand_over((_TICK, future), True)
        return future

    def step(
        self, events: list[Any], ts: float | None = None, data_parallel_rank: int | None = None
    ) -> None:
        """One engine step: `events` become exactly one batch, even when empty.

        `ts` and `data_parallel_rank` stamp it (None: the scheduler's clock
        and rank). The list is kept as given (copy it if you reuse it); the
        handle's converter checks it on the loop. This is what
        [`EventPublisher.publish()`][kvstream.publisher.EventPublisher.publish] calls.

        With `idle_poll` > 0, a step handed over while the loop side has been out of
        work for less than `idle_poll` seconds does not wake it: the loop looks again
        by itself when that time is up. An engine stepping faster than that hands its
        steps over without a wake-up each (whose self-pipe write lets the loop take the
        GIL from the engine mid-step), at the price of up to `idle_poll` of latency.
        A poll that finds nothing parks the loop side, and it does not poll again until a
        step comes within `idle_poll` of its running out of work: an engine stepping
        slower than that wakes it once per step, with no empty poll between its steps.
        `tick()` and `flush()` always wake it: someone waits for them.
        """
        self._hand_over((_STEP, events, ts, data_parallel_rank), True, urgent=False)

    def _hand_over(self, entry: tuple[Any, ...], is_step: bool, *, urgent: bool = True) -> None:
        if is_step and self._pushed - self._taken >= self._max_pending:
            self._wait_for_room()
        with self._lock:
            if self._closed:
                raise ClosedError(
                    "the thread-safe handle is closed (its scheduler or publisher shut down); "
                    "nothing handed over after that can be delivered"
                )
            self._entries.append(entry)
            if is_step:
                self._pushed += 1
            # A step nobody waits for is left to the loop side's own look while it
            # lingers: no wake-up, whose write would hand it the GIL mid-step.
            wake = self._idle and (urgent or not self._lingering)
            if wake:
                self._idle = False
        if wake:
            self.wakeups += 1
            try:
                self._loop.call_soon_threadsafe(self._wake_set)
            except RuntimeError:  # the loop has stopped: nothing can run the entry
                self._closed = True
                raise ClosedError("the scheduler's event loop has stopped") from None

    def _linger_over(self) -> None:
        """On the loop, `idle_poll` after it ran out of work: take what came, or park.

        What came is worked through here, in the timer's callback, when it needs
        no waiting (steps every sink takes at once): a burst costs no task switch,
        whose extra loop turn hands the GIL back and forth once more. Anything
        that needs waiting (a full `block` sink, a tick, a flush) wakes the task.
        """
        with self._lock:
            self._lingering = False
            if not self._idle:
                return  # woken meanwhile: the task has it
            if not self._entries:  # parked: the next hand-off wakes it
                self.polls_empty += 1
                self._poll_next = False
                return
            self._idle = False
        if not self._work_through():
            self._wake()
            return
        self.bursts_inline += 1
        with self._lock:
            if self._entries or self._closed:
                wake = True
            else:
                wake = False
                self._idle = True
                self._lingering = True
        if wake:
            self._wake()
        else:
            self._idle_since = self._loop.time()
            self._timer = self._loop.call_later(self._linger, self._linger_over)

    def _work_through(self) -> bool:
        """Seal and hand on the queued steps that need no waiting; True when none is left.

        Stops at the first entry that needs the task (a tick, a flush, a step a
        full `block` sink did not take at once: its batches wait in the
        scheduler's backlog, and `_dispatch_pending` tells the task to see them on).
        """
        entries = self._entries
        for _ in range(_TURN):
            if not entries:
                return True
            kind = entries[0][0]
            if kind == _EMIT:
                self._scheduler._emit_from_thread(entries.popleft()[1])
                continue
            if kind != _STEP:
                return False
            if not self._offer_step(entries.popleft()):
                self._dispatch_pending = True
                return False
        return not entries

    def _offer_step(self, entry: tuple[Any, ...]) -> bool:
        """Seal a step's batch and offer it to every sink, without waiting.

        False when a full `block` sink left it in the scheduler's backlog: the
        caller then sees it on with `_see_dispatched()`. A failing step is logged.
        """
        self._took_one()
        scheduler = self._scheduler
        try:
            batches = scheduler._seal_step(self._convert(entry[1]), entry[2], entry[3])
            return not batches or scheduler._dispatch.dispatch_now(batches)
        except Exception:
            log.exception("a step handed over from a thread failed")
            return True

    async def _see_dispatched(self) -> None:
        """Wait until every batch in the scheduler's backlog reached every sink."""
        try:
            await self._scheduler._dispatch.wait_all()
        except Exception:
            log.exception("a step handed over from a thread failed")

    def _took_one(self) -> None:
        """A step or tick left the deque: an engine waiting for room may go on."""
        self._taken += 1
        if self._room_wanted:
            self._room.set()

    def _wake(self) -> None:
        """On the loop: resume the loop side if it waits (a late wake finds nothing to do)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wait_for_room(self) -> None:
        """Backpressure: wait while `max_pending` steps are queued (a full `block` sink)."""
        while self._pushed - self._taken >= self._max_pending and not self._closed:
            self._room.clear()
            self._room_wanted = True
            if self._pushed - self._taken < self._max_pending:
                break
            self._room.wait(0.05)
        self._room_wanted = False

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything handed over so far has been worked through.

        Every tick and step before this call has then offered its batch to
        every sink. Raises `TimeoutError` after `timeout` seconds.
        """
        if threading.get_ident() == self._loop_thread_id():
            raise ClosedError("flush: called on the loop's own thread, it would never return")
        done = threading.Event()
        try:
            self._hand_over((_FLUSH, done), False)
        except ClosedError:
            if not self._done.is_set():
                raise
            return  # closed and worked through: nothing is pending
        if not done.wait(timeout):
            raise TimeoutError(f"flush: entries still pending after {timeout} s")

    def _loop_thread_id(self) -> int | None:
        return getattr(self._loop, "_thread_id", None)

    def close(self) -> None:
        """Take nothing more; what was handed over before is still worked through."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            wake = self._idle
            self._idle = False
        if wake:
            with contextlib.suppress(RuntimeError):  # the loop has stopped
                self._loop.call_soon_threadsafe(self._wake_set)
        self._room.set()

    @property
    def closed(self) -> bool:
        return self._closed

    def pending(self) -> int:
        """Entries handed over and not yet worked through."""
        return len(self._entries)

    # -- the loop's side --------------------------------------------------------------------

    async def _run(self) -> None:
        """Work through the hand-off deque in order until closed (one task, on the loop)."""
        entries = self._entries
        scheduler = self._scheduler
        loop = self._loop
        try:
            while True:
                turn = 0
                while entries:
                    entry = entries.popleft()
                    kind = entry[0]
                    if kind == _STEP:
                        if not self._offer_step(entry):
                            await self._see_dispatched()
                    elif kind == _EMIT:
                        scheduler._emit_from_thread(entry[1])
                    elif kind == _TICK:
                        self._took_one()
                        future: concurrent.futures.Future[EventBatch | None] = entry[1]
                        try:
                            batch = await scheduler._tick_step(None, None, None)
                        except BaseException as exc:
                            future.set_exception(exc)
                            if not isinstance(exc, Exception):
                                raise
                        else:
                            future.set_result(batch)
                    else:
                        entry[1].set()
                    turn += 1
                    if turn >= _TURN and entries:
                        turn = 0
                        await anyio.lowlevel.checkpoint()  # let the sinks' tasks run
                waiter = self._waiter = loop.create_future()
                with self._lock:
                    if entries:
                        continue
                    if self._closed:
                        break
                    self._idle = True
                    self._lingering = poll = self._linger > 0 and self._poll_next
                if poll:
                    self._timer = loop.call_later(self._linger, self._linger_over)
                self._idle_since = loop.time()
                try:
                    await waiter
                finally:
                    if self._timer is not None:
                        self._timer.cancel()
                        self._timer = None
                if not self._poll_next and loop.time() - self._idle_since < self._linger:
                    # the step came within idle_poll: a poll would have found it
                    self._poll_next = True
                if self._dispatch_pending:
                    self._dispatch_pending = False
                    await self._see_dispatched()
        finally:
            self._closed = True
            self._done.set()
            self._room.set()
            # Cancelled with entries left (the scheduler's close timed out first):
            # fail the waiting callers, and count and report what is lost.
            lost_events = 0
            while entries:
                entry = entries.popleft()
                if entry[0] == _TICK:
                    entry[1].set_exception(ClosedError("tick: the scheduler stopped first"))
                elif entry[0] == _FLUSH:
                    entry[1].set()
                else:
                    lost_events += len(entry[1])
                    self.events_abandoned += len(entry[1])
            if lost_events:
                log.error(
                    "%d event(s) handed over from a thread were never sealed: the "
                    "scheduler's close timed out before its loop worked through them",
                    lost_events,
                )

    async def _close_and_drain(self) -> None:
        """For the scheduler's `aclose`: take nothing more, work through what is queued."""
        self.close()
        await self._done.wait()


class LoopThread:
    """A scheduler running on an asyncio event loop in a daemon thread of its own.

    The thread is a daemon, so a process whose owner never calls `close()`
    still exits; [`EventPublisher`][kvstream.publisher.EventPublisher] closes its loop
    thread at interpreter exit (see its docs). `handle` is the
    `ThreadsafeHandle` engines use; `close()` flushes it, closes the
    scheduler (delivering what is pending within its `close_timeout`) and
    joins the thread.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        name: str = "kvstream loop",
        max_pending: int = 65_536,
        convert: StepConverter = _no_conversion,
        idle_poll: float = 0.0,
        loop: EventLoopName = "asyncio",
    ) -> None:
        self.scheduler = scheduler
        #: The loop the thread runs on, resolved (`"auto"` becomes the one chosen).
        self.loop_name = resolve_event_loop(loop, field=f"{type(self).__name__}.loop")
        self._max_pending = max_pending
        self._convert = convert
        self._idle_poll = idle_poll
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._handle: ThreadsafeHandle | None = None
        self.report: CloseReport | None = None
        self._close_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        error = self._failure()
        if error is not None:
            self._thread.join()
            raise error

    def _failure(self) -> BaseException | None:
        """What stopped the thread before the scheduler was running (set by the thread)."""
        return self._error

    @property
    def handle(self) -> ThreadsafeHandle:
        assert self._handle is not None
        return self._handle

    def _main(self) -> None:
        try:
            anyio.run(
                self._serve, backend="asyncio", backend_options=backend_options(self.loop_name)
            )
        except BaseException as exc:
            if not self._ready.is_set():
                self._error = exc
            elif self.report is not None and _refused_at_exit(exc):
                # The scheduler closed; what failed is asyncio's runner ending the loop
                # after it (see _refused_at_exit): nothing was lost.
                log.debug("the scheduler's loop thread ended at interpreter exit: %s", exc)
            else:
                log.exception("the scheduler's loop thread failed")
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with self.scheduler:
            self._handle = self.scheduler.threadsafe(
                max_pending=self._max_pending, convert=self._convert, idle_poll=self._idle_poll
            )
            self._ready.set()
            await self._stop.wait()
            self.report = await self.scheduler.aclose()

    def close(self, timeout: float | None = None) -> None:
        """Work through what was handed over, close the scheduler, end the thread. Idempotent.

        Waits at most the scheduler's `close_timeout` plus `timeout` (default 5 s)
        for the thread; the thread is a daemon, so it never keeps the process alive.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        loop, stop = self._loop, self._stop
        if self._handle is not None:
            self._handle.close()
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already stopped
                loop.call_soon_threadsafe(stop.set)
        extra = 5.0 if timeout is None else timeout
        self._thread.join(self.scheduler.close_timeout + extra)
        if self._thread.is_alive():
            log.error("the scheduler's loop thread did not stop within its close timeout")


def _refused_at_exit(exc: BaseException) -> bool:
    """Whether `exc` is Python 3.12.0/3.12.1 refusing a new thread at interpreter exit.

    Those versions refuse to start threads once the interpreter exits, atexit
    callbacks included (3.12.2 lifted it: CPython gh-113964). A publisher that
    was never shut down is closed from such a callback. After its scheduler has
    closed, asyncio's runner shuts down the loop's default executor, which
    needs a new thread for the join, and is refused. There is nothing left to
    join then: `concurrent.futures` joins every executor's workers at exit,
    before the atexit callbacks run.
    """
    return (
        isinstance(exc, RuntimeError)
        and str(exc) == "can't create new thread at interpreter shutdown"
    )


@contextlib.contextmanager
def run_in_thread(
    scheduler: Scheduler, *, loop: EventLoopName = "asyncio"
) -> Iterator[ThreadsafeHandle]:
    """Run `scheduler` on an event loop in a new (daemon) thread, for synchronous engines:

        with run_in_thread(Scheduler(sinks=[FileSink("kv.jsonl")])) as kv:
            kv.emit(events)      # from the engine's thread
            kv.tick()

    On exit, what was handed over is worked through, the scheduler closes
    (delivering what is pending) and the thread ends. `loop`: the thread's
    event loop, `"asyncio"` (the default), `"uvloop"` or `"auto"` (uvloop when
    installed).
    """
    runner = LoopThread(scheduler, name=f"kvstream loop {scheduler.origin}", loop=loop)
    try:
        yield runner.handle
    finally:
        runner.close()
