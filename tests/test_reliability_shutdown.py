"""Shutdown: every accepted batch reaches every healthy sink within the deadline, and
what could not be delivered is reported (in ``statistics()``, the close report and,
for the CLI, on stderr).

Includes ``kvstream demo`` killed mid-run with SIGTERM (and SIGINT): the file
must hold every batch up to the last sequence number the process reported.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from kvstream import EventBatch, FileSink, JsonCodec, MemorySink, Scheduler
from kvstream.sim import check_consistency
from kvstream.testing import FaultySink, SeededEvents, StreamVerifier

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


async def test_aclose_seals_and_delivers_everything_accepted() -> None:
    """Batches queued in slow sinks, events emitted but not ticked, events a source
    yielded but no tick took: all of it reaches every sink before aclose returns."""
    stream = SeededEvents(11)
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="kvs-close-"))
    path = folder / "out.jsonl"
    slow = MemorySink(name="slow", delay=0.001)
    file_sink = FileSink(path)
    source_done = anyio.Event()

    async def source() -> object:
        for chunk in stream.chunks(500, 50, start=100_000):
            yield chunk
        source_done.set()

    async with Scheduler(sinks=[slow, file_sink], origin="eng") as scheduler:
        for n in range(200):
            scheduler.emit(stream.events(n * 10, n * 10 + 10))
            await scheduler.tick()
        assert slow.statistics().queued_batches > 0  # the slow sink is behind
        scheduler.add_source(source(), name="late")  # type: ignore[arg-type]
        scheduler.emit(stream.events(2000, 2010))  # accepted, never ticked by the host
        with anyio.fail_after(10):
            await source_done.wait()
        report = await scheduler.aclose(timeout=30)

    assert report.complete, report
    assert [s.undelivered_batches for s in scheduler.statistics().sinks] == [0, 0]
    expected = stream.events(0, 2010) + stream.events(100_000, 100_500)
    assert [e for b in slow.batches for e in b.events] == expected
    from_file = JsonCodec().decode_lines(path.read_bytes())
    assert [b.seq for b in from_file] == list(range(201))
    assert [e for b in from_file for e in b.events] == expected
    await anyio.Path(path).unlink()
    await anyio.Path(folder).rmdir()


async def test_aclose_does_not_wait_on_a_full_block_sink_and_reports_what_it_holds() -> None:
    """A ``block`` sink is stalled with a full outbox and a tick is waiting for it.
    aclose must not wait for ever: the waiting tick returns, the last batch is
    sealed, the healthy sink gets everything, and the stalled one reports all of
    its batches as undelivered."""
    stream = SeededEvents(12)
    stuck = FaultySink(name="stuck", policy="block", max_batches=2)
    healthy_seen = StreamVerifier(stream, origin="eng", events_per_batch=5)
    healthy = FaultySink(name="healthy", on_batch=healthy_seen.check)
    returned: list[int] = []
    async with Scheduler(sinks=[stuck, healthy], origin="eng") as scheduler:

        async def emit_and_tick(n: int) -> None:
            scheduler.emit(stream.events(n * 5, n * 5 + 5))
            batch = await scheduler.tick()
            assert batch is not None
            returned.append(batch.seq)

        stuck.stall()
        await emit_and_tick(0)
        await stuck.wait_stalled()
        await emit_and_tick(1)
        await emit_and_tick(2)  # outbox full now
        async with anyio.create_task_group() as tg:
            tg.start_soon(emit_and_tick, 3)
            await anyio.wait_all_tasks_blocked()
            assert returned == [0, 1, 2]  # seq 3 waits for the stuck sink
            scheduler.emit(stream.events(20, 25))  # seq 4: pending at close
            with anyio.fail_after(10):
                report = await scheduler.aclose(timeout=0.5)
        assert returned == [0, 1, 2, 3]

    stuck_report, healthy_report = report.sinks
    assert healthy_report.complete
    assert (healthy_seen.batches, healthy_seen.gaps) == (5, 0)
    # 1 in write() + 2 queued + seq 3 (waiting) + seq 4 (sealed at close): all reported.
    assert (stuck_report.undelivered_batches, stuck_report.undelivered_events) == (5, 25)
    assert stuck_report.first_undelivered == ("eng", scheduler.epoch, 0)
    assert stuck.statistics().batches_dropped == 0


async def test_a_sink_cancelled_from_outside_reports_its_batch_in_flight() -> None:
    """The host cancels the scope a sink runs in while a send is in flight: the
    report counts that batch, not only the queued ones."""
    stream = SeededEvents(13)
    sink = FaultySink(hang=True, close_timeout=0.2)
    with anyio.CancelScope() as scope:
        async with sink:
            for seq in range(3):
                sink.offer(EventBatch(seq=seq, ts=0.0, events=stream.events(seq, seq + 1)))
            await sink.wait_stalled()
            scope.cancel()
            await anyio.sleep_forever()
    st = sink.statistics()
    assert (st.batches_out, st.undelivered_batches, st.undelivered_events) == (0, 3, 3)


# -- the CLI ------------------------------------------------------------------------


def _kvstream(*args: str, cwd: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.Popen(
        [sys.executable, "-m", "kvstream", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.fixture
def workdir() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="kvs-sig-"))
    yield folder
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()


def _wait_for_lines(path: Path, n: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"demo exited early ({proc.returncode}): {proc.stderr.read()}")  # type: ignore[union-attr]
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.05)
    pytest.fail(f"demo wrote fewer than {n} lines in 60 s")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_demo_stopped_by_a_signal_delivers_every_batch_it_reported(
    workdir: Path, signum: signal.Signals
) -> None:
    path = workdir / "demo.jsonl"
    # As fast as it goes, with a second, slower sink: both have batches queued
    # when the signal lands.
    proc = _kvstream(
        "demo", "--steps", "0", "--rate", "0", "--sink", f"file:{path}",
        "--sink", "memory:?delay=0.0005",
        cwd=workdir,
    )  # fmt: skip
    try:
        _wait_for_lines(path, 200, proc)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert f"stopped by {signum.name}" in stderr
    assert "NOT delivered" not in stderr
    assert "Traceback" not in stderr
    match = re.search(r"last seq (\d+)", stderr)
    assert match is not None, stderr
    last = int(match.group(1))
    batches = JsonCodec().decode_lines(path.read_bytes())
    # Every batch up to the last one reported, once each, in order; nothing after.
    assert [b.seq for b in batches] == list(range(last + 1))
    assert last >= 199
    check_consistency(batches)
    # The slow sink delivered as much: the summary names no undelivered batch.
    assert re.search(rf"-> MemorySink: {last + 1} batches", stderr), stderr


@pytest.mark.slow
def test_demo_reports_what_a_stuck_sink_could_not_deliver(workdir: Path) -> None:
    """A sink that takes 60 s per batch cannot deliver within the 5 s close deadline:
    the demo still ends, the healthy file sink has everything, and stderr and the
    exit status say what was not delivered."""
    path = workdir / "demo.jsonl"
    proc = _kvstream(
        "demo", "--steps", "30", "--rate", "0", "--sink", f"file:{path}",
        "--sink", "memory:?delay=60&name=stuck",
        cwd=workdir,
    )  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, stderr
    match = re.search(r"last seq (\d+)", stderr)
    assert match is not None, stderr
    total = int(match.group(1)) + 1
    assert [b.seq for b in JsonCodec().decode_lines(path.read_bytes())] == list(range(total))
    # The stuck sink: one batch in its write(), the rest queued; all reported.
    assert re.search(rf"-> stuck: 0 batches, .*{total} NOT delivered", stderr), stderr
    assert f"stuck: {total} batches" in stderr  # the log record of the drain
    assert "Traceback" not in stderr
