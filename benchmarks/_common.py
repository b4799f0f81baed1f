"""What every script in `benchmarks/` shares: options, the run, the output.

The benchmarks themselves live in `kvstream._bench` (so `kvstream bench`
can run them from an installed package); each script here runs a few of them,
prints their table and writes the JSON report. Every script takes:

    --quick        small sizes (seconds, for development)
    --json PATH    write the report as JSON ('-' for stdout, no table)
    --runs N       timed runs per case (the median is reported)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from kvstream._bench.report import render_text
from kvstream._bench.sizes import FULL, QUICK, Sizes
from kvstream._bench.suite import run_suite


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON ('-': stdout)")
    p.add_argument("--runs", type=int, metavar="N", help="timed runs per case (median)")
    return p


def sizes_of(args: argparse.Namespace) -> Sizes:
    sizes = QUICK if args.quick else FULL
    if args.runs is not None:
        if args.runs < 1:
            raise SystemExit("--runs: expected a positive number")
        sizes = sizes.scaled(runs=args.runs)
    return sizes


def main(
    args: argparse.Namespace, benchmarks: Sequence[str], *, sinks: Sequence[str] | None = None
) -> int:
    """Run `benchmarks` (names of `kvstream._bench.suite.BENCHMARKS`), report."""
    sizes = sizes_of(args)

    async def go() -> dict[str, Any]:
        options: dict[str, Any] = {"only": list(benchmarks), "quick": args.quick}
        if sinks is not None:
            options["sinks"] = tuple(sinks)
        return await run_suite(sizes, **options)

    report = anyio.run(go)
    report["command"] = " ".join(["python", *sys.argv])
    if args.json != "-":
        print(render_text(report))
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0
