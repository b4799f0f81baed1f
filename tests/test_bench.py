"""The benchmark suite works: tiny sizes, every code path, valid reports. No timings asserted."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvstream._bench.measure import Sample, percentile, summarize
from kvstream._bench.plot import plot_series
from kvstream._bench.report import render_text
from kvstream._bench.sizes import TINY
from kvstream._bench.suite import BENCHMARKS, machine_info, run_suite
from kvstream._bench.vllm_baseline import to_vllm_batch
from kvstream._bench.workload import VOCAB_SIZE, batches, chunks, event_pool, pool_stats
from kvstream._cli.main import main
from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.events import BlockRemoved, BlockStored

ROOT = Path(__file__).resolve().parent.parent


def _load(path: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(path.read_text())
    return report


def _check_report(report: dict[str, Any], names: list[str]) -> None:
    assert report["kvstream_bench"] == 1
    assert report["machine"]["cpus"] >= 1
    assert [r["name"] for r in report["results"]] == names
    for result in report["results"]:
        if result.get("skipped"):
            continue
        assert result["rows"], result["name"]
        for row in result["rows"]:
            for key in ("events_per_s", "ratio", "cpu_us_per_event", "p50_us", "p99_us"):
                if key in row:
                    assert row[key] >= 0, (result["name"], row)
    for target in report["targets"]:
        assert set(target) >= {"target", "value", "op", "limit", "met"}
        assert target["met"] == (
            target["value"] >= target["limit"]
            if target["op"] == ">="
            else target["value"] <= target["limit"]
        )


def test_workload_has_the_issue_shape() -> None:
    # The main case: shaped as vLLM emits it (issue 12, target 8).
    pool = event_pool(512)
    stats = pool_stats(pool)
    assert (stats.events, stats.stored, stats.removed) == (512, 512, 0)
    assert stats.blocks_per_stored == 16
    assert stats.tokens_per_stored == 256
    for e in pool:
        assert type(e) is BlockStored
        assert e.extra_keys == [None] * 16
        assert (e.group_idx, e.kv_cache_spec_kind, e.medium) == (0, "full_attention", "GPU")
        assert all(0 <= t < VOCAB_SIZE for t in e.token_ids)
        assert all(type(h) is int and 0 <= h < 2**64 for h in e.block_hashes)
    assert max(t for e in pool for t in e.token_ids) >= 32_768  # type: ignore[attr-defined]  # the whole vocabulary
    assert any(e.parent_block_hash is None for e in pool)  # type: ignore[attr-defined]
    assert any(e.parent_block_hash == p.block_hashes[-1] for p, e in itertools.pairwise(pool))  # type: ignore[attr-defined]
    # The second case: stores and removals from the simulated engine.
    mixed = event_pool(512, shape="mixed")
    mixed_stats = pool_stats(mixed)
    assert mixed_stats.stored > 0
    assert mixed_stats.removed > 0
    assert mixed_stats.blocks_per_stored == 16
    assert all(type(e) in (BlockStored, BlockRemoved) for e in mixed)
    # Cycling reuses the pool's events: nothing new is made.
    cycled = chunks(pool, 64, 20)
    assert all(e is pool[(i * 64 + j) % 512] for i, c in enumerate(cycled) for j, e in enumerate(c))
    numbered = batches(pool, 16, 3)
    assert [b.seq for b in numbered] == [0, 1, 2]
    assert all(len(b) == 16 for b in numbered)


def test_vllm_baseline_sends_the_bytes_kvstream_sends() -> None:
    """The baseline does the same work: its payload is the msgpack codec's (map profile)."""
    pool = event_pool(512)
    encoder = msgspec.msgpack.Encoder()
    codec = MsgpackCodec()
    for batch in batches(pool, 16, 4):
        assert encoder.encode(to_vllm_batch(batch)) == codec.encode(batch)


def test_measure_helpers() -> None:
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0
    s = summarize([Sample(1.0, 0.5, 100, 1000), Sample(2.0, 1.0, 100, 1000)])
    assert s.events_per_s == 75.0
    assert s.cpu_us_per_event == 7500.0


def test_cli_bench_tiny_writes_json_table_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report_path = tmp_path / "bench.json"
    plot_path = tmp_path / "bench.svg"
    code = main(
        [
            "bench",
            "--tiny",
            "--no-progress",
            "--only",
            "event",
            "--only",
            "efficiency",
            "--only",
            "host",
            "--only",
            "scaling",
            "--only",
            "memory",
            "--json",
            str(report_path),
            "--plot",
            str(plot_path),
        ]
    )
    assert code == 0
    report = _load(report_path)
    _check_report(report, ["event", "efficiency", "host", "scaling", "memory"])
    out = capsys.readouterr().out
    assert "Pipeline efficiency" in out
    assert "Targets:" in out
    names = {t["target"] for t in report["targets"]}
    assert any("tick() p50" in n for n in names)
    assert any("validated event" in n for n in names)
    memory = next(r for r in report["results"] if r["name"] == "memory")
    assert set(memory["data"]) == {"drop_oldest", "drop_newest", "block"}
    assert memory["data"]["block"]["blocked"] is True
    assert memory["data"]["drop_oldest"]["stalled_dropped_events"] > 0
    assert plot_path.stat().st_size > 0


async def test_zmq_and_sinks_tiny() -> None:
    report = await run_suite(TINY, only=["zmq", "sinks"], quick=True, sinks=("file", "unix", "zmq"))
    _check_report(report, ["zmq", "sinks"])
    zmq_result, sinks_result = report["results"]
    assert not zmq_result.get("skipped")
    # uvloop is in the test extra: on asyncio's loop the host-on-uvloop row is there beside
    # the others; on uvloop (KVSTREAM_TEST_LOOP=uvloop) the bench's own rows are that case.
    cases = {row["case"] for row in zmq_result["rows"]}
    on_asyncio = report["machine"]["event_loop"] == "asyncio"
    assert ("kvstream Scheduler + ZmqSink, ring on, host on uvloop" in cases) is on_asyncio
    assert "kvstream Scheduler + ZmqSink, replay ring on" in cases
    # Every batch reached the counting subscriber, on both sides.
    for row in zmq_result["rows"]:
        if "subscriber got" not in row.get("note", ""):
            continue  # the ring's cost: a difference of two rows
        got, sent = row["note"].split("subscriber got ")[1].split(" ")[0].split("/")
        assert got == sent, row
    # The ring's cost at each batch size, in wall time (the target) and in process CPU.
    data = zmq_result["data"]
    wall_keys = sorted(k for k in data if k.startswith("ring_us_per_event_"))
    cpu_keys = sorted(k for k in data if k.startswith("ring_cpu_us_per_event_"))
    assert wall_keys
    assert [k.rsplit("_", 1)[1] for k in cpu_keys] == [k.rsplit("_", 1)[1] for k in wall_keys]
    assert all(isinstance(data[k], float) for k in cpu_keys)
    costs = [r for r in zmq_result["rows"] if r["case"].startswith("replay ring's cost")]
    assert len(costs) == len(wall_keys)
    assert all(" in CPU); ring bound " in r["note"] for r in costs)
    assert {r["case"] for r in sinks_result["rows"]} == {"file", "unix", "zmq"}
    assert all(r["events_per_s"] > 0 and r["mb_per_s"] > 0 for r in sinks_result["rows"])


def test_render_and_svg_plot_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = {
        "quick": True,
        "machine": {"cpus": 2, "python": "3.11"},
        "results": [
            {
                "name": "efficiency",
                "title": "Pipeline efficiency",
                "rows": [
                    {
                        "case": "pipeline",
                        "param": "64/tick",
                        "events_per_s": 1000.0,
                        "ratio": 0.9,
                        "baseline": "codec",
                    }
                ],
                "targets": [
                    {
                        "target": "t",
                        "value": 0.9,
                        "op": ">=",
                        "limit": 0.85,
                        "unit": "",
                        "met": True,
                    }
                ],
                "data": {
                    "series": {
                        "codec alone": [[16, 900.0], [64, 1000.0]],
                        "null sink": [[16, 800.0], [64, 950.0]],
                    }
                },
            },
            {
                "name": "index",
                "title": "Index",
                "skipped": "not available",
                "rows": [],
                "targets": [],
            },
        ],
        "targets": [
            {"target": "t", "value": 0.9, "op": ">=", "limit": 0.85, "unit": "", "met": True}
        ],
    }
    text = render_text(report)
    assert "0.90x" in text
    assert "[MET ]" in text
    assert "not available" in text
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails: SVG fallback
    written = plot_series(report, str(tmp_path / "plot.png"))
    assert written.endswith(".svg")
    svg = Path(written).read_text()
    assert svg.startswith("<svg")
    assert "polyline" in svg
    assert "codec alone" in svg


async def test_codec_batch_and_file_tiny() -> None:
    report = await run_suite(TINY, only=["codec", "batch", "file"], quick=True)
    _check_report(report, ["codec", "batch", "file"])
    names = {t["target"] for t in report["targets"]}
    assert any("[12.7] MsgpackCodec" in n for n in names)
    assert any("[12.7] JsonCodec" in n for n in names)
    assert any("[12.4]" in n for n in names)
    assert {n for n in names if "[12.5]" in n} == {
        "[12.5] FileSink pipeline over codec writing, tmpfs file",
        "[12.5] FileSink pipeline over codec writing, /dev/null",
    }


def test_the_report_names_the_version_of_kvstream_it_measured() -> None:
    import kvstream

    # kvstream-events' version, not that of the package index's unrelated `kvstream`
    assert machine_info()["versions"]["kvstream"] == kvstream.__version__ != "0.0.0"


def test_every_benchmark_is_listed() -> None:
    assert list(BENCHMARKS) == [
        "event",
        "codec",
        "batch",
        "efficiency",
        "host",
        "scaling",
        "file",
        "zmq",
        "publisher",
        "memory",
        "sinks",
        "index",
    ]


@pytest.mark.parametrize("script", ["bench_events.py"])
def test_scripts_emit_json(script: str, tmp_path: Path) -> None:
    """The scripts in benchmarks/ run and write a report (the quickest one, at --quick)."""
    out = tmp_path / "out.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / script),
            "--quick",
            "--runs",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    _check_report(_load(out), ["event"])
