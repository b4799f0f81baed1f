"""`kvstream demo` and `kvstream verify`, run as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvstream import JsonCodec
from kvstream.cli.main import main
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
        (["demo", "--sink", "bogus://x"], "unknown scheme 'bogus'"),
        (["demo", "--sink", "file:x.jsonl?polcy=1"], "unknown option(s): polcy"),
        (["verify", str(tmp_path / "missing.jsonl")], "cannot read"),
    ]:
        proc = _run(*args, cwd=tmp_path)
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr
        assert "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
