"""Reliability under load: N seeded events through one scheduler into every local sink.

Policy `block` on every sink: nothing may be lost. Each sink's consumer checks
every sequence number once and in order, and every event against the stream
regenerated from the seed (`kvstream.testing.SeededEvents`), so nothing
is held in memory to compare against:

* `queue`: a consumer task reading the `QueueSink` as batches arrive;
* `memory`: the `MemorySink`'s list, checked and emptied every 64 ticks;
* `file`: the JSON-lines file, read back with `FileSubscriber` after
  the run (its read-back time is reported apart).

The CI suite runs the same pipeline with one million events
(`tests/test_reliability_load.py`); this script is the ten-million run:

    python benchmarks/reliability_load.py --events 10000000 --json

Numbers: sent, received, dropped and duplicated per sink, wall time, and the
process's peak resident memory (`ru_maxrss`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from kvstream import FileSink, MemorySink, QueueSink, Scheduler
from kvstream.consumers.base import Gap
from kvstream.consumers.file import FileSubscriber
from kvstream.sinks.base import Sink
from kvstream.testing import SeededEvents, StreamVerifier, VerificationError

SINKS = ("file", "memory", "queue")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def run(
    *, events: int, per_batch: int, sinks: tuple[str, ...], seed: int, folder: Path
) -> dict[str, Any]:
    """One run; returns the measured numbers (raises VerificationError on any loss)."""
    stream = SeededEvents(seed)
    batches = events // per_batch
    path = folder / f"reliability-load-{os.getpid()}.jsonl"
    made: dict[str, Sink] = {}
    if "file" in sinks:
        made["file"] = FileSink(path, policy="block", max_bytes=8 << 20)
    if "memory" in sinks:
        made["memory"] = MemorySink(policy="block", max_batches=256)
    if "queue" in sinks:
        made["queue"] = QueueSink(policy="block", max_batches=256)
    verifiers = {
        name: StreamVerifier(stream, origin="load", events_per_batch=per_batch) for name in made
    }
    memory = made.get("memory")
    queue = made.get("queue")

    def consume_memory() -> None:
        assert isinstance(memory, MemorySink)
        verifiers["memory"].check_all(memory.batches)
        memory.batches.clear()

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        if isinstance(queue, QueueSink):

            async def consume_queue() -> None:
                assert isinstance(queue, QueueSink)
                async for batch in queue:
                    verifiers["queue"].check(batch)

            tg.start_soon(consume_queue)
        async with Scheduler(sinks=list(made.values()), origin="load") as scheduler:
            for n, chunk in enumerate(stream.chunks(batches * per_batch, per_batch)):
                scheduler.emit(chunk)
                await scheduler.tick()
                if memory is not None and n % 64 == 0:
                    consume_memory()
            report = await scheduler.aclose(timeout=600)
    if memory is not None:
        consume_memory()
    pipeline_s = time.perf_counter() - started

    readback_s = None
    file_bytes = None
    if "file" in made:
        file_bytes = path.stat().st_size
        t0 = time.perf_counter()
        async with FileSubscriber(path) as sub:
            async for item in sub:
                if isinstance(item, Gap):
                    raise VerificationError(f"file: {item}")
                verifiers["file"].check(item)
        readback_s = time.perf_counter() - t0
        path.unlink()

    per_sink: dict[str, Any] = {}
    for name, sink in made.items():
        st = sink.statistics()
        v = verifiers[name]
        per_sink[name] = {
            "sent_batches": st.batches_in,
            "sent_events": st.batches_in * per_batch,
            "received_batches": v.batches,
            "received_events": v.events,
            "dropped_batches": st.batches_dropped,
            "missing_batches": v.missing_batches,
            "duplicated_batches": 0,  # the verifier raises on any duplicate
            "undelivered_batches": st.undelivered_batches,
        }
        if v.batches != batches or v.events != batches * per_batch:
            raise VerificationError(f"{name}: {v.batches} of {batches} batches verified")
    return {
        "events": batches * per_batch,
        "batches": batches,
        "events_per_batch": per_batch,
        "seed": seed,
        "complete": report.complete,
        "pipeline_seconds": round(pipeline_s, 2),
        "file_readback_seconds": None if readback_s is None else round(readback_s, 2),
        "file_bytes": file_bytes,
        "events_per_second": round(batches * per_batch / pipeline_s),
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "sinks": per_sink,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=10_000_000, help="events (10,000,000)")
    parser.add_argument("--per-batch", type=int, default=100, help="events per tick (100)")
    parser.add_argument(
        "--sinks", default=",".join(SINKS), help=f"comma-separated subset of {','.join(SINKS)}"
    )
    parser.add_argument("--seed", type=int, default=20260601)
    parser.add_argument(
        "--dir", type=Path, default=None, help="folder for the file sink (a temporary one)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    sinks = tuple(s for s in args.sinks.split(",") if s)
    unknown = set(sinks) - set(SINKS)
    if unknown:
        parser.error(f"--sinks: unknown {sorted(unknown)}; expected {SINKS}")
    folder = args.dir or Path(tempfile.mkdtemp(prefix="kvs-bench-", dir="/tmp"))
    try:
        result = anyio.run(
            lambda: run(
                events=args.events,
                per_batch=args.per_batch,
                sinks=sinks,
                seed=args.seed,
                folder=folder,
            )
        )
    except VerificationError as exc:
        print(f"reliability_load: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.dir is None:
            folder.rmdir()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{result['events']:,} events in {result['batches']:,} batches, "
            f"{result['pipeline_seconds']} s ({result['events_per_second']:,} events/s), "
            f"peak RSS {result['peak_rss_mib']} MiB"
        )
        for name, s in result["sinks"].items():
            print(
                f"  {name:<6} sent {s['sent_events']:,}  received {s['received_events']:,}  "
                f"dropped {s['dropped_batches']}  missing {s['missing_batches']}  "
                f"duplicated {s['duplicated_batches']}"
            )
        if result["file_readback_seconds"] is not None:
            print(
                f"  file: {result['file_bytes']:,} bytes, read back and verified in "
                f"{result['file_readback_seconds']} s"
            )
    return 0 if result["complete"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
