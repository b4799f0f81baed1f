"""Overload: one sink stalled (its send waits at a gate) while the engine keeps ticking.

For each policy, `--stalled-ticks` ticks of `--per-batch` events run while
the stalled sink is provably inside `write`; a healthy sink with policy
`block` runs beside it. Measured, per policy:

* ticks that suspended (stepping each `tick()` coroutine by hand: a tick that
  completes in one step never waited);
* the stalled outbox's peak `queued_bytes` against its `max_bytes`, and the
  traced memory (tracemalloc) the run grew by, against what the batches made
  during the stall take when held;
* batches sent, delivered, dropped (as the sink counted them) and missing,
  duplicated (as the consumer saw them after the gate opened).

For `block` the stalled tick is released after `--block-wait` seconds by
opening the gate; what is reported is that it waited and that nothing was lost.


    python benchmarks/reliability_overload.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from collections.abc import Coroutine
from typing import Any

import anyio
import anyio.lowlevel

from kvstream import EventBatch, Scheduler
from kvstream.testing import FaultySink, SeededEvents, StreamVerifier


def _step(coro: Coroutine[Any, Any, EventBatch | None]) -> bool:
    """Run a tick; True if it completed without suspending (then it never waited)."""
    try:
        coro.send(None)
    except StopIteration:
        return True
    return False


async def drop_run(policy: str, ticks: int, per_batch: int, max_bytes: int) -> dict[str, Any]:
    stream = SeededEvents(7)
    stalled_seen = StreamVerifier(stream, origin="eng", events_per_batch=per_batch)
    healthy_seen = StreamVerifier(stream, origin="eng", events_per_batch=per_batch)
    stalled = FaultySink(
        name="stalled", policy=policy, max_bytes=max_bytes, on_batch=stalled_seen.check
    )
    healthy = FaultySink(name="healthy", policy="block", on_batch=healthy_seen.check)
    seq = 0
    suspended = 0
    peak_queued = 0
    async with Scheduler(sinks=[stalled, healthy], origin="eng") as scheduler:

        async def tick() -> None:
            nonlocal seq, suspended
            scheduler.emit(stream.events(seq * per_batch, (seq + 1) * per_batch))
            seq += 1
            coro = scheduler.tick()
            if not _step(coro):
                suspended += 1
                coro.close()
                raise RuntimeError(f"{policy}: a tick suspended")

        stalled.stall()
        await tick()
        await stalled.wait_stalled()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        started = time.perf_counter()
        for _ in range(ticks):
            await tick()
            await anyio.lowlevel.checkpoint()
            peak_queued = max(peak_queued, stalled.statistics().queued_bytes)
        elapsed = time.perf_counter() - started
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        stalled.release()
        await anyio.wait_all_tasks_blocked()
        for _ in range(3):
            await tick()
        report = await scheduler.aclose(timeout=60)
    st = stalled.statistics()
    held = _held_bytes(stream, ticks, per_batch)
    return {
        "policy": policy,
        "stalled_ticks": ticks,
        "events_per_batch": per_batch,
        "ticks_suspended": suspended,
        "stall_seconds_traced": round(elapsed, 3),  # tracemalloc on: slow
        "max_bytes": max_bytes,
        "peak_queued_bytes": peak_queued,
        "traced_growth_bytes": grown,
        "held_if_kept_bytes": held,
        "sent_batches": st.batches_in,
        "delivered_batches": st.batches_out,
        "dropped_batches": st.batches_dropped,
        "dropped_events": st.events_dropped,
        "consumer_missing_batches": stalled_seen.missing_batches,
        "consumer_missing_events": stalled_seen.missing_events,
        "consumer_gaps": stalled_seen.gaps,
        "duplicated_batches": 0,  # the verifier raises on any duplicate
        "healthy_delivered": healthy_seen.batches,
        "healthy_missing": healthy_seen.missing_batches,
        "complete": report.complete,
    }


async def block_run(per_batch: int, wait: float) -> dict[str, Any]:
    stream = SeededEvents(8)
    seen = StreamVerifier(stream, origin="eng", events_per_batch=per_batch)
    stalled = FaultySink(name="stalled", policy="block", max_batches=4, on_batch=seen.check)
    seq = 0
    async with Scheduler(sinks=[stalled], origin="eng") as scheduler:

        def emit() -> None:
            nonlocal seq
            scheduler.emit(stream.events(seq * per_batch, (seq + 1) * per_batch))
            seq += 1

        stalled.stall()
        emit()
        await scheduler.tick()
        await stalled.wait_stalled()
        free = 0
        while stalled.statistics().queued_batches < stalled.max_batches:
            emit()  # ticks that fit the outbox complete at once
            if not _step(scheduler.tick()):
                raise RuntimeError("block: a tick suspended with room in the outbox")
            free += 1
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            done = anyio.Event()

            async def waiting_tick() -> None:
                emit()
                await scheduler.tick()
                done.set()

            tg.start_soon(waiting_tick)
            await anyio.wait_all_tasks_blocked()
            blocked = not done.is_set()
            await anyio.sleep(wait)
            still_blocked = not done.is_set()
            stalled.release()
        waited = time.perf_counter() - started
        for _ in range(20):
            emit()
            await scheduler.tick()
        report = await scheduler.aclose(timeout=60)
    st = stalled.statistics()
    return {
        "policy": "block",
        "ticks_completed_before_full": free,
        "tick_blocked_while_stalled": blocked and still_blocked,
        "tick_waited_seconds": round(waited, 3),
        "sent_batches": st.batches_in,
        "delivered_batches": st.batches_out,
        "dropped_batches": st.batches_dropped,
        "consumer_missing_batches": seen.missing_batches,
        "consumer_received_batches": seen.batches,
        "complete": report.complete,
    }


def _held_bytes(stream: SeededEvents, ticks: int, per_batch: int) -> int:
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    kept = [stream.events(i * per_batch, (i + 1) * per_batch) for i in range(ticks)]
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del kept
    return held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stalled-ticks", type=int, default=3000)
    parser.add_argument("--per-batch", type=int, default=20)
    parser.add_argument("--max-bytes", type=int, default=256 * 1024)
    parser.add_argument("--block-wait", type=float, default=2.0, help="seconds (2)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    async def everything() -> list[dict[str, Any]]:
        out = []
        for policy in ("drop_oldest", "drop_newest"):
            out.append(await drop_run(policy, args.stalled_ticks, args.per_batch, args.max_bytes))
        out.append(await block_run(args.per_batch, args.block_wait))
        return out

    results = anyio.run(everything)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(json.dumps(r))
    ok = all(r["complete"] for r in results)
    if not ok:
        print("reliability_overload: a close report was incomplete", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
