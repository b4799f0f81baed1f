"""Pipeline benchmarks: efficiency against the codec alone, cost to the host, scaling.

* `bench_efficiency()` (issue item 1): events/s through async sources, the
  tick, the JSON codec and a null sink (and a file sink), against the JSON codec
  encoding the same batches in a plain loop, interleaved, same process.
* `bench_host_cost()` (item 3): `tick()` wall time on the host's loop
  (p50/p99) and the whole pipeline's CPU per event, at 16 and 256 events per
  tick from 4 paced sources, against the codec's CPU per event; and the cost of
  `emit`.
* `bench_scaling()` (item 4): events/s against the number of sources (each
  yielding 64-event chunks) and of sinks.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio.lowlevel

from kvstream._bench.harness import (
    Countdown,
    Gate,
    NullSink,
    drive,
    free_source,
    paced_source,
    wait_delivered,
)
from kvstream._bench.measure import Meter, Sample, interleave, percentile, summarize
from kvstream._bench.results import Result, Row, Target
from kvstream._bench.sizes import Sizes
from kvstream._bench.workload import EPOCH, ORIGIN, batches, chunks
from kvstream.codecs.json import JsonCodec
from kvstream.events import EventBatch, KVCacheEvent
from kvstream.scheduler import Scheduler
from kvstream.sinks.base import Sink
from kvstream.sinks.file import FileSink

__all__ = ["bench_efficiency", "bench_host_cost", "bench_scaling"]

Progress = Callable[[], None]


def _scratch_dir() -> str:
    """A tmpfs folder when there is one (the file sink then measures the pipeline and
    the write calls, not the disk), else the system's temporary folder."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


def _split(all_chunks: list[list[KVCacheEvent]], n: int) -> list[list[list[KVCacheEvent]]]:
    """Deal chunks round-robin to `n` sources."""
    return [all_chunks[i::n] for i in range(n)]


async def codec_alone(codec: JsonCodec, prebuilt: Sequence[EventBatch], events: int) -> Sample:
    """The baseline: the codec encoding the batches in a plain loop."""
    encode = codec.encode
    nbytes = 0
    meter = Meter()
    for batch in prebuilt:
        nbytes += len(encode(batch))
    return meter.stop(events, nbytes)


async def run_sources(
    per_source: Sequence[Sequence[list[KVCacheEvent]]],
    make_sinks: Callable[[int], list[Sink]],
) -> Sample:
    """Free-running sources through a scheduler into `make_sinks(total)`; timed to delivery."""
    total = sum(len(c) for chunks_ in per_source for c in chunks_)
    sinks = make_sinks(total)
    countdown = Countdown(len(per_source))
    async with Scheduler(sinks=sinks, origin=ORIGIN, epoch=EPOCH) as scheduler:
        meter = Meter()
        for i, source_chunks in enumerate(per_source):
            scheduler.add_source(free_source(source_chunks, countdown), name=f"source-{i}")
        ticks = await drive(scheduler, countdown)
        await wait_delivered(sinks, total)
        stats = scheduler.statistics()
        nbytes = sinks[0].statistics().bytes_out
        sample = meter.stop(
            total,
            nbytes,
            ticks=ticks,
            batches=stats.batches_sealed,
            events_per_batch=stats.events_sealed / max(stats.batches_sealed, 1),
        )
    return sample


def _null_sinks(n: int) -> Callable[[int], list[Sink]]:
    def make(total: int) -> list[Sink]:
        return [NullSink(total, codec=JsonCodec(), name=f"null-{i}") for i in range(n)]

    return make


# -- item 1 -------------------------------------------------------------------------------


async def bench_efficiency(
    pool: list[KVCacheEvent], sizes: Sizes, progress: Progress | None = None
) -> Result:
    """Pipeline events/s over the codec's own, by events per tick."""
    result = Result("efficiency", "Pipeline efficiency: sources -> tick -> JSON codec -> sink")
    codec = JsonCodec()
    folder = tempfile.mkdtemp(prefix="kvbench-", dir=_scratch_dir())
    series: dict[str, list[tuple[int, float]]] = {"codec alone": [], "null sink": [], "file": []}
    try:
        for n in sizes.events_per_tick:
            ticks = sizes.ticks_for(n)
            all_chunks = chunks(pool, n, ticks)
            prebuilt = batches(pool, n, ticks)
            total = n * ticks
            path = os.path.join(folder, "events.jsonl")

            def file_sinks(total: int, path: str = path) -> list[Sink]:
                if os.path.exists(path):
                    os.unlink(path)
                return [FileSink(path, codec=JsonCodec())]

            async def codec_case(
                prebuilt: list[EventBatch] = prebuilt, total: int = total
            ) -> Sample:
                return await codec_alone(codec, prebuilt, total)

            async def null_case(all_chunks: list[list[KVCacheEvent]] = all_chunks) -> Sample:
                return await run_sources([all_chunks], _null_sinks(1))

            async def file_case(all_chunks: list[list[KVCacheEvent]] = all_chunks) -> Sample:
                return await run_sources([all_chunks], file_sinks)

            samples = await interleave(
                {"codec alone": codec_case, "null sink": null_case, "file": file_case},
                runs=sizes.runs,
                warmup=sizes.warmup,
                on_run=progress,
            )
            base = summarize(samples["codec alone"])
            base_cpu = base.cpu_us_per_event
            result.rows.append(
                Row(
                    "efficiency",
                    "JSON codec alone (baseline)",
                    f"{n}/tick",
                    base.events_per_s,
                    cpu_us_per_event=base_cpu,
                    mb_per_s=base.mb_per_s,
                )
            )
            series["codec alone"].append((n, base.events_per_s))
            for name, label in (
                ("null sink", "pipeline -> null sink"),
                ("file", "pipeline -> file"),
            ):
                s = summarize(samples[name])
                # The ratio of medians and the median of per-round ratios agree closely;
                # report the per-round one (pairs measured back to back).
                ratios = [
                    a.events_per_s / b.events_per_s
                    for a, b in zip(samples[name], samples["codec alone"], strict=True)
                ]
                ratio = statistics.median(ratios)
                per_batch = statistics.median(
                    float((x.extra or {}).get("events_per_batch", 0)) for x in samples[name]
                )
                result.rows.append(
                    Row(
                        "efficiency",
                        label,
                        f"{n}/tick",
                        s.events_per_s,
                        "codec alone",
                        ratio,
                        s.cpu_us_per_event,
                        mb_per_s=s.mb_per_s,
                        note=f"{per_batch:.0f} events/batch",
                    )
                )
                series[name].append((n, s.events_per_s))
                if name == "null sink" and n >= 64:
                    result.targets.append(
                        Target(f"pipeline/codec events/s at {n} events/tick", ratio, 0.85, ">=")
                    )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result.data["series"] = {k: v for k, v in series.items() if v}
    return result


# -- item 3 -------------------------------------------------------------------------------


async def run_paced(
    per_source: Sequence[Sequence[list[KVCacheEvent]]], events_per_tick: int
) -> tuple[Sample, list[float]]:
    """Paced sources (one chunk each per tick); returns the run and every tick's wall time."""
    total = sum(len(c) for chunks_ in per_source for c in chunks_)
    ticks = len(per_source[0])
    sink = NullSink(total, codec=JsonCodec())
    gate = Gate()
    countdown = Countdown(len(per_source))
    latencies: list[float] = []
    clock = time.perf_counter_ns
    checkpoint = anyio.lowlevel.checkpoint
    async with Scheduler(sinks=[sink], origin=ORIGIN, epoch=EPOCH) as scheduler:
        meter = Meter()
        handles = [
            scheduler.add_source(paced_source(c, gate, countdown), name=f"source-{i}")
            for i, c in enumerate(per_source)
        ]
        tick = scheduler.tick
        for _ in range(ticks):
            # Wait (untimed) until every source has yielded this tick's chunk.
            while sum(len(h.buffer) for h in handles) < events_per_tick:
                await checkpoint()
            t0 = clock()
            await tick()
            latencies.append((clock() - t0) / 1000)
            gate.release()
        await wait_delivered([sink], total)
        sample = meter.stop(total, sink.nbytes)
    return sample, latencies


def _encode_times(codec: JsonCodec, prebuilt: Sequence[EventBatch]) -> list[float]:
    """Microseconds to encode each batch once (as the tick does), in this process."""
    clock = time.perf_counter_ns
    times: list[float] = []
    for batch in prebuilt:
        t0 = clock()
        codec.encode(batch)
        times.append((clock() - t0) / 1000)
    return times


async def bench_host_cost(
    pool: list[KVCacheEvent], sizes: Sizes, progress: Progress | None = None, sources: int = 4
) -> Result:
    """tick() latency and pipeline CPU per event against the codec's; emit's cost."""
    result = Result("host", f"Cost to the host ({sources} paced sources)")
    codec = JsonCodec()
    for n in (16, 256):
        ticks = sizes.latency_ticks
        all_chunks = chunks(pool, n // sources, ticks * sources)
        per_source = _split(all_chunks, sources)
        prebuilt = batches(pool, n, ticks)
        total = n * ticks
        all_latencies: list[float] = []

        async def pipeline_case(
            per_source: list[list[list[KVCacheEvent]]] = per_source,
            n: int = n,
            all_latencies: list[float] = all_latencies,
        ) -> Sample:
            sample, latencies = await run_paced(per_source, n)
            all_latencies.extend(latencies)
            return sample

        async def codec_case(prebuilt: list[EventBatch] = prebuilt, total: int = total) -> Sample:
            return await codec_alone(codec, prebuilt, total)

        samples = await interleave(
            {"pipeline": pipeline_case, "codec alone": codec_case},
            runs=sizes.runs,
            warmup=sizes.warmup,
            on_run=progress,
        )
        # Latencies of the timed runs only (the warm-up run's were collected first).
        timed = all_latencies[-sizes.runs * ticks :]
        p50 = percentile(timed, 50)
        p99 = percentile(timed, 99)
        pipe = summarize(samples["pipeline"])
        base = summarize(samples["codec alone"])
        cpu_ratio = statistics.median(
            a.cpu_us_per_event / b.cpu_us_per_event
            for a, b in zip(samples["pipeline"], samples["codec alone"], strict=True)
        )
        result.rows.append(
            Row(
                "host",
                "JSON codec alone (baseline)",
                f"{n}/tick",
                base.events_per_s,
                cpu_us_per_event=base.cpu_us_per_event,
            )
        )
        result.rows.append(
            Row(
                "host",
                f"pipeline, {sources} paced sources -> null sink",
                f"{n}/tick",
                pipe.events_per_s,
                "codec alone (CPU/event)",
                cpu_ratio,
                pipe.cpu_us_per_event,
                p50,
                p99,
                note=f"tick() max {max(timed):.0f} us over {len(timed)} ticks",
            )
        )
        result.data[f"tick_us_{n}"] = {
            "p50": p50,
            "p90": percentile(timed, 90),
            "p99": p99,
            "p999": percentile(timed, 99.9),
            "max": max(timed),
            "ticks": len(timed),
        }
        # A tick encodes the batch it seals (once per codec; docs/design.md): what it
        # costs the host beyond that is the tick's time less encoding the same batch.
        # Tail latencies are recorded (p99 column, data) but a difference of two
        # tails means little on a shared machine, so only the median is a target.
        encode_us = _encode_times(codec, prebuilt)
        enc50, enc99 = percentile(encode_us, 50), percentile(encode_us, 99)
        result.data[f"encode_us_{n}"] = {"p50": enc50, "p99": enc99}
        if n == 256:
            result.targets.append(
                Target("tick() p50 beyond encoding, 256 events/tick", p50 - enc50, 10.0, "<=", "us")
            )
            result.targets.append(
                Target("pipeline/codec CPU per event at 256 events/tick", cpu_ratio, 1.25, "<=")
            )
        else:
            result.data[f"cpu_ratio_{n}"] = cpu_ratio
    result.rows.extend(await _emit_cost(pool, sizes))
    if progress is not None:
        progress()
    return result


async def _emit_cost(pool: list[KVCacheEvent], sizes: Sizes) -> list[Row]:
    """`emit` of one event and of lists, per call and per event (no sinks, untimed ticks)."""
    rows: list[Row] = []
    calls = 256
    repeats = max(sizes.event_repeats * 4, 8)
    clock = time.perf_counter_ns
    async with Scheduler(origin=ORIGIN, epoch=EPOCH) as scheduler:
        emit = scheduler.emit
        single = pool[:calls]
        for n in (1, 16, 256):
            lists = chunks(pool, n, calls)
            timings: list[float] = []
            for _ in range(repeats):
                if n == 1:
                    t0 = clock()
                    for event in single:
                        emit(event)
                    dt = clock() - t0
                else:
                    t0 = clock()
                    for events in lists:
                        emit(events)
                    dt = clock() - t0
                await scheduler.tick()
                timings.append(dt / 1000 / calls)
            per_call = statistics.median(timings)
            what = "emit(event)" if n == 1 else f"emit(list of {n})"
            rows.append(
                Row(
                    "host",
                    what,
                    "",
                    1e6 / per_call * n,
                    p50_us=per_call,
                    note=f"{per_call / n * 1000:.0f} ns per event",
                )
            )
    return rows


# -- item 4 -------------------------------------------------------------------------------


async def bench_scaling(
    pool: list[KVCacheEvent], sizes: Sizes, progress: Progress | None = None
) -> Result:
    """Events/s by number of sources (64-event chunks) and of sinks."""
    result = Result("scaling", "Scaling: sources (64-event chunks) and sinks")
    all_chunks = chunks(pool, 64, sizes.scaling_events // 64)
    cases: dict[str, Any] = {}
    for n in sizes.sources:
        per_source = _split(all_chunks, n)

        async def source_case(per_source: list[list[list[KVCacheEvent]]] = per_source) -> Sample:
            return await run_sources(per_source, _null_sinks(1))

        cases[f"{n} sources, 1 sink"] = source_case
    for k in sizes.sinks:
        if k == 1:
            continue
        per_source = _split(all_chunks, 4)

        async def sink_case(
            per_source: list[list[list[KVCacheEvent]]] = per_source, k: int = k
        ) -> Sample:
            return await run_sources(per_source, _null_sinks(k))

        cases[f"4 sources, {k} sinks"] = sink_case
    samples = await interleave(cases, runs=sizes.runs, warmup=sizes.warmup, on_run=progress)
    first = f"{sizes.sources[0]} sources, 1 sink"
    base = summarize(samples[first])
    for name, runs in samples.items():
        s = summarize(runs)
        ratio = statistics.median(
            a.events_per_s / b.events_per_s for a, b in zip(runs, samples[first], strict=True)
        )
        per_batch = statistics.median(
            float((x.extra or {}).get("events_per_batch", 0)) for x in runs
        )
        result.rows.append(
            Row(
                "scaling",
                name,
                "",
                s.events_per_s,
                first if name != first else "",
                ratio if name != first else None,
                s.cpu_us_per_event,
                note=f"{per_batch:.0f} events/batch",
            )
        )
        if name == f"{max(sizes.sources)} sources, 1 sink" and name != first:
            result.targets.append(
                Target(
                    f"events/s, {max(sizes.sources)} sources over {sizes.sources[0]}",
                    ratio,
                    0.75,
                    ">=",
                )
            )
    result.data["baseline_events_per_s"] = base.events_per_s
    return result
