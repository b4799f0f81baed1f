"""Dispatch: sealed batches to every sink, in `seq` order, without loss.

The scheduler seals batches; a `Dispatcher` hands each one to every sink, in
the order the sinks were added. It never waits when every sink has room
(`dispatch_now`); when a `block` sink is full, what is left goes into the
backlog, each batch with the index of the next sink that still needs it, and
callers wait for their ticket (`wait_dispatched`). One caller at a time works
through the backlog; if it is cancelled, its place is kept and the next caller
takes over, so no sink gets a batch twice or out of order.

While closing (`flush()`), a waiting offer stops waiting and every later offer
is forced past the outbox's bounds: each sink's drain then delivers or reports
it, so a sealed batch reaches every sink or its close report.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import anyio

from kvstream.events import EventBatch
from kvstream.sinks._encoding import EncodingGroup
from kvstream.sinks.base import Sink

__all__ = ["Dispatcher"]


class Dispatcher:
    """Hands sealed batches to a scheduler's sinks (see the module doc)."""

    __slots__ = (
        "_backlog",
        "_dispatched",
        "_dispatching",
        "_encodings",
        "_progress",
        "_put_scope",
        "_sinks",
        "_tickets",
        "flushing",
    )

    def __init__(self, sinks: list[Sink], encodings: EncodingGroup) -> None:
        #: The scheduler's own list: sinks added later are dispatched to as well.
        self._sinks = sinks
        self._encodings = encodings
        self._backlog: deque[list[Any]] = deque()  # [batch, next sink index, ticket]
        self._dispatching = False
        #: Set when closing: full `block` outboxes take the last batches past
        #: their bounds (their drain delivers or reports them) instead of waiting.
        self.flushing = False
        self._put_scope: anyio.CancelScope | None = None
        self._tickets = 0
        self._dispatched = 0
        self._progress = anyio.Event()

    @property
    def stalled(self) -> bool:
        """Batches of a cancelled dispatch wait, and nobody works on them."""
        return bool(self._backlog) and not self._dispatching

    def flush(self) -> None:
        """Closing: stop waiting for room; every offer from now on is forced."""
        self.flushing = True
        if self._put_scope is not None:
            self._put_scope.cancel()

    def dispatch_now(self, batches: list[EventBatch]) -> bool:
        """Hand `batches` to every sink without waiting, if nothing is queued ahead.

        Returns False when some `block` sink is full (or batches of an earlier
        dispatch still wait): what was not handed over is then in the backlog,
        and the caller awaits `wait_all()`.
        """
        if self._backlog or self._dispatching:
            self._enqueue(batches, 0)
            return False
        sinks = self._sinks
        force = self.flushing
        for n, batch in enumerate(batches):
            for i, sink in enumerate(sinks):
                if not sink._accepting:  # closed by its owner (`accepting`, read as the field)
                    sink.count_missed(batch, "the sink was closed before the batch")
                    continue
                if not sink.offer(batch, force=force):
                    self._enqueue(batches[n:], i)
                    return False
        # Every sink has the bytes it needs: let them go (memory is reused).
        self._encodings.forget()
        return True

    def _enqueue(self, batches: list[EventBatch], first_sink: int) -> None:
        for k, batch in enumerate(batches):
            self._tickets += 1
            self._backlog.append([batch, first_sink if k == 0 else 0, self._tickets])

    async def wait_all(self) -> None:
        """Return once every batch dispatched so far reached every sink, in order."""
        await self._wait_dispatched(self._tickets)

    async def _wait_dispatched(self, ticket: int) -> None:
        while self._dispatched < ticket:
            if self._dispatching:
                progress = self._progress
                await progress.wait()
                continue
            self._dispatching = True
            try:
                backlog = self._backlog
                sinks = self._sinks
                while backlog and self._dispatched < ticket:
                    entry = backlog[0]
                    batch: EventBatch = entry[0]
                    i = entry[1]
                    while i < len(sinks):
                        sink = sinks[i]
                        if not sink.accepting:
                            sink.count_missed(batch, "the sink was closed before the batch")
                            i += 1
                            entry[1] = i
                            continue
                        if not sink.offer(batch, force=self.flushing):
                            entry[1] = i
                            with anyio.CancelScope() as scope:
                                self._put_scope = scope
                                await sink.put(batch)
                            self._put_scope = None
                            if scope.cancelled_caught:  # closing: offer again, forced
                                continue
                        i += 1
                        entry[1] = i
                    backlog.popleft()
                    self._dispatched = entry[2]
            finally:
                self._dispatching = False
                progress, self._progress = self._progress, anyio.Event()
                progress.set()
        if not self._backlog:
            self._dispatched = self._tickets
            if not self._dispatching:
                self._encodings.forget()
