"""The file sink at the codec's speed (issue 12, target 5).

Four async sources yield 64-event chunks (awaiting once after each), the host
ticks in a tight loop (`tick()`, one checkpoint), and a [`FileSink`][kvstream.sinks.file.FileSink]
writes JSON lines to a file on tmpfs (`/dev/shm`: the pipeline and the write
calls are measured, not a disk) and to `/dev/null`. The baseline, interleaved
in the same run: the JSON codec alone encoding batches of the same size (four
chunks, 256 events) and writing each with one `os.write` to the same target.
Events/s are timed to the last byte handed to the OS; ratios are medians of
per-round ratios.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import statistics
import tempfile
from collections.abc import Callable, Sequence

from kvstream._bench.harness import Countdown, drive, free_source, wait_delivered
from kvstream._bench.measure import Meter, Sample, interleave, summarize
from kvstream._bench.results import Result, Row, Target
from kvstream._bench.sizes import Sizes
from kvstream._bench.workload import EPOCH, ORIGIN, batches, chunks
from kvstream.codecs.json import JsonCodec
from kvstream.events import EventBatch, KVCacheEvent
from kvstream.scheduler import Scheduler
from kvstream.sinks.file import FileSink

__all__ = ["bench_file"]

Progress = Callable[[], None]

SOURCES = 4
CHUNK = 64


def _scratch_dir() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


def _faults() -> int:
    """Minor page faults of this process so far (fresh memory touched)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _median_extra(samples: Sequence[Sample], key: str) -> float:
    return statistics.median(float((x.extra or {}).get(key, 0)) for x in samples)


def _codec_writing(path: str, prebuilt: Sequence[EventBatch], events: int) -> Sample:
    """The baseline: encode each batch and write it with one `os.write`."""
    encode = JsonCodec().encode
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o600)
    nbytes = 0
    try:
        faults = _faults()
        meter = Meter()
        for batch in prebuilt:
            data = encode(batch)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            nbytes += len(data)
        sample = meter.stop(events, nbytes, faults_per_event=(_faults() - faults) / events)
    finally:
        os.close(fd)
    return sample


async def _pipeline(path: str, per_source: Sequence[Sequence[list[KVCacheEvent]]]) -> Sample:
    total = sum(len(c) for chunks_ in per_source for c in chunks_)
    if path != os.devnull:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    sink = FileSink(path, codec=JsonCodec())
    countdown = Countdown(len(per_source))
    async with Scheduler(sinks=[sink], origin=ORIGIN, epoch=EPOCH) as scheduler:
        faults = _faults()
        meter = Meter()
        for i, source_chunks in enumerate(per_source):
            scheduler.add_source(free_source(source_chunks, countdown), name=f"source-{i}")
        ticks = await drive(scheduler, countdown)
        await wait_delivered([sink], total)
        stats = scheduler.statistics()
        sample = meter.stop(
            total,
            sink.statistics().bytes_out,
            ticks=ticks,
            events_per_batch=stats.events_sealed / max(stats.batches_sealed, 1),
            faults_per_event=(_faults() - faults) / total,
            batches_inline=sink.batches_inline,
            batches=stats.batches_sealed,
        )
    return sample


async def bench_file(
    pool: list[KVCacheEvent], sizes: Sizes, progress: Progress | None = None
) -> Result:
    """FileSink pipeline events/s over the JSON codec writing the same batches."""
    result = Result("file", f"File sink: {SOURCES} sources x {CHUNK}-event chunks, tight tick loop")
    n_chunks = max(sizes.scaling_events // CHUNK, SOURCES)
    all_chunks = chunks(pool, CHUNK, n_chunks)
    per_source = [all_chunks[i::SOURCES] for i in range(SOURCES)]
    prebuilt = batches(pool, CHUNK * SOURCES, n_chunks // SOURCES)
    base_events = CHUNK * SOURCES * (n_chunks // SOURCES)
    folder = tempfile.mkdtemp(prefix="kvbench-file-", dir=_scratch_dir())
    targets = {"tmpfs file": os.path.join(folder, "events.jsonl"), "/dev/null": os.devnull}
    try:
        for where, path in targets.items():
            base_path = path if path == os.devnull else os.path.join(folder, "codec.jsonl")

            async def codec_case(base_path: str = base_path) -> Sample:
                return _codec_writing(base_path, prebuilt, base_events)

            async def pipeline_case(path: str = path) -> Sample:
                return await _pipeline(path, per_source)

            samples = await interleave(
                {"codec": codec_case, "pipeline": pipeline_case},
                runs=sizes.runs,
                warmup=sizes.warmup,
                on_run=progress,
            )
            base = summarize(samples["codec"])
            pipe = summarize(samples["pipeline"])
            ratio = statistics.median(
                a.events_per_s / b.events_per_s
                for a, b in zip(samples["pipeline"], samples["codec"], strict=True)
            )
            per_batch = _median_extra(samples["pipeline"], "events_per_batch")
            inline = statistics.median(
                (x.extra or {}).get("batches_inline", 0) / max((x.extra or {}).get("batches", 1), 1)
                for x in samples["pipeline"]
            )
            result.rows.append(
                Row(
                    "file",
                    f"JSON codec alone writing, {where} (baseline)",
                    f"{CHUNK * SOURCES}/batch",
                    base.events_per_s,
                    cpu_us_per_event=base.cpu_us_per_event,
                    mb_per_s=base.mb_per_s,
                    note=f"{_median_extra(samples['codec'], 'faults_per_event'):.2f} faults/event",
                )
            )
            result.rows.append(
                Row(
                    "file",
                    f"pipeline -> FileSink, {where}",
                    f"{SOURCES}x{CHUNK}",
                    pipe.events_per_s,
                    "codec writing",
                    ratio,
                    pipe.cpu_us_per_event,
                    mb_per_s=pipe.mb_per_s,
                    note=(
                        f"{per_batch:.0f} events/batch; {inline:.0%} of batches written inline; "
                        f"{_median_extra(samples['pipeline'], 'faults_per_event'):.2f} faults/event"
                    ),
                )
            )
            result.targets.append(
                Target(f"[12.5] FileSink pipeline over codec writing, {where}", ratio, 0.85, ">=")
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return result
