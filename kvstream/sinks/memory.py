"""In-process sinks: `MemorySink` (the test double) and `QueueSink`."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvstream._checks import seconds
from kvstream._one_reader import OneReader
from kvstream.events import EventBatch
from kvstream.sinks.base import Sink

__all__ = ["MemorySink", "QueueSink"]


class MemorySink(Sink):
    """Keeps every delivered batch, as objects, in `batches`.

    The public test double: put one in a scheduler and assert on what arrived.
    `delay` (seconds per batch) simulates a slow transport.
    """

    def __init__(self, *, delay: float = 0.0, **options: Any) -> None:
        options.setdefault("codec", None)
        super().__init__(**options)
        self.batches: list[EventBatch] = []
        self.delay = seconds("MemorySink.delay", delay, zero=True)

    async def write(self, data: bytes, batch: EventBatch) -> None:
        if self.delay:
            await anyio.sleep(self.delay)
        self.batches.append(batch)

    def write_nowait(self, data: bytes, batch: EventBatch) -> bool:
        if self.delay:
            return False  # a slow transport: the writer takes it
        self.batches.append(batch)
        return True

    @property
    def events(self) -> list[Any]:
        """Every delivered event, in order."""
        return [e for b in self.batches for e in b.events]


class QueueSink(Sink):
    """Hands batches, as objects, to an in-process consumer.

    Iterate the sink (`async for batch in sink`: the loop ends once the sink is
    closed and everything was handed over, and closes `receive_stream`), or
    read `receive_stream` yourself and close it when done. One task reads it
    (a second one reading at the same time is refused with `ClosedError`: each
    batch goes to one reader); a loop that stopped and starts again goes on
    where it was. The consumer's pace is the sink's pace: batches wait in the
    sink's bounded outbox, under its policy, while the consumer is busy.
    """

    def __init__(self, **options: Any) -> None:
        options.setdefault("codec", None)
        super().__init__(**options)
        send, receive = anyio.create_memory_object_stream[EventBatch](0)
        self._send_stream: MemoryObjectSendStream[EventBatch] = send
        self.receive_stream: MemoryObjectReceiveStream[EventBatch] = receive
        self._reader: AsyncGenerator[EventBatch, None] | None = None

    async def write(self, data: bytes, batch: EventBatch) -> None:
        try:
            await self._send_stream.send(batch)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.discard(batch, "the consumer closed its receive stream")

    def write_nowait(self, data: bytes, batch: EventBatch) -> bool:
        """Hand `batch` over now if the consumer is waiting for one."""
        try:
            self._send_stream.send_nowait(batch)
        except anyio.WouldBlock:
            return False
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.discard(batch, "the consumer closed its receive stream")
        return True

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            # The consumer sees the end of the stream once everything is delivered.
            self._send_stream.close()

    def __aiter__(self) -> AsyncIterator[EventBatch]:
        # One generator for every loop: a loop that stopped and starts again goes on
        # where it was; two tasks reading at once are refused (each would get part).
        if self._reader is None:
            self._reader = self._iterate()
        return OneReader(self._reader, self.name, "QueueSink")

    async def _iterate(self) -> AsyncGenerator[EventBatch, None]:
        receive = self.receive_stream
        try:
            async for batch in receive:
                yield batch
        finally:
            receive.close()
