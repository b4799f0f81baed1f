"""``kvstream tail`` against files, a socket sink and a running ``kvstream demo``."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from kvstream import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, JsonCodec, Scheduler
from kvstream._cli.main import main
from kvstream._cli.tail import Printer
from kvstream.consumers.base import Gap
from kvstream.sim import check_consistency
from kvstream.sinks.socket import SocketSink

DEADLINE = 30.0
CODEC = JsonCodec()


def batch(seq: int, *events: Any) -> EventBatch:
    return EventBatch(seq=seq, ts=1_767_225_600.5 + seq, events=list(events), origin="o", epoch="e")


def stored(h: int, parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=[h], parent_block_hash=parent, token_ids=[1, 2], block_size=2, medium="GPU"
    )


def write_batches(path: Path, batches: list[EventBatch]) -> None:
    with path.open("ab") as f:
        for b in batches:
            f.write(CODEC.encode(b))


def from_json_lines(text: str) -> list[EventBatch]:
    """Batches from ``tail --format json`` output; a snapshot line becomes the batch
    it stands for (seq ``next_seq - 1``)."""
    out: list[EventBatch] = []
    for line in text.splitlines():
        obj = orjson.loads(line)
        if obj.get("type") == "snapshot":
            assert "seq" not in obj  # no line without seq is a batch
            obj["seq"] = obj.pop("next_seq") - 1
            del obj["type"]
            for key in ("first_missing", "part", "last"):
                obj.pop(key, None)
        out.append(CODEC.batch_from_dict(obj))
    return out


async def run_tail(*args: str, timeout: float = DEADLINE) -> tuple[int, str, str]:
    """``python -m kvstream tail ARGS`` in a subprocess, while this loop keeps serving."""
    with anyio.fail_after(timeout):
        result = await anyio.run_process(
            [sys.executable, "-m", "kvstream", "tail", *args], check=False
        )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- the printer ---------------------------------------------------------------------------


def test_pretty_prints_one_readable_line_per_event() -> None:
    b = batch(
        7,
        stored(0xABC, parent=0x1),
        BlockRemoved(block_hashes=[1, 2, 3], medium="CPU"),
        AllBlocksCleared(),
    )
    text = Printer("pretty", color=False).batch(b)
    lines = text.splitlines()
    assert len(lines) == 3
    assert all(" o #7 " in line for line in lines)
    assert "stored" in lines[0]
    assert "GPU" in lines[0]
    assert "0000000000000abc" in lines[0]
    assert "parent 0000000000000001" in lines[0]
    assert "removed" in lines[1]
    assert "3 blocks" in lines[1]
    assert "cleared" in lines[2]
    assert "\x1b[" not in text
    assert "\x1b[32m" in Printer("pretty", color=True).batch(b)
    assert Printer("json", color=True).batch(b) == CODEC.encode(b).decode()
    gap = Printer.gap(Gap("o", "e", 3, 9, "evicted"))
    assert gap == "kvstream tail: gap: o epoch e: batches 3..8 missing (evicted)\n"


# -- files ---------------------------------------------------------------------------------


def test_tail_prints_a_file_and_its_json_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kv.jsonl"
    batches = [batch(i, stored(100 + i)) for i in range(6)]
    write_batches(path, batches)
    assert main(["tail", str(path), "--no-follow", "--format", "json"]) == 0
    assert from_json_lines(capsys.readouterr().out) == batches
    assert main(["tail", f"file:{path}", "--no-follow", "--from-seq", "4"]) == 0
    pretty = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in pretty] == ["#4", "#5"]


def test_tail_reports_gaps_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kv.jsonl"
    write_batches(path, [batch(0, stored(1)), batch(5, stored(2))])
    assert main(["tail", str(path), "--no-follow", "--format", "json"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2
    assert "gap: o epoch e: batches 1..4 missing" in captured.err


async def test_tail_follows_a_file_as_it_grows(tmp_path: Path) -> None:
    path = tmp_path / "grow.jsonl"
    write_batches(path, [batch(0, stored(1))])
    async with anyio.create_task_group() as tg:
        result: list[tuple[int, str, str]] = []

        async def tail() -> None:
            result.append(await run_tail(str(path), "--format", "json", "--count", "4"))

        tg.start_soon(tail)
        for i in range(1, 4):
            await anyio.sleep(0.3)  # the tail is already following by now, or soon
            write_batches(path, [batch(i, stored(i + 1))])
    code, out, err = result[0]
    assert code == 0, err
    assert [b.seq for b in from_json_lines(out)] == [0, 1, 2, 3]


# -- a socket sink -------------------------------------------------------------------------


async def test_tail_a_socket_sink_from_seq_with_a_gap_warning() -> None:
    sink = SocketSink(port=0, ring_bytes=4096)
    async with Scheduler(sinks=[sink], origin="o") as s:
        for i in range(40):
            s.emit(BlockRemoved(block_hashes=[i], medium="GPU"))
            await s.tick()
        with anyio.fail_after(DEADLINE):
            while sink.statistics().batches_out < 40:  # noqa: ASYNC110 - the sink's counter
                await anyio.sleep(0.01)
        oldest = 40 - sink.statistics().ring_batches
        assert oldest > 0
        code, out, err = await run_tail(
            sink.address, "--from-seq", "0", "--count", str(40 - oldest), "--format", "json"
        )
        assert code == 0, err
        assert [b.seq for b in from_json_lines(out)] == list(range(oldest, 40))
        assert f"gap: o epoch {s.epoch}: batches 0..{oldest - 1} missing (evicted)" in err
        code, out, err = await run_tail(sink.address, "--from-seq", "38", "--count", "2")
        assert code == 0, err
        assert "\x1b[" not in out  # not a terminal: no colour
        assert [line.split()[2] for line in out.splitlines()] == ["#38", "#39"]
        code, out, err = await run_tail(sink.address, "--from-seq", "99")
        assert code == 2
        assert "ahead" in err
        assert len(err.strip().splitlines()) == 1  # one line, no traceback


async def test_demo_serves_tail_a_snapshot_then_live_batches(tmp_path: Path) -> None:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}?ring_bytes=768KiB"
    demo = await anyio.open_process(
        [sys.executable, "-m", "kvstream", "demo", "--steps", "0", "--rate", "40", "--sink", url],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        with anyio.fail_after(DEADLINE):
            while True:  # until it listens
                try:
                    async with await anyio.connect_tcp("127.0.0.1", port):
                        break
                except OSError:
                    await anyio.sleep(0.05)
        await anyio.sleep(2.0)  # long enough for seq 0 to leave the small ring
        code, out, err = await run_tail(
            f"tcp://127.0.0.1:{port}", "--from-seq", "0", "--count", "15", "--format", "json"
        )
        assert code == 0, err
        assert "gap" not in err
        lines = out.splitlines()
        assert orjson.loads(lines[0])["type"] == "snapshot"
        batches = from_json_lines(out)
        assert isinstance(batches[0].events[0], AllBlocksCleared)
        check_consistency(batches, start_seq=None)  # the snapshot, then every batch after it
        assert [b.seq for b in batches] == list(range(batches[0].seq, batches[0].seq + 15))
        # kvstream verify reads the recording as it is, snapshot line included.
        recording = tmp_path / "tail.jsonl"
        recording.write_text(out)
        verify = await anyio.run_process(
            [sys.executable, "-m", "kvstream", "verify", str(recording)], check=False
        )
        assert verify.returncode == 0, verify.stderr
        assert b"OK: 15 batches" in verify.stdout
    finally:
        demo.send_signal(signal.SIGTERM)
        with anyio.fail_after(DEADLINE):
            await demo.wait()
        assert demo.stderr is not None
        await demo.aclose()
    assert demo.returncode == 0


def test_tail_help_lists_the_formats(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["tail", "--help"])
    assert "--format {pretty,json}" in capsys.readouterr().out


# -- unreachable upstreams, foreign files, silent ZMQ ----------------------------------------


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    return free_port()


@pytest.mark.parametrize("scheme", ["tcp", "unix"])
async def test_tail_no_retry_exits_at_once_with_one_line(tmp_path: Path, scheme: str) -> None:
    url = f"tcp://127.0.0.1:{closed_port()}" if scheme == "tcp" else f"unix:{tmp_path / 'no.sock'}"
    code, out, err = await run_tail(url, "--no-retry")
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


async def test_tail_retries_an_unreachable_socket_until_it_comes_up() -> None:
    port = closed_port()
    tail = await anyio.open_process(
        [sys.executable, "-m", "kvstream", "-v", "tail", f"tcp://127.0.0.1:{port}", "--count", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert tail.stderr is not None
        seen = await read_stderr_until(tail, b"attempt 2 failed")  # each attempt, with -v
        assert seen.count(b"retrying with backoff") == 1  # the clear line, once
        sink = SocketSink(host="127.0.0.1", port=port)
        async with Scheduler(sinks=[sink], origin="late") as s:
            with anyio.fail_after(DEADLINE):
                while not sink.statistics().subscribers:
                    s.emit(BlockRemoved(block_hashes=[1], medium="GPU"))
                    await s.tick()
                    await anyio.sleep(0.1)
                s.emit(BlockRemoved(block_hashes=[2], medium="GPU"))
                await s.tick()
                await tail.wait()
        assert tail.returncode == 0
        assert tail.stdout is not None
        assert b"late #" in await tail.stdout.receive()
    finally:
        if tail.returncode is None:
            tail.kill()
            await tail.wait()
        await tail.aclose()


async def test_tail_refuses_a_file_that_is_not_kvstream_json_lines(tmp_path: Path) -> None:
    foreign = tmp_path / "notes.txt"
    foreign.write_text("hello\nworld\n" * 50)
    for args in ([str(foreign)], [str(foreign), "--no-follow"]):
        code, out, err = await run_tail(*args)
        assert code == 2
        assert out == ""
        # One line, naming the file and why; the JSON parser's own words vary by version.
        (line,) = err.strip().splitlines()
        assert line.startswith(
            f"kvstream tail: error: {foreign}: not a kvstream JSON-lines file "
            "(its first line is not a batch: not a JSON line: unexpected character"
        )
        assert line.endswith(": line 1 column 1 (char 0))")


async def read_stderr_until(process: Any, needle: bytes) -> bytes:
    """What ``process`` wrote on stderr up to and including ``needle``."""
    seen = b""
    with anyio.fail_after(DEADLINE):
        while needle not in seen:
            seen += await process.stderr.receive()
    return seen


async def test_tail_says_once_why_a_connecting_zmq_end_may_hear_nothing() -> None:
    pytest.importorskip("zmq")
    # Both ends connect (nobody binds the port): nothing can arrive, and tail says why.
    tail = await anyio.open_process(
        [sys.executable, "-m", "kvstream", "tail", f"zmq+tcp://127.0.0.1:{closed_port()}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        seen = await read_stderr_until(tail, b"bind one end")
        assert b"nothing received from tcp://127.0.0.1:" in seen
        assert b"this end connects" in seen
    finally:
        tail.send_signal(signal.SIGTERM)
        with anyio.fail_after(DEADLINE):
            await tail.wait()
        assert tail.stderr is not None
        rest = b""
        with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError):
            while True:
                rest += await tail.stderr.receive()
        await tail.aclose()
    assert (seen + rest).count(b"nothing received") == 1  # once
    assert tail.returncode == 0
