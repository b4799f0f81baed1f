"""The scheduler: inputs, the tick, origins, faults, shutdown and the thread-safe handle."""

from __future__ import annotations

import gc
import itertools
import logging
import socket
import threading
import warnings
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import pytest
from waiting import wait_until

from kvstream import (
    AllBlocksCleared,
    BlockRemoved,
    ClosedError,
    ConfigError,
    EventBatch,
    FileSink,
    InvalidEventTypeError,
    KVCacheEvent,
    MemorySink,
    QueueSink,
    Scheduler,
    Sink,
    TransportError,
    from_take_events,
    run_in_thread,
)

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


def ev(i: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[i])


def evs(*ids: int) -> list[KVCacheEvent]:
    return [ev(i) for i in ids]


_END = object()


class Controlled:
    """An async source the test drives one item at a time.

    ``await push(item)`` returns once the source's ``yield`` has handed the item
    over (the scheduler asked for the next one), so the item is accepted.
    """

    def __init__(self) -> None:
        self._items: deque[object] = deque()
        self._wakeup: anyio.Event | None = None
        self._acked: anyio.Event | None = None
        self.handed_over = 0
        self.closed = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._run()

    async def _run(self) -> AsyncIterator[Any]:
        try:
            while True:
                while not self._items:
                    wakeup = self._wakeup = anyio.Event()
                    await wakeup.wait()
                item = self._items.popleft()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                self.handed_over += 1
                if self._acked is not None:
                    self._acked.set()
        finally:
            self.closed = True

    def _put(self, item: object) -> None:
        self._items.append(item)
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.set()

    async def push(self, item: object) -> None:
        acked = self._acked = anyio.Event()
        self._put(item)
        with anyio.fail_after(10):
            await acked.wait()

    def fail(self, exc: BaseException) -> None:
        self._put(exc)

    def end(self) -> None:
        self._put(_END)


class Connector:
    """A vLLM-style connector: ``take_events()`` returns and forgets what it has."""

    def __init__(self) -> None:
        self.pending: list[KVCacheEvent] = []
        self.threads: list[int] = []

    def take_events(self) -> list[KVCacheEvent]:
        self.threads.append(threading.get_ident())
        out, self.pending = self.pending, []
        return out


class GatedSink(Sink):
    def __init__(self, **options: Any) -> None:
        options.setdefault("codec", None)
        super().__init__(**options)
        self.gate = anyio.Event()
        self.batches: list[EventBatch] = []

    async def write(self, data: bytes, batch: EventBatch) -> None:
        await self.gate.wait()
        self.batches.append(batch)


def clock_from(start: float) -> Callable[[], float]:
    """A test clock: start, start + 1, ... one value per call."""
    it: Iterator[int] = itertools.count()
    return lambda: start + next(it)


# -- emit and tick ------------------------------------------------------------------------------


async def test_emit_then_tick_seals_one_numbered_batch() -> None:
    sink = MemorySink()
    s = Scheduler(sinks=[sink], origin="engine-0", data_parallel_rank=2, clock=clock_from(10.0))
    async with s:
        s.emit(ev(1))
        s.emit(evs(2, 3))
        b0 = await s.tick()
        assert b0 is not None
        assert (b0.seq, b0.ts, b0.origin, b0.epoch, b0.data_parallel_rank) == (
            0,
            10.0,
            "engine-0",
            s.epoch,
            2,
        )
        assert b0.events == evs(1, 2, 3)
        assert await s.tick() is None  # nothing pending: no batch, no seq used
        s.emit(ev(4))
        b1 = await s.tick()
        assert b1 is not None
        assert (b1.seq, b1.ts, b1.events) == (1, 12.0, evs(4))
        stats = s.statistics()
        assert (stats.ticks, stats.batches_sealed, stats.events_sealed) == (3, 2, 4)
        assert (stats.events_accepted, stats.pending_events) == (4, 0)
        assert stats.next_seq == {"engine-0": 2}
    assert sink.batches == [b0, b1]


async def test_each_scheduler_draws_its_own_epoch_and_defaults_its_origin() -> None:
    a, b = Scheduler(), Scheduler()
    assert a.epoch != b.epoch
    assert a.origin == socket.gethostname()
    assert Scheduler(epoch="fixed").epoch == "fixed"
    await a.aclose()
    await b.aclose()


async def test_host_events_come_first_then_inputs_in_the_order_they_were_added() -> None:
    a, c = Connector(), Connector()
    b = Controlled()
    async with Scheduler(origin="o") as s:
        s.add_source(a)  # adapted automatically: it has take_events()
        s.add_source(b)
        s.add_source(from_take_events(c, name="remote"))
        await b.push(evs(20, 21))
        a.pending = evs(10)
        c.pending = evs(30, 31)
        s.emit(ev(1))
        batch = await s.tick()
        assert batch is not None
        assert batch.events == evs(1, 10, 20, 21, 30, 31)
        names = [h.statistics() for h in s.sources]
        assert [(n.kind, n.events_accepted) for n in names] == [
            ("polled", 1),
            ("async", 2),
            ("polled", 2),
        ]
        assert names[2].name.startswith("remote")


async def test_polled_connectors_are_polled_once_per_tick_in_the_hosts_thread() -> None:
    conn = Connector()
    async with Scheduler(origin="o") as s:
        s.add_source(from_take_events(conn))
        for i in range(3):
            conn.pending = evs(i)
            batch = await s.tick()
            assert batch is not None
            assert batch.events == evs(i)
        assert await s.tick() is None
    # Four ticks, and the last one when the scheduler closed.
    assert conn.threads == [threading.get_ident()] * 5


async def test_an_async_source_item_accepted_before_tick_is_in_that_batch() -> None:
    src = Controlled()
    async with Scheduler(origin="o") as s:
        s.add_source(src)
        for i in range(5):
            await src.push(ev(i))
            await src.push(evs(100 + i, 200 + i))
            batch = await s.tick()
            assert batch is not None
            assert batch.events == evs(i, 100 + i, 200 + i)
        src.end()


# -- adding and removing inputs and sinks while running -------------------------------------------


async def test_add_and_remove_sources_while_running() -> None:
    sink = MemorySink()
    async with Scheduler(sinks=[sink], origin="o") as s:
        first = Controlled()
        h1 = s.add_source(first, name="first")
        await first.push(ev(1))
        second = Controlled()
        h2 = s.add_source(second)
        await second.push(ev(2))
        await first.push(ev(3))
        s.remove_source(h1)
        await wait_until(lambda: first.closed)  # its generator was closed
        assert not h1.statistics().running
        b = await s.tick()
        assert b is not None
        assert b.events == evs(1, 3, 2)  # what it yielded before removal stays accepted
        await second.push(ev(4))
        b = await s.tick()
        assert b is not None
        assert b.events == evs(4)
        assert h2.statistics().running
        with pytest.raises(ConfigError, match="not a source"):
            Scheduler().remove_source(h2)
    assert [e for b in sink.batches for e in b.events] == evs(1, 3, 2, 4)


async def test_add_sink_while_running_gets_every_later_batch() -> None:
    early, late = MemorySink(), MemorySink()
    async with Scheduler(sinks=[early], origin="o") as s:
        s.emit(ev(0))
        await s.tick()
        await s.add_sink(late)
        s.emit(ev(1))
        await s.tick()
        assert s.sinks == (early, late)
    assert [b.seq for b in early.batches] == [0, 1]
    assert [b.seq for b in late.batches] == [1]


# -- origins ------------------------------------------------------------------------------------


async def test_every_origin_has_its_own_batches_and_sequence() -> None:
    sink = MemorySink()
    relay = Controlled()
    async with Scheduler(sinks=[sink], origin="own") as s:
        s.add_source(relay, origin="engine-7", data_parallel_rank=1)
        for step in range(4):
            s.emit(ev(step))
            if step % 2:
                s.emit(ev(100 + step), origin="third")
            await relay.push(ev(1000 + step))
            own = await s.tick()
            assert own is not None
            assert (own.origin, own.seq, own.events) == ("own", step, evs(step))
        await relay.push(ev(9999))
        assert await s.tick() is None  # only another origin had events
        assert s.statistics().next_seq == {"own": 4, "engine-7": 5, "third": 2}
    by_origin: dict[str, list[EventBatch]] = {}
    for b in sink.batches:
        by_origin.setdefault(b.origin, []).append(b)
        assert b.epoch == s.epoch
    assert [b.seq for b in by_origin["own"]] == [0, 1, 2, 3]
    assert [b.seq for b in by_origin["engine-7"]] == [0, 1, 2, 3, 4]
    assert [b.seq for b in by_origin["third"]] == [0, 1]
    assert {b.data_parallel_rank for b in by_origin["engine-7"]} == {1}
    assert [b.events for b in by_origin["third"]] == [evs(101), evs(103)]


# -- faulty sources -----------------------------------------------------------------------------


async def test_a_source_that_raises_is_closed_and_reported_while_others_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = MemorySink()
    bad, good = Controlled(), Controlled()
    async with Scheduler(sinks=[sink], origin="o") as s:
        hb = s.add_source(bad, name="bad")
        hg = s.add_source(good, name="good")
        await bad.push(ev(1))
        await good.push(ev(2))
        bad.fail(RuntimeError("boom"))
        await wait_until(lambda: hb.statistics().error is not None)
        assert bad.closed
        await good.push(ev(3))
        b = await s.tick()
        assert b is not None
        assert b.events == evs(1, 2, 3)
        stats = {x.name: x for x in s.statistics().sources}
        assert stats["bad"].error == "RuntimeError: boom"
        assert not stats["bad"].running
        assert stats["good"].running
        assert stats["good"].error is None
        await good.push(ev(4))
        assert (await s.tick()) is not None
        report = await s.aclose()
    assert report.failed_sources == ("bad",)
    assert hg.statistics().events_accepted == 3
    assert [e for b in sink.batches for e in b.events] == evs(1, 2, 3, 4)
    logged = [r for r in caplog.records if r.name == "kvstream.sources"]
    assert any("bad" in r.getMessage() and "boom" in r.getMessage() for r in logged)
    assert all(r.levelno == logging.ERROR for r in logged)


@pytest.mark.parametrize(
    ("garbage", "named"),
    [
        (42, "got int"),
        ("events", "got str"),
        ([ev(9), "x"], "[1]: expected a KV cache event, got str"),
        ({"type": "BlockStored"}, "[0]: expected a KV cache event"),
    ],
)
async def test_a_source_yielding_garbage_is_closed_with_a_clear_error(
    garbage: object, named: str
) -> None:
    src, other = Controlled(), Controlled()
    async with Scheduler(origin="o") as s:
        h = s.add_source(src, name="junk")
        s.add_source(other)
        await src.push(ev(1))
        src._put(garbage)
        await wait_until(lambda: h.statistics().error is not None)
        error = h.statistics().error
        assert error is not None
        assert error.startswith("InvalidEventTypeError: source junk")
        assert named in error
        await other.push(ev(2))
        b = await s.tick()
        assert b is not None
        assert b.events == evs(1, 2)  # the bad chunk is refused whole
        other.end()


async def test_a_polled_connector_that_raises_is_reported_and_not_polled_again() -> None:
    class Broken:
        calls = 0

        def take_events(self) -> list[KVCacheEvent]:
            self.calls += 1
            raise ValueError("connector bug")

    broken = Broken()
    async with Scheduler(origin="o") as s:
        h = s.add_source(broken)
        s.emit(ev(1))
        b = await s.tick()
        assert b is not None
        assert b.events == evs(1)
        s.emit(ev(2))
        await s.tick()
        assert broken.calls == 1
        assert h.statistics().error == "ValueError: connector bug"


# -- the ticker and the clock ----------------------------------------------------------------------


async def test_a_ticker_drives_the_ticks_with_no_sleeps() -> None:
    requests_tx, requests_rx = anyio.create_memory_object_stream[None](1)
    ticked: list[anyio.Event] = []

    async def ticker() -> AsyncIterator[None]:
        async with requests_rx:
            async for _ in requests_rx:
                yield
                # The scheduler asks for the next item only after the tick returned.
                ticked.pop(0).set()

    async def tick_now() -> None:
        done = anyio.Event()
        ticked.append(done)
        await requests_tx.send(None)
        with anyio.fail_after(10):
            await done.wait()

    sink = MemorySink()
    s = Scheduler(sinks=[sink], origin="o", ticker=ticker(), clock=clock_from(1.0))
    async with requests_tx, s:
        s.emit(ev(1))
        await tick_now()
        assert s.statistics().next_seq == {"o": 1}
        await tick_now()  # nothing pending
        s.emit(evs(2, 3))
        await tick_now()
        assert s.statistics().ticks == 3
    assert [(b.seq, b.ts, b.events) for b in sink.batches] == [
        (0, 1.0, evs(1)),
        (1, 3.0, evs(2, 3)),
    ]


async def test_tick_interval_runs_a_periodic_ticker() -> None:
    sink = MemorySink()
    async with Scheduler(sinks=[sink], origin="o", tick_interval=0.001) as s:
        s.emit(ev(1))
        await wait_until(lambda: len(sink.batches) == 1)
        s.emit(ev(2))
        await wait_until(lambda: len(sink.batches) == 2)
    assert [b.events for b in sink.batches] == [evs(1), evs(2)]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"tick_interval": 0}, "Scheduler.tick_interval: expected seconds > 0, got 0"),
        ({"tick_interval": float("nan")}, "Scheduler.tick_interval: expected seconds > 0, got nan"),
        ({"tick_interval": 1.0, "ticker": object()}, "not both"),
        ({"origin": ""}, "origin"),
        ({"data_parallel_rank": -1}, "data_parallel_rank"),
        ({"max_pending_events": 0}, "max_pending_events"),
    ],
)
def test_bad_scheduler_options_are_refused_when_made(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Scheduler(**options)


# -- backpressure from a source --------------------------------------------------------------------


async def test_max_pending_events_holds_back_a_source_until_the_next_tick() -> None:
    produced = 0

    async def firehose() -> AsyncIterator[KVCacheEvent]:
        nonlocal produced
        while True:  # never awaits on its own
            produced += 1
            yield ev(produced)

    async with Scheduler(origin="o", max_pending_events=10) as s:
        h = s.add_source(firehose())
        await wait_until(lambda: h.statistics().pending_events >= 10)
        for _ in range(50):
            await anyio.lowlevel.checkpoint()
        assert h.statistics().pending_events == 10
        assert produced == 10  # the source was not even asked for more
        b = await s.tick()
        assert b is not None
        assert b.events == evs(*range(1, 11))
        await wait_until(lambda: h.statistics().pending_events >= 10)
        b = await s.tick()
        assert b is not None
        assert b.events == evs(*range(11, 21))


# -- shutdown -------------------------------------------------------------------------------------


async def test_aclose_seals_what_is_pending_and_delivers_it() -> None:
    sink = MemorySink()
    src = Controlled()
    conn = Connector()
    async with Scheduler(sinks=[sink], origin="o") as s:
        s.add_source(src)
        s.add_source(conn)
        s.emit(ev(1))
        await src.push(ev(2))
        conn.pending = evs(3)
        s.emit(ev(4), origin="other")
        report = await s.aclose(timeout=5)
    assert report.complete
    assert report.undelivered_batches == 0
    assert [(b.origin, b.seq, b.events) for b in sink.batches] == [
        ("o", 0, evs(1, 2, 3)),
        ("other", 0, evs(4)),
    ]
    assert src.closed


async def test_aclose_reports_a_stuck_sink_and_still_delivers_to_the_healthy_ones() -> None:
    stuck = GatedSink(name="stuck", max_batches=1)
    healthy = MemorySink(name="healthy")
    async with Scheduler(sinks=[stuck, healthy], origin="o") as s:
        s.emit(ev(0))
        await s.tick()  # in flight at the stuck sink
        await wait_until(lambda: stuck.statistics().queued_batches == 0)
        s.emit(ev(1))
        await s.tick()  # fills its outbox
        s.emit(ev(2))  # pending at close: the stuck sink's outbox is full
        report = await s.aclose(timeout=0.2)
    assert [b.seq for b in healthy.batches] == [0, 1, 2]
    assert not report.complete
    by_name = {r.name: r for r in report.sinks}
    assert by_name["healthy"].complete
    assert by_name["stuck"].undelivered_batches == 3  # every one of them, reported
    assert by_name["stuck"].first_undelivered == ("o", s.epoch, 0)
    assert stuck.statistics().undelivered_batches == 3


async def test_aclose_with_a_ticker_waiting_on_a_full_sink_closes_cleanly() -> None:
    requests_tx, requests_rx = anyio.create_memory_object_stream[None](10)
    stuck = GatedSink(name="stuck", max_batches=1)
    healthy = MemorySink(name="healthy")
    async with requests_tx:
        s = Scheduler(sinks=[stuck, healthy], origin="o", ticker=requests_rx)
        async with s:
            for i in range(3):
                s.emit(ev(i))
                await requests_tx.send(None)
                await wait_until(lambda i=i: s.statistics().ticks == i + 1)  # type: ignore[misc]
            # The ticker is now waiting for room in the stuck sink's outbox.
            report = await s.aclose(timeout=0.2)
    assert [b.seq for b in healthy.batches] == [0, 1, 2]
    (stuck_report,) = (r for r in report.sinks if r.name == "stuck")
    assert stuck_report.undelivered_batches == 3


async def test_aclose_is_idempotent_and_use_after_close_raises() -> None:
    s = Scheduler(origin="o")
    async with s:
        first = await s.aclose()
        assert await s.aclose() is first
        with pytest.raises(ClosedError):
            s.emit(ev(1))
        with pytest.raises(ClosedError):
            await s.tick()
        with pytest.raises(ClosedError):
            s.add_source(Controlled())
        with pytest.raises(ClosedError):
            await s.add_sink(MemorySink())
    with pytest.raises(ClosedError):
        async with s:
            pass


async def test_the_host_goes_on_after_aclose_inside_its_async_with() -> None:
    sink = MemorySink()
    steps = []
    async with Scheduler(sinks=[sink], origin="o") as s:
        s.emit(ev(1))
        report = await s.aclose()
        # Closing stopped the scheduler's tasks, not the host's own code.
        await anyio.lowlevel.checkpoint()
        await anyio.sleep(0.001)
        steps.append("after aclose")
    assert steps == ["after aclose"]
    assert report.complete
    assert [b.events for b in sink.batches] == [evs(1)]


async def test_concurrent_acloses_get_the_same_outcome() -> None:
    sink = MemorySink(delay=0.01)
    async with Scheduler(sinks=[sink], origin="o") as s:
        s.emit(ev(1))
        reports = []

        async def close() -> None:
            reports.append(await s.aclose())

        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
            tg.start_soon(close)
    assert len(reports) == 2
    assert all(r.complete for r in reports)
    assert [b.events for b in sink.batches] == [evs(1)]


async def test_a_sink_that_fails_to_open_fails_the_start_with_its_own_error(tmp_path: Any) -> None:
    queue = QueueSink()
    s = Scheduler(sinks=[MemorySink(), FileSink(tmp_path / "no" / "x.jsonl"), queue])
    with pytest.raises(TransportError, match="cannot open"):
        async with s:
            pass
    assert queue.closed
    queue.receive_stream.close()


async def test_a_scheduler_never_started_holds_nothing_that_needs_closing() -> None:
    gc.collect()
    # Garbage another test left behind may be collected here too: only count
    # resources made during this test (holding the others keeps their ids unique).
    alive = gc.get_objects()
    existing = {id(o) for o in alive}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = Scheduler(sinks=[MemorySink()])
        s.add_source(Controlled())
        del s
        gc.collect()
        queue = QueueSink()
        never_entered = Scheduler(sinks=[MemorySink(), queue])
        with pytest.raises(ClosedError, match="never entered"):
            never_entered.emit(ev(1))  # nothing is taken that could not be delivered
        with pytest.raises(ClosedError, match="never entered"):
            await never_entered.tick()
        report = await never_entered.aclose()
        queue.receive_stream.close()  # the consumer's end: the consumer closes it
        del never_entered
        gc.collect()
    assert [str(w.message) for w in caught if id(w.source) not in existing] == []
    del alive
    assert [r.undelivered_batches for r in report.sinks] == [0, 0]


async def test_bad_inputs_are_refused_where_they_enter() -> None:
    async with Scheduler(origin="o") as s:
        with pytest.raises(InvalidEventTypeError, match="emit"):
            s.emit(42)  # type: ignore[arg-type]
        with pytest.raises(InvalidEventTypeError, match=r"emit\[1\]"):
            s.emit([ev(1), "x"])  # type: ignore[list-item]
        with pytest.raises(InvalidEventTypeError, match="add_source"):
            s.add_source(42)  # type: ignore[arg-type]
        with pytest.raises(InvalidEventTypeError, match="Sink"):
            await s.add_sink(object())  # type: ignore[arg-type]
        assert await s.tick() is None  # nothing of the refused list was accepted
        sink = MemorySink()
        await s.add_sink(sink)
        with pytest.raises(ConfigError, match="twice"):
            await s.add_sink(sink)
    async with Scheduler(origin="o") as s:
        with pytest.raises(ConfigError, match="call_at_barrier: callback: expected a callable"):
            s.call_at_barrier(5)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="add_source: name: expected a non-empty str"):
            s.add_source(_never_yields(), name=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"MemorySink\.name: expected a str, got 5"):
        MemorySink(name=5)
    busy = MemorySink()
    async with Scheduler(sinks=[busy]):
        with pytest.raises(ClosedError, match=r"already running .* a sink serves one scheduler"):
            Scheduler(sinks=[busy])
    one = MemorySink()
    with pytest.raises(InvalidEventTypeError, match=r"one sink goes in a list: \[sink\]"):
        Scheduler(sinks=one)  # type: ignore[arg-type]
    with pytest.raises(InvalidEventTypeError, match="expected a list of sinks, got str 'file:x'"):
        Scheduler(sinks="file:x")  # type: ignore[arg-type]
    with pytest.raises(InvalidEventTypeError, match="expected a list of sinks, got int 3"):
        Scheduler(sinks=3)  # type: ignore[arg-type]


# -- synchronous engines in another thread ---------------------------------------------------------


async def test_threadsafe_handle_barrier_from_an_engine_thread() -> None:
    sink = MemorySink()
    async with Scheduler(sinks=[sink], origin="o") as s:
        handle = s.threadsafe()

        def engine() -> list[EventBatch | None]:
            out = []
            for step in range(20):
                for j in range(step % 4):
                    handle.emit(ev(step * 10 + j))
                out.append(handle.tick().result(timeout=10))
            handle.flush(timeout=10)
            return out

        batches = await anyio.to_thread.run_sync(engine)
        handle.close()
        with pytest.raises(ClosedError):
            handle.emit(ev(1))
    # Each step's events are exactly that step's batch.
    for step, b in enumerate(batches):
        want = [ev(step * 10 + j) for j in range(step % 4)]
        if want:
            assert b is not None
            assert b.events == want
        else:
            assert b is None
    assert [b.seq for b in sink.batches] == list(range(15))


def test_run_in_thread_serves_a_synchronous_engine() -> None:
    sink = MemorySink()
    with run_in_thread(Scheduler(sinks=[sink], origin="sync")) as kv:
        for step in range(10):
            kv.emit(evs(step, step + 100))
            kv.emit(AllBlocksCleared())
            batch = kv.tick().result(timeout=10)
            assert batch is not None
            assert batch.events == [*evs(step, step + 100), AllBlocksCleared()]
        kv.emit(ev(999))  # not ticked: sealed when the scheduler closes
    assert [b.seq for b in sink.batches] == list(range(11))
    assert sink.batches[-1].events == evs(999)


async def _never_yields() -> AsyncIterator[KVCacheEvent]:
    await anyio.sleep_forever()
    yield ev(0)
