"""kvstream's ZMQ sink against a publisher built as vLLM builds its own (issue 12, targets 3, 6).

Four cases publish the same pre-built batches (kvstream's events for kvstream,
the same events as vLLM-style structs for the others, converted before timing)
on TCP to a subscriber in another process that only counts frames
(`kvstream._bench.frame_counter`):

* the **vLLM-design publisher** (the baseline, `kvstream._bench.vllm_baseline`);
* the **floor**: msgspec encoding the vLLM structs and a synchronous
  `send_multipart` in one thread, nothing else (no queue, no ring): what any
  publisher of this wire costs at least, so every ratio can be read against it;
* **kvstream, replay ring on** (vLLM always keeps its ring) and **ring off**:
  `Scheduler` + `ZmqSink` driven natively, an engine step loop of
  `emit(chunk)`, `await tick()`, one checkpoint, on the bench's own loop;
* when uvloop is installed and the bench runs on asyncio's loop, **ring on, the
  host on uvloop**: the same drive on a uvloop loop in a thread of its own (the
  bench's loop waits), for hosts that run on uvloop, as uvicorn and vLLM's
  server do. The targets are read from the bench's own loop.

Measured in the sender process, from the first publish until the last batch has
been handed to the socket: events/s and CPU per event (`time.process_time()`:
every thread, ZMQ's I/O thread included). The subscriber's counts show what
arrived. The ring holds what it holds in a long-running publisher: it is filled
(untimed) before each timed run and bounded (`ring_bytes`) at about half of
what a run publishes, so the timed run measures a full ring that keeps wrapping.
"""

from __future__ import annotations

import resource
import socket
import statistics
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from kvstream._bench.frame_counter import CounterProcess
from kvstream._bench.measure import Meter, Sample, interleave, summarize
from kvstream._bench.results import Result, Row, Target
from kvstream._bench.sizes import Sizes
from kvstream._bench.workload import EPOCH, ORIGIN, batches, chunks
from kvstream._event_loop import backend_options, resolve_event_loop, running_loop_name
from kvstream.events import KVCacheEvent
from kvstream.scheduler import Scheduler

__all__ = ["bench_zmq", "free_tcp_port", "zmq_available", "zmq_cases"]

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


async def _baseline_run(
    endpoint: str, counter: CounterProcess, vbatches: list[Any], events: int, probe: Any
) -> Sample:
    from kvstream._bench.vllm_baseline import VllmStylePublisher

    pub = VllmStylePublisher(endpoint)
    try:
        counter.wait_ready(lambda: pub.publish(probe))
        pub.expect(events)
        publish = pub.publish
        meter = Meter()
        for batch in vbatches:
            publish(batch)
        if not pub.wait_sent(120.0):
            raise TimeoutError("the vLLM-style publisher did not send everything")
        sample = meter.stop(events)
        got = counter.counts_when(len(vbatches))
    finally:
        pub.close()
    return Sample(
        sample.wall,
        sample.cpu,
        events,
        int(got.get("bytes", 0)),
        {"received_messages": got.get("messages", 0), "sent_messages": len(vbatches)},
    )


def _floor_run(endpoint: str, counter: CounterProcess, vbatches: list[Any], events: int) -> Sample:
    """msgspec encode + synchronous send, one thread: the floor."""
    import msgspec
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.bind(endpoint)
    try:
        encode = msgspec.msgpack.Encoder().encode
        send = pub.send_multipart

        def probe() -> None:
            send((b"", b"\0" * 8, encode(vbatches[0])))

        counter.wait_ready(probe)
        meter = Meter()
        for seq, batch in enumerate(vbatches):
            send((b"", seq.to_bytes(8, "big"), encode(batch)))
        sample = meter.stop(events)
        got = counter.counts_when(len(vbatches))
    finally:
        pub.close(linger=0)
        ctx.term()
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
    ring_bytes: int | None = None,
) -> Sample:
    from kvstream.sinks.zmq import ZmqSink

    sink = ZmqSink(
        endpoint,
        replay_endpoint=None if ring_bytes is None else "tcp://127.0.0.1:*",
        replay_max_bytes=ring_bytes or 1,
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
        counter.arm()
        deadline = time.monotonic() + 20
        while True:
            send_probe()
            await s.tick()
            await anyio.sleep(0.01)
            if counter.poll_line(0.0) == "ready":
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the counting subscriber never received a probe")
        if ring_bytes is not None:
            # A long-running publisher's ring is full: fill it (untimed) so that the
            # timed run measures the ring as it is for all but its first minutes.
            # Full: at its count of batches, or when one more batch of the size it holds
            # would pass its bound (a ring of a few large batches never reaches 90% of it).
            def full() -> bool:
                st = sink.statistics()
                held = st.ring_batches
                return held >= sink.buffer_steps or (
                    held > 0 and st.ring_bytes + st.ring_bytes // held > ring_bytes
                )

            while not full():
                for chunk in kchunks:
                    s.emit(chunk)
                    await s.tick()
                    await anyio.lowlevel.checkpoint()
                    if full():
                        break
            await anyio.sleep(0.2)
        await anyio.sleep(0.2)
        counter.arm()
        before = sink.statistics().events_out
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
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
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        stats = sink.statistics()
        got = counter.counts_when(len(kchunks))
    return Sample(
        sample.wall,
        sample.cpu,
        events,
        int(got.get("bytes", 0)),
        {
            "received_messages": got.get("messages", 0),
            "sent_messages": len(kchunks),
            "dropped_batches": stats.batches_dropped,
            "faults_per_batch": faults / len(kchunks),
        },
    )


#: The cases, in table order: (key, label).
_CASES: tuple[tuple[str, str], ...] = (
    ("baseline", "vLLM-design publisher (baseline)"),
    ("floor", "floor: msgspec encode + sync send, one thread"),
    ("ring", "kvstream Scheduler + ZmqSink, replay ring on"),
    ("noring", "kvstream Scheduler + ZmqSink, no ring"),
    ("ring_uvloop", "kvstream Scheduler + ZmqSink, ring on, host on uvloop"),
)


def zmq_cases() -> list[tuple[str, str]]:
    """The cases this run has: the uvloop host's only with uvloop installed and the
    bench on asyncio's own loop."""
    uvloop = resolve_event_loop("auto") == "uvloop" and running_loop_name() == "asyncio"
    return [(key, label) for key, label in _CASES if key != "ring_uvloop" or uvloop]


async def _on_uvloop(run: Callable[[], Awaitable[Sample]]) -> Sample:
    """`run` on a uvloop event loop in a worker thread, while this loop waits."""

    def main() -> Sample:
        return anyio.run(run, backend="asyncio", backend_options=backend_options("uvloop"))

    return await anyio.to_thread.run_sync(main)


def _ratio(mine: list[Sample], base: list[Sample], what: str) -> float:
    """Median of per-round ratios (`what`: events/s or CPU/event)."""
    if what == "rate":
        return statistics.median(
            a.events_per_s / b.events_per_s for a, b in zip(mine, base, strict=True)
        )
    return statistics.median(
        a.cpu_us_per_event / b.cpu_us_per_event for a, b in zip(mine, base, strict=True)
    )


async def bench_zmq(
    pool: list[KVCacheEvent], sizes: Sizes, progress: Progress | None = None
) -> Result:
    """Sender events/s and CPU per event: kvstream's ZmqSink, the floor, the vLLM design."""
    result = Result("zmq", "ZMQ: kvstream's sink against vLLM's publisher design and the floor")
    why = zmq_available()
    if why:
        result.skipped = why
        return result
    from kvstream._bench.vllm_baseline import to_vllm_batch

    cases = zmq_cases()
    endpoints = {key: f"tcp://127.0.0.1:{free_tcp_port()}" for key, _ in cases}
    counters = {key: CounterProcess("zmq", endpoints[key]) for key, _ in cases}
    probe_events = pool[:1]
    probe_batch = to_vllm_batch(batches(pool, 1, 1)[0])
    series: dict[str, list[tuple[int, float]]] = {label: [] for _, label in cases}
    try:
        for n in sizes.zmq_batch_sizes:
            count = max(sizes.zmq_events // n, 16)
            count = min(count, 20_000)
            kchunks = chunks(pool, n, count)
            cache: dict[int, Any] = {}
            prebuilt = batches(pool, n, count)
            vbatches = [to_vllm_batch(b, cache) for b in prebuilt]
            total = n * count
            # A ring that wraps about halfway through a run: its steady state is timed.
            from kvstream.codecs.msgpack import MsgpackCodec

            run_bytes = sum(len(MsgpackCodec().encode(b)) for b in prebuilt[:64]) * count // 64
            ring_bytes = max(run_bytes // 2, 1 << 20)

            async def base_case(vbatches: list[Any] = vbatches, total: int = total) -> Sample:
                return await _baseline_run(
                    endpoints["baseline"], counters["baseline"], vbatches, total, probe_batch
                )

            async def floor_case(vbatches: list[Any] = vbatches, total: int = total) -> Sample:
                return _floor_run(endpoints["floor"], counters["floor"], vbatches, total)

            async def ring_case(
                kchunks: list[list[KVCacheEvent]] = kchunks,
                total: int = total,
                ring_bytes: int = ring_bytes,
            ) -> Sample:
                return await _kvstream_run(
                    endpoints["ring"], counters["ring"], kchunks, total, probe_events, ring_bytes
                )

            async def noring_case(
                kchunks: list[list[KVCacheEvent]] = kchunks, total: int = total
            ) -> Sample:
                return await _kvstream_run(
                    endpoints["noring"], counters["noring"], kchunks, total, probe_events
                )

            runners: dict[str, Callable[[], Awaitable[Sample]]] = {
                "baseline": base_case,
                "floor": floor_case,
                "ring": ring_case,
                "noring": noring_case,
            }
            if "ring_uvloop" in endpoints:

                async def ring_uvloop_case(
                    kchunks: list[list[KVCacheEvent]] = kchunks,
                    total: int = total,
                    ring_bytes: int = ring_bytes,
                ) -> Sample:
                    drive = partial(
                        _kvstream_run,
                        endpoints["ring_uvloop"],
                        counters["ring_uvloop"],
                        kchunks,
                        total,
                        probe_events,
                        ring_bytes,
                    )
                    return await _on_uvloop(drive)

                runners["ring_uvloop"] = ring_uvloop_case
            samples = await interleave(
                runners,
                runs=sizes.runs,
                warmup=sizes.warmup,
                on_run=progress,
            )

            def received(runs: list[Sample]) -> str:
                got = sum(int((s.extra or {}).get("received_messages", 0)) for s in runs)
                sent = sum(int((s.extra or {}).get("sent_messages", 0)) for s in runs)
                return f"subscriber got {got}/{sent} batches"

            base_runs = samples["baseline"]
            for key, label in cases:
                summary = summarize(samples[key])
                note = received(samples[key])
                if key != "baseline":
                    cpu = _ratio(samples[key], base_runs, "cpu")
                    floor = _ratio(samples[key], samples["floor"], "rate")
                    note = f"CPU/event ratio {cpu:.2f}; {floor:.2f}x the floor; {note}"
                    result.data[f"{key}_cpu_ratio_{n}"] = cpu
                    result.data[f"{key}_rate_ratio_{n}"] = _ratio(samples[key], base_runs, "rate")
                result.rows.append(
                    Row(
                        "zmq",
                        label,
                        f"{n}/batch",
                        summary.events_per_s,
                        "" if key == "baseline" else "vLLM-design",
                        None if key == "baseline" else _ratio(samples[key], base_runs, "rate"),
                        summary.cpu_us_per_event,
                        mb_per_s=summary.mb_per_s,
                        note=note,
                    )
                )
                series[label].append((n, summary.events_per_s))
            ring_rate = _ratio(samples["ring"], base_runs, "rate")
            ring_cpu = _ratio(samples["ring"], base_runs, "cpu")
            # What the ring adds per event: per-round differences of wall time per event.
            ring_cost = statistics.median(
                (a.wall - b.wall) / total * 1e6
                for a, b in zip(samples["ring"], samples["noring"], strict=True)
            )
            result.data[f"ring_us_per_event_{n}"] = ring_cost
            # The same in process CPU (data, not the target): the sender's own work,
            # without the scheduling noise that wall time takes in on two cores.
            ring_cpu_cost = statistics.median(
                (a.cpu - b.cpu) / total * 1e6
                for a, b in zip(samples["ring"], samples["noring"], strict=True)
            )
            result.data[f"ring_cpu_us_per_event_{n}"] = ring_cpu_cost

            def faults(runs: list[Sample]) -> float:
                return statistics.median(
                    float((x.extra or {}).get("faults_per_batch", 0)) for x in runs
                )

            result.data[f"ring_faults_per_batch_{n}"] = faults(samples["ring"])
            result.data[f"noring_faults_per_batch_{n}"] = faults(samples["noring"])
            result.rows.append(
                Row(
                    "zmq",
                    "replay ring's cost (ring on - ring off)",
                    f"{n}/batch",
                    note=(
                        f"{ring_cost:+.3f} us/event ({ring_cpu_cost:+.3f} in CPU); "
                        f"ring bound {ring_bytes / 2**20:.0f} MiB; "
                        f"minor faults/batch {faults(samples['ring']):.1f} with ring, "
                        f"{faults(samples['noring']):.1f} without"
                    ),
                )
            )
            result.targets.append(
                Target(
                    f"[12.3] ZMQ sink (ring on) events/s over vLLM design at {n}/batch",
                    ring_rate,
                    1.0 if n == 1 else 1.25,
                    ">=",
                )
            )
            if n in (16, 256):
                result.targets.append(
                    Target(
                        f"[12.3] ZMQ sink (ring on) sender CPU/event over vLLM design at {n}/batch",
                        ring_cpu,
                        0.8,
                        "<=",
                    )
                )
            if n == 256:
                result.targets.append(
                    Target(
                        "[12.6] ZMQ replay ring's cost at 256/batch",
                        ring_cost,
                        0.2,
                        "<=",
                        "us/event",
                    )
                )
    finally:
        for counter in counters.values():
            counter.close()
    result.data["series"] = series
    return result
