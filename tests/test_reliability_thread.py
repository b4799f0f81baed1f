"""Issue 15 on the thread path: what careless engines do to the bridge and the drop-in.

Each test failed before the fix it guards (kvstream 53807fe): an engine reusing
its list lost and duplicated steps (the handle kept the caller's list);
unpaused ticks sealed a fraction of the steps (each tick started a loop turn
late); an emit after close returned and was lost; a process whose code never
called ``shutdown()`` never exited (the portal's thread); refusals were logged
once per process.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from test_publisher import KVEventBatch, kv_of, vllm_stored

from kvstream import BlockRemoved, KVCacheEvent, MemorySink, Scheduler
from kvstream._threadsafe import run_in_thread
from kvstream.errors import ClosedError
from kvstream.publisher import EventPublisher


def ev(i: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[i], medium="GPU")


def test_1000_unpaused_steps_are_1000_batches() -> None:
    sink = MemorySink()
    with run_in_thread(Scheduler(sinks=[sink], origin="engine")) as kv:
        futures = []
        for i in range(1000):
            kv.emit(ev(i))
            futures.append(kv.tick())
        batches = [f.result(timeout=30) for f in futures]
    assert all(b is not None for b in batches)
    assert [b.events for b in sink.batches] == [[ev(i)] for i in range(1000)]


def test_emit_copies_the_callers_list() -> None:
    """An engine that clears and refills one list per step loses nothing (issue 15, item 4)."""
    sink = MemorySink()
    reused: list[KVCacheEvent] = []
    with run_in_thread(Scheduler(sinks=[sink], origin="engine")) as kv:
        for step in range(1000):
            reused.clear()
            reused.extend([ev(2 * step), ev(2 * step + 1)])
            kv.emit(reused)
            kv.tick()
    assert [b.events for b in sink.batches] == [[ev(2 * s), ev(2 * s + 1)] for s in range(1000)]


def test_emit_tick_and_step_after_close_raise() -> None:
    sink = MemorySink()
    with run_in_thread(Scheduler(sinks=[sink], origin="engine")) as kv:
        kv.emit(ev(1))
    with pytest.raises(ClosedError):
        kv.emit(ev(2))
    with pytest.raises(ClosedError):
        kv.tick()
    with pytest.raises(ClosedError):
        kv.step([ev(3)])
    assert sink.events == [ev(1)]  # the emit before close was sealed by the last tick


async def test_the_scheduler_closing_works_through_what_threads_handed_over() -> None:
    sink = MemorySink()
    async with Scheduler(sinks=[sink], origin="engine") as s:
        handle = s.threadsafe()

        def engine() -> None:
            for i in range(500):
                handle.emit(ev(i))
                if i % 7 == 0:
                    handle.tick()

        await anyio.to_thread.run_sync(engine)
        # Closing at once: nothing handed over may be left behind.
    assert sink.events == [ev(i) for i in range(500)]
    with pytest.raises(ClosedError):
        handle.emit(ev(0))


def test_publish_copies_the_callers_list() -> None:
    sink = MemorySink()
    reused: list[Any] = []
    with EventPublisher([sink], origin="engine") as pub:
        for i in range(500):
            reused.clear()
            reused.append(vllm_stored(i))
            pub.publish(KVEventBatch(ts=float(i), events=reused))
    assert [b.events for b in sink.batches] == [[kv_of(vllm_stored(i))] for i in range(500)]


def test_refusals_are_logged_once_per_burst_and_again_after_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = MemorySink()
    caplog.set_level(logging.WARNING, "kvstream.publisher")
    with EventPublisher([sink], origin="engine") as pub:
        for _ in range(50):
            pub.publish(["bad"])
        pub._runner.handle.flush(10)
        assert len(caplog.records) == 1  # one warning for the burst
        pub._converter._burst.window = 0.0  # the burst is over
        pub.publish(["bad"])
    assert len(caplog.records) == 2
    assert "more like it" in caplog.records[1].getMessage()


def test_a_process_that_never_shuts_down_exits_and_delivers(tmp_path: Path) -> None:
    out = tmp_path / "kv.jsonl"
    result = subprocess.run(
        [sys.executable, "-c", _FORGETFUL, f"file:{out}"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    lines = out.read_text().splitlines()
    assert [json.loads(line)["seq"] for line in lines] == list(range(200))


_FORGETFUL = """
import sys
from kvstream import BlockRemoved
from kvstream.publisher import EventPublisher
pub = EventPublisher([sys.argv[1]], origin="forgetful")
for i in range(200):
    pub.publish([BlockRemoved(block_hashes=[i], medium="GPU")])
print("published", flush=True)
# no shutdown(): the process must still exit, and what was published is delivered
"""
