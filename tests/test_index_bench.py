"""benchmarks/bench_index.py runs on a small corpus, and its JSON becomes report rows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvstream.bench.index_runner import _rows

ROOT = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    path = ROOT / "benchmarks" / "bench_index.py"
    spec = importlib.util.spec_from_file_location("bench_index_under_test", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_functions_run_and_report_every_key() -> None:
    bench = _script()
    corpus = bench.Corpus(2048)
    match = bench.bench_match(corpus, 5, 1)
    for tokens in (1024, 8192):
        for kind in ("hit", "miss", "baseline_hash_only", "bytes_hit", "baseline_bytes_hash_only"):
            assert match[f"{tokens}_tokens_{kind}_p50_us"] >= 0
    http = bench.bench_http(corpus, 5)
    assert set(http) >= {"in_process_p50_us", "http_json_p50_us", "http_binary_p50_us"}
    apply = bench.bench_apply(corpus, 1)
    assert apply["block_events"] > corpus.blocks  # stores and placeholders
    rows = _rows({"match_2048": match, "http": http, "apply_2048": apply})
    names = [row.case for row in rows]
    assert "match 8192-token prompt (hit, bytes API)" in names
    assert "HTTP /match, 8192 tokens, binary body" in names
    assert "apply (blocks/s)" in names


def test_only_and_sizes_run_a_part_of_the_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _script()
    assert bench.main(["--only", "apply,gc", "--sizes", "2048", "--repeat", "1", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert {"apply_2048", "gc"} <= set(results)
    assert not any(k.startswith(("match_", "memory_", "http", "apply_sim")) for k in results)
    with pytest.raises(SystemExit):
        bench.main(["--only", "apply,nothing"])
    assert "unknown parts ['nothing']" in capsys.readouterr().err
