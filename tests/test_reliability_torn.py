"""A torn last line (a writer killed mid-line) loses nothing more than itself."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstream import BlockStored, EventBatch, FileSink, JsonCodec, Scheduler
from kvstream.consumers import FileSubscriber
from kvstream.sim._check import ConsistencyError, check_consistency

REPO = Path(__file__).resolve().parent.parent


def _event(h: int) -> BlockStored:
    return BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[1, 2], block_size=2)


async def _run(path: Path, origin: str, hashes: list[int]) -> None:
    async with Scheduler(sinks=[FileSink(str(path))], origin=origin) as scheduler:
        for h in hashes:
            scheduler.emit([_event(h)])
            await scheduler.tick()


def _tear(path: Path) -> None:
    """Cut the last line in the middle, as `kill -9` during a write leaves it."""
    data = path.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: last + (len(data) - last) // 2])


async def _read(path: Path) -> tuple[list[EventBatch], int]:
    sub = FileSubscriber(str(path))
    async with sub:
        batches = [item async for item in sub if isinstance(item, EventBatch)]
    return batches, sub.bad_lines


async def test_a_run_appending_after_a_torn_line_keeps_its_first_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "events.jsonl"
    await _run(path, "eng", [1, 2, 3])
    _tear(path)  # batch seq 2 of the first run is torn
    caplog.set_level(logging.WARNING, logger="kvstream.sinks")
    await _run(path, "eng", [10, 11])
    assert any("ended in a torn line" in r.getMessage() for r in caplog.records)
    batches, bad = await _read(path)
    assert bad == 1  # the torn line, skipped and counted
    assert [(b.seq, b.events[0].block_hashes[0]) for b in batches] == [  # type: ignore[attr-defined]
        (0, 1),
        (1, 2),
        (0, 10),  # the new run's first batch: not glued to the torn line
        (1, 11),
    ]
    assert check_consistency(batches, start_seq=None).batches == 4


def _verify(path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "kvstream", "verify", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


async def test_verify_reports_a_torn_line_and_checks_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    await _run(path, "eng", [1, 2, 3])
    _tear(path)
    done = _verify(path)
    assert done.returncode == 0, done.stderr
    assert "1 torn line(s) skipped (line 3)" in done.stderr
    assert "Traceback" not in done.stderr
    assert "OK: 2 batches" in done.stdout
    # After another run appended (and the sink ended the torn line), both runs check.
    await _run(path, "eng", [10, 11])
    done = _verify(path)
    assert done.returncode == 0, done.stderr
    assert "torn line(s) skipped (line 3)" in done.stderr
    assert "OK: 4 batches" in done.stdout


def test_a_restart_seen_without_its_first_batch_is_inconsistent() -> None:
    codec = JsonCodec()
    lines = [
        EventBatch(seq=0, ts=0.0, events=[_event(1)], origin="eng", epoch="a"),
        EventBatch(seq=1, ts=0.0, events=[_event(2)], origin="eng", epoch="b"),
    ]
    batches = [codec.decode(codec.encode(b)) for b in lines]
    with pytest.raises(
        ConsistencyError, match=r"restarted \(epoch a -> b\).*seq 0\.\.0 are missing"
    ):
        check_consistency(batches, start_seq=None)
    # A recording that joined late (a relay's) may start an epoch anywhere.
    assert check_consistency(batches, joined_late=True).batches == 2
