"""`kvstream bench`: the benchmark suite, side by side with its baselines.

Runs every benchmark of kvstream._bench (or those named with `--only`)
with a progress bar on stderr, prints a table (events/s, ratio to the
baseline measured in the same run, CPU per event, p50/p99), checks the
project's targets, and optionally writes the report as JSON and a plot of
events/s against events per tick. `--quick` runs small sizes (about 50 s on a
2-core machine; every run prints its own time); numbers for the record
come from a full run. `--check` exits with status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import anyio

from kvstream._bench.per_sink import SINK_NAMES, is_sink_url
from kvstream._bench.sizes import FULL, QUICK, TINY, Sizes
from kvstream._bench.suite import BENCHMARKS, run_suite
from kvstream._cli.argtypes import positive_int
from kvstream.config import open_sink
from kvstream.errors import ConfigError

__all__ = ["QUICK_TIME", "missed_targets", "register", "run"]

#: What `kvstream bench --quick` took, measured (see docs/benchmarks.md).
QUICK_TIME = "about 50 s"

EXAMPLES = (
    f"""\
examples:
  kvstream bench --quick                        every benchmark, small sizes ({QUICK_TIME})
  kvstream bench --quick --check                exit status 1 when a target is missed
  kvstream bench --json bench.json --plot bench.png
  kvstream bench --only efficiency --only zmq   two benchmarks, full size
  kvstream bench --only sinks --sink tcp --sink zmq --runs 3

benchmarks: """
    + ", ".join(BENCHMARKS)
    + """

The machine should be otherwise idle: ratios are measured side by side in one run
and hold better than absolute figures, but a loaded machine moves both.
"""
)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="run the benchmark suite against its baselines and check the targets",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick", action="store_true", help=f"small sizes ({QUICK_TIME} on a 2-core machine)"
    )
    p.add_argument(
        "--check", action="store_true", help="exit with status 1 when any target is missed"
    )
    p.add_argument("--json", metavar="PATH", help="write the full report as JSON ('-': stdout)")
    p.add_argument(
        "--plot", metavar="PATH", help="draw events/s against events per tick (.png, .svg)"
    )
    p.add_argument(
        "--only",
        action="append",
        choices=tuple(BENCHMARKS),
        metavar="NAME",
        help="run only this benchmark (repeatable): " + ", ".join(BENCHMARKS),
    )
    p.add_argument(
        "--sink",
        action="append",
        metavar="NAME|URL",
        help="per-sink benchmark: only these sinks (repeatable): "
        + ", ".join(SINK_NAMES)
        + ", or any sink URL (a plug-in's scheme too)",
    )
    p.add_argument(
        "--runs", type=positive_int, metavar="N", help="timed runs per case (median of N)"
    )
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # smoke tests
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


class _LineProgress:
    """A progress line on stderr, rewritten in place (when stderr is not a terminal:
    one line per benchmark)."""

    def __init__(self) -> None:
        self._tty = sys.stderr.isatty()
        self._name = ""
        self._total = 1
        self._done = 0
        self._t0 = time.monotonic()

    def start(self, name: str, description: str, total: int) -> None:
        self._name, self._total, self._done = name, max(total, 1), 0
        self._t0 = time.monotonic()
        if not self._tty:
            print(f"kvstream bench: {name}: {description} ...", file=sys.stderr, flush=True)
        self._draw()

    def advance(self) -> None:
        self._done += 1
        self._draw()

    def finish(self, name: str) -> None:
        if self._tty:
            self._done = self._total
            self._draw()
            print(file=sys.stderr, flush=True)
        else:
            print(
                f"kvstream bench: {name}: done in {time.monotonic() - self._t0:.1f} s",
                file=sys.stderr,
                flush=True,
            )

    def _draw(self) -> None:
        if not self._tty:
            return
        frac = min(self._done / self._total, 1.0)
        bar = "#" * int(frac * 30)
        print(
            f"\r{self._name:<11} [{bar:<30}] {frac * 100:3.0f}% "
            f"{time.monotonic() - self._t0:5.1f} s",
            end="",
            file=sys.stderr,
            flush=True,
        )


class _RichProgress:
    """rich's progress bar, one task per benchmark."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("{task.fields[name]:<11}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=Console(file=sys.stderr),
            transient=False,
        )
        self._task: Any = None

    def __enter__(self) -> _RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def start(self, name: str, description: str, total: int) -> None:
        self._task = self._progress.add_task(description, total=max(total, 1), name=name)

    def advance(self) -> None:
        if self._task is not None:
            self._progress.advance(self._task)

    def finish(self, name: str) -> None:
        if self._task is not None:
            task = self._progress.tasks[-1]
            self._progress.update(self._task, completed=task.total)


def _command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run (for the record in the report)."""
    words = ["kvstream", "bench"]
    if args.quick:
        words.append("--quick")
    for name in args.only or ():
        words += ["--only", name]
    for name in args.sink or ():
        words += ["--sink", name]
    if args.runs is not None:
        words += ["--runs", str(args.runs)]
    return " ".join(words)


def _sizes(args: argparse.Namespace) -> Sizes:
    sizes = TINY if args.tiny else QUICK if args.quick else FULL
    if args.runs is not None:
        sizes = sizes.scaled(runs=args.runs)
    return sizes


def missed_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of the report (overall and per benchmark) that was not met."""
    targets = list(report.get("targets", []))
    for result in report.get("results", []):
        targets.extend(result.get("targets", []))
    seen: set[str] = set()
    missed: list[dict[str, Any]] = []
    for t in targets:
        key = json.dumps(t, sort_keys=True, default=str)
        if not t.get("met", True) and key not in seen:
            seen.add(key)
            missed.append(t)
    return missed


async def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    sizes = _sizes(args)
    quick = bool(args.quick or args.tiny)
    only = args.only
    sinks = tuple(args.sink) if args.sink else SINK_NAMES
    for name in sinks:
        if is_sink_url(name):
            open_sink(name)  # a bad URL fails here, with the URL's own error
        elif name not in SINK_NAMES:
            raise ConfigError(
                f"--sink: expected one of {', '.join(SINK_NAMES)} or a sink URL, got {name!r}"
            )
    if args.plot and only is not None and not {"efficiency", "zmq"} & set(only):
        raise ConfigError("--plot: needs the efficiency or zmq benchmark (add --only efficiency)")
    progress: Any = None
    use_rich = False
    if not args.no_progress:
        use_rich = sys.stderr.isatty()
        if use_rich:
            try:
                progress = _RichProgress()
            except ImportError:
                use_rich = False
        if not use_rich:
            progress = _LineProgress()
    if use_rich:
        with progress:
            report = await run_suite(sizes, only=only, quick=quick, progress=progress, sinks=sinks)
    else:
        report = await run_suite(sizes, only=only, quick=quick, progress=progress, sinks=sinks)
    report["command"] = _command_line(args)
    from kvstream._bench.report import print_report

    if args.json != "-":
        print_report(report, sys.stdout, rich=sys.stdout.isatty())
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            await anyio.Path(args.json).write_text(text + "\n")
            print(f"kvstream bench: report written to {args.json}", file=sys.stderr)
    if args.plot:
        from kvstream._bench.plot import plot_series

        written = plot_series(report, args.plot)
        note = "" if written == args.plot else " (matplotlib not installed: SVG instead)"
        print(f"kvstream bench: plot written to {written}{note}", file=sys.stderr)
    elapsed = time.monotonic() - started
    missed = missed_targets(report)
    print(
        f"kvstream bench: ran in {elapsed:.0f} s; "
        + (f"{len(missed)} target(s) missed" if missed else "every target met"),
        file=sys.stderr,
    )
    if args.check and missed:
        for t in missed:
            print(f"kvstream bench: missed: {t.get('target')}", file=sys.stderr)
        return 1
    return 0
