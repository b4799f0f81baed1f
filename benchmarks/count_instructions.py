"""Instructions per step, thread by thread, under callgrind (issue 12).

    python benchmarks/count_instructions.py dropin --events 16
    python benchmarks/count_instructions.py dropin --events 16 --loops 2000
    python benchmarks/count_instructions.py dropin --events 1
    python benchmarks/count_instructions.py native --events 1
    python benchmarks/count_instructions.py dropin --events 16 --repeat 2 --cache-sim

Wall-clock ratios on two shared cores move by a few percent from run to run,
more than the gaps they are meant to show; instruction counts say how much
work each thread does. This script runs each publisher twice under
`valgrind --tool=callgrind --separate-threads=yes`, once for `--short` steps
and once for `--long` steps, and divides the difference of each thread's
count by the difference of the steps: what remains is what one more step
costs, start-up, imports and the workload's construction cancelled out. Each
design runs `--repeat` times (3), the designs taking turns; the table gives
the medians, the range of the totals, and the median ratio of each repeat's
total to the vLLM design's. The engine runs in the process's main thread; the
subscriber counts frames in another process, not traced.

`dropin`: the engine's thread does `busy_work(--loops)` (0: none) and then
`publish()`es one step of vLLM's structs, to the vLLM-design publisher
(`kvstream._bench.vllm_baseline`, vLLM's own code's design) and to kvstream's
drop-in `EventPublisher(idle_poll=0.005)`; per thread: the engine's, the
sender (the publisher's thread, or kvstream's loop), the rest summed (ZMQ's
I/O thread and reaper).

`native`: the vLLM-design publisher fed from the main thread, against
kvstream's `Scheduler` + `ZmqSink` driven natively (`emit`, `await tick()`, a
checkpoint, in one thread), replay ring on and off.

Both rings hold `--buffer-steps` steps (100: full, and evicting one step per
step, within the first `--short` steps, as a long-running publisher's ring is;
vLLM's default of 10,000 would not fill in a run this short).

`--functions N` also prints, for each design's first repeat, the N functions
(C level: Python code shows as the interpreter's eval loop) with the most
instructions of their own per step in its busiest thread; `--keep DIR` keeps
callgrind's files for `callgrind_annotate`. `--cache-sim` also counts L1 and
last-level data misses per step and thread, in callgrind's simulation of one
cache hierarchy shared by all threads (fixed 32 KiB L1s; the last level 8 MiB,
16-way, unless given): how much memory each step first touches, not what a
miss costs; about twice as slow.

Callgrind runs the threads one at a time and about 50 times slower than the
machine: it counts the work, not how the threads overlap, wait for each other
or miss the caches, and a timer (kvstream's idle poll) fires more often per
step than it does at full speed. One run's count moves by about half a percent
at 1 event per step and by up to a few percent at 16 (how many steps each
wake-up of a sender finds varies with timing): compare the ranges. Needs
valgrind (Debian: `apt-get install valgrind`).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

#: Distinct steps, built once and cycled, so that a longer run builds nothing more.
DISTINCT_STEPS = 50

#: How long the traced child waits for anything (seconds): callgrind is ~50x slower.
_WAIT = 600.0

#: The designs of each mode, in table order: (key, label).
DESIGNS: dict[str, tuple[tuple[str, str], ...]] = {
    "dropin": (
        ("vllm", "vLLM design"),
        ("dropin", "kvstream EventPublisher"),
    ),
    "native": (
        ("vllm", "vLLM design"),
        ("ring", "kvstream Scheduler+ZmqSink, ring on"),
        ("noring", "kvstream Scheduler+ZmqSink, no ring"),
    ),
}


# -- the traced child: one publisher, N steps ---------------------------------------------


def _workload(events: int) -> tuple[list[Any], list[Any], Any]:
    """DISTINCT_STEPS steps as kvstream's events and as vLLM's structs, and a probe."""
    from kvstream._bench.vllm_baseline import to_vllm_batch
    from kvstream._bench.workload import batches, event_pool

    pool = event_pool(n_events=DISTINCT_STEPS * events)
    shaped = batches(pool, events, DISTINCT_STEPS)
    cache: dict[int, Any] = {}
    vllm = [to_vllm_batch(b, cache, rank=False) for b in shaped]
    probe = to_vllm_batch(batches(pool, 1, 1)[0], rank=False)
    return [list(b.events) for b in shaped], vllm, probe


def _endpoint() -> str:
    from kvstream._bench.zmq_compare import free_tcp_port

    return f"tcp://127.0.0.1:{free_tcp_port()}"


def _threaded(design: str, args: argparse.Namespace) -> None:
    """The vLLM design or the drop-in, published to from this (the main) thread."""
    from kvstream._bench import publisher_compare as pc
    from kvstream._bench.frame_counter import CounterProcess

    _, steps, probe = _workload(args.events)
    endpoint = _endpoint()
    counter = CounterProcess("zmq", endpoint)
    try:
        pub = (
            pc._Baseline(endpoint, args.buffer_steps)
            if design == "vllm"
            else pc._DropIn(endpoint, 0.005, args.buffer_steps)
        )
        try:
            counter.wait_ready(lambda: pub.publish(probe), timeout=_WAIT)
            pub.expect(args.steps * args.events)
            publish, busy_work, loops = pub.publish, pc.busy_work, args.loops
            for i in range(args.steps):
                if loops:
                    busy_work(loops)
                publish(steps[i % DISTINCT_STEPS])
            pub.wait_sent()
            counter.wait_count(args.steps, timeout=_WAIT)
        finally:
            pub.close()
    finally:
        counter.close()


async def _native(design: str, args: argparse.Namespace) -> None:
    """kvstream's Scheduler + ZmqSink, driven as a native engine drives it."""
    import anyio

    from kvstream._bench.frame_counter import CounterProcess
    from kvstream._bench.workload import EPOCH, ORIGIN
    from kvstream.scheduler import Scheduler
    from kvstream.sinks.zmq import ZmqSink

    chunks, _, _ = _workload(args.events)
    endpoint = _endpoint()
    counter = CounterProcess("zmq", endpoint)
    try:
        sink = ZmqSink(
            endpoint,
            replay_endpoint="tcp://127.0.0.1:*" if design == "ring" else None,
            buffer_steps=args.buffer_steps,
            bind=True,
            hwm=100_000,  # vLLM's default, as the vLLM design's
            name="zmq",
        )
        async with Scheduler(sinks=[sink], origin=ORIGIN, epoch=EPOCH, data_parallel_rank=0) as s:
            counter.arm(timeout=_WAIT)
            while True:  # probes go out on the loop: tick, and let the writer run
                s.emit(chunks[0][:1])
                await s.tick()
                await anyio.sleep(0.01)
                if counter.poll_line(0.0) == "ready":
                    break
            await anyio.sleep(0.2)
            counter.arm(timeout=_WAIT)
            target = sink.statistics().events_out + args.steps * args.events
            emit, tick, checkpoint = s.emit, s.tick, anyio.lowlevel.checkpoint
            for i in range(args.steps):
                emit(chunks[i % DISTINCT_STEPS])
                await tick()
                await checkpoint()
            while sink.statistics().events_out < target:  # noqa: ASYNC110
                await anyio.sleep(0.001)
            # Sent is not delivered: ZMQ's I/O thread may still hold the last
            # messages; wait for them before the sink closes.
            counter.wait_count(args.steps, timeout=_WAIT)
    finally:
        counter.close()


def _child(args: argparse.Namespace) -> int:
    if args.child in ("ring", "noring"):
        asyncio.run(_native(args.child, args))
    else:
        _threaded(args.child, args)
    return 0


# -- the parent: run the children under callgrind, take differences ----------------------


def thread_totals(directory: str, prefix: str, events: Sequence[str] = ("Ir",)) -> dict[int, int]:
    """Per thread (1: the main thread), the sum of `events` (callgrind's names: `Ir`
    instructions; with `--cache-sim=yes` also `D1mr`, `DLmw`, ...) from callgrind's
    per-thread files `<prefix>-NN` in `directory`."""
    totals: dict[int, int] = {}
    for path in glob.glob(os.path.join(directory, f"{prefix}-*")):
        number = int(path.rsplit("-", 1)[1])
        names: list[str] = []
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == "events":
                    names = value.split()
                elif key in ("totals", "summary"):
                    counts = dict(zip(names, (int(v) for v in value.split()), strict=False))
                    missing = [e for e in events if e not in counts]
                    if missing:
                        raise ValueError(
                            f"{path}: no {missing} among its events {names} "
                            "(--cache-sim gives the cache events)"
                        )
                    totals[number] = sum(counts[e] for e in events)
                    break
        if number not in totals:
            raise ValueError(f"{path}: no 'totals:' or 'summary:' line (an unfinished run?)")
    if not totals:
        raise ValueError(f"{directory}: no callgrind files named {prefix}-NN")
    return totals


def roles(totals: dict[int, int]) -> tuple[int, int, int]:
    """(the main thread's, the largest other thread's, the rest's summed) counts."""
    main = totals.get(1, 0)
    others = sorted((n for t, n in totals.items() if t != 1), reverse=True)
    return main, (others[0] if others else 0), sum(others[1:])


def per_step(short: dict[int, int], long: dict[int, int], steps: int) -> tuple[float, ...]:
    """Each role's instructions per step, and their total: (long - short) / steps."""
    a, b = roles(short), roles(long)
    each = tuple((y - x) / steps for x, y in zip(a, b, strict=True))
    return (*each, sum(each))


def busiest(short: dict[int, int], long: dict[int, int]) -> int:
    """The thread whose count grows most with the steps (threads are numbered in the
    order they start, the same in both runs)."""
    return max(long, key=lambda t: long[t] - short.get(t, 0))


def function_costs(path: str) -> dict[str, int]:
    """Instructions per function, its own (not its callees'), from `callgrind_annotate`."""
    out = subprocess.run(
        ["callgrind_annotate", "--show=Ir", "--inclusive=no", "--threshold=100", path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    costs: dict[str, int] = {}
    for line in out.splitlines():
        match = _ANNOTATED.match(line)
        if match and ":" in match["name"]:
            where, _, function = match["name"].split(" [", 1)[0].rpartition(":")
            name = f"{os.path.basename(where)}:{function}"  # ceval.c:_PyEval_EvalFrameDefault
            costs[name] = costs.get(name, 0) + int(match["count"].replace(",", ""))
    return costs


#: A function's line in `callgrind_annotate`'s table: its count, maybe a percentage, the name.
_ANNOTATED = re.compile(r"\s*(?P<count>[\d,]+)\s+(?:\([^)]*\)\s+)?(?P<name>\S.*)$")


def _functions(directory: str, prefix_short: str, prefix_long: str, steps: int, top: int) -> str:
    """The busiest thread's top functions by their own instructions per step."""
    short, long = thread_totals(directory, prefix_short), thread_totals(directory, prefix_long)
    thread = busiest(short, long)
    a = function_costs(os.path.join(directory, f"{prefix_short}-{thread:02d}"))
    b = function_costs(os.path.join(directory, f"{prefix_long}-{thread:02d}"))
    diff = {name: (b.get(name, 0) - a.get(name, 0)) / steps for name in a.keys() | b.keys()}
    ranked = sorted(diff.items(), key=lambda item: -abs(item[1]))[:top]
    lines = [f"    thread {thread}: {sum(diff.values()):,.0f} per step"]
    lines += [f"    {count:10,.0f}  {name}" for name, count in ranked]
    return "\n".join(lines)


def _traced(
    valgrind: str, design: str, steps: int, args: argparse.Namespace, directory: str, repeat: int
) -> str:
    """Run one child under callgrind; the prefix of its files in `directory`."""
    prefix = f"{design}-{steps}-r{repeat}"
    for old in glob.glob(os.path.join(directory, f"{prefix}-*")):  # a --keep DIR's last run
        os.remove(old)
    command = [
        valgrind,
        "--tool=callgrind",
        "--separate-threads=yes",
        *(_cache_options(args.cache_sim) if args.cache_sim else ()),
        f"--callgrind-out-file={os.path.join(directory, prefix)}",
        os.path.realpath(sys.executable),
        os.path.abspath(__file__),
        args.mode,
        "--child",
        design,
        "--steps",
        str(steps),
        "--events",
        str(args.events),
        "--loops",
        str(args.loops),
        "--buffer-steps",
        str(args.buffer_steps),
    ]
    done = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(
            f"{design}, {steps} steps, under callgrind: exit {done.returncode}\n"
            + done.stderr[-3000:]
        )
    return prefix


#: The measures of a table: (title, callgrind's events summed).
INSTRUCTIONS = ("instructions per step", ("Ir",))
CACHE_MEASURES = (
    ("L1 data misses per step (reads + writes)", ("D1mr", "D1mw")),
    ("last-level data misses per step (reads + writes)", ("DLmr", "DLmw")),
)


def _cache_options(model: str) -> list[str]:
    """Callgrind's cache simulation with a fixed model (its detection of the host's
    caches can be wrong): 32 KiB 8-way L1s, the last level as `--cache-sim` gives it."""
    return ["--cache-sim=yes", "--I1=32768,8,64", "--D1=32768,8,64", f"--LL={model}"]


def _table(mode: str, title: str, rows: dict[str, list[tuple[float, ...]]]) -> list[str]:
    """Each design's medians over the repeats, its range of the total, and the median of
    its per-repeat ratios over the first design's total."""
    heads = (
        ("engine's thread", "sender", "rest (ZMQ I/O)", "all threads")
        if mode == "dropin"
        else ("main thread", "largest other", "rest", "all threads")
    )
    base = next(iter(rows.values()))
    lines = [
        f"| {title} | " + " | ".join(heads) + " | all threads, min-max | all / vLLM's |",
        "|---|" + "---:|" * (len(heads) + 2),
    ]
    for label, repeats in rows.items():
        medians = [statistics.median(column) for column in zip(*repeats, strict=True)]
        cells = [f"{m:,.0f}" if abs(m) >= 0.5 else "0" for m in medians]
        totals = [r[-1] for r in repeats]
        ratio = statistics.median(
            r[-1] / b[-1] if b[-1] else float("nan") for r, b in zip(repeats, base, strict=True)
        )
        lines.append(
            f"| {label} | "
            + " | ".join(cells)
            + f" | {min(totals):,.0f}-{max(totals):,.0f} | {ratio:.3f} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=sorted(DESIGNS), help="dropin or native (see above)")
    p.add_argument("--events", type=int, default=16, help="events per step (16)")
    p.add_argument("--loops", type=int, default=0, help="dropin: busy_work loops per step (0)")
    p.add_argument("--short", type=int, default=200, help="steps of the shorter run (200)")
    p.add_argument("--long", type=int, default=1200, help="steps of the longer run (1200)")
    p.add_argument("--buffer-steps", type=int, default=100, help="steps each ring holds (100)")
    p.add_argument(
        "--functions",
        type=int,
        default=0,
        metavar="N",
        help="also print the busiest thread's top N functions per step (callgrind_annotate)",
    )
    p.add_argument(
        "--cache-sim",
        nargs="?",
        const="8388608,16,64",
        metavar="SIZE,ASSOC,LINE",
        help="also count cache misses (callgrind's simulation; the last level's model, "
        "default 8 MiB, 16-way, 64-byte lines)",
    )
    p.add_argument("--repeat", type=int, default=3, help="runs of each design (3)")
    p.add_argument(
        "--keep",
        metavar="DIR",
        help="keep callgrind's files in DIR (for callgrind_annotate) instead of a temporary one",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("events", "short", "buffer_steps", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if args.loops < 0:
        p.error(f"--loops: expected an int >= 0, got {args.loops}")
    if args.long <= args.short:
        p.error(f"--long: expected more steps than --short ({args.short}), got {args.long}")
    if args.mode == "native" and args.loops:
        p.error("--loops: only the dropin mode has an engine doing work between steps")
    if args.cache_sim is not None and not re.fullmatch(r"\d+,\d+,\d+", args.cache_sim):
        p.error(f"--cache-sim: expected SIZE,ASSOC,LINE (three ints), got {args.cache_sim!r}")
    if args.child is not None:
        if args.child not in {key for key, _ in DESIGNS[args.mode]}:
            p.error(f"--child: expected one of {[k for k, _ in DESIGNS[args.mode]]}")
        return _child(args)
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print(
            "count_instructions: valgrind not found on PATH (Debian: apt-get install valgrind)",
            file=sys.stderr,
        )
        return 2
    measures = [INSTRUCTIONS, *(CACHE_MEASURES if args.cache_sim else ())]
    rows: dict[str, dict[str, list[tuple[float, ...]]]] = {
        title: {label: [] for _, label in DESIGNS[args.mode]} for title, _ in measures
    }
    functions: list[str] = []
    steps = args.long - args.short
    with tempfile.TemporaryDirectory(prefix="kvstream-callgrind-") as scratch:
        directory = scratch
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            directory = args.keep
        for repeat in range(args.repeat):  # the designs take turns, so drift hits each
            for key, label in DESIGNS[args.mode]:
                short, long = (
                    _traced(valgrind, key, n, args, directory, repeat)
                    for n in (args.short, args.long)
                )
                for title, events in measures:
                    rows[title][label].append(
                        per_step(
                            thread_totals(directory, short, events),
                            thread_totals(directory, long, events),
                            steps,
                        )
                    )
                print(f"  repeat {repeat + 1}, {label}: done", file=sys.stderr, flush=True)
                if args.functions and repeat == 0:
                    found = _functions(directory, short, long, steps, args.functions)
                    functions.append(f"  {label}, its busiest thread's own instructions:\n{found}")
    print(
        f"{args.mode}: {args.events} events/step, busy_work({args.loops}) per step, "
        f"rings of {args.buffer_steps} steps, ({args.long} - {args.short} steps) / "
        f"{steps}, medians of {args.repeat} repeats"
        + (f", cache model LL={args.cache_sim}" if args.cache_sim else "")
    )
    for title, _ in measures:
        print("\n".join(_table(args.mode, title, rows[title])))
    if functions:
        print(f"Per step, the first repeat, the top {args.functions} functions (C level):")
        print("\n".join(functions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
