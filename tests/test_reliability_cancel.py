"""Cancellation on the put path never loses a sealed batch (issue 15, item 3).

The host cancels ``tick()`` at random points while ``block`` sinks are full
(``move_on_after`` with random timeouts, a second task ticking concurrently,
``aclose`` with a short deadline). Whatever happens, every sink accounts for
every accepted event: delivered, counted as dropped, or reported undelivered
at close. Delivered batches arrive in order, each at most once.
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from kvstream import BlockRemoved, EventBatch, MemorySink, Scheduler, Sink

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


class SlowSink(Sink):
    """A ``block`` sink whose writer needs a few loop turns per batch (never inline)."""

    def __init__(self, turns: int, **options: Any) -> None:
        options.setdefault("codec", None)
        super().__init__(**options)
        self.turns = turns
        self.batches: list[EventBatch] = []

    async def write(self, data: bytes, batch: EventBatch) -> None:
        for _ in range(self.turns):
            await anyio.lowlevel.checkpoint()
        self.batches.append(batch)


def delivered(sink: SlowSink | MemorySink) -> list[EventBatch]:
    return sink.batches


def check_accounting(sink: SlowSink | MemorySink, accepted: int, report: Any) -> None:
    batches = delivered(sink)
    seqs = [b.seq for b in batches]
    assert seqs == sorted(set(seqs)), f"{sink.name}: out of order or repeated: {seqs[:20]}"
    st = sink.statistics()
    got = sum(len(b.events) for b in batches)
    assert (sink.name, got + st.events_dropped + st.undelivered_events) == (sink.name, accepted)
    assert st.events_out == got
    mine = next(r for r in report.sinks if r.name == sink.name)
    assert mine.undelivered_events == st.undelivered_events


@pytest.mark.parametrize("seed", range(6))
async def test_cancelled_ticks_never_lose_a_sealed_batch(seed: int) -> None:
    rnd = random.Random(seed)
    sinks: list[Any] = [
        SlowSink(3, name="slow-block", policy="block", max_batches=2),
        SlowSink(1, name="slower-block", policy="block", max_batches=1),
        SlowSink(2, name="drop-oldest", policy="drop_oldest", max_batches=2),
        MemorySink(name="inline"),
    ]
    accepted = 0
    hash_no = 0
    async with Scheduler(sinks=sinks, origin="o", close_timeout=0.05) as scheduler:

        async def rival() -> None:
            # Another task ticking now and then: it may become the dispatcher
            # while the host's tick is cancelled, or wait for the host's.
            while True:
                await anyio.sleep(rnd.choice([0, 0.0001, 0.001]))
                with anyio.move_on_after(rnd.choice([0, 0.0002, 0.002])):
                    await scheduler.tick()

        async with anyio.create_task_group() as tg:
            tg.start_soon(rival)
            for _ in range(300):
                n = rnd.randint(1, 3)
                scheduler.emit([BlockRemoved(block_hashes=[hash_no + i]) for i in range(n)])
                hash_no += n
                accepted += n
                with anyio.move_on_after(rnd.choice([0, 0, 0.0001, 0.0005, 0.003])):
                    await scheduler.tick()
                if rnd.random() < 0.2:
                    await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        report = await scheduler.aclose(timeout=rnd.choice([0.0, 0.05, 1.0]))
    stats = scheduler.statistics()
    assert stats.events_sealed == accepted  # everything accepted was sealed
    for sink in sinks:
        check_accounting(sink, accepted, report)


async def test_a_tick_cancelled_on_a_full_block_sink_is_delivered_at_close() -> None:
    """The failure issue 15 found: the last tick of ``aclose`` sealed nothing new and
    returned early, so a batch left in the backlog by a cancelled tick reached no
    sink, not even the healthy one."""
    stuck = SlowSink(10_000, name="stuck", policy="block", max_batches=1)
    healthy = MemorySink(name="healthy")
    async with Scheduler(sinks=[stuck, healthy], origin="o", close_timeout=0.05) as s:
        for seq in range(4):
            s.emit(BlockRemoved(block_hashes=[seq]))
            with anyio.move_on_after(0.01):
                await s.tick()  # seq 2 and 3 wait for room in "stuck", then are cancelled
        report = await s.aclose()
    assert [b.seq for b in healthy.batches] == [0, 1, 2, 3]
    stuck_report = next(r for r in report.sinks if r.name == "stuck")
    st = stuck.statistics()
    assert len(stuck.batches) + st.undelivered_batches + st.batches_dropped == 4
    assert stuck_report.undelivered_batches == st.undelivered_batches


async def test_a_sink_closed_by_its_owner_counts_what_it_no_longer_takes() -> None:
    early = MemorySink(name="early")
    late = MemorySink(name="late")
    async with Scheduler(sinks=[early, late], origin="o") as s:
        s.emit(BlockRemoved(block_hashes=[1]))
        await s.tick()
        await early.aclose()
        s.emit([BlockRemoved(block_hashes=[2]), BlockRemoved(block_hashes=[3])])
        await s.tick()
    assert [b.seq for b in late.batches] == [0, 1]
    st = early.statistics()
    assert (st.batches_out, st.batches_dropped, st.events_dropped) == (1, 1, 2)
