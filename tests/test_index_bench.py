"""The index benchmark (`kvstream._bench.index_measure`) runs on a small corpus, and its JSON
becomes report rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvstream
from kvstream._bench import index_measure as bench
from kvstream._bench.index_runner import _rows, index_command


def test_the_benchmark_functions_run_and_report_every_key() -> None:
    corpus = bench.Corpus(2048)
    match = bench.bench_match(corpus, 5, 1)
    for tokens in (1024, 8192):
        for kind in ("hit", "miss", "baseline_hash_only", "bytes_hit", "baseline_bytes_hash_only"):
            assert match[f"{tokens}_tokens_{kind}_p50_us"] >= 0
    http = bench.bench_http(corpus, 5)
    assert set(http) >= {
        "in_process_p50_us",
        "in_process_bytes_p50_us",
        "http_json_p50_us",
        "http_binary_p50_us",
        "echo_json_p50_us",
        "echo_binary_p50_us",
        "h11_cycle_us",
        "orjson_loads_p50_us",
    }
    assert all(v > 0 for k, v in http.items() if k.endswith(("p50_us", "cycle_us")))
    apply = bench.bench_apply(corpus, 1)
    assert apply["block_events"] > corpus.blocks  # stores and placeholders
    live = bench.bench_match_live(corpus, 5, 1)
    assert live["queries"] == 2  # half the corpus's four batches are held back, at most
    for kind in ("after_batch", "second", "static"):
        assert live[f"8192_tokens_bytes_{kind}_p50_us"] > 0
    assert live["apply_batch_p50_us"] > 0
    rows = _rows({"match_2048": match, "http": http, "apply_2048": apply, "live_2048": live})
    names = [row.case for row in rows]
    assert "match 8192-token prompt, bytes API, events flowing (the first after a batch)" in names
    assert "match 8192-token prompt (hit, bytes API)" in names
    assert "HTTP /match, 8192 tokens, binary body" in names
    assert "HTTP /match floor: anyio echo of the binary request" in names
    assert "apply (blocks/s)" in names


def test_the_child_imports_the_kvstream_this_process_runs(tmp_path: Path) -> None:
    argv, env = index_command(quick=True)
    assert argv[:4] == [sys.executable, "-P", "-m", "kvstream._bench.index_measure"]
    assert argv[4:] == ["--json", "--quick"]
    # Run from a folder holding a decoy kvstream: the child still imports this one.
    (tmp_path / "kvstream").mkdir()
    (tmp_path / "kvstream" / "__init__.py").write_text("raise ImportError('decoy')\n")
    probe = [*argv[:2], "-c", "import kvstream; print(kvstream.__file__)"]
    done = subprocess.run(probe, env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == kvstream.__file__


def test_only_and_sizes_run_a_part_of_the_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--only", "apply,gc", "--sizes", "2048", "--repeat", "1", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert {"apply_2048", "gc"} <= set(results)
    assert not any(k.startswith(("match_", "memory_", "http", "apply_sim")) for k in results)
    with pytest.raises(SystemExit):
        bench.main(["--only", "apply,nothing"])
    assert "unknown parts ['nothing']" in capsys.readouterr().err
