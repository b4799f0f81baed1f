"""The prefix index's numbers (issue item 7), from `kvstream._bench.index_measure`.

The suite runs the index benchmark in a child process (its memory and CPU
time are then its own) and turns its JSON into table rows. The child imports
the very `kvstream` this process runs (`index_command()`), whether installed
or from a source tree, so nothing is looked up by a path relative to a file.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvstream
from kvstream._bench.results import Result, Row

__all__ = ["bench_index", "index_command"]

Progress = Callable[[], None]

MODULE = "kvstream._bench.index_measure"


def index_command(quick: bool) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of the child that runs the index benchmark.

    `-P` keeps the working directory off the child's `sys.path`, and the
    folder this process imported `kvstream` from goes first on its
    `PYTHONPATH`: the child measures the same code.
    """
    home = str(Path(kvstream.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (home, env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-P", "-m", MODULE, "--json"] + (["--quick"] if quick else [])
    return argv, env


def _latency(
    case: str,
    indexed: int,
    p50: float,
    base: float | None,
    baseline: str,
    p99: float | None = None,
) -> Row:
    """A latency row of the index section: p50 (and p99), over `base` when there is one."""
    return Row(
        "index",
        case,
        f"{indexed:,} blocks",
        baseline=baseline if base else "",
        ratio=p50 / base if base else None,
        p50_us=p50,
        p99_us=p99,
    )


def _rows(data: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for key, value in data.items():
        if not isinstance(value, dict):
            continue
        if key.startswith("apply_") and "apply_blocks_per_s" in value:
            blocks = int(key.split("_", 1)[1])
            base = value.get("baseline_hash_only_blocks_per_s")
            rows.append(
                Row(
                    "index",
                    "apply (blocks/s)",
                    f"{blocks:,} blocks",
                    value["apply_blocks_per_s"],
                    "hash only" if base else "",
                    value["apply_blocks_per_s"] / base if base else None,
                    note=f"{value.get('apply_ns_per_block', 0):.0f} ns/block",
                )
            )
        elif key == "apply_sim" and "apply_block_events_per_s" in value:
            rows.append(
                Row(
                    "index",
                    "apply, simulated engines (block events/s)",
                    "",
                    value["apply_block_events_per_s"],
                )
            )
        elif key.startswith("match_"):
            indexed = int(key.split("_", 1)[1])
            for tokens in (1024, 8192):
                for kind, label, base_key in (
                    ("hit", "hit", "baseline_hash_only"),
                    ("miss", "miss", None),
                    ("bytes_hit", "hit, bytes API", "baseline_bytes_hash_only"),
                ):
                    p50 = value.get(f"{tokens}_tokens_{kind}_p50_us")
                    p99 = value.get(f"{tokens}_tokens_{kind}_p99_us")
                    if p50 is None:
                        continue
                    base = value.get(f"{tokens}_tokens_{base_key}_p50_us") if base_key else None
                    rows.append(
                        _latency(
                            f"match {tokens}-token prompt ({label})",
                            indexed,
                            p50,
                            base,
                            "hash only",
                            p99,
                        )
                    )
        elif key.startswith("live_"):
            indexed = int(key.split("_", 1)[1])
            base = value.get("8192_tokens_bytes_static_p50_us")
            for kind, label in (
                ("after_batch", "the first after a batch"),
                ("second", "the second"),
            ):
                p50 = value.get(f"8192_tokens_bytes_{kind}_p50_us")
                if p50 is None:
                    continue
                rows.append(
                    _latency(
                        f"match 8192-token prompt, bytes API, events flowing ({label})",
                        indexed,
                        p50,
                        base,
                        "no batch between",
                    )
                )
        elif key == "http" and "in_process_p50_us" in value:
            base = {"json": "in_process_p50_us", "binary": "in_process_bytes_p50_us"}
            for kind in ("json", "binary"):
                # the anyio client's round trip, and (binary) the asyncio Protocol client's
                for key_part, client in (("", ""), ("_lean", ", Protocol client")):
                    p50 = value.get(f"http_{kind}{key_part}_p50_us")
                    if p50 is None:
                        continue
                    added = value[f"http_{kind}{key_part}_added_us"]
                    rows.append(
                        Row(
                            "index",
                            f"HTTP /match, 8192 tokens, {kind} body{client}",
                            f"{value.get('blocks_indexed', 0):,} blocks",
                            baseline="in process",
                            ratio=p50 / value.get(base[kind], value["in_process_p50_us"]),
                            p50_us=p50,
                            note=f"+{added:.0f} µs over in process",
                        )
                    )
                echo = value.get(f"echo_{kind}_p50_us")
                if echo is not None:  # the same bytes through a bare anyio echo server
                    rows.append(
                        Row(
                            "index",
                            f"HTTP /match floor: anyio echo of the {kind} request",
                            baseline="",
                            p50_us=echo,
                            note="no HTTP, no index",
                        )
                    )
        elif key.startswith("memory_"):
            n = int(key.split("_", 1)[1])
            per = value.get("bytes_per_block_one_origin_one_tier")
            shared = value.get("bytes_per_block_per_origin_4_origins")
            if shared is not None:
                rows.append(
                    Row(
                        "index",
                        "bytes per (origin, block), four origins holding the same blocks",
                        f"{n:,} blocks",
                        note=f"{shared:.0f} bytes",
                    )
                )
            if per is not None:
                rows.append(
                    Row(
                        "index",
                        "bytes per block (one origin, one tier)",
                        f"{n:,} blocks",
                        note=f"{per:.0f} bytes/block",
                    )
                )
    return rows


async def bench_index(quick: bool, progress: Progress | None = None) -> Result:
    result = Result("index", "Prefix index (benchmarks/bench_index.py)")
    argv, env = index_command(quick)
    import anyio

    try:
        done = await anyio.run_process(argv, check=False, env=env)
    except OSError as exc:
        result.skipped = f"not available ({exc})"
        return result
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace")[-500:]
        result.skipped = f"bench_index.py failed (exit {done.returncode}): {tail}"
        return result
    try:
        data = json.loads(done.stdout)
    except ValueError as exc:
        result.skipped = f"bench_index.py printed no JSON: {exc}"
        return result
    result.rows = _rows(data)
    result.data = {
        "command": " ".join(["python", "benchmarks/bench_index.py", *argv[4:]]),
        "output": data,
    }
    if progress is not None:
        progress()
    return result
