"""The pieces the pipeline benchmarks assemble: a counting null sink, sources, a driver.

* `NullSink` encodes (the base class does, with its codec) and discards,
  counting events, and sets `NullSink.done` once it has seen a target.
  Its transport always has room: batches are "written" inline from the tick.
* `free_source()` yields pre-built chunks and awaits once between chunks,
  as a connector doing real work would.
* `Gate` paces sources to one chunk per tick (`paced_source()`), for
  the measurements that need a fixed number of events per tick.
* `drive()` is the host's step loop: `tick()` then one checkpoint, until
  every source has ended; then a last tick and a wait for the sinks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import anyio.lowlevel

from kvstream.events import EventBatch, KVCacheEvent
from kvstream.scheduler import Scheduler
from kvstream.sinks.base import Sink

__all__ = [
    "Countdown",
    "Gate",
    "NullSink",
    "drive",
    "free_source",
    "paced_source",
    "wait_delivered",
]


class NullSink(Sink):
    """Encodes every batch (in the base class) and discards it; counts what arrived."""

    def __init__(self, target: int = 0, **options: Any) -> None:
        options.setdefault("name", "null")
        super().__init__(**options)
        self.target = target
        self.received = 0
        self.nbytes = 0
        self.done = anyio.Event()
        if target <= 0:
            self.done.set()

    async def write(self, data: bytes, batch: EventBatch) -> None:
        self.write_nowait(data, batch)

    def write_nowait(self, data: bytes, batch: EventBatch) -> bool:
        self.nbytes += len(data)
        self.received += len(batch.events)
        if self.received >= self.target:
            self.done.set()
        return True


class Countdown:
    """How many sources are still yielding; `drive()` ticks until it reaches 0."""

    __slots__ = ("remaining",)

    def __init__(self, n: int) -> None:
        self.remaining = n


async def free_source(
    chunks: Sequence[list[KVCacheEvent]], countdown: Countdown
) -> AsyncIterator[list[KVCacheEvent]]:
    """Yield every chunk, awaiting once after each (a connector's I/O)."""
    checkpoint = anyio.lowlevel.checkpoint
    try:
        for chunk in chunks:
            yield chunk
            await checkpoint()
    finally:
        countdown.remaining -= 1


class Gate:
    """Releases paced sources once per tick."""

    __slots__ = ("_event", "generation")

    def __init__(self) -> None:
        self._event = anyio.Event()
        self.generation = 0

    def release(self) -> None:
        self.generation += 1
        event, self._event = self._event, anyio.Event()
        event.set()

    async def wait_past(self, generation: int) -> None:
        """Wait until the gate was released after `generation` was read."""
        while self.generation == generation:
            await self._event.wait()


async def paced_source(
    chunks: Sequence[list[KVCacheEvent]], gate: Gate, countdown: Countdown
) -> AsyncIterator[list[KVCacheEvent]]:
    """Yield one chunk per release of `gate`."""
    try:
        for chunk in chunks:
            generation = gate.generation
            yield chunk
            await gate.wait_past(generation)
    finally:
        countdown.remaining -= 1


async def wait_delivered(sinks: Sequence[Sink], events: int) -> None:
    """Wait until every sink has delivered `events` events (or closed)."""
    for sink in sinks:
        if isinstance(sink, NullSink):
            await sink.done.wait()
            continue
        # Sinks have no delivery event to wait on: poll their counters (0.5 ms).
        while sink.statistics().events_out < events and not sink.closed:  # noqa: ASYNC110
            await anyio.sleep(0.0005)


async def drive(scheduler: Scheduler, countdown: Countdown) -> int:
    """The host's loop: tick, checkpoint, until every source has ended; a last tick.

    Returns the number of ticks.
    """
    tick = scheduler.tick
    checkpoint = anyio.lowlevel.checkpoint
    ticks = 0
    while countdown.remaining:
        await tick()
        await checkpoint()
        ticks += 1
    await tick()
    return ticks + 1
