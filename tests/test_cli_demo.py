"""`kvstream demo` and `kvstream verify`, run as a user runs them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstream import JsonCodec
from kvstream._cli.main import main
from kvstream.sim import check_consistency


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run(
        [sys.executable, "-m", "kvstream", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        check=False,
    )


def test_demo_default_writes_a_consistent_file(tmp_path: Path) -> None:
    proc = _run("demo", "--steps", "150", "--rate", "0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    files = list(tmp_path.glob("kvstream-demo-*.jsonl"))
    assert len(files) == 1
    assert files[0].name in proc.stderr  # the output names the file
    assert "BlockStored" in proc.stderr
    assert "last seq" in proc.stderr
    batches = JsonCodec().decode_lines(files[0].read_bytes())
    report = check_consistency(batches)
    assert report.batches == len(batches) > 100
    assert f"last seq {batches[-1].seq}" in proc.stderr

    verify = _run("verify", str(files[0]), cwd=tmp_path)
    assert verify.returncode == 0, verify.stderr
    assert "OK" in verify.stdout


def test_demo_writes_to_several_sinks(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    code = main(
        [
            "demo",
            "--steps",
            "40",
            "--rate",
            "0",
            "--seed",
            "9",
            "--sink",
            f"file:{a}",
            "--sink",
            f"file://{b}?policy=drop_newest",
        ]
    )
    assert code == 0
    assert a.read_bytes() == b.read_bytes() != b""


def test_verify_reports_an_inconsistent_file(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    assert main(["demo", "--steps", "30", "--rate", "0", "--sink", f"file:{src}"]) == 0
    lines = src.read_bytes().splitlines(keepends=True)
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b"".join(lines[:5] + lines[6:]))  # lose one batch
    proc = _run("verify", str(broken), cwd=tmp_path)
    assert proc.returncode == 1
    assert "INCONSISTENT" in proc.stderr
    assert "expected seq 5" in proc.stderr


def test_user_mistakes_are_one_line_errors(tmp_path: Path) -> None:
    for args, needle in [
        (["demo", "--steps", "-1"], "--steps"),
        # Numeric options are named by their flag, not by the class parameter they feed.
        (["demo", "--block-size", "0"], "argument --block-size: expected an integer >= 1, got '0'"),
        (["index", "x.jsonl", "--ttl", "0"], "argument --ttl: expected seconds > 0, got '0'"),
        (["index", "--demo", "--ranks", "0"], "argument --ranks: expected an integer >= 1"),
        (["relay", "--close-timeout", "-1"], "argument --close-timeout: expected seconds >= 0"),
        (["tail", "x.jsonl", "--count", "-1"], "argument --count: expected an integer >= 0"),
        # argparse's own refusals are one line too, pointing at --help.
        (["demo", "--stepz", "1"], "unrecognized arguments: --stepz 1 (see kvstream --help)"),
        (["bench", "--only", "nosuch"], "invalid choice: 'nosuch'"),
        (["demo", "--sink", "bogus://x"], "unknown scheme 'bogus'"),
        (["demo", "--sink", "file:x.jsonl?polcy=1"], "unknown option(s): polcy"),
        (["verify", str(tmp_path / "missing.jsonl")], "cannot read"),
    ]:
        proc = _run(*args, cwd=tmp_path)
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr
        assert "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_every_demo_run_writes_its_own_file_and_says_where_and_how_big(tmp_path: Path) -> None:
    runs = [_run("demo", "--steps", "20", "--rate", "0", cwd=tmp_path) for _ in range(2)]
    files = sorted(tmp_path.glob("kvstream-demo-*.jsonl"))
    assert len(files) == 2  # never two runs appended into one file
    for proc in runs:
        assert proc.returncode == 0, proc.stderr
        wrote = [line for line in proc.stderr.splitlines() if " wrote " in line]
        assert len(wrote) == 1
        name = wrote[0].split(" to ")[1].split()[0]
        size = (tmp_path / name).stat().st_size
        assert f"{size / 1000:,.1f} kB" in wrote[0] or f"{size / 1e6:,.1f} MB" in wrote[0]
    for f in files:
        assert [b.seq for b in JsonCodec().decode_lines(f.read_bytes())] == list(range(20))


def test_demo_out_replaces_the_file_it_names(tmp_path: Path) -> None:
    out = tmp_path / "demo.jsonl"
    out.write_text("an earlier run\n")
    proc = _run("demo", "--steps", "10", "--rate", "0", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [b.seq for b in JsonCodec().decode_lines(out.read_bytes())] == list(range(10))
    assert list(tmp_path.iterdir()) == [out]  # and no default file beside it
    with_sink = _run("demo", "--steps", "5", "--rate", "0", "--sink", "memory:", cwd=tmp_path)
    assert with_sink.returncode == 0, with_sink.stderr
    assert list(tmp_path.iterdir()) == [out]  # --sink alone writes no file


def _recording(tmp_path: Path, steps: int = 60) -> list[bytes]:
    src = tmp_path / "full.jsonl"
    assert main(["demo", "--steps", str(steps), "--rate", "0", "--out", str(src)]) == 0
    return src.read_bytes().splitlines(keepends=True)


def test_verify_takes_several_files_and_quoted_globs(tmp_path: Path) -> None:
    lines = _recording(tmp_path)
    (tmp_path / "a.jsonl").write_bytes(b"".join(lines))
    (tmp_path / "b.jsonl").write_bytes(b"".join(lines[:5] + lines[6:]))  # one batch lost
    proc = _run("verify", str(tmp_path / "full.jsonl"), str(tmp_path / "[ab].jsonl"), cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stdout.count(": OK: ") == 2
    assert "b.jsonl: INCONSISTENT" in proc.stderr
    assert "expected seq 5" in proc.stderr
    nothing = _run("verify", str(tmp_path / "nope-*.jsonl"), cwd=tmp_path)
    assert nothing.returncode == 2
    assert "no file matches" in nothing.stderr


def test_verify_judges_a_late_join_from_its_first_batch(tmp_path: Path) -> None:
    lines = _recording(tmp_path)
    late = tmp_path / "tail.jsonl"  # what `kvstream tail` records after joining at seq 25
    late.write_bytes(b"".join(lines[25:]))
    proc = _run("verify", str(late), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "OK: 35 batches" in proc.stdout
    # A relay that joined late numbers its own batches from 0: only --joined-late knows.
    codec = JsonCodec()
    relayed = [codec.decode(line) for line in lines[25:]]
    relay = tmp_path / "relay.jsonl"
    relay.write_bytes(
        b"".join(
            codec.encode(type(b)(**{**codec.batch_to_dict(b), "seq": i, "events": b.events}))
            for i, b in enumerate(relayed)
        )
    )
    plain = _run("verify", str(relay), cwd=tmp_path)
    assert plain.returncode == 1
    assert "INCONSISTENT" in plain.stderr
    assert "--joined-late" in plain.stderr
    late_ok = _run("verify", "--joined-late", str(relay), cwd=tmp_path)
    assert late_ok.returncode == 0, late_ok.stderr
    # Still strict after the start: a lost batch in the middle is caught.
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b"".join(lines[25:30] + lines[31:]))
    assert _run("verify", "--joined-late", str(broken), cwd=tmp_path).returncode == 1


def test_demo_banner_says_whether_each_zmq_endpoint_binds_or_connects(tmp_path: Path) -> None:
    pytest.importorskip("zmq")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvstream", "demo", "--steps", "0", "--rate", "20",
         "--sink", f"zmq+tcp://127.0.0.1:{port}", "--sink", "zmq+tcp://*:0?replay=tcp://*:0"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert demo.stderr is not None
    lines: list[str] = []
    try:
        for line in demo.stderr:
            lines.append(line)
            if "nobody has subscribed" in line and f":{port}" in line:
                break
    finally:
        demo.send_signal(signal.SIGTERM)
        _, rest = demo.communicate(timeout=60)
    text = "".join(lines) + rest
    assert demo.returncode == 0, text
    assert f"tcp://127.0.0.1:{port} connects (no '*' in the endpoint" in text
    assert "tcp://0.0.0.0:" in text  # the bound port, resolved
    assert "binds: subscribers connect to it" in text
    assert "; replay tcp://" in text
    assert " binds" in text
    hint = [
        line
        for line in text.splitlines()
        if f"nobody has subscribed to tcp://127.0.0.1:{port}" in line
    ]
    assert len(hint) == 1  # once
    assert "a subscriber there must bind" in hint[0]
    assert f"tcp://127.0.0.1:{port} never had a subscriber" in text


@pytest.mark.parametrize("command", ["demo", "relay"])
def test_a_closed_stdout_stops_the_command_quietly(command: str, tmp_path: Path) -> None:
    """`kvstream demo --sink - | head`: the command stops once head has what it wanted,
    as on SIGTERM (it retried the write for ever, and an endless demo never ended)."""
    if command == "demo":
        args = ["demo", "--steps", "0", "--sink", "-"]
    else:
        source = tmp_path / "in.jsonl"
        made = _run("demo", "--steps", "300", "--rate", "0", "--out", str(source), cwd=tmp_path)
        assert made.returncode == 0, made.stderr
        args = ["relay", "--source", f"file:{source}?follow=1", "--sink", "-"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstream", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what head does once it has its lines
    try:
        err = proc.stderr.read().decode()  # until the command exits
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert JsonCodec().decode(first.strip()).seq == 0
    assert proc.returncode == 0, err
    assert "stopped by the reader of standard output going away" in err
    assert "Traceback" not in err
    assert "Exception ignored" not in err
