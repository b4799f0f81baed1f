"""kvstream's ZMQ sink against a publisher built as vLLM builds its own (issue item 2).

Both publish the same pre-built batches (kvstream's events for kvstream, the
same events as vLLM-style structs for the baseline, converted before timing) on
TCP to a subscriber in another process that only counts frames
(:mod:`kvstream.bench.frame_counter`). Measured in the sender process, from the
first publish until the last batch has been handed to the socket: events/s and
CPU per event (:func:`time.process_time`: every thread, ZMQ's I/O thread
included, for both). The subscriber's counts show what arrived.

kvstream's host loop is an engine step loop: ``emit(chunk)``, ``await tick()``,
one checkpoint. The sink publishes with the msgpack codec, map profile (vLLM's
current wire), and keeps a replay ring as vLLM's publisher does.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

from kvstream.bench.frame_counter import CounterProcess
from kvstream.bench.measure import Meter, Sample, interleave, summarize
from kvstream.bench.results import Result, Row, Target
from kvstream.bench.sizes import Sizes
from kvstream.bench.workload import EPOCH, ORIGIN, batches, chunks
from kvstream.events import KVCacheEvent
from kvstream.scheduler import Scheduler

__all__ = ["bench_zmq", "free_tcp_port", "zmq_available"]

Progress = Callable[[], None]


def zmq_available() -> str:
    """ "" when the ZMQ comparison can run, else why not."""
    try:
        import zmq  # noqa: F401

        import kvstream.codecs.msgpack
        import kvstream.sinks.zmq  # noqa: F401
    except ImportError as exc:
        return f"not available: {exc}"
    return ""


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _arm(counter: CounterProcess, timeout: float = 20.0) -> None:
    """Reset the subscriber's counts; returns once it has done so."""
    counter.command("arm")
    deadline = time.monotonic() + timeout
    while counter.poll_line(max(deadline - time.monotonic(), 0)) != "armed":
        if time.monotonic() > deadline:
            raise TimeoutError("the counting subscriber did not answer 'arm'")


def _wait_ready(counter: CounterProcess, probe: Callable[[], None], timeout: float = 20.0) -> None:
    """Send probes until the subscriber has one, let stragglers land, re-arm the counts."""
    _arm(counter)
    deadline = time.monotonic() + timeout
    while True:
        probe()
        if counter.poll_line(0.02) == "ready":
            break
        if time.monotonic() > deadline:
            raise TimeoutError("the counting subscriber never received a probe")
    time.sleep(0.2)
    _arm(counter)


def _counts(counter: CounterProcess, messages: int, timeout: float = 20.0) -> dict[str, Any]:
    """The subscriber's counts once ``messages`` arrived (or they stop growing)."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    stable = 0
    while time.monotonic() < deadline:
        counter.command("count")
        line = counter.poll_line(5.0)
        while line in ("ready", "armed"):
            line = counter.poll_line(5.0)
        if not line:
            break
        now: dict[str, Any] = json.loads(line)
        if now.get("messages", 0) >= messages:
            return now
        stable = stable + 1 if now == last else 0
        if stable >= 10:
            return now
        last = now
        time.sleep(0.05)
    return last


async def _baseline_run(
    endpoint: str, counter: CounterProcess, vbatches: list[Any], events: int, probe: Any
) -> Sample:
    from kvstream.bench.vllm_baseline import VllmStylePublisher

    pub = VllmStylePublisher(endpoint)
    try:
        _wait_ready(counter, lambda: pub.publish(probe))
        pub.expect(events)
        publish = pub.publish
        meter = Meter()
        for batch in vbatches:
            publish(batch)
        if not pub.wait_sent(120.0):
            raise TimeoutError("the vLLM-style publisher did not send everything")
        sample = meter.stop(events)
        got = _counts(counter, len(vbatches))
    finally:
        pub.close()
    return Sample(
        sample.wall,
        sample.cpu,
        events,
        int(got.get("bytes", 0)),
        {"received_messages": got.get("messages", 0), "sent_messages": len(vbatches)},
    )


async def _kvstream_run(
    endpoint: str,
    counter: CounterProcess,
    kchunks: list[list[KVCacheEvent]],
    events: int,
    probe: list[KVCacheEvent],
) -> Sample:
    from kvstream.sinks.zmq import ZmqSink

    sink = ZmqSink(
        endpoint,
        replay_endpoint="tcp://127.0.0.1:*",
        bind=True,
        hwm=100_000,
        linger=0.0,
        name="zmq",
    )
    async with Scheduler(sinks=[sink], origin=ORIGIN, epoch=EPOCH, data_parallel_rank=0) as s:
        with anyio.fail_after(20):
            await sink.wait_subscribed()

        def send_probe() -> None:
            s.emit(probe)

        # Probes go out on the loop: tick and let the writer run between polls.
        _arm(counter)
        deadline = time.monotonic() + 20
        while True:
            send_probe()
            await s.tick()
            await anyio.sleep(0.01)
            if counter.poll_line(0.0) == "ready":
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the counting subscriber never received a probe")
        await anyio.sleep(0.2)
        _arm(counter)
        before = sink.statistics().events_out
        emit = s.emit
        tick = s.tick
        checkpoint = anyio.lowlevel.checkpoint
        meter = Meter()
        for chunk in kchunks:
            emit(chunk)
            await tick()
            await checkpoint()
        target = before + events
        # Sinks have no delivery event to wait on: poll their counters (0.5 ms).
        while sink.statistics().events_out < target:  # noqa: ASYNC110
            await anyio.sleep(0.0005)
        sample = meter.stop(events)
        stats = sink.statistics()
        got = _counts(counter, len(kchunks))
    return Sample(
        sample.wall,
        sample.cpu,
        events,
        int(got.get("bytes", 0)),
        {
            "received_messages": got.get("messages", 0),
            "sent_messages": len(kchunks),
            "dropped_batches": stats.batches_dropped,
        },
    )


async def bench_zmq(
    pool: list[KVCacheEvent], sizes: Sizes, progress: Progress | None = None
) -> Result:
    """Sender events/s and CPU per event: kvstream's ZmqSink over the vLLM-style publisher."""
    result = Result("zmq", "ZMQ: kvstream's sink against vLLM's publisher design")
    why = zmq_available()
    if why:
        result.skipped = why
        return result
    from kvstream.bench.vllm_baseline import to_vllm_batch

    base_endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    kv_endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    base_counter = CounterProcess("zmq", base_endpoint)
    kv_counter = CounterProcess("zmq", kv_endpoint)
    probe_events = pool[:1]
    probe_batch = to_vllm_batch(batches(pool, 1, 1)[0])
    series: dict[str, list[tuple[int, float]]] = {"vLLM-design publisher": [], "kvstream ZMQ": []}
    try:
        for n in sizes.zmq_batch_sizes:
            count = max(sizes.zmq_events // n, 16)
            count = min(count, 20_000)
            kchunks = chunks(pool, n, count)
            cache: dict[int, Any] = {}
            vbatches = [to_vllm_batch(b, cache) for b in batches(pool, n, count)]
            total = n * count

            async def base_case(vbatches: list[Any] = vbatches, total: int = total) -> Sample:
                return await _baseline_run(
                    base_endpoint, base_counter, vbatches, total, probe_batch
                )

            async def kv_case(
                kchunks: list[list[KVCacheEvent]] = kchunks, total: int = total
            ) -> Sample:
                return await _kvstream_run(kv_endpoint, kv_counter, kchunks, total, probe_events)

            samples = await interleave(
                {"baseline": base_case, "kvstream": kv_case},
                runs=sizes.runs,
                warmup=sizes.warmup,
                on_run=progress,
            )
            base = summarize(samples["baseline"])
            kv = summarize(samples["kvstream"])
            rate_ratio = statistics.median(
                a.events_per_s / b.events_per_s
                for a, b in zip(samples["kvstream"], samples["baseline"], strict=True)
            )
            cpu_ratio = statistics.median(
                a.cpu_us_per_event / b.cpu_us_per_event
                for a, b in zip(samples["kvstream"], samples["baseline"], strict=True)
            )

            def received(runs: list[Sample]) -> str:
                got = sum(int((s.extra or {}).get("received_messages", 0)) for s in runs)
                sent = sum(int((s.extra or {}).get("sent_messages", 0)) for s in runs)
                return f"subscriber got {got}/{sent} batches"

            result.rows.append(
                Row(
                    "zmq",
                    "vLLM-design publisher (baseline)",
                    f"{n}/batch",
                    base.events_per_s,
                    cpu_us_per_event=base.cpu_us_per_event,
                    mb_per_s=base.mb_per_s,
                    note=received(samples["baseline"]),
                )
            )
            result.rows.append(
                Row(
                    "zmq",
                    "kvstream ZmqSink (msgpack, map)",
                    f"{n}/batch",
                    kv.events_per_s,
                    "vLLM-design",
                    rate_ratio,
                    kv.cpu_us_per_event,
                    mb_per_s=kv.mb_per_s,
                    note=f"CPU/event ratio {cpu_ratio:.2f}; {received(samples['kvstream'])}",
                )
            )
            series["vLLM-design publisher"].append((n, base.events_per_s))
            series["kvstream ZMQ"].append((n, kv.events_per_s))
            result.data[f"cpu_ratio_{n}"] = cpu_ratio
            result.data[f"rate_ratio_{n}"] = rate_ratio
            if n in (16, 256):
                result.targets.append(
                    Target(
                        f"ZMQ sender events/s over vLLM design at {n}/batch", rate_ratio, 1.5, ">="
                    )
                )
                result.targets.append(
                    Target(
                        f"ZMQ sender CPU/event over vLLM design at {n}/batch", cpu_ratio, 0.67, "<="
                    )
                )
    finally:
        base_counter.close()
        kv_counter.close()
    result.data["series"] = series
    return result
