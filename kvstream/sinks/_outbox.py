"""A sink's outbox: encoded batches waiting for the writer, bounded in batches and in bytes.

Each entry is `(batch, its encoded bytes, what they cost)`. `queued_bytes`
counts the queue and the hop in flight: the bound covers both, since a hop's
bytes stay allocated until it is delivered. A first batch always fits, however
large (a batch is never refused for its size alone). The writer takes a hop
(`take`), delivers it, then says so (`landed`); until then its batches are
`pending`, which is what a drain that times out reports. Callers waiting for
room (`wait_for_room`) are woken whenever a hop leaves the queue.

What happens when a batch does not fit is the sink's policy, decided in
`Sink.offer()`; the outbox only keeps the books.
"""

from __future__ import annotations

from collections import deque
from typing import Final

import anyio

from kvstream.events import EventBatch

__all__ = ["HOP_BYTES", "Outbox"]

#: A writer hop (`write_many`) carries at most this many bytes (or one batch).
#: Large, because a hop to a worker thread costs a GIL hand-off each way, which a
#: busy loop makes slow (up to the interpreter's switch interval, 5 ms); bounded,
#: so that what a hop holds is freed, and its memory reused, before the next.
HOP_BYTES: Final = 16 * 1024 * 1024


class Outbox:
    """Encoded batches waiting for a sink's writer (see the module doc)."""

    __slots__ = (
        "_room_waiters",
        "entries",
        "inflight",
        "inflight_cost",
        "max_batches",
        "max_bytes",
        "queued_bytes",
    )

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        #: `(batch, data, cost)`, oldest first (read directly on the tick's hot path).
        self.entries: deque[tuple[EventBatch, bytes, int]] = deque()
        self.queued_bytes = 0
        #: The hop the writer is delivering, and what it costs.
        self.inflight: list[EventBatch] = []
        self.inflight_cost = 0
        self._room_waiters: list[anyio.Event] = []

    def full_for(self, cost: int) -> bool:
        """Whether a batch costing `cost` would pass a bound (with anything ahead of it)."""
        return bool(self.entries or self.inflight) and self.over(cost)

    def over(self, cost: int) -> bool:
        """Whether the queue is at its batch bound, or `cost` more bytes pass the byte bound."""
        return len(self.entries) >= self.max_batches or self.queued_bytes + cost > self.max_bytes

    def push(self, batch: EventBatch, data: bytes, cost: int) -> None:
        self.entries.append((batch, data, cost))
        self.queued_bytes += cost

    def pop_oldest(self) -> EventBatch:
        """Take the oldest queued batch out (for the `drop_oldest` policy)."""
        batch, _, cost = self.entries.popleft()
        self.queued_bytes -= cost
        return batch

    def take(self, limit: int) -> list[tuple[bytes, EventBatch]]:
        """The next hop: up to `limit` batches and `HOP_BYTES` (or one batch); now in flight."""
        items: list[tuple[bytes, EventBatch]] = []
        entries = self.entries
        hop = 0
        while entries and len(items) < limit and (hop < HOP_BYTES or not items):
            batch, data, cost = entries.popleft()
            hop += cost
            items.append((data, batch))
        self.inflight = [b for _, b in items]
        self.inflight_cost = hop
        self.wake()
        return items

    def landed(self) -> None:
        """The hop in flight was delivered: its bytes no longer count."""
        self.inflight = []
        self.queued_bytes -= self.inflight_cost
        self.inflight_cost = 0
        self.wake()

    def pending(self) -> list[EventBatch]:
        """Every batch not delivered yet: the hop in flight, then the queue."""
        return self.inflight + [b for b, _, _ in self.entries]

    @property
    def waiting(self) -> int:
        """How many callers wait for room."""
        return len(self._room_waiters)

    async def wait_for_room(self) -> None:
        """Wait until a hop leaves the queue (or `wake()`: the sink closed)."""
        event = anyio.Event()
        self._room_waiters.append(event)
        await event.wait()

    def wake(self) -> None:
        """Wake everyone waiting for room (each offers again)."""
        if self._room_waiters:
            waiters, self._room_waiters = self._room_waiters, []
            for w in waiters:
                w.set()
