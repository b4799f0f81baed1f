"""The thread bridge: ThreadsafeHandle, LoopThread and run_in_thread (kvstream.threadsafe)."""

from __future__ import annotations

import random
import threading

import anyio
import anyio.to_thread
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream import AllBlocksCleared, BlockRemoved, EventBatch, KVCacheEvent, MemorySink, Scheduler
from kvstream._threadsafe import LoopThread, ThreadsafeHandle, run_in_thread
from kvstream.errors import ClosedError, ConfigError, InvalidEventTypeError


def ev(i: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[i], medium="GPU")


def step_sizes(seed: int, steps: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice((0, 1, 1, 2, 3, 8)) for _ in range(steps)]


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_every_thread_side_tick_seals_exactly_its_steps_events(seed: int) -> None:
    """10,000 unpaused steps from a thread: every batch is exactly its step's events."""
    sizes = step_sizes(seed, 10_000)
    sink = MemorySink(max_batches=20_000)
    returned: list[EventBatch | None] = []
    with run_in_thread(Scheduler(sinks=[sink], origin="engine")) as kv:
        futures = []
        n = 0
        for size in sizes:
            for _ in range(size):
                kv.emit(ev(n))
                n += 1
            futures.append(kv.tick())
        returned = [f.result(timeout=30) for f in futures]
    n = 0
    expected: list[list[KVCacheEvent]] = []
    for step, size in enumerate(sizes):
        want: list[KVCacheEvent] = [ev(n + j) for j in range(size)]
        n += size
        if want:
            got = returned[step]
            assert got is not None, f"step {step}: no batch"
            assert got.events == want, f"step {step}"
            expected.append(want)
        else:
            assert returned[step] is None, f"step {step}: an empty step sealed a batch"
    assert [b.events for b in sink.batches] == expected
    assert [b.seq for b in sink.batches] == list(range(len(expected)))


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_every_step_is_one_batch_with_the_next_seq(seed: int) -> None:
    """A publisher's steps (``step``): one batch each, empty ones too, ts and rank as given."""
    sizes = step_sizes(seed, 10_000)
    sink = MemorySink(max_batches=20_000)
    with run_in_thread(Scheduler(sinks=[sink], origin="engine", data_parallel_rank=3)) as kv:
        n = 0
        for i, size in enumerate(sizes):
            kv.step(
                [ev(n + j) for j in range(size)], ts=1000.0 + i, data_parallel_rank=i % 3 or None
            )
            n += size
    assert len(sink.batches) == len(sizes)
    n = 0
    for i, (batch, size) in enumerate(zip(sink.batches, sizes, strict=True)):
        assert batch.seq == i
        assert batch.ts == 1000.0 + i
        assert batch.data_parallel_rank == (i % 3 or 3)
        assert batch.events == [ev(n + j) for j in range(size)]
        n += size


async def test_threadsafe_needs_a_running_scheduler() -> None:
    s = Scheduler(sinks=[MemorySink()])
    with pytest.raises(ClosedError, match="async with"):
        s.threadsafe()


async def test_bad_input_is_refused_in_the_callers_thread() -> None:
    async with Scheduler(sinks=[MemorySink()], origin="engine") as s:
        handle = s.threadsafe()
        with pytest.raises(InvalidEventTypeError, match=r"emit\[1\]"):
            await anyio.to_thread.run_sync(handle.emit, [ev(1), "not an event"])  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="max_pending"):
            ThreadsafeHandle(s, max_pending=0)


async def test_several_threads_keep_their_own_order() -> None:
    sink = MemorySink()
    async with Scheduler(sinks=[sink], origin="engine") as s:
        handle = s.threadsafe()

        def engine(k: int) -> None:
            for i in range(300):
                handle.emit(ev(k * 1000 + i))
                handle.tick()

        async with anyio.create_task_group() as tg:
            for k in range(3):
                tg.start_soon(anyio.to_thread.run_sync, engine, k)
        await anyio.to_thread.run_sync(handle.flush, 10)
    for k in range(3):
        mine = [e.block_hashes[0] for e in sink.events if e.block_hashes[0] // 1000 == k]
        assert mine == [k * 1000 + i for i in range(300)]


def test_a_full_block_sink_holds_the_engine_back_and_loses_nothing() -> None:
    """A slow ``block`` sink: the steps wait on the loop, in order, and every one arrives."""
    sink = MemorySink(delay=0.001, policy="block", max_batches=2)
    with run_in_thread(Scheduler(sinks=[sink], origin="engine")) as kv:
        for i in range(200):
            kv.emit(ev(i))
            kv.tick()
    assert sink.events == [ev(i) for i in range(200)]
    assert [b.seq for b in sink.batches] == list(range(200))


def test_max_pending_bounds_what_is_queued() -> None:
    sink = MemorySink(delay=0.002, policy="block", max_batches=1)
    runner = LoopThread(Scheduler(sinks=[sink], origin="engine"), max_pending=4)
    peak = 0
    try:
        for i in range(50):
            runner.handle.step([ev(i)])
            peak = max(peak, runner.handle.pending())
    finally:
        runner.close()
    assert peak <= 4
    assert sink.events == [ev(i) for i in range(50)]


def test_a_loop_thread_that_cannot_start_raises_in_the_caller() -> None:
    class Broken(MemorySink):
        async def open(self) -> None:
            raise OSError("no such device")

    with pytest.raises(OSError, match="no such device"):
        LoopThread(Scheduler(sinks=[Broken()]))
    names = [t.name for t in threading.enumerate()]
    assert not any(n.startswith("kvstream loop") for n in names)


def test_run_in_thread_threads_are_daemons_and_end_on_exit() -> None:
    with run_in_thread(Scheduler(sinks=[MemorySink()], origin="engine")) as kv:
        loops = [t for t in threading.enumerate() if t.name == "kvstream loop engine"]
        assert loops
        assert all(t.daemon for t in loops)
        kv.emit(AllBlocksCleared())
    assert not any(t.is_alive() for t in loops)


def test_flush_waits_for_every_entry() -> None:
    sink = MemorySink(delay=0.001)
    with run_in_thread(Scheduler(sinks=[sink], origin="engine")) as kv:
        for i in range(20):
            kv.emit(ev(i))
            kv.tick()
        kv.flush(timeout=10)
        assert kv.pending() == 0


def _steps_apart(handle: ThreadsafeHandle, steps: range, gap: float) -> None:
    """One step per event of `steps`, `gap` seconds apart, then a flush."""
    import time

    for i in steps:
        handle.step([ev(i)])
        time.sleep(gap)
    handle.flush(10.0)


@pytest.mark.parametrize(("idle_poll", "wakes_at_most"), [(0.0, None), (0.9, 1)])
def test_idle_poll_hands_steps_over_without_a_wake_each(
    idle_poll: float, wakes_at_most: int | None
) -> None:
    # Steps 50 ms apart: without idle_poll each finds the loop parked and wakes it;
    # with it, the loop still looks by itself and no step needs a wake-up. Either
    # way every step is its batch, in order.
    sink = MemorySink()
    runner = LoopThread(Scheduler(sinks=[sink], origin="engine"), idle_poll=idle_poll)
    try:
        handle = runner.handle
        _steps_apart(handle, range(6), 0.05)
        assert [b.events for b in sink.batches] == [[ev(i)] for i in range(6)]
        if wakes_at_most is None:
            assert handle.wakeups >= 5
        else:
            assert handle.wakeups <= wakes_at_most
    finally:
        runner.close()


def test_idle_poll_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"idle_poll: expected seconds in \[0, 1\], got 5"):
        LoopThread(Scheduler(sinks=[MemorySink()]), idle_poll=5)


def test_a_burst_is_worked_through_in_the_idle_poll_timer() -> None:
    # Steps handed over while the loop lingers are sealed and written by the
    # timer's callback itself: no wake-up, no task switch, every step its batch.
    import time

    sink = MemorySink()
    runner = LoopThread(Scheduler(sinks=[sink], origin="engine"), idle_poll=0.25)
    try:
        handle = runner.handle
        # The loop lingers 250 ms each time it runs out of work: rounds of steps
        # 20 ms apart all land while it lingers (the first one woke it).
        for round_ in range(4):
            for i in range(4):
                handle.step([ev(round_ * 4 + i)])
            time.sleep(0.02)
        time.sleep(0.5)
        handle.flush(10.0)
        assert [b.events for b in sink.batches] == [[ev(i)] for i in range(16)]
        assert handle.bursts_inline >= 1
        assert handle.wakeups <= 2  # the first round and the flush
    finally:
        runner.close()


def test_a_burst_a_full_block_sink_cannot_take_at_once_is_finished_by_the_task() -> None:
    # The timer's callback cannot wait: a step whose batch a full `block` sink
    # refuses goes to the scheduler's backlog, and the loop's task sees it on,
    # in order, before anything handed over later.
    import time

    from kvstream.sinks.base import Sink

    class SlowSink(Sink):
        def __init__(self) -> None:
            super().__init__(name="slow", policy="block", max_batches=1)
            self.seqs: list[int] = []

        async def write(self, data: bytes, batch: EventBatch) -> None:
            await anyio.sleep(0.01)
            self.seqs.append(batch.seq)

    sink = SlowSink()
    runner = LoopThread(Scheduler(sinks=[sink], origin="engine"), idle_poll=0.05)
    try:
        handle = runner.handle
        time.sleep(0.1)
        for i in range(10):
            handle.step([ev(i)])
        time.sleep(0.2)
        for i in range(10, 15):
            handle.step([ev(i)])
        handle.flush(10.0)
        deadline = time.monotonic() + 10
        while len(sink.seqs) < 15 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink.seqs == list(range(15))
        assert sink.statistics().batches_dropped == 0
    finally:
        runner.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_steps_ticks_and_flushes_with_idle_poll_keep_order_under_a_slow_block_sink(
    seed: int,
) -> None:
    # Bursts worked through in the timer's callback, steps a full `block` sink
    # refuses at once (finished by the task), ticks and flushes among them: every
    # step is its batch, in order, with the next seq, and nothing is lost.
    import time

    rng = random.Random(seed)
    sink = MemorySink(delay=0.0005, policy="block", max_batches=2)
    runner = LoopThread(Scheduler(sinks=[sink], origin="engine"), idle_poll=0.005)
    expected: list[list[KVCacheEvent]] = []
    try:
        handle = runner.handle
        n = 0
        for _ in range(300):
            action = rng.random()
            if action < 0.8:
                events: list[KVCacheEvent] = [ev(n + j) for j in range(rng.choice((0, 1, 2, 5)))]
                n += len(events)
                handle.step(events)
                expected.append(events)
            elif action < 0.9:
                events = [ev(n)]
                n += 1
                handle.emit(events)
                handle.tick()
                expected.append(events)
            else:
                handle.flush(10.0)
            if rng.random() < 0.1:
                time.sleep(rng.choice((0.001, 0.004, 0.008)))
        handle.flush(10.0)
    finally:
        runner.close()
    assert [b.events for b in sink.batches] == expected
    assert [b.seq for b in sink.batches] == list(range(len(expected)))


def test_an_engine_stepping_slower_than_idle_poll_pays_no_empty_poll_per_step() -> None:
    # Steps 120 ms apart, idle_poll 30 ms: the first poll that finds nothing parks the
    # loop without the next one, so every later step wakes it once and no poll runs
    # empty between steps. Steps that come closer again bring the poll back: a burst
    # 5 ms apart needs no wake-up after its first step.
    sink = MemorySink()
    runner = LoopThread(Scheduler(sinks=[sink], origin="engine"), idle_poll=0.03)
    try:
        handle = runner.handle
        _steps_apart(handle, range(5), 0.12)
        # one empty poll after the first step (two if the loop polled before it came);
        # every later step woke the loop itself
        assert handle.polls_empty <= 2
        assert handle.wakeups >= 4
        woken = handle.wakeups
        _steps_apart(handle, range(5, 15), 0.005)
        assert [b.events for b in sink.batches] == [[ev(i)] for i in range(15)]
        # the burst's first step and the flush woke it (with room for a slow machine);
        # with no poll, each of its 10 steps would
        assert handle.wakeups - woken <= 5
    finally:
        runner.close()
