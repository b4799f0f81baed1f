"""Memory under a stalled sink (issue item 5).

A scheduler feeds two sinks with the same JSON codec: a healthy null sink and a
sink whose `write` never returns (a stalled transport) with a configured bound
(`max_bytes`). Because the codec is shared, every batch the healthy sink
encodes carries its bytes while it waits in the stalled sink's outbox, so the
outbox holds real encoded bytes, as it would with a slow socket.

Each policy runs in a fresh interpreter (`python -m kvstream._bench.memory`):
memory that earlier benchmarks freed stays resident and would be reused, hiding
growth. The host emits 64-event chunks cycled from the pre-built pool and ticks. RSS is
taken after a short warm-up (8 chunks: the pipeline's first allocations made,
the stalled outbox far below its bound), then sampled until every event has
flowed, so the stalled outbox's filling is part of the growth. A warm-up that
churned more memory would hide growth: the allocator would reuse what it freed.
With `drop_oldest` and `drop_newest` the flow never stops and the growth
must stay within the bound plus 32 MB; with `block` the tick waits once the
outbox is full (backpressure): the run stops there and reports how far it got.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

from kvstream._bench.harness import NullSink
from kvstream._bench.measure import Meter, rss_bytes
from kvstream._bench.quiet import quiet_logs
from kvstream._bench.results import Result, Row, Target
from kvstream._bench.sizes import Sizes
from kvstream._bench.workload import EPOCH, ORIGIN, chunks, event_pool
from kvstream.codecs.json import JsonCodec
from kvstream.events import EventBatch, KVCacheEvent
from kvstream.scheduler import Scheduler
from kvstream.sinks.base import OverflowPolicy, Sink

__all__ = ["StalledSink", "bench_memory"]

Progress = Callable[[], None]

_MB = 1024 * 1024
_SLACK = 32 * _MB


class StalledSink(Sink):
    """A sink whose transport never accepts anything: `write` waits forever."""

    async def write(self, data: bytes, batch: EventBatch) -> None:
        await anyio.sleep_forever()


async def _run_policy(
    pool: list[KVCacheEvent], sizes: Sizes, policy: OverflowPolicy
) -> dict[str, Any]:
    chunk_size = 64
    n_chunks = sizes.memory_events // chunk_size
    cycle = chunks(pool, chunk_size, min(n_chunks, 2048))
    # Warm-up: the pipeline's first allocations, with the stalled outbox still far
    # below its bound (8 chunks of 64 events: about 1 MB of JSON).
    warmup_chunks = 8
    healthy = NullSink(0, codec=JsonCodec(), name="healthy")
    stalled = StalledSink(
        codec=JsonCodec(),
        policy=policy,
        max_bytes=sizes.memory_bound_bytes,
        name=f"stalled ({policy})",
        close_timeout=0.0,
    )
    gc.collect()
    flowed = 0
    blocked = False
    async with Scheduler(
        sinks=[healthy, stalled], origin=ORIGIN, epoch=EPOCH, close_timeout=0.5
    ) as scheduler:
        emit = scheduler.emit
        tick = scheduler.tick
        checkpoint = anyio.lowlevel.checkpoint
        base = peak = rss_bytes()  # replaced after the warm-up (if the run gets there)
        meter = Meter()
        for i in range(n_chunks):
            if i == warmup_chunks:
                gc.collect()
                base = rss_bytes()
                peak = base
            events = cycle[i % len(cycle)]
            emit(events)
            with anyio.move_on_after(1.0) as scope:
                await tick()
            if scope.cancelled_caught:
                blocked = True
                break
            flowed += len(events)
            await checkpoint()
            if i % 64 == 0 and i >= warmup_chunks:
                peak = max(peak, rss_bytes())
        elapsed = meter.stop(flowed)
        end = rss_bytes()
        peak = max(peak, end)
        stats = stalled.statistics()
        healthy_stats = healthy.statistics()
    return {
        "policy": policy,
        "bound_mb": sizes.memory_bound_bytes / _MB,
        "events_flowed": flowed,
        "blocked": blocked,
        "rss_warm_mb": base / _MB,
        "rss_growth_mb": (end - base) / _MB,
        "rss_peak_growth_mb": (peak - base) / _MB,
        "stalled_queued_batches": stats.queued_batches,
        "stalled_queued_mb": stats.queued_bytes / _MB,
        "stalled_dropped_events": stats.events_dropped,
        "healthy_events_out": healthy_stats.events_out,
        "seconds": elapsed.wall,
    }


POLICIES: tuple[OverflowPolicy, ...] = ("drop_oldest", "drop_newest", "block")


async def _run_in_child(sizes: Sizes, policy: OverflowPolicy) -> dict[str, Any]:
    """One policy in a fresh interpreter: memory freed by whatever ran before in this
    process stays resident (the allocator keeps it) and would hide the growth."""
    argv = [
        sys.executable,
        "-m",
        "kvstream._bench.memory",
        policy,
        "--events",
        str(sizes.memory_events),
        "--bound",
        str(sizes.memory_bound_bytes),
        "--pool-events",
        str(sizes.pool_events),
    ]
    done = await anyio.run_process(argv, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"memory benchmark child failed ({done.returncode}): "
            f"{done.stderr.decode(errors='replace')[-800:]}"
        )
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def main(argv: list[str] | None = None) -> int:
    """Child entry: `python -m kvstream._bench.memory POLICY --events N --bound BYTES`."""
    p = argparse.ArgumentParser(prog="python -m kvstream._bench.memory")
    p.add_argument("policy", choices=POLICIES)
    p.add_argument("--events", type=int, required=True)
    p.add_argument("--bound", type=int, required=True)
    p.add_argument("--pool-events", type=int, default=8192)
    args = p.parse_args(argv)
    sizes = Sizes(
        pool_events=args.pool_events, memory_events=args.events, memory_bound_bytes=args.bound
    )
    pool = event_pool(sizes.pool_events)
    gc.collect()
    gc.freeze()

    async def go() -> dict[str, Any]:
        with quiet_logs():
            return await _run_policy(pool, sizes, args.policy)

    print(json.dumps(anyio.run(go)))
    return 0


async def bench_memory(
    pool: list[KVCacheEvent], sizes: Sizes, progress: Progress | None = None
) -> Result:
    """RSS growth with one stalled sink, per overflow policy, against its bound."""
    result = Result("memory", "Memory: one sink stalled, events keep flowing")
    for policy in POLICIES:
        data = await _run_in_child(sizes, policy)
        result.data[policy] = data
        limit = data["bound_mb"] + _SLACK / _MB
        note = (
            f"{data['events_flowed']:,} events flowed; stalled outbox "
            f"{data['stalled_queued_batches']} batches, {data['stalled_queued_mb']:.1f} MB; "
            f"{data['stalled_dropped_events']:,} events dropped (counted)"
        )
        if data["blocked"]:
            note += "; tick blocked once the outbox was full (backpressure)"
        result.rows.append(
            Row(
                "memory",
                f"stalled sink, policy {policy}",
                f"bound {data['bound_mb']:.0f} MB",
                mb_per_s=None,
                note=f"RSS growth {data['rss_growth_mb']:.1f} MB "
                f"(peak {data['rss_peak_growth_mb']:.1f} MB); " + note,
            )
        )
        result.targets.append(
            Target(
                f"RSS peak growth, {policy} (MB, bound {data['bound_mb']:.0f} + 32)",
                data["rss_peak_growth_mb"],
                limit,
                "<=",
                "MB",
            )
        )
        if progress is not None:
            progress()
    return result


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
