"""benchmarks/count_instructions.py: its traced runs deliver every step, and its
arithmetic takes per-thread differences (callgrind itself is not needed here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from benchmark_scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "count_instructions.py"


def _script() -> ModuleType:
    return load_script("count_instructions")


@pytest.mark.parametrize(
    ("mode", "design"),
    [("dropin", "vllm"), ("dropin", "dropin"), ("native", "ring"), ("native", "noring")],
)
def test_a_traced_run_delivers_every_step_before_it_exits(mode: str, design: str) -> None:
    # The child waits until its subscriber has counted every step (it raises
    # TimeoutError otherwise): what callgrind counts is work that reached the wire.
    done = subprocess.run(
        [sys.executable, str(SCRIPT), mode, "--child", design, "--steps", "30", "--events", "4"]
        + (["--loops", "100"] if mode == "dropin" else []),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def _callgrind_file(path: Path, total: int) -> None:
    # The lines of callgrind's per-thread output that the script reads.
    path.write_text(
        "# callgrind format\nversion: 1\ncreator: callgrind-3.19.0\npid: 7\n"
        f"thread: 1\npart: 1\n\nevents: Ir\nsummary: {total}\n\nfl=(1) x.c\nfn=(1) f\n0 {total}\n\n"
        f"totals: {total}\n"
    )


def test_per_step_counts_come_from_the_difference_of_two_runs(tmp_path: Path) -> None:
    ci = _script()
    short = {1: 1_000, 2: 5_000, 3: 300, 4: 200}
    long = {1: 3_000, 2: 9_000, 3: 500, 4: 400}
    for n, counts in (("200", short), ("1200", long)):
        for thread, total in counts.items():
            _callgrind_file(tmp_path / f"vllm-{n}-{thread:02d}", total)
    read_short = ci.thread_totals(str(tmp_path), "vllm-200")
    read_long = ci.thread_totals(str(tmp_path), "vllm-1200")
    assert read_short == short
    assert read_long == long
    # main thread, the largest other, the rest summed, all: each (long - short) / steps
    assert ci.per_step(read_short, read_long, 1000) == (2.0, 4.0, 0.4, 6.4)


def test_an_unfinished_or_missing_run_is_an_error_that_names_it(tmp_path: Path) -> None:
    ci = _script()
    (tmp_path / "ring-200-01").write_text("# callgrind format\nevents: Ir\n")
    with pytest.raises(ValueError, match="ring-200-01: no 'totals:'"):
        ci.thread_totals(str(tmp_path), "ring-200")
    with pytest.raises(ValueError, match="no callgrind files named noring-200-NN"):
        ci.thread_totals(str(tmp_path), "noring-200")


def test_bad_arguments_name_the_option_and_the_value() -> None:
    for argv, expected in (
        (["dropin", "--events", "0"], "--events: expected an int >= 1, got 0"),
        (["dropin", "--short", "500", "--long", "400"], "--long: expected more steps"),
        (["native", "--loops", "10"], "--loops: only the dropin mode"),
        (["dropin", "--loops", "-1"], "--loops: expected an int >= 0, got -1"),
        (["dropin", "--cache-sim", "8MiB"], "--cache-sim: expected SIZE,ASSOC,LINE"),
    ):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), *argv],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2, (argv, done.stderr)
        assert expected in done.stderr, (argv, done.stderr)


def test_annotated_lines_give_each_functions_own_count() -> None:
    ci = _script()
    lines = (
        "170,988,000 (35.20%)  ???:mpack_encode_long [/x/msgspec/_core.so]",
        "    30,199  /tmp/Python-3.11.7/Python/ceval.c:_PyEval_EvalFrameDefault'2 [/x/lib.so]",
    )
    found = [ci._ANNOTATED.match(line) for line in lines]
    assert [(m["count"], m["name"].split(" [")[0]) for m in found if m] == [
        ("170,988,000", "???:mpack_encode_long"),
        ("30,199", "/tmp/Python-3.11.7/Python/ceval.c:_PyEval_EvalFrameDefault'2"),
    ]
    assert ci.busiest({1: 900, 2: 100, 3: 50}, {1: 1_000, 2: 700, 3: 60}) == 2


def test_cache_events_are_read_by_name_and_summed(tmp_path: Path) -> None:
    ci = _script()
    # With --cache-sim=yes callgrind's totals line has one count per event, in order.
    (tmp_path / "dropin-200-r0-01").write_text(
        "events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\nsummary: 1000 400 300 9 50 40 8 7 6\n"
    )
    assert ci.thread_totals(str(tmp_path), "dropin-200-r0") == {1: 1000}
    assert ci.thread_totals(str(tmp_path), "dropin-200-r0", ("DLmr", "DLmw")) == {1: 13}
    (tmp_path / "vllm-200-r0-01").write_text("events: Ir\nsummary: 1000\n")
    with pytest.raises(ValueError, match=r"no \['D1mr'\] among its events \['Ir'\]"):
        ci.thread_totals(str(tmp_path), "vllm-200-r0", ("D1mr",))
