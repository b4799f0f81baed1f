"""`kvstream bench --check` and the time it states: the exit status follows the targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstream._cli.bench import QUICK_TIME, missed_targets
from kvstream._cli.main import main


def test_missed_targets_collects_every_unmet_target_once() -> None:
    miss = {"target": "tick() p50", "met": False, "value": 3.0, "op": "<=", "limit": 2.0}
    report = {
        "targets": [miss, {"target": "ok", "met": True}],
        "results": [{"targets": [miss]}, {"targets": [{"target": "zmq", "met": False}]}],
    }
    assert [t["target"] for t in missed_targets(report)] == ["tick() p50", "zmq"]
    assert missed_targets({"targets": [{"target": "ok", "met": True}], "results": []}) == []


def test_check_exits_non_zero_exactly_when_a_target_is_missed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report_path = tmp_path / "bench.json"
    args = ["bench", "--tiny", "--no-progress", "--only", "event", "--json", str(report_path)]
    assert main(args) == 0  # without --check the status says nothing about targets
    err = capsys.readouterr().err
    assert "kvstream bench: ran in " in err
    code = main([*args, "--check"])
    report = json.loads(report_path.read_text())
    missed = missed_targets(report)
    assert report["targets"]  # the event benchmark has targets to miss
    assert code == (1 if missed else 0)
    err = capsys.readouterr().err
    if missed:
        assert f"{len(missed)} target(s) missed" in err
        assert all(f"missed: {t['target']}" in err for t in missed)
    else:
        assert "every target met" in err


def test_quick_help_states_the_measured_time(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert QUICK_TIME in out
    assert "under a minute" not in out
