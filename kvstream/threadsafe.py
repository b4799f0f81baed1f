"""Reaching a scheduler from a synchronous engine running in another thread.

vLLM's scheduler runs in a thread of its own. :class:`ThreadsafeHandle` lets such
an engine ``emit`` and ``tick`` into a pipeline whose event loop runs elsewhere:
``emit`` validates in the caller's thread and hands the events to the loop
without waiting; ``tick`` schedules a tick and returns a future. The caller waits
only when more than ``max_pending_ticks`` ticks are still in flight, which
happens only when a sink with policy ``block`` is full: that is the backpressure
the policy asks for, and nothing else ever blocks the engine.

:func:`run_in_thread` starts an event loop in a thread of its own (anyio's
blocking portal) for engines that have none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from anyio.from_thread import start_blocking_portal

from kvstream.errors import ClosedError
from kvstream.events import EventBatch, KVCacheEvent
from kvstream.sources.base import check_events

if TYPE_CHECKING:
    from kvstream.scheduler import Scheduler

__all__ = ["ThreadsafeHandle", "run_in_thread"]


class ThreadsafeHandle:
    """``emit`` and ``tick`` from any thread into a scheduler on its loop.

    Create it on the loop's thread with :meth:`Scheduler.threadsafe`.
    """

    def __init__(self, scheduler: Scheduler, *, max_pending_ticks: int = 64) -> None:
        self._scheduler = scheduler
        self._loop = asyncio.get_running_loop()
        self._max_pending = max_pending_ticks
        self._pending: deque[concurrent.futures.Future[EventBatch | None]] = deque()
        self._closed = False

    def emit(self, events: KVCacheEvent | Sequence[KVCacheEvent]) -> None:
        """Hand events to the scheduler; returns at once.

        Events emitted before :meth:`tick` are in that tick's batch.
        """
        if self._closed:
            raise ClosedError("emit: the handle is closed")
        checked = check_events(events, "emit")
        self._loop.call_soon_threadsafe(self._scheduler.emit, checked)

    def tick(self) -> concurrent.futures.Future[EventBatch | None]:
        """Schedule a tick; returns a future of this engine's batch.

        Waits only while more than ``max_pending_ticks`` earlier ticks are still
        in flight (a full sink with policy ``block``).
        """
        if self._closed:
            raise ClosedError("tick: the handle is closed")
        pending = self._pending
        while pending and pending[0].done():
            pending.popleft().result()  # surfaces a tick that raised
        while len(pending) >= self._max_pending:
            pending.popleft().result()
        future = asyncio.run_coroutine_threadsafe(self._scheduler.tick(), self._loop)
        pending.append(future)
        return future

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every tick scheduled so far has handed its batches to the sinks."""
        while self._pending:
            self._pending.popleft().result(timeout)

    def close(self) -> None:
        self._closed = True


@contextlib.contextmanager
def run_in_thread(scheduler: Scheduler) -> Iterator[ThreadsafeHandle]:
    """Run ``scheduler`` on an event loop in a new thread, for synchronous engines::

        with run_in_thread(Scheduler(sinks=[FileSink("kv.jsonl")])) as kv:
            kv.emit(events)      # from the engine's thread
            kv.tick()

    On exit, pending ticks finish, the scheduler closes (delivering what is
    pending) and the thread ends.
    """
    with (
        start_blocking_portal(backend="asyncio") as portal,
        portal.wrap_async_context_manager(scheduler),
    ):
        handle: ThreadsafeHandle = portal.call(_make_handle, scheduler)
        try:
            yield handle
            handle.flush()
        finally:
            handle.close()


async def _make_handle(scheduler: Scheduler) -> ThreadsafeHandle:
    return scheduler.threadsafe()
