"""Overload: a sink stalled while the engine keeps ticking.

The stalled sink's ``write`` waits at a gate the test holds closed (a
:class:`~kvstream.testing.FaultySink`), so the stall is a fact, not a timing.
With ``drop_oldest``/``drop_newest`` every tick runs to its end without
suspending once (checked by stepping the ``tick()`` coroutine by hand), the
outbox stays within its byte bound, traced memory stays flat, and the drops the
sink counts are exactly the gaps its consumer sees. With ``block`` the tick
waits, and nothing is lost.
"""

from __future__ import annotations

import logging
import tracemalloc
from collections.abc import Coroutine
from typing import Any

import anyio
import pytest

from kvstream import EventBatch, Scheduler
from kvstream.testing import FaultySink, SeededEvents, StreamVerifier

PER_BATCH = 20
STALLED_TICKS = 3000
MAX_BYTES = 256 * 1024

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


def run_without_suspending(coro: Coroutine[Any, Any, EventBatch | None]) -> EventBatch | None:
    """Run ``coro`` to its end in one step; fail if it would wait for anything."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise AssertionError("tick() suspended: it waited for a stalled sink")


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(1 for r in caplog.records if r.name == "kvstream.sinks" and text in r.getMessage())


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest"])
async def test_a_stalled_drop_sink_never_makes_the_tick_wait(
    policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstream.sinks")
    stream = SeededEvents(7)
    seen_by_stalled = StreamVerifier(stream, origin="eng", events_per_batch=PER_BATCH)
    seen_by_healthy = StreamVerifier(stream, origin="eng", events_per_batch=PER_BATCH)
    stalled = FaultySink(
        name="stalled", policy=policy, max_bytes=MAX_BYTES, on_batch=seen_by_stalled.check
    )
    # A healthy sink beside it, with policy block: it must get every batch.
    healthy = FaultySink(name="healthy", policy="block", on_batch=seen_by_healthy.check)
    seq = 0

    async with Scheduler(sinks=[stalled, healthy], origin="eng") as scheduler:

        def emit_and_tick() -> None:
            nonlocal seq
            scheduler.emit(stream.events(seq * PER_BATCH, (seq + 1) * PER_BATCH))
            batch = run_without_suspending(scheduler.tick())
            assert batch is not None
            assert batch.seq == seq
            seq += 1

        stalled.stall()
        emit_and_tick()
        await stalled.wait_stalled()  # the writer is inside write(), at the gate

        tracemalloc.start()
        try:
            baseline = tracemalloc.get_traced_memory()[0]
            peak_queued = 0
            for _ in range(STALLED_TICKS):
                emit_and_tick()
                # Let the healthy sink's writer run; the stalled one stays at the gate.
                await anyio.lowlevel.checkpoint()
                st = stalled.statistics()
                assert st.queued_bytes <= MAX_BYTES
                peak_queued = max(peak_queued, st.queued_bytes)
            grown = tracemalloc.get_traced_memory()[0] - baseline
        finally:
            tracemalloc.stop()
        assert stalled.attempts == 1  # still the first send, never returned
        st = stalled.statistics()
        # Made while stalled: 3000 batches of 20 events; nearly all were dropped.
        assert st.batches_dropped > STALLED_TICKS // 2
        # Memory held stays near the outbox bound, not what was produced.
        assert grown < 8 * MAX_BYTES, (grown, peak_queued)
        assert _warnings(caplog, "dropping batches") == 1  # one burst, one record

        stalled.release()
        await anyio.wait_all_tasks_blocked()  # the writer emptied the outbox
        assert stalled.statistics().queued_batches == 0
        # After the stall, a few more batches: a trailing gap becomes visible.
        for _ in range(3):
            emit_and_tick()
        report = await scheduler.aclose(timeout=30)

    assert report.complete, report
    st = stalled.statistics()
    total = STALLED_TICKS + 4
    assert st.batches_in == total
    assert st.batches_out + st.batches_dropped == total
    # Every drop the sink counted is a gap its consumer saw, and nothing else is.
    assert seen_by_stalled.missing_batches == st.batches_dropped
    assert seen_by_stalled.missing_events == st.events_dropped == st.batches_dropped * PER_BATCH
    assert seen_by_stalled.batches == st.batches_out
    assert seen_by_stalled.gaps == 1
    assert _warnings(caplog, "dropping batches") == 1
    assert _warnings(caplog, "outbox drained") == 1
    # The healthy sink lost nothing.
    assert (seen_by_healthy.batches, seen_by_healthy.gaps) == (total, 0)
    assert healthy.statistics().batches_dropped == 0


async def test_a_stalled_block_sink_makes_the_tick_wait_and_loses_nothing() -> None:
    stream = SeededEvents(8)
    seen = StreamVerifier(stream, origin="eng", events_per_batch=PER_BATCH)
    stalled = FaultySink(name="stalled", policy="block", max_batches=4, on_batch=seen.check)
    done: list[int] = []
    seq = 0

    async with Scheduler(sinks=[stalled], origin="eng") as scheduler:

        async def emit_and_tick() -> None:
            nonlocal seq
            scheduler.emit(stream.events(seq * PER_BATCH, (seq + 1) * PER_BATCH))
            seq += 1
            batch = await scheduler.tick()
            assert batch is not None
            done.append(batch.seq)

        stalled.stall()
        await emit_and_tick()
        await stalled.wait_stalled()
        for _ in range(4):  # the outbox has room for 4 batches: no wait
            scheduler.emit(stream.events(seq * PER_BATCH, (seq + 1) * PER_BATCH))
            seq += 1
            assert run_without_suspending(scheduler.tick()) is not None
        assert stalled.statistics().queued_batches == 4

        async with anyio.create_task_group() as tg:
            tg.start_soon(emit_and_tick)
            await anyio.wait_all_tasks_blocked()
            # Every task is blocked, the tick among them: it waits for the sink.
            assert done == [0]
            assert stalled.attempts == 1
            stalled.release()
        assert done == [0, 5]
        for _ in range(20):
            await emit_and_tick()
        report = await scheduler.aclose(timeout=30)

    assert report.complete, report
    st = stalled.statistics()
    assert (st.batches_in, st.batches_out, st.batches_dropped) == (26, 26, 0)
    assert (seen.batches, seen.gaps, seen.events) == (26, 0, 26 * PER_BATCH)


async def test_a_waiting_tick_that_is_cancelled_loses_and_repeats_nothing() -> None:
    """The host gives up on a tick that waits for a full ``block`` sink (a timeout,
    a shutdown): its batch keeps its place, the next tick still waits behind it,
    and every batch arrives once, in order."""
    stream = SeededEvents(9)
    seen = StreamVerifier(stream, origin="eng", events_per_batch=2)
    stalled = FaultySink(name="stalled", policy="block", max_batches=2, on_batch=seen.check)
    seq = 0
    async with Scheduler(sinks=[stalled], origin="eng") as scheduler:

        def emit() -> None:
            nonlocal seq
            scheduler.emit(stream.events(seq * 2, seq * 2 + 2))
            seq += 1

        stalled.stall()
        emit()
        await scheduler.tick()
        await stalled.wait_stalled()
        for _ in range(2):
            emit()
            assert run_without_suspending(scheduler.tick()) is not None
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def give_up() -> None:
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()  # the host stops waiting for seq 3

                tg.start_soon(give_up)
                emit()
                await scheduler.tick()
        assert scope.cancelled_caught
        done = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def next_tick() -> None:
                emit()
                await scheduler.tick()
                done.set()

            tg.start_soon(next_tick)
            await anyio.wait_all_tasks_blocked()
            assert not done.is_set()  # seq 4 waits behind seq 3, which still waits
            stalled.release()
        for _ in range(5):
            emit()
            await scheduler.tick()
        report = await scheduler.aclose(timeout=30)
    assert report.complete
    assert (seen.batches, seen.gaps) == (10, 0)  # seq 0..9, each once, in order
    assert stalled.statistics().batches_dropped == 0
