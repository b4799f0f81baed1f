"""Per sink: events/s and MB/s through each transport that is available (issue item 6).

Every case runs the same host loop (`emit` a 64-event chunk, `await
tick()`, one checkpoint) into one sink with its default codec, and is timed
until the sink's transport has taken every batch:

* `file`: a file on the temporary folder's disk, until written and flushed;
* `tcp` / `unix`: the socket sink, until its writer has written every batch
  to a subscriber in another process that only counts bytes;
* `zmq`: the ZMQ sink, until every batch is handed to the socket, with a
  frame-counting SUB in another process;
* `nats`: JetStream (memory storage), until every publish is acknowledged;
* `redis`: Redis Streams (no persistence), until every XADD has answered.

A transport whose module or server is missing is reported "not available".

Any sink URL works too (`kvstream bench --only sinks --sink 'mysink:/x?opt=1'`,
a third-party scheme included): the sink is built from the URL
(`kvstream.config.open_sink()`) and timed until its statistics count every
batch delivered.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel

from kvstream._bench.frame_counter import CounterProcess
from kvstream._bench.measure import Meter, Sample, interleave, summarize
from kvstream._bench.results import Result, Row
from kvstream._bench.servers import BrokerServer
from kvstream._bench.sizes import Sizes
from kvstream._bench.workload import EPOCH, ORIGIN, chunks
from kvstream._bench.zmq_compare import free_tcp_port
from kvstream.events import KVCacheEvent
from kvstream.scheduler import Scheduler
from kvstream.sinks.base import Sink
from kvstream.sinks.file import FileSink

__all__ = ["SINK_NAMES", "bench_sinks", "is_sink_url"]

Progress = Callable[[], None]

SINK_NAMES = ("file", "tcp", "unix", "zmq", "nats", "redis")

#: A case: an async context manager that yields (sink, wait_ready, delivered).
Setup = Callable[[], AbstractAsyncContextManager[tuple[Sink, Any, Callable[[], int]]]]


def _module_missing(module: str) -> str:
    try:
        __import__(module)
    except ImportError as exc:
        return f"not available ({module}: {exc})"
    return ""


async def _publish(setup: Setup, kchunks: list[list[KVCacheEvent]], events: int) -> Sample:
    async with (
        setup() as (sink, wait_ready, delivered),
        Scheduler(sinks=[sink], origin=ORIGIN, epoch=EPOCH) as scheduler,
    ):
        with anyio.fail_after(30):
            await wait_ready(scheduler)
        before_batches = delivered()
        before_bytes = sink.statistics().bytes_out
        emit = scheduler.emit
        tick = scheduler.tick
        checkpoint = anyio.lowlevel.checkpoint
        meter = Meter()
        for chunk in kchunks:
            emit(chunk)
            await tick()
            await checkpoint()
        target = before_batches + len(kchunks)
        with anyio.fail_after(120):
            # Sinks have no delivery event to wait on: poll their counters (0.5 ms).
            while delivered() < target:  # noqa: ASYNC110
                await anyio.sleep(0.0005)
        nbytes = sink.statistics().bytes_out - before_bytes
        sample = meter.stop(events, nbytes)
    return sample


async def _probe_until(
    scheduler: Scheduler, delivered: Callable[[], int], probe: list[Any]
) -> None:
    """Publish one-event batches until one is delivered (the consumer is attached)."""
    start = delivered()
    while delivered() <= start:
        scheduler.emit(probe)
        await scheduler.tick()
        await anyio.sleep(0.02)


def _url_case(url: str) -> Setup:
    from kvstream.config import open_sink

    @asynccontextmanager
    async def setup() -> AsyncIterator[tuple[Sink, Any, Callable[[], int]]]:
        sink = open_sink(url)

        async def ready(scheduler: Scheduler) -> None:
            return None

        yield sink, ready, lambda: sink.statistics().batches_out

    return setup


def is_sink_url(name: str) -> bool:
    """Whether a `--sink` value is a URL (any scheme) rather than a built-in case name."""
    return ":" in name or name == "-"


def _fresh(path: str) -> str:
    """`path`, with whatever a previous run left there removed."""
    if os.path.exists(path):
        os.unlink(path)
    return path


def _file_case(folder: str) -> Setup:
    @asynccontextmanager
    async def setup() -> AsyncIterator[tuple[Sink, Any, Callable[[], int]]]:
        path = _fresh(os.path.join(folder, "sink.jsonl"))
        sink = FileSink(path)

        async def ready(scheduler: Scheduler) -> None:
            return None

        yield sink, ready, lambda: sink.statistics().batches_out
        _fresh(path)

    return setup


def _socket_case(kind: str, folder: str, probe: list[Any]) -> Setup:
    from kvstream.sinks.socket import SocketSink

    @asynccontextmanager
    async def setup() -> AsyncIterator[tuple[Sink, Any, Callable[[], int]]]:
        if kind == "unix":
            path = _fresh(os.path.join(folder, "s.sock"))
            sink = SocketSink(path=path, ring_bytes=256 << 20, subscriber_bytes=128 << 20)
        else:
            sink = SocketSink(
                port=free_tcp_port(), ring_bytes=256 << 20, subscriber_bytes=128 << 20
            )
        counter: CounterProcess | None = None

        def delivered() -> int:
            return sum(s.batches_sent for s in sink.statistics().peers)

        async def ready(scheduler: Scheduler) -> None:
            nonlocal counter
            address = sink.address
            if address.startswith("tcp://"):
                address = address[len("tcp://") :]
            counter = CounterProcess("stream", address)
            counter.command("arm")
            while sink.statistics().subscribers < 1:  # noqa: ASYNC110 - no event
                await anyio.sleep(0.01)
            await _probe_until(scheduler, delivered, probe)

        try:
            yield sink, ready, delivered
        finally:
            if counter is not None:
                counter.close()

    return setup


def _zmq_case(probe: list[Any]) -> Setup:
    from kvstream.sinks.zmq import ZmqSink

    @asynccontextmanager
    async def setup() -> AsyncIterator[tuple[Sink, Any, Callable[[], int]]]:
        endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
        sink = ZmqSink(endpoint, bind=True, linger=0.0)
        counter = CounterProcess("zmq", endpoint)

        async def ready(scheduler: Scheduler) -> None:
            await sink.wait_subscribed()

        try:
            yield sink, ready, lambda: sink.statistics().batches_out
        finally:
            counter.close()

    return setup


def _nats_case(server: BrokerServer) -> Setup:
    from kvstream.sinks.nats import NatsSink

    @asynccontextmanager
    async def setup() -> AsyncIterator[tuple[Sink, Any, Callable[[], int]]]:
        sink = NatsSink(
            server.url,
            subject="bench.events",
            stream="BENCH",
            create=True,
            storage="memory",
            max_msgs=2000,
        )

        async def ready(scheduler: Scheduler) -> None:
            return None

        yield sink, ready, lambda: sink.statistics().batches_out

    return setup


def _redis_case(server: BrokerServer) -> Setup:
    from kvstream.sinks.redis import RedisSink

    @asynccontextmanager
    async def setup() -> AsyncIterator[tuple[Sink, Any, Callable[[], int]]]:
        sink = RedisSink(server.url, stream="bench:events", maxlen=2000)

        async def ready(scheduler: Scheduler) -> None:
            return None

        yield sink, ready, lambda: sink.statistics().batches_out

    return setup


async def bench_sinks(
    pool: list[KVCacheEvent],
    sizes: Sizes,
    progress: Progress | None = None,
    only: tuple[str, ...] = SINK_NAMES,
) -> Result:
    """events/s and MB/s per available sink, 64-event batches, interleaved."""
    result = Result("sinks", "Per sink: events/s and MB/s (64-event batches)")
    n = sizes.sink_batch_size
    count = max(sizes.sink_events // n, 8)
    kchunks = chunks(pool, n, count)
    total = n * count
    probe = pool[:1]
    folder = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
    servers: list[BrokerServer] = []
    setups: dict[str, Setup] = {}
    missing: dict[str, str] = {}
    try:
        for name in only:
            if is_sink_url(name):
                setups[name] = _url_case(name)
            elif name == "file":
                setups[name] = _file_case(folder)
            elif name in ("tcp", "unix"):
                why = _module_missing("kvstream.sinks.socket")
                if why:
                    missing[name] = why
                else:
                    setups[name] = _socket_case(name, folder, probe)
            elif name == "zmq":
                why = _module_missing("zmq")  # pyzmq, the extra kvstream-events[zmq]
                if why:
                    missing[name] = why
                else:
                    setups[name] = _zmq_case(probe)
            elif name in ("nats", "redis"):
                why = _module_missing(name)  # nats-py / redis, the extras of the same name
                server = BrokerServer(name)
                if not why and not server.available:
                    why = f"not available ({name} server binary not in PATH)"
                if why:
                    missing[name] = why
                    continue
                try:
                    server.__enter__()
                except (OSError, RuntimeError) as exc:
                    missing[name] = f"not available ({exc})"
                    continue
                servers.append(server)
                setups[name] = _nats_case(server) if name == "nats" else _redis_case(server)

        cases: dict[str, Any] = {}
        for name, setup in setups.items():

            async def case(setup: Setup = setup) -> Sample:
                return await _publish(setup, kchunks, total)

            cases[name] = case
        samples = await interleave(cases, runs=sizes.runs, warmup=sizes.warmup, on_run=progress)
        for name in only:
            if name in missing:
                result.rows.append(Row("sinks", name, f"{n}/batch", note=missing[name]))
                result.data[name] = {"skipped": missing[name]}
                continue
            s = summarize(samples[name])
            result.rows.append(
                Row(
                    "sinks",
                    name,
                    f"{n}/batch",
                    s.events_per_s,
                    cpu_us_per_event=s.cpu_us_per_event,
                    mb_per_s=s.mb_per_s,
                    note=_notes.get(name, "built from the URL, its own codec"),
                )
            )
            result.data[name] = s.as_dict()
            result.data[name]["mb_per_s_values"] = [
                round(x.nbytes / x.wall / 1e6, 2) for x in samples[name]
            ]
            result.data[name]["events_per_s_spread"] = round(
                statistics.pstdev(x.events_per_s for x in samples[name]), 1
            )
    finally:
        for server in servers:
            server.__exit__(None, None, None)
        shutil.rmtree(folder, ignore_errors=True)
    return result


_notes = {
    "file": "JSON lines, disk-backed temporary folder",
    "tcp": "JSON lines to a counting subscriber process",
    "unix": "JSON lines to a counting subscriber process",
    "zmq": "msgpack (map) to a frame-counting SUB process",
    "nats": "JSON, JetStream memory storage, acked",
    "redis": "JSON, XADD, no persistence",
}
