"""Sinks: the built-ins, and what the base class owns (outbox, policies, retries, encoding)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from waiting import wait_until

from kvstream import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ClosedError,
    ConfigError,
    EventBatch,
    FileSink,
    JsonCodec,
    KVCacheEvent,
    MemorySink,
    QueueSink,
    Scheduler,
    Sink,
    SinkStatistics,
    TransportError,
)
from kvstream.codecs.base import Refusal
from kvstream.consumers import SequenceTracker

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


def batch(seq: int, n_events: int = 1, origin: str = "o") -> EventBatch:
    events: list[KVCacheEvent] = [
        BlockRemoved(block_hashes=[seq * 1000 + i]) for i in range(n_events)
    ]
    return EventBatch(seq=seq, ts=float(seq), events=events, origin=origin, epoch="e")


class GatedSink(Sink):
    """``write`` waits until the test opens the gate."""

    def __init__(self, **options: Any) -> None:
        options.setdefault("codec", None)
        super().__init__(**options)
        self.gate = anyio.Event()
        self.batches: list[EventBatch] = []

    async def write(self, data: bytes, batch: EventBatch) -> None:
        await self.gate.wait()
        self.batches.append(batch)

    @property
    def seqs(self) -> list[int]:
        return [b.seq for b in self.batches]


class FlakySink(Sink):
    """``write`` raises while ``failing`` is true (or for the first ``fail_first`` writes)."""

    def __init__(self, fail_first: int = 0, **options: Any) -> None:
        options.setdefault("codec", None)
        options.setdefault("retry_initial", 0.001)
        options.setdefault("retry_max", 0.004)
        super().__init__(**options)
        self.fail_first = fail_first
        self.failing = False
        self.attempts = 0
        self.recovered: list[Exception] = []
        self.batches: list[EventBatch] = []

    async def write(self, data: bytes, batch: EventBatch) -> None:
        self.attempts += 1
        if self.failing or self.attempts <= self.fail_first:
            raise TransportError(f"attempt {self.attempts} failed")
        self.batches.append(batch)

    async def recover(self, exc: Exception) -> None:
        self.recovered.append(exc)


class CountingCodec:
    """A codec equal to every other CountingCodec with the same ``tag``; counts encodes."""

    name = "counting"
    self_delimiting = True

    def __init__(self, counter: list[EventBatch], tag: str = "a") -> None:
        self.counter = counter
        self.tag = tag
        self._json = JsonCodec()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CountingCodec) and other.tag == self.tag

    def __hash__(self) -> int:
        return hash(("counting", self.tag))

    def encode(self, batch: EventBatch) -> bytes:
        self.counter.append(batch)
        return self._json.encode(batch)

    def encode_screened(self, batch: EventBatch) -> tuple[bytes, tuple[Refusal, ...]]:
        return self.encode(batch), ()

    def decode(self, data: bytes) -> EventBatch:
        return self._json.decode(data)

    def decode_keyed(self, data: bytes, *, seq: int, origin: str, epoch: str) -> EventBatch:
        return self._json.decode_keyed(data, seq=seq, origin=origin, epoch=epoch)


class RecordingSink(Sink):
    """Keeps the encoded bytes it was handed."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.data: list[bytes] = []

    async def write(self, data: bytes, batch: EventBatch) -> None:
        self.data.append(data)


# -- MemorySink and QueueSink ----------------------------------------------------------------


async def test_memory_sink_keeps_batches_in_order() -> None:
    sent = [batch(i, n_events=i % 3) for i in range(5)]
    async with MemorySink() as sink:
        for b in sent:
            assert sink.offer(b)
    assert sink.batches == sent
    assert sink.events == [e for b in sent for e in b.events]
    stats = sink.statistics()
    assert (stats.batches_in, stats.batches_out, stats.events_out) == (5, 5, 4)
    assert (stats.queued_batches, stats.batches_dropped, stats.undelivered_batches) == (0, 0, 0)


async def test_queue_sink_hands_batches_to_a_consumer_and_ends_the_stream() -> None:
    sink = QueueSink()
    received: list[EventBatch] = []

    async def consume() -> None:
        async for b in sink:
            received.append(b)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        async with Scheduler(sinks=[sink], origin="o") as s:
            for i in range(4):
                s.emit(BlockRemoved(block_hashes=[i]))
                await s.tick()
        # Closing the scheduler ended the consumer's loop: the task group exits.
    assert [b.seq for b in received] == [0, 1, 2, 3]
    assert [b.events[0] for b in received] == [BlockRemoved(block_hashes=[i]) for i in range(4)]
    assert sink.statistics().batches_out == 4
    # The iterator closed the receive stream: nothing is left to warn about.
    assert sink.receive_stream._closed


async def test_queue_sink_counts_batches_a_departed_consumer_did_not_take() -> None:
    async with QueueSink() as sink:
        sink.receive_stream.close()
        sink.offer(batch(0, n_events=2))
        sink.offer(batch(1))
        await wait_until(lambda: sink.statistics().batches_dropped == 2)
    stats = sink.statistics()
    # Dropped, not also counted as sent.
    assert (stats.batches_dropped, stats.events_dropped, stats.batches_out) == (2, 3, 0)


# -- FileSink --------------------------------------------------------------------------------


async def test_file_sink_appends_and_flushes_every_batch(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    codec = JsonCodec()
    earlier = codec.encode(batch(0, origin="earlier"))
    path.write_bytes(earlier)
    async with FileSink(path) as sink:
        for i in range(3):
            sink.offer(batch(i, n_events=2))
            await wait_until(lambda i=i: sink.statistics().batches_out == i + 1)  # type: ignore[misc]
            # Flushed: another reader sees the line while the sink is still open.
            assert codec.decode_lines(path.read_bytes())[1:] == [batch(j, 2) for j in range(i + 1)]
    data = path.read_bytes()
    assert data.startswith(earlier)
    assert codec.decode_lines(data) == [batch(0, origin="earlier")] + [
        batch(j, 2) for j in range(3)
    ]
    assert sink.statistics().bytes_out == len(data) - len(earlier)
    assert sink.name == f"file:{path}"


async def test_file_sink_refuses_a_missing_folder_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "events.jsonl"
    sink = FileSink(path)
    with pytest.raises(TransportError, match="missing"):
        async with sink:
            pass
    with pytest.raises(TransportError, match="missing"):
        async with Scheduler(sinks=[FileSink(path)]):
            pass


async def test_file_sink_writes_a_regular_file_on_the_tick(tmp_path: Path) -> None:
    # Nothing queued ahead and a regular file: the batch is on disk when offer() returns.
    path = tmp_path / "events.jsonl"
    async with FileSink(path) as sink:
        for i in range(3):
            assert sink.offer(batch(i))
            assert JsonCodec().decode_lines(path.read_bytes()) == [batch(j) for j in range(i + 1)]
        assert sink.batches_inline == 3
        assert sink.statistics().batches_out == 3


async def test_file_sink_inline_false_writes_from_the_thread_only(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    async with FileSink(path, inline=False) as sink:
        sink.offer(batch(0))
        assert path.read_bytes() == b""  # not yet: the worker thread writes it
        await wait_until(lambda: sink.statistics().batches_out == 1)
        assert sink.batches_inline == 0
    assert JsonCodec().decode_lines(path.read_bytes()) == [batch(0)]


async def test_a_slow_inline_write_sends_the_next_writes_to_the_thread(tmp_path: Path) -> None:
    # A budget of 0 s makes every inline write "slow": the first is inline, then the
    # cooldown sends the others to the worker thread, in order, none lost.
    path = tmp_path / "events.jsonl"
    async with FileSink(path, inline_budget=0.0, inline_cooldown=60.0) as sink:
        for i in range(5):
            sink.offer(batch(i))
        await wait_until(lambda: sink.statistics().batches_out == 5)
        assert sink.batches_inline == 1
        assert sink.slow_inline_writes == 1
    assert JsonCodec().decode_lines(path.read_bytes()) == [batch(j) for j in range(5)]


async def test_file_sink_writes_a_fifo_from_the_thread(tmp_path: Path) -> None:
    # A FIFO can block the writer (its reader is slow): never written on the loop.
    import os

    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []

    def read_all() -> None:
        with open(fifo, "rb") as f:
            got.append(f.read())

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, read_all)
        async with FileSink(fifo) as sink:
            sink.offer(batch(0))
            assert sink.batches_inline == 0
            await wait_until(lambda: sink.statistics().batches_out == 1)
    assert JsonCodec().decode_lines(got[0]) == [batch(0)]


async def test_a_fifo_whose_reader_left_is_written_to_the_next_reader(tmp_path: Path) -> None:
    """EPIPE on a FIFO is not for ever, unlike on standard output: the pipe stays (the
    sink holds it open), and a retry writes the batch, whole, to the next reader."""
    import os

    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)

    def read_line() -> bytes:
        with open(fifo, "rb") as f:
            return f.readline()

    def read_rest() -> bytes:
        with open(fifo, "rb") as f:
            return f.read()

    async with anyio.create_task_group() as tg:
        first: list[bytes] = []

        async def first_reader() -> None:
            first.append(await anyio.to_thread.run_sync(read_line))

        tg.start_soon(first_reader)
        sink = FileSink(fifo, retry_initial=0.01, retry_max=0.05)
        async with sink:
            sink.offer(batch(0))
            await wait_until(lambda: bool(first), "the first reader's line")
            sink.offer(batch(1))  # nobody reads: EPIPE, then no reader to open it for
            await wait_until(lambda: sink.statistics().send_errors >= 2, "failed attempts")
            rest: list[bytes] = []

            async def second_reader() -> None:
                rest.append(await anyio.to_thread.run_sync(read_rest))

            tg.start_soon(second_reader)
            await wait_until(lambda: sink.statistics().batches_out == 2, "batch 1 written")
            sink.offer(batch(2))
            await wait_until(lambda: sink.statistics().batches_out == 3, "batch 2 written")
        await wait_until(lambda: bool(rest), "the second reader's end of file")
    assert JsonCodec().decode_lines(first[0]) == [batch(0)]
    assert JsonCodec().decode_lines(rest[0]) == [batch(1), batch(2)]
    assert sink.ended is None


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"inline": "yes"}, "inline"),
        ({"inline_budget": -1}, "inline_budget"),
        ({"inline_cooldown": "5"}, "inline_cooldown"),
    ],
)
def test_file_sink_inline_options_are_checked(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        FileSink("x.jsonl", **options)


def test_file_sink_url_takes_inline_false(tmp_path: Path) -> None:
    from kvstream.config import open_sink

    sink = open_sink(f"file:{tmp_path / 'x.jsonl'}?inline=false")
    assert isinstance(sink, FileSink)
    assert sink.inline is False


def test_file_sink_needs_a_codec() -> None:
    with pytest.raises(ConfigError, match="codec"):
        FileSink("x.jsonl", codec=None)


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        timeout=60,
        check=False,
    )


def test_file_sink_dash_writes_to_stdout() -> None:
    proc = run_python(
        """
        import anyio
        from kvstream import BlockRemoved, FileSink, Scheduler

        async def main():
            async with Scheduler(sinks=[FileSink("-")], origin="o", epoch="e") as s:
                for i in range(3):
                    s.emit(BlockRemoved(block_hashes=[i]))
                    await s.tick()

        anyio.run(main)
        """
    )
    assert proc.returncode == 0, proc.stderr.decode()
    batches = JsonCodec().decode_lines(proc.stdout)
    assert [(b.seq, b.events) for b in batches] == [
        (i, [BlockRemoved(block_hashes=[i])]) for i in range(3)
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE semantics")
def test_file_sink_rolls_back_a_partial_write_and_retries(tmp_path: Path) -> None:
    """A real short write: the file-size limit (RLIMIT_FSIZE) stops a write half-way.

    The sink truncates what the failed write left, retries after ``recover`` (here
    lifting the limit), and the file holds every line exactly once.
    """
    path = tmp_path / "events.jsonl"
    proc = run_python(
        """
        import os, resource, signal, sys
        import anyio
        from kvstream import BlockStored, FileSink, Scheduler

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG instead
        path = sys.argv[1]
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

        class LiftOnRecover(FileSink):
            sizes = []
            async def recover(self, exc):
                self.sizes.append(os.path.getsize(path))
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

        def event(i):
            return BlockStored(block_hashes=[i, i + 1], parent_block_hash=None,
                               token_ids=list(range(32)), block_size=16)

        async def main():
            sink = LiftOnRecover(path, retry_initial=0.001)
            ends = []
            async with Scheduler(sinks=[sink], origin="o") as s:
                # One line, then one smaller and one larger than a write buffer (8 KiB),
                # each allowed to grow the file by only 100 bytes before it fails.
                for k, n in enumerate((1, 5, 300)):
                    if k:
                        resource.setrlimit(resource.RLIMIT_FSIZE, (ends[-1] + 100, hard))
                    s.emit([event(i) for i in range(n)])
                    await s.tick()
                    while sink.statistics().batches_out < k + 1:
                        await anyio.sleep(0.001)
                    ends.append(os.path.getsize(path))
            print(ends[0], ends[1], *sink.sizes, sink.statistics().send_errors)

        anyio.run(main)
        """,
        str(path),
    )
    assert proc.returncode == 0, proc.stderr.decode()
    first_end, second_end, *sizes_at_recover, errors = map(int, proc.stdout.split())
    assert errors == 2
    # When recover() ran, each failed write had been rolled back to the last full line.
    assert sizes_at_recover == [first_end, second_end]
    batches = JsonCodec().decode_lines(path.read_bytes())
    assert [(b.seq, len(b)) for b in batches] == [(0, 1), (1, 5), (2, 300)]


# -- overflow policies ------------------------------------------------------------------------


async def tick_without_waiting(s: Scheduler) -> tuple[EventBatch | None, bool]:
    """Call tick() in an already-cancelled scope: any wait would be cancelled."""
    result = None
    with anyio.CancelScope() as scope:
        scope.cancel()
        result = await s.tick()
    return result, scope.cancelled_caught


async def test_block_policy_makes_the_tick_wait_and_loses_nothing() -> None:
    sink = GatedSink(policy="block", max_batches=2)
    async with Scheduler(sinks=[sink], origin="o") as s:
        for i in range(3):
            s.emit(BlockRemoved(block_hashes=[i]))
            _, waited = await tick_without_waiting(s)
            assert not waited
            if i == 0:  # the writer takes batch 0 and waits at the gate
                await wait_until(lambda: sink.statistics().queued_batches == 0)
        assert sink.statistics().queued_batches == 2
        s.emit(BlockRemoved(block_hashes=[3]))
        _, waited = await tick_without_waiting(s)
        assert waited  # the outbox is full: the tick waited (and was cancelled)
        s.emit(BlockRemoved(block_hashes=[4]))
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.tick)  # waits behind the full outbox
            await wait_until(lambda: s.statistics().ticks == 5)
            sink.gate.set()
    assert sink.seqs == [0, 1, 2, 3, 4]
    assert [b.events[0].block_hashes for b in sink.batches] == [[i] for i in range(5)]  # type: ignore[attr-defined]
    stats = sink.statistics()
    assert (stats.batches_dropped, stats.batches_in, stats.batches_out) == (0, 5, 5)


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest"])
async def test_drop_policies_never_wait_and_count_exactly_the_gaps(policy: str) -> None:
    sink = GatedSink(policy=policy, max_batches=3)
    sizes = [1, 2, 3, 1, 4, 2, 5, 1, 1, 3]
    async with Scheduler(sinks=[sink], origin="o") as s:
        for i, n in enumerate(sizes):
            s.emit([AllBlocksCleared(metadata={"i": i, "j": j}) for j in range(n)])
            _, waited = await tick_without_waiting(s)
            assert not waited
            if i == 0:
                await wait_until(lambda: sink.statistics().queued_batches == 0)
            assert sink.statistics().queued_batches <= 3
        sink.gate.set()
        await wait_until(lambda: sink.statistics().batches_out == 4)
        # One more batch, delivered: a consumer sees a trailing drop only then.
        s.emit(AllBlocksCleared())
        await s.tick()
    sizes.append(1)
    received = sink.seqs
    assert received == sorted(received)
    missing = sorted(set(range(len(sizes))) - set(received))
    stats = sink.statistics()
    assert stats.batches_dropped == len(missing) == len(sizes) - 5
    assert stats.events_dropped == sum(sizes[i] for i in missing)
    assert stats.batches_in == len(sizes)
    if policy == "drop_newest":
        assert received == [0, 1, 2, 3, 10]
    else:
        assert received == [0, 7, 8, 9, 10]
    # A consumer sees the drops as gaps in seq, and nothing else.
    tracker = SequenceTracker()
    for b in sink.batches:
        tracker.check(b)
    assert tracker.missing == len(missing)


async def test_the_outbox_is_bounded_in_bytes() -> None:
    sink = GatedSink(policy="drop_newest", max_bytes=4000, codec=JsonCodec())
    async with sink:
        sink.offer(batch(0))
        await wait_until(lambda: sink.statistics().queued_batches == 0)  # in flight
        for i in range(1, 40):
            assert sink.offer(batch(i, n_events=1 + i % 4))
            stats = sink.statistics()
            assert stats.queued_bytes <= 4000
        assert stats.batches_dropped > 0
        assert stats.queued_batches >= 1
        # A batch larger than the whole bound still goes through an empty outbox.
        sink.gate.set()
        await wait_until(lambda: sink.statistics().queued_batches == 0)
        sink.gate = anyio.Event()
        dropped = sink.statistics().batches_dropped
        assert sink.offer(batch(99, n_events=50))
        assert sink.statistics().batches_dropped == dropped
        sink.gate.set()
    assert sink.seqs[-1] == 99


async def test_the_outbox_is_bounded_in_batches() -> None:
    sink = GatedSink(policy="block", max_batches=2, close_timeout=0.01)
    async with sink:
        assert sink.offer(batch(0))
        await wait_until(lambda: sink.statistics().queued_batches == 0)
        assert sink.offer(batch(1))
        assert sink.offer(batch(2))
        assert not sink.offer(batch(3))  # block: the caller must wait in put()
        assert sink.statistics().queued_batches == 2
        async with anyio.create_task_group() as tg:
            tg.start_soon(sink.put, batch(3))
            await wait_until(lambda: sink._outbox.waiting > 0)
            sink.gate.set()
    assert sink.seqs == [0, 1, 2, 3]


# -- faults -------------------------------------------------------------------------------


async def test_a_failing_sink_is_retried_with_backoff_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "kvstream.sinks")
    flaky = FlakySink(fail_first=3, name="flaky")
    async with Scheduler(sinks=[flaky], origin="o") as s:
        for i in range(3):
            s.emit(BlockRemoved(block_hashes=[i]))
            await s.tick()
        await wait_until(lambda: len(flaky.batches) == 3)
        assert flaky.statistics().healthy
    assert [b.seq for b in flaky.batches] == [0, 1, 2]
    stats = flaky.statistics()
    assert (stats.send_errors, stats.batches_out, stats.batches_dropped) == (3, 3, 0)
    assert len(flaky.recovered) == 3
    assert all(isinstance(e, TransportError) for e in flaky.recovered)
    messages = [r.getMessage() for r in caplog.records if r.name == "kvstream.sinks"]
    assert sum("send failed" in m for m in messages) == 1  # once per burst
    assert any("recovered after 3 failed attempts" in m for m in messages)


async def test_a_broken_sink_does_not_slow_the_others() -> None:
    flaky = FlakySink(name="flaky", close_timeout=5.0)
    flaky.failing = True
    healthy = MemorySink()
    async with Scheduler(sinks=[flaky, healthy], origin="o") as s:
        for i in range(5):
            s.emit(BlockRemoved(block_hashes=[i]))
            _, waited = await tick_without_waiting(s)
            assert not waited
        await wait_until(lambda: len(healthy.batches) == 5)
        await wait_until(lambda: flaky.statistics().send_errors >= 2)
        assert not flaky.statistics().healthy
        assert flaky.batches == []
        flaky.failing = False
    assert [b.seq for b in flaky.batches] == [0, 1, 2, 3, 4]
    assert flaky.statistics().healthy


async def test_a_sink_that_never_recovers_is_reported_at_close() -> None:
    flaky = FlakySink(name="dead", close_timeout=0.05)
    flaky.failing = True
    async with Scheduler(sinks=[flaky], origin="o", close_timeout=0.05) as s:
        for i in range(3):
            s.emit([BlockRemoved(block_hashes=[i]), BlockRemoved(block_hashes=[i + 10])])
            await s.tick()
        report = await s.aclose()
    assert not report.complete
    (dead,) = report.sinks
    assert (dead.name, dead.undelivered_batches, dead.undelivered_events) == ("dead", 3, 6)
    assert dead.first_undelivered == (s.origin, s.epoch, 0)
    assert not flaky.statistics().healthy


class OneShotSink(Sink):
    """A transport that can take one batch, then never again (a pipe whose reader left)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.attempts = 0

    async def write(self, data: bytes, batch: EventBatch) -> None:
        self.attempts += 1
        if self.attempts > 1:
            raise BrokenPipeError("the reader left")

    def final_error(self, exc: Exception) -> str | None:
        return "its reader went away" if isinstance(exc, BrokenPipeError) else None


async def test_a_final_error_ends_the_writer_and_what_follows_is_reported_at_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not retried (each retry would fail the same way) and never silent: `ended` says
    why, the batches after it are undelivered in the close report, the others go on."""
    one, memory = OneShotSink(name="pipe", close_timeout=60.0), MemorySink()
    async with Scheduler(sinks=[one, memory], origin="o") as s:
        for i in range(2):
            s.emit(BlockRemoved(block_hashes=[i]))
            await s.tick()
        await wait_until(lambda: one.ended is not None, "the sink ended")
        for i in range(2, 5):
            s.emit(BlockRemoved(block_hashes=[i]))
            await s.tick()
        with anyio.fail_after(30):  # drain does not wait for a writer that ended
            report = await s.aclose()
    assert one.ended == "its reader went away"
    assert one.attempts == 2
    assert [b.seq for b in memory.batches] == [0, 1, 2, 3, 4]
    by_name = {r.name: r for r in report.sinks}
    assert by_name["pipe"].undelivered_batches == 4
    assert by_name["pipe"].first_undelivered == (s.origin, s.epoch, 1)
    assert by_name[memory.name].complete
    st = one.statistics()
    assert (st.batches_out, st.healthy, st.send_errors) == (1, False, 1)
    assert "its reader went away; nothing more can be delivered" in caplog.text


async def test_an_unencodable_batch_is_dropped_loudly_and_the_rest_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Picky(JsonCodec):
        def encode(self, batch: EventBatch) -> bytes:
            if batch.seq == 1:
                raise ValueError("cannot encode seq 1")
            return super().encode(batch)

    sink = RecordingSink(codec=Picky())
    async with sink:
        for i in range(3):
            sink.offer(batch(i, n_events=2))
    stats = sink.statistics()
    assert (stats.batches_out, stats.batches_dropped, stats.events_dropped) == (2, 1, 2)
    assert [JsonCodec().decode(d).seq for d in sink.data] == [0, 2]
    assert any("cannot encode batch" in r.getMessage() for r in caplog.records)


# -- encoding ---------------------------------------------------------------------------------


async def test_sinks_with_equal_codecs_share_one_encoding_per_batch() -> None:
    encoded: list[EventBatch] = []
    sinks = [RecordingSink(codec=CountingCodec(encoded), name=f"s{i}") for i in range(3)]
    other: list[EventBatch] = []
    odd = RecordingSink(codec=CountingCodec(other, tag="b"), name="odd")
    async with Scheduler(sinks=[*sinks, odd], origin="o") as s:
        for i in range(4):
            s.emit(BlockRemoved(block_hashes=[i]))
            await s.tick()
            assert len(encoded) == i + 1  # encoded on the tick, once for three sinks
    assert [b.seq for b in encoded] == [0, 1, 2, 3]
    assert [b.seq for b in other] == [0, 1, 2, 3]
    assert sinks[0].data == sinks[1].data == sinks[2].data == odd.data
    assert sinks[0].encoding is sinks[1].encoding is sinks[2].encoding
    assert sinks[0].encoding.users == 3
    assert odd.encoding is not sinks[0].encoding


async def test_sinks_with_different_codecs_get_their_own_bytes() -> None:
    plain = RecordingSink(codec=JsonCodec())
    decimal = RecordingSink(codec=JsonCodec(hashes_as_strings=True))
    async with Scheduler(sinks=[plain, decimal], origin="o") as s:
        s.emit(BlockRemoved(block_hashes=[5]))
        await s.tick()
    assert b'"block_hashes":[5]' in plain.data[0]
    assert b'"block_hashes":["5"]' in decimal.data[0]


# -- statistics, lifetime ---------------------------------------------------------------------


async def test_statistics_is_an_immutable_snapshot(tmp_path: Path) -> None:
    sink = FileSink(tmp_path / "x.jsonl", policy="drop_oldest", max_batches=7, name="f")
    before = sink.statistics()
    assert isinstance(before, SinkStatistics)
    assert (before.name, before.policy, before.batches_in, before.healthy) == (
        "f",
        "drop_oldest",
        0,
        True,
    )
    with pytest.raises(AttributeError):
        before.batches_in = 3  # type: ignore[misc]
    async with sink:
        sink.offer(batch(0, n_events=3))
    after = sink.statistics()
    assert before.batches_in == 0
    assert (after.batches_in, after.batches_out, after.events_out) == (1, 1, 3)
    assert after.bytes_out == (tmp_path / "x.jsonl").stat().st_size


async def test_aclose_is_idempotent_and_use_after_close_raises(tmp_path: Path) -> None:
    sink = FileSink(tmp_path / "x.jsonl")
    async with sink:
        sink.offer(batch(0))
        await sink.aclose()
        await sink.aclose()
        assert sink.closed
        with pytest.raises(ClosedError, match="closed"):
            sink.offer(batch(1))
    await sink.aclose()
    with pytest.raises(ClosedError):
        sink.offer(batch(2))
    with pytest.raises(ClosedError):
        async with sink:
            pass
    assert JsonCodec().decode_lines((tmp_path / "x.jsonl").read_bytes()) == [batch(0)]


@pytest.mark.parametrize("close", ["aclose", "drain"])
async def test_the_owner_goes_on_after_closing_inside_its_async_with(close: str) -> None:
    steps = []
    async with MemorySink() as sink:
        sink.offer(batch(0))
        await (sink.aclose() if close == "aclose" else sink.drain(1.0))
        # Closing stopped the writer, not the owner's own code.
        await anyio.lowlevel.checkpoint()
        await anyio.sleep(0.001)
        steps.append(close)
    assert steps == [close]
    assert sink.batches == [batch(0)]


async def test_drain_timeout_reports_what_was_not_delivered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = GatedSink(name="stuck")
    async with sink:
        for i in range(3):
            sink.offer(batch(i, n_events=2))
        await wait_until(lambda: sink.statistics().queued_batches == 2)
        report = await sink.drain(0.02)
        assert not report.complete
        assert (report.undelivered_batches, report.undelivered_events) == (3, 6)
        assert report.first_undelivered == ("o", "e", 0)
        assert await sink.drain(5) is report  # remembered
    assert sink.statistics().undelivered_batches == 3
    assert sink.statistics().undelivered_events == 6
    assert any("3 batches (6 events) not delivered" in r.getMessage() for r in caplog.records)


async def test_a_sink_never_entered_or_closed_refuses_batches_naming_what_to_do() -> None:
    sink = MemorySink()
    with pytest.raises(ClosedError, match=r"never entered.*async with sink"):
        sink.offer(batch(0))
    with pytest.raises(ClosedError, match="never entered"):
        await sink.put(batch(0))
    report = await sink.drain(1.0)  # nothing was taken, so nothing is owed
    assert (report.undelivered_batches, report.undelivered_events) == (0, 0)
    await sink.aclose()
    with pytest.raises(ClosedError, match="never entered"):
        sink.offer(batch(0))
    async with MemorySink() as used:
        used.offer(batch(0))
    with pytest.raises(ClosedError, match="the sink is closed"):
        used.offer(batch(1))
    assert used.statistics().batches_out == 1


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"policy": "drop_all"}, "policy"),
        ({"max_bytes": 0}, "max_bytes"),
        ({"max_bytes": 1.5}, "max_bytes"),
        ({"max_batches": -1}, "max_batches"),
        ({"close_timeout": -1.0}, "close_timeout"),
    ],
)
def test_bad_sink_options_are_config_errors(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        MemorySink(**options)


async def test_any_sink_counts_what_a_strict_codec_refuses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvstream.codecs.msgpack import MsgpackCodec

    good = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[], block_size=0)
    bytes_hash = BlockStored(
        block_hashes=[b"\x01" * 32], parent_block_hash=None, token_ids=[], block_size=0
    )
    codec = MsgpackCodec(strict="refuse")
    a = FileSink(tmp_path / "a.bin", codec=codec, name="a")
    b = FileSink(tmp_path / "b.bin", codec=codec, name="b")  # shares the encoding with a
    async with Scheduler(sinks=[a, b], origin="o") as scheduler:
        for _ in range(3):
            scheduler.emit([good, bytes_hash])
            await scheduler.tick()
    for sink in (a, b):
        stats = sink.statistics()
        assert stats.batches_out == 3
        assert stats.events_refused == 3  # left out, never silently
    warnings = [r for r in caplog.records if "codec refused" in r.getMessage()]
    assert len(warnings) == 2  # once per burst, per sink
