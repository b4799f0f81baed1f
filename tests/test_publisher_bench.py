"""kvstream bench's drop-in publisher comparison runs at tiny sizes (no timings asserted)."""

from __future__ import annotations

from kvstream._bench.publisher_compare import bench_publisher, busy_work, calibrate_busy_work
from kvstream._bench.sizes import TINY
from kvstream._bench.suite import BENCHMARKS, run_suite
from kvstream._bench.workload import event_pool


async def test_the_publisher_comparison_reports_every_row_and_target() -> None:
    result = await bench_publisher(event_pool(TINY.pool_events), TINY)
    assert result.skipped == ""
    cases = [(row.case, row.param) for row in result.rows]
    assert ("vLLM-design publisher (baseline)", "16/batch") in cases
    assert ("kvstream EventPublisher (drop-in)", "16/batch") in cases
    for n in (16, 256):
        assert ("engine + kvstream EventPublisher", f"busy 2 ms, {n}/step") in cases
        assert ("engine alone (no publisher: the limit)", f"busy 2 ms, {n}/step") in cases
    names = [t.name for t in result.targets]
    assert "drop-in publish() p50 at 16/batch" in names
    assert "busy engine steps/s with the drop-in over vLLM design, 256/step" in names
    # Every batch published reached the counting subscriber in the other process.
    for row in result.rows:
        if "subscriber got" in row.note:
            got, sent = row.note.rsplit("subscriber got ", 1)[1].split()[0].split("/")
            assert got == sent


async def test_the_suite_runs_it_by_name() -> None:
    assert "publisher" in BENCHMARKS
    report = await run_suite(TINY, only=["publisher"], quick=True)
    assert [r["name"] for r in report["results"]] == ["publisher"]


def test_busy_work_is_calibrated_to_a_positive_loop_count() -> None:
    loops = calibrate_busy_work(0.0005)
    assert loops >= 1
    assert busy_work(10) == sum(i * i % 7 for i in range(10))
