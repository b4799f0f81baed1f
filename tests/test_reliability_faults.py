"""Faults stay local: a broken source or sink is counted, logged once per burst, and the
rest of the pipeline keeps its guarantees.

Sources that raise, hang or return garbage; sinks that raise on send, raise on
close or never answer; a file sink on a disk that fills up (a real tmpfs of a
few pages, mounted for the test) and gets its space back.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup
from servers import wait_until

from kvstream import FileSink, JsonCodec, MemorySink, Scheduler
from kvstream.consumers.base import Gap
from kvstream.consumers.file import FileSubscriber
from kvstream.events import KVCacheEvent
from kvstream.sinks.base import Sink
from kvstream.testing import (
    FaultySink,
    SeededEvents,
    StreamVerifier,
    garbage_source,
    hanging_source,
    raising_source,
)

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

FAST_RETRY: dict[str, Any] = {"retry_initial": 0.001, "retry_max": 0.01}


def _caught_up(sink: Sink) -> bool:
    """The sink is healthy again and has delivered everything queued."""
    st = sink.statistics()
    return st.healthy and not st.queued_batches


def _records(caplog: pytest.LogCaptureFixture, logger: str, text: str) -> int:
    return sum(1 for r in caplog.records if r.name == logger and text in r.getMessage())


def _events(sink: MemorySink) -> list[KVCacheEvent]:
    return [e for b in sink.batches for e in b.events]


# -- sources ------------------------------------------------------------------------


async def test_a_source_that_raises_is_closed_and_reported_while_the_others_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="kvstream.sources")
    stream = SeededEvents(1)
    sink = MemorySink()
    async with Scheduler(sinks=[sink], origin="eng") as scheduler:
        broken = scheduler.add_source(
            raising_source(stream.chunks(50, 10), RuntimeError("connector crashed")),
            name="crashing",
        )
        healthy_done = anyio.Event()

        async def healthy() -> object:
            for chunk in stream.chunks(50, 10, start=1000):
                yield chunk
            healthy_done.set()

        scheduler.add_source(healthy(), name="healthy")  # type: ignore[arg-type]
        with anyio.fail_after(10):
            await healthy_done.wait()
        await wait_until(lambda: not broken.running, timeout=10)
        await scheduler.tick()
        scheduler.emit(stream.events(2000, 2010))  # the host goes on too
        await scheduler.tick()
        report = await scheduler.aclose()

    assert report.complete
    assert report.failed_sources == ("crashing",)
    stats = {s.name: s for s in scheduler.statistics().sources}
    assert stats["crashing"].error == "RuntimeError: connector crashed"
    assert stats["crashing"].events_accepted == 50
    assert stats["healthy"].error is None
    # Everything accepted was delivered: the crashed source's 50 events too, in order.
    assert _events(sink) == (
        stream.events(0, 50) + stream.events(1000, 1050) + stream.events(2000, 2010)
    )
    assert _records(caplog, "kvstream.sources", "crashing") == 1


async def test_a_source_that_hangs_neither_holds_the_tick_nor_the_close() -> None:
    stream = SeededEvents(2)
    sink = MemorySink()
    hung = anyio.Event()
    async with Scheduler(sinks=[sink], origin="eng") as scheduler:
        handle = scheduler.add_source(hanging_source(stream.chunks(30, 10), hung), name="stuck")
        with anyio.fail_after(10):
            await hung.wait()
        for i in range(20):
            scheduler.emit(stream.events(100 + i, 101 + i))
            batch = await scheduler.tick()
            assert batch is not None
        assert handle.running  # still hanging
        with anyio.fail_after(10):  # generous: closing must not wait for the source
            report = await scheduler.aclose(timeout=5)
    assert report.complete
    assert report.failed_sources == ()
    # The first batch: the host's event first, then what the source yielded.
    assert _events(sink) == stream.events(100, 101) + stream.events(0, 30) + stream.events(101, 120)
    assert not handle.running


class _JunkConnector:
    """A vLLM-style connector whose take_events() returns a number."""

    def __init__(self) -> None:
        self.polls = 0

    def take_events(self) -> object:
        self.polls += 1
        return 42


@pytest.mark.parametrize(
    "junk",
    [{"type": "BlockStored"}, "BlockStored", b"\x93\xcb", 7, None, [object()]],
    ids=["dict", "str", "bytes", "int", "None", "list-of-junk"],
)
async def test_a_source_returning_garbage_is_refused_at_the_edge(
    junk: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="kvstream.sources")
    stream = SeededEvents(3)
    sink = MemorySink()
    connector = _JunkConnector()
    async with Scheduler(sinks=[sink], origin="eng") as scheduler:
        bad = scheduler.add_source(garbage_source(stream.chunks(20, 10), junk), name="junk")
        polled = scheduler.add_source(connector, name="junk-poll")  # type: ignore[arg-type]
        await wait_until(lambda: not bad.running, timeout=10)
        for i in range(5):
            scheduler.emit(stream.events(100 + i, 101 + i))
            await scheduler.tick()
        report = await scheduler.aclose()
    assert set(report.failed_sources) == {"junk", "junk-poll"}
    assert polled.error is not None
    assert connector.polls == 1
    assert bad.error is not None
    assert "expected a KV cache event" in str(bad.error)
    assert _events(sink) == stream.events(100, 101) + stream.events(0, 20) + stream.events(101, 105)
    assert _records(caplog, "kvstream.sources", "junk ") == 1
    assert _records(caplog, "kvstream.sources", "junk-poll") == 1


# -- sinks --------------------------------------------------------------------------


async def test_a_sink_failing_on_send_is_retried_without_loss_and_logged_once_per_burst(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstream.sinks")
    stream = SeededEvents(4)
    failing_seen = StreamVerifier(stream, origin="eng")
    failing = FaultySink(name="flaky", fail_sends=40, on_batch=failing_seen.check, **FAST_RETRY)
    healthy = MemorySink(name="healthy")
    async with Scheduler(sinks=[failing, healthy], origin="eng") as scheduler:
        for n in range(10):
            scheduler.emit(stream.events(n * 10, n * 10 + 10))
            await scheduler.tick()
        # The healthy sink is not held back by the failing one.
        await wait_until(lambda: len(healthy.batches) == 10, timeout=10)
        assert failing.statistics().batches_out == 0 or failing.statistics().send_errors == 40
        await wait_until(lambda: _caught_up(failing), timeout=10)
        # A second burst of failures: logged again, once.
        failing.fail_next(5)
        for n in range(10, 20):
            scheduler.emit(stream.events(n * 10, n * 10 + 10))
            await scheduler.tick()
        report = await scheduler.aclose(timeout=10)

    assert report.complete
    st = failing.statistics()
    assert st.send_errors == 45
    assert (st.batches_out, st.batches_dropped) == (20, 0)
    assert (failing_seen.batches, failing_seen.events) == (20, 200)  # in order, once each
    assert failing.recovered == 45  # recover() ran before every retry
    assert _records(caplog, "kvstream.sinks", "flaky: send failed") == 2
    assert _records(caplog, "kvstream.sinks", "flaky: send recovered") == 2
    assert [e for b in healthy.batches for e in b.events] == stream.events(0, 200)


async def test_a_sink_failing_for_good_with_a_drop_policy_counts_every_drop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstream.sinks")
    stream = SeededEvents(5)
    broken = FaultySink(
        name="broken", fail_sends=10**9, policy="drop_oldest", max_batches=8, **FAST_RETRY
    )
    healthy = MemorySink(name="healthy")
    async with Scheduler(sinks=[broken, healthy], origin="eng") as scheduler:
        for n in range(200):
            scheduler.emit(stream.events(n * 5, n * 5 + 5))
            await scheduler.tick()
            if n % 20 == 0:
                await anyio.sleep(0.002)  # let the broken sink fail a few more times
        report = await scheduler.aclose(timeout=0.2)
    st = broken.statistics()
    assert st.batches_in == 200
    # Every batch is accounted for: dropped by the policy or reported undelivered.
    assert st.batches_dropped + st.undelivered_batches == 200
    assert st.batches_dropped == 200 - 8 - 1  # 8 queued + 1 in flight when closed
    assert [r.undelivered_batches for r in report.sinks] == [9, 0]
    assert _records(caplog, "kvstream.sinks", "broken: send failed") == 1
    assert _records(caplog, "kvstream.sinks", "broken: dropping batches") == 1
    assert len(healthy.batches) == 200


async def test_a_sink_failing_on_close_does_not_break_the_shutdown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR)
    stream = SeededEvents(6)
    bad = FaultySink(name="bad-close", fail_close=True)
    good = MemorySink(name="good")
    async with Scheduler(sinks=[bad, good], origin="eng") as scheduler:
        for n in range(5):
            scheduler.emit(stream.events(n, n + 1))
            await scheduler.tick()
        report = await scheduler.aclose()
    # The host's code after aclose() ran: the close failure did not cancel it.
    assert report.complete
    assert len(bad.batches) == len(good.batches) == 5
    assert _records(caplog, "kvstream.scheduler", "bad-close failed while closing") == 1


class CrashingTaskSink(MemorySink):
    """A sink whose own background task fails (a bug, a library missing a function)."""

    def start_tasks(self, tg: TaskGroup) -> None:
        async def crash() -> None:
            await self.crash.wait()
            raise AttributeError("module 'anyio' has no attribute 'wait_readable'")

        self.crash = anyio.Event()
        tg.start_soon(crash)


async def test_a_sink_whose_task_crashes_says_why_and_the_others_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The error itself is named (it was an exception group's "1 sub-exception", logged
    as a failure "while closing"); later batches are counted, the other sinks go on."""
    caplog.set_level(logging.ERROR)
    stream = SeededEvents(7)
    bad = CrashingTaskSink(name="crashy")
    good = MemorySink(name="good")
    async with Scheduler(sinks=[bad, good], origin="eng") as scheduler:
        for n in range(2):
            scheduler.emit(stream.events(n, n + 1))
            await scheduler.tick()
        bad.crash.set()
        await wait_until(lambda: not bad.accepting)
        for n in range(2, 5):
            scheduler.emit(stream.events(n, n + 1))
            await scheduler.tick()
    assert len(bad.batches) == 2
    assert len(good.batches) == 5
    assert bad.statistics().batches_dropped == 3
    assert bad.ended == "it failed: AttributeError: module 'anyio' has no attribute 'wait_readable'"
    expected = "crashy failed: AttributeError: module 'anyio' has no attribute 'wait_readable'"
    assert _records(caplog, "kvstream.scheduler", expected) == 1
    assert _records(caplog, "kvstream.scheduler", "while closing") == 0


async def test_a_sink_that_never_answers_is_reported_at_close_within_the_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="kvstream.sinks")
    stream = SeededEvents(7)
    silent = FaultySink(name="silent", hang=True, policy="drop_newest", max_batches=100)
    good = MemorySink(name="good")
    async with Scheduler(sinks=[silent, good], origin="eng") as scheduler:
        for n in range(12):
            scheduler.emit(stream.events(n * 3, n * 3 + 3))
            await scheduler.tick()
        await silent.wait_stalled()
        with anyio.fail_after(10):  # the deadline is 0.3 s; 10 s means "it hung"
            report = await scheduler.aclose(timeout=0.3)
    silent_report, good_report = report.sinks
    assert good_report.complete
    assert len(good.batches) == 12
    # All 12 reported: 11 queued and the one stuck in write().
    assert (silent_report.undelivered_batches, silent_report.undelivered_events) == (12, 36)
    assert silent_report.first_undelivered == ("eng", scheduler.epoch, 0)
    assert silent.statistics().undelivered_batches == 12
    assert _records(caplog, "kvstream.sinks", "silent: 12 batches (36 events) not delivered") == 1


# -- a full disk --------------------------------------------------------------------


@pytest.fixture
def tiny_disk() -> Iterator[Path]:
    """A 256 KiB tmpfs: a real file system that really fills up.

    Mounting needs root, and a test suite should not mount file systems just because
    it happens to run as root: the test runs only when asked with
    ``KVSTREAM_TEST_MOUNT=1`` (CI sets it), and then a failed mount is a failure.
    """
    if os.environ.get("KVSTREAM_TEST_MOUNT") != "1":
        pytest.skip("set KVSTREAM_TEST_MOUNT=1 (as root) to mount a 256 KiB tmpfs for this test")
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.fail("KVSTREAM_TEST_MOUNT=1 needs root and mount(8)")
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="kvs-disk-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        folder.rmdir()
        pytest.fail(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=True)  # busy: detach
        folder.rmdir()


def _fill(folder: Path) -> Path:
    """Fill the file system to the last byte; returns the ballast file."""
    ballast = folder / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        for chunk in (b"\0" * 4096, b"\0"):  # whole pages, then the last bytes
            with pytest.raises(OSError, match="No space") as full:  # noqa: PT012 - until full
                while True:
                    f.write(chunk)
            assert full.value.errno == errno.ENOSPC
    return ballast


class DiskProducer:
    """Ticks batches of `per_batch` seeded events into a file sink filling its disk."""

    def __init__(self, scheduler: Scheduler, stream: SeededEvents, per_batch: int) -> None:
        self.scheduler = scheduler
        self.stream = stream
        self.per_batch = per_batch
        #: batches made so far (the next seq)
        self.seq = 0

    async def produce(self, n: int) -> None:
        for _ in range(n):
            first = self.seq * self.per_batch
            self.scheduler.emit(self.stream.events(first, first + self.per_batch))
            self.seq += 1
            await self.scheduler.tick()

    async def until_unhealthy(self, sink: FileSink) -> None:
        """Fill the file's last page (it may take a few lines) until the sink fails."""
        with anyio.fail_after(10):
            while sink.statistics().healthy:
                await self.produce(1)
                await anyio.sleep(0.005)


async def _wait_healthy(sink: FileSink) -> None:
    await wait_until(lambda: _caught_up(sink), timeout=20)


@pytest.mark.parametrize("policy", ["block", "drop_oldest"])
async def test_a_full_disk_is_reported_held_per_policy_and_resumed_when_space_returns(
    tiny_disk: Path, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstream.sinks")
    stream = SeededEvents(8)
    per_batch = 4
    path = tiny_disk / "events.jsonl"
    sink = FileSink(path, policy=policy, max_batches=20, name="disk", **FAST_RETRY)
    async with Scheduler(sinks=[sink], origin="eng") as scheduler:
        producer = DiskProducer(scheduler, stream, per_batch)
        await producer.produce(10)
        await _wait_healthy(sink)
        ballast = _fill(tiny_disk)
        await producer.until_unhealthy(sink)
        await producer.produce(15 if policy == "block" else 60)  # block: fits the outbox
        st = sink.statistics()
        assert not st.healthy
        assert st.send_errors > 0
        assert st.queued_batches <= 20
        if policy == "block":
            assert st.batches_dropped == 0
        else:
            assert st.batches_dropped >= 60 - 20  # what did not fit the outbox

        ballast.unlink()  # space returns
        await _wait_healthy(sink)
        await producer.produce(10)
        report = await scheduler.aclose(timeout=10)
    seq = producer.seq

    assert report.complete
    st = sink.statistics()
    assert st.batches_in == seq
    assert st.batches_out + st.batches_dropped == seq
    # The file holds whole lines only (failed writes were rolled back), in order,
    # once each; the only gap is what the policy dropped and counted.
    seen = StreamVerifier(stream, origin="eng", events_per_batch=per_batch)
    gaps: list[Gap] = []
    async with FileSubscriber(path) as sub, aclosing(aiter(sub)) as items:  # type: ignore[type-var]
        async for item in items:
            if isinstance(item, Gap):
                gaps.append(item)
            else:
                seen.check(item)
    assert sub.bad_lines == 0
    assert seen.batches == st.batches_out
    assert seen.missing_batches == st.batches_dropped == sum(g.missing for g in gaps)
    assert seen.gaps == len(gaps) == (0 if policy == "block" else 1)
    assert _records(caplog, "kvstream.sinks", "disk: send failed") == 1
    assert _records(caplog, "kvstream.sinks", "disk: send recovered") == 1
    assert "No space left on device" in caplog.text
    JsonCodec().decode_lines(path.read_bytes())  # every line decodes
