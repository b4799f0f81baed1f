"""FileSink rotation: by size, by age, numbered names, retention, restarts, failures."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from kvstream import BlockStored, ConfigError, EventBatch, FileSink, JsonCodec, Scheduler
from kvstream.config import open_sink
from kvstream.sinks.rotation import rotated_files, rotated_name


def stored(h: int, blocks: int = 1) -> BlockStored:
    return BlockStored(
        block_hashes=list(range(h * 100, h * 100 + blocks)),
        parent_block_hash=None,
        token_ids=[7] * (4 * blocks),
        block_size=4,
        medium="GPU",
    )


async def until(predicate: Callable[[], bool]) -> None:
    """Poll ``predicate`` (a sink's counters) with a generous deadline."""
    with anyio.fail_after(10):
        while True:
            if predicate():
                return
            await anyio.sleep(0.005)


async def run_batches(sink: FileSink, n: int, advance: list[float] | None = None) -> None:
    """Seal ``n`` batches one write at a time (wait for each before the next)."""
    async with Scheduler(sinks=[sink], origin="o", epoch="e") as scheduler:
        for i in range(n):
            scheduler.emit(stored(i + 1))
            await scheduler.tick()
            await until(lambda n=i + 1: sink.statistics().batches_out >= n)  # type: ignore[misc]
            if advance is not None:
                advance[0] += 1.0


def all_files(path: Path) -> list[Path]:
    return [Path(name) for _, name in rotated_files(str(path))] + [path]


def read_seqs(files: list[Path]) -> list[int]:
    codec = JsonCodec()
    seqs: list[int] = []
    for f in files:
        data = f.read_bytes()
        assert not data or data.endswith(b"\n"), f"{f} ends inside a line"
        seqs.extend(b.seq for b in codec.decode_lines(data))
    return seqs


def test_rotated_names_are_numbered_and_keep_the_suffix(tmp_path: Path) -> None:
    assert rotated_name(str(tmp_path / "events.jsonl"), 3) == str(tmp_path / "events.000003.jsonl")
    assert rotated_name(str(tmp_path / "events"), 12) == str(tmp_path / "events.000012")
    assert rotated_name("kv.jsonl", 1_234_567) == "kv.1234567.jsonl"


async def test_rotates_by_size_between_lines(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    one = EventBatch(seq=10, ts=1.0, events=[stored(1)], origin="o", epoch="e")
    line = len(JsonCodec().encode(one))
    sink = FileSink(path, rotate_bytes=3 * line + line // 2)
    await run_batches(sink, 20)
    files = all_files(path)
    assert [f.name for f in files[:2]] == ["events.000001.jsonl", "events.000002.jsonl"]
    assert len(files) == 7  # 3 lines per file: 6 full files and 2 lines in the current one
    for f in files:
        assert f.stat().st_size <= 3 * line + line // 2
    assert read_seqs(files) == list(range(20))
    assert sink.rotation is not None
    assert sink.rotation.rotations == 6


async def test_keep_bounds_the_rotated_files(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    sink = FileSink(path, rotate_bytes=1, keep=2)  # every line its own file
    await run_batches(sink, 6)
    kept = rotated_files(str(path))
    assert [n for n, _ in kept] == [4, 5]
    assert read_seqs([Path(name) for _, name in kept] + [path]) == [3, 4, 5]


async def test_rotates_by_age_only_when_writing(tmp_path: Path) -> None:
    path = tmp_path / "kv.jsonl"
    now = [0.0]
    sink = FileSink(path, rotate_seconds=2.5, clock=lambda: now[0])
    await run_batches(sink, 7, advance=now)  # one batch per simulated second
    # Lines at t=0,1,2 | 3,4,5 | 6: the file rotates at the first write 2.5 s after its first.
    assert [n for n, _ in rotated_files(str(path))] == [1, 2]
    assert [len(read_seqs([f])) for f in all_files(path)] == [3, 3, 1]
    now[0] += 1000.0  # idle: nothing written, nothing rotates
    assert len(rotated_files(str(path))) == 2


async def test_a_restarted_sink_continues_the_numbers(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    await run_batches(FileSink(path, rotate_bytes=1), 3)
    assert [n for n, _ in rotated_files(str(path))] == [1, 2]
    await run_batches(FileSink(path, rotate_bytes=1), 2)  # appends, then rotates on
    assert [n for n, _ in rotated_files(str(path))] == [1, 2, 3, 4]


def block(path: Path) -> None:
    path.mkdir()
    path.joinpath("x").write_text("x")


def unblock(path: Path) -> None:
    path.joinpath("x").unlink()
    path.rmdir()


async def test_a_failed_rotation_is_retried_without_loss(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    sink = FileSink(path, rotate_bytes=1, retry_initial=0.01, retry_max=0.05)
    blocker = Path(rotated_name(str(path), 1))
    async with Scheduler(sinks=[sink], origin="o", epoch="e") as scheduler:
        scheduler.emit(stored(1))
        await scheduler.tick()
        await until(lambda: sink.statistics().batches_out >= 1)
        block(blocker)  # renaming onto a directory fails: the write is retried
        scheduler.emit(stored(2))
        await scheduler.tick()
        await until(lambda: sink.statistics().send_errors >= 2)
        assert sink.statistics().batches_out == 1
        unblock(blocker)
        await until(lambda: sink.statistics().batches_out >= 2)
    assert read_seqs(all_files(path)) == [0, 1]


def test_rotation_options_in_the_url(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    sink = open_sink(f"file:{path}?rotate_bytes=64MiB&rotate_seconds=3600&keep=10")
    assert isinstance(sink, FileSink)
    assert sink.rotation is not None
    policy = sink.rotation.policy
    assert (policy.max_bytes, policy.max_seconds, policy.keep) == (64 * 1024**2, 3600.0, 10)
    plain = open_sink(f"file:{path}")
    assert isinstance(plain, FileSink)
    assert plain.rotation is None
    cases = {
        f"file:{path}?keep=3": "keep=3: expected rotate_bytes or rotate_seconds",
        f"file:{path}?rotate_seconds=0": "rotate_seconds: expected seconds > 0",
        f"file:{path}?rotate_bytes=lots": "rotate_bytes: expected a size",
        f"file:{path}?rotate_bytes=1KiB&keep=-1": "keep: expected >= 0",
        "-?rotate_bytes=1MiB": "standard output cannot rotate",
    }
    for url, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            open_sink(url)


def test_rotated_files_ignores_other_names(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    names = ["events.000002.jsonl", "events.000010.jsonl", "events.1.jsonl"]
    names += ["other.000003.jsonl", "events.000004.json", "events.jsonl"]
    for name in names:
        (tmp_path / name).write_text("")
    assert [n for n, _ in rotated_files(str(path))] == [2, 10]
    assert rotated_files(str(tmp_path / "missing" / "x.jsonl")) == []
    assert os.path.exists(path)


async def test_a_follower_reads_across_rotations_without_gaps(tmp_path: Path) -> None:
    from kvstream.consumers.base import Gap
    from kvstream.consumers.file import FileSubscriber

    path = tmp_path / "events.jsonl"
    path.touch()
    sink = FileSink(path, rotate_bytes=1)  # every line its own file
    seen: list[int] = []
    # The reader polls far less often than the sink rotates: between two polls the
    # file is replaced many times, and the reader must go through every rotated file.
    reader = FileSubscriber(path, follow=True, poll_interval=0.2)
    n = 30
    async with anyio.create_task_group() as tg:

        async def follow() -> None:
            # Closed here: FileSubscriber.aclose() does not close an iterator left
            # suspended, whose open file would otherwise leak into a later test.
            items = aiter(reader)
            try:
                async for item in items:
                    assert not isinstance(item, Gap), item
                    seen.append(item.seq)
                    if item.seq == n - 1:
                        return
            finally:
                await items.aclose()  # type: ignore[attr-defined]

        tg.start_soon(follow)
        async with Scheduler(sinks=[sink], origin="o", epoch="e") as scheduler:
            for i in range(n):
                scheduler.emit(stored(i + 1))
                await scheduler.tick()
                await until(lambda n=i + 1: sink.statistics().batches_out >= n)  # type: ignore[misc]  # one per write
        with anyio.fail_after(30):
            await until(lambda: len(seen) >= n)
    await reader.aclose()
    assert seen == list(range(n))
    assert sink.rotation is not None
    assert sink.rotation.rotations == n - 1


# -- rotation by something else (logrotate's "create" mode, an operator's rm) ----------


async def test_a_file_moved_away_or_deleted_is_followed_by_a_new_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The sink notices (within the check interval of its clock) and starts a new file
    at its path; before, it wrote on into the renamed file, or into a deleted one."""
    path = tmp_path / "events.jsonl"
    now = [0.0]
    sink = FileSink(path, clock=lambda: now[0])

    async def tick(scheduler: Scheduler, n: int) -> None:
        for _ in range(n):
            scheduler.emit(stored(1))
            await scheduler.tick()
        await until(lambda: sink.statistics().queued_batches == 0)

    async with Scheduler(sinks=[sink], origin="o", epoch="e") as scheduler:
        await tick(scheduler, 2)
        moved = tmp_path / "events.jsonl.1"
        path.rename(moved)  # what logrotate does, then it creates an empty file
        path.write_bytes(b"")
        await tick(scheduler, 1)  # within the interval: still the file it has open
        now[0] += 1.0
        await tick(scheduler, 2)
        assert sink.reopened == 1
        path.unlink()
        now[0] += 1.0
        await tick(scheduler, 1)
        assert sink.reopened == 2
    assert sink.statistics().batches_out == 6
    assert read_seqs([moved]) == [0, 1, 2]
    assert read_seqs([path]) == [5]
    assert "moved away or deleted by something else" in caplog.text
    # A file that stays where it is is never reopened, however long the sink runs.
    steady = FileSink(tmp_path / "steady.jsonl", clock=lambda: now[0])
    await run_batches(steady, 3, advance=now)
    assert steady.reopened == 0
    assert read_seqs([tmp_path / "steady.jsonl"]) == [0, 1, 2]
