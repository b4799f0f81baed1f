"""Each item goes to one reader: a second task reading the same subscriber or `QueueSink`
while the first waits is refused, instead of each silently getting part of the stream.
A reader that stops and starts again goes on where it was."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from servers import RedisServer, redis_server, redis_servers, stored, wait_until

from kvstream import EventBatch, Scheduler
from kvstream._one_reader import running
from kvstream.consumers import FileSubscriber
from kvstream.consumers.redis import RedisSubscriber
from kvstream.consumers.socket import SocketSubscriber
from kvstream.errors import ClosedError
from kvstream.sinks.base import Sink
from kvstream.sinks.file import FileSink
from kvstream.sinks.memory import QueueSink
from kvstream.sinks.redis import RedisSink
from kvstream.sinks.socket import SocketSink

__all__ = ["redis_server", "redis_servers"]  # fixtures, imported for pytest

#: A pipeline: a scheduler into a sink, and what reads the sink's batches back.
Pipeline = Callable[[Path, Any], AbstractAsyncContextManager[tuple[Scheduler, Any]]]


@asynccontextmanager
async def _queue(tmp_path: Path, server: Any) -> AsyncIterator[tuple[Scheduler, Any]]:
    sink = QueueSink()
    async with Scheduler(sinks=[sink], origin="o") as scheduler:
        yield scheduler, sink


@asynccontextmanager
async def _file(tmp_path: Path, server: Any) -> AsyncIterator[tuple[Scheduler, Any]]:
    path = tmp_path / "kv.jsonl"
    async with (
        Scheduler(sinks=[FileSink(path)], origin="o") as scheduler,
        FileSubscriber(path, follow=True, poll_interval=0.01) as reader,
    ):
        yield scheduler, reader


@asynccontextmanager
async def _socket(tmp_path: Path, server: Any) -> AsyncIterator[tuple[Scheduler, Any]]:
    sink = SocketSink(port=0)
    async with Scheduler(sinks=[sink], origin="o") as scheduler:
        port = int(sink.address.rsplit(":", 1)[1])
        async with SocketSubscriber(port=port, from_seq=0) as reader:
            yield scheduler, reader


@asynccontextmanager
async def _redis(tmp_path: Path, server: RedisServer) -> AsyncIterator[tuple[Scheduler, Any]]:
    sink: Sink = RedisSink(server.url, stream="kv")
    async with (
        Scheduler(sinks=[sink], origin="o") as scheduler,
        RedisSubscriber(server.url, stream="kv", start="0", block=0.05) as reader,
    ):
        yield scheduler, reader


PIPELINES = [
    pytest.param(_queue, id="QueueSink"),
    pytest.param(_file, id="FileSubscriber"),
    pytest.param(_socket, id="SocketSubscriber"),
    pytest.param(_redis, id="RedisSubscriber", marks=pytest.mark.server),
]


async def _publish(scheduler: Scheduler, seq: int) -> None:
    scheduler.emit(stored(seq))
    await scheduler.tick()


async def _next_batch(reader: Any) -> EventBatch:
    with anyio.fail_after(10):
        async for item in reader:
            if isinstance(item, EventBatch):
                return item
    raise AssertionError("the stream ended")


def _waiting(reader: Any) -> bool:
    """Whether a task is inside `reader`'s next item (its generator, or the socket
    subscriber's own flag)."""
    if isinstance(reader, SocketSubscriber):
        return reader._reading
    gen = getattr(reader, "_reader", None) or getattr(reader, "_gen", None)
    return gen is not None and running(gen)


def _server(request: pytest.FixtureRequest, pipeline: Pipeline) -> Any:
    return request.getfixturevalue("redis_server") if pipeline is _redis else None


@pytest.mark.parametrize("pipeline", PIPELINES)
async def test_a_second_reader_is_refused_and_the_first_gets_every_batch(
    pipeline: Pipeline, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    async with pipeline(tmp_path, _server(request, pipeline)) as (scheduler, reader):
        got: list[int] = []
        waiting = anyio.Event()

        async def first() -> None:
            waiting.set()
            for _ in range(2):
                got.append((await _next_batch(reader)).seq)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await waiting.wait()
            await wait_until(lambda: _waiting(reader))  # the first reader waits for a batch
            with pytest.raises(ClosedError, match="already being read by another task"):
                await anext(aiter(reader))
            await _publish(scheduler, 0)
            await _publish(scheduler, 1)
        assert got == [0, 1]


@pytest.mark.parametrize("pipeline", PIPELINES)
async def test_a_reader_that_stops_and_starts_again_goes_on_where_it_was(
    pipeline: Pipeline, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    async with pipeline(tmp_path, _server(request, pipeline)) as (scheduler, reader):
        seqs: list[int] = []
        async with anyio.create_task_group() as tg:

            async def read() -> None:
                for _ in range(3):  # three loops, each stopped after one batch
                    seqs.append((await _next_batch(reader)).seq)

            tg.start_soon(read)
            for seq in range(3):
                await _publish(scheduler, seq)
        assert seqs == [0, 1, 2]
