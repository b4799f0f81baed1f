"""Memory under a stalled sink (issue item 5).

A scheduler feeds two sinks with the same JSON codec: a healthy null sink and a
sink whose ``send`` never returns (a stalled transport) with a configured bound
(``max_bytes``). Because the codec is shared, every batch the healthy sink
encodes carries its bytes while it waits in the stalled sink's outbox, so the
outbox holds real encoded bytes, as it would with a slow socket.

The host emits 64-event chunks cycled from the pre-built pool and ticks. RSS is
taken after a warm-up (2% of the events, at least 16 chunks) during which the
sink still delivers; then the sink stalls, and RSS is sampled until every
event has flowed, so the stalled outbox's filling is part of the growth. With ``drop_oldest`` and
``drop_newest`` the flow never stops and the growth must stay within the bound
plus 32 MB; with ``block`` the tick waits once the outbox is full
(backpressure): the run stops there and reports how far it got.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

from kvstream.bench.harness import NullSink
from kvstream.bench.measure import Meter, rss_bytes
from kvstream.bench.results import Result, Row, Target
from kvstream.bench.sizes import Sizes
from kvstream.bench.workload import EPOCH, ORIGIN, chunks
from kvstream.codecs.json import JsonCodec
from kvstream.events import EventBatch, KVCacheEvent
from kvstream.scheduler import Scheduler
from kvstream.sinks.base import Sink

__all__ = ["StalledSink", "bench_memory"]

Progress = Callable[[], None]

_MB = 1024 * 1024
_SLACK = 32 * _MB


class StalledSink(Sink):
    """A sink that discards batches until :attr:`stalled` is set; then ``send`` waits
    forever (a transport that stopped accepting anything)."""

    stalled = False

    async def send(self, data: bytes, batch: EventBatch) -> None:
        if self.stalled:
            await anyio.sleep_forever()


async def _run_policy(
    pool: list[KVCacheEvent], sizes: Sizes, policy: str
) -> dict[str, Any]:
    chunk_size = 64
    n_chunks = sizes.memory_events // chunk_size
    cycle = chunks(pool, chunk_size, min(n_chunks, 2048))
    warmup_chunks = max(n_chunks // 50, 16)
    healthy = NullSink(0, codec=JsonCodec(), name="healthy")
    stalled = StalledSink(
        codec=JsonCodec(), policy=policy, max_bytes=sizes.memory_bound_bytes,  # type: ignore[arg-type]
        name=f"stalled ({policy})", close_timeout=0.0,
    )
    gc.collect()
    peak = 0
    flowed = 0
    blocked = False
    async with Scheduler(
        sinks=[healthy, stalled], origin=ORIGIN, epoch=EPOCH, close_timeout=0.5
    ) as scheduler:
        emit = scheduler.emit
        tick = scheduler.tick
        checkpoint = anyio.lowlevel.checkpoint
        base = 0
        meter = Meter()
        for i in range(n_chunks):
            if i == warmup_chunks:
                # Warm: every buffer of the pipeline has been allocated. Stall now.
                gc.collect()
                base = rss_bytes()
                peak = base
                stalled.stalled = True
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


async def bench_memory(
    pool: list[KVCacheEvent], sizes: Sizes, progress: Progress | None = None
) -> Result:
    """RSS growth with one stalled sink, per overflow policy, against its bound."""
    result = Result("memory", "Memory: one sink stalled, events keep flowing")
    for policy in ("drop_oldest", "drop_newest", "block"):
        data = await _run_policy(pool, sizes, policy)
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
            Row("memory", f"stalled sink, policy {policy}",
                f"bound {data['bound_mb']:.0f} MB",
                mb_per_s=None,
                note=f"RSS growth {data['rss_growth_mb']:.1f} MB "
                     f"(peak {data['rss_peak_growth_mb']:.1f} MB); " + note)
        )
        result.targets.append(
            Target(f"RSS peak growth, {policy} (MB, bound {data['bound_mb']:.0f} + 32)",
                   data["rss_peak_growth_mb"], limit, "<=", "MB")
        )
        if progress is not None:
            progress()
    return result
