"""What a publisher costs a busy engine, thread by thread (issue 12, target 2).

    python benchmarks/profile_busy_engine.py --events 16 --rounds 14
    nice -n -15 python benchmarks/profile_busy_engine.py --events 256   # on a shared machine

The engine's thread does about 2 ms of Python per step and then publishes one
step of vLLM's structs (the same workload and calibration as
`kvstream bench --only publisher`), 500 steps per run, the vLLM-design
publisher and kvstream's `EventPublisher` (once per `--idle-poll` value)
alternating, each to a counting subscriber in another process; a run ends when
its publisher has sent every step. Per run it
prints the engine's steps/s, its thread CPU and time off CPU per step, its
context switches per step
(voluntary: it waited, mostly for the GIL; involuntary: it was preempted),
and the CPU per step of every other thread of the process that ran (the
publisher's thread or loop, ZMQ's I/O thread), from `/proc/self/task/*`
(Linux). The last lines are the medians of the per-round ratios.

    python benchmarks/profile_busy_engine.py --interleave 25 --chunks 100 --idle-poll 0.005,0.02
    python benchmarks/profile_busy_engine.py --pace 0.01 --steps 300 --idle-poll 0.005,0.02
    python benchmarks/profile_busy_engine.py --interleave 25 --chunks 60 --idle-poll 0.005,0.005
    python benchmarks/profile_busy_engine.py --interleave 25 --chunks 60 --loop asyncio,uvloop

`--interleave N` instead keeps every publisher alive side by side (the
vLLM-design one, and kvstream's `EventPublisher` once per `--idle-poll` value
and `--loop`, the event loop its thread runs on)
and lets them and the engine alone take turns every N steps
(`publisher_compare.busy_chunks()`, what `kvstream bench` measures), in every
order of them (`--chunks` is rounded up to whole rounds of the orders), each
turn timed until its publisher has sent every step of it, then, untimed, until
its subscriber has every message. Per publisher it prints the engine's steps/s
over all its turns, its thread CPU and time off CPU per step
(`time.thread_time()`: off CPU, the engine waits for the GIL or for the
publisher to finish the turn), the ratio over the vLLM design and what the
publisher costs the engine per step against its turns alone; for kvstream, how
its loop took the steps (wake-ups, bursts worked through in the poll's timer,
polls that found nothing, per step).

A value given twice is an A/A control: two identical kvstream publishers side by side,
whose ratio shows what the measure itself moves by within one run.

`--pace S` makes the engine sleep to one step every S seconds instead of
working: with no contention for the GIL, the other threads' CPU per step is
what each publisher costs by itself at that cadence (every wake-up included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from functools import partial
from typing import Any

from kvstream._bench import publisher_compare as pc
from kvstream._bench.frame_counter import CounterProcess
from kvstream._bench.vllm_baseline import to_vllm_batch
from kvstream._bench.workload import batches, event_pool
from kvstream._event_loop import EventLoopName, resolve_event_loop
from kvstream.errors import ConfigError


def _thread(tid: int) -> dict[str, int]:
    """A thread's CPU (ns) and context switches, from procfs."""
    out: dict[str, int] = {}
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        out["cpu_ns"] = int(f.read().split()[0])
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.endswith("ctxt_switches"):
                out[key.split("_")[0]] = int(value)
    return out


def _threads() -> dict[int, dict[str, int]]:
    found = {}
    for name in os.listdir("/proc/self/task"):
        try:
            found[int(name)] = _thread(int(name))
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return found


def _paced(pace: float) -> Any:
    """Each step, wait (the GIL released) until `pace` seconds after the last one."""
    due = time.perf_counter()

    def wait(_loops: int) -> None:
        nonlocal due
        due += pace
        while (left := due - time.perf_counter()) > 0.0002:
            time.sleep(min(left - 0.0001, 0.001))
        while time.perf_counter() < due:
            pass

    return wait


#: With --interleave: untimed turns before the timed ones.
_WARMUP = 2


def _loops(text: str) -> list[EventLoopName]:
    """`--loop`: comma-separated loop names, resolved as `EventPublisher` resolves them."""
    try:
        return [resolve_event_loop(name, field="--loop") for name in text.split(",")]
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--loop: ")) from exc


def _variants(args: argparse.Namespace) -> list[tuple[float, EventLoopName]]:
    """kvstream's publishers: one per `--idle-poll` value and `--loop`, in that order."""
    return [(poll, loop) for poll in args.idle_poll for loop in args.loop]


def _names(args: argparse.Namespace) -> list[str]:
    """The publishers' names: the vLLM design, then kvstream's once per `--idle-poll`
    value and `--loop`; a variant given twice (an A/A control: two identical publishers
    side by side) gets a number."""
    names = ["vLLM design"]
    for poll, loop in _variants(args):
        name = f"kvstream idle_poll={poll:g}" + ("" if loop == "asyncio" else f" {loop}")
        copies = sum(1 for known in names if known.split(" #")[0] == name)
        names.append(f"{name} #{copies + 1}" if copies else name)
    return names


def _run(
    name: str,
    make: Any,
    counter: CounterProcess,
    steps: list[Any],
    probe: Any,
    loops: int,
    pace: float = 0.0,
) -> float:
    pub = make()
    try:
        counter.wait_ready(lambda: pub.publish(probe))
        work = _paced(pace) if pace else pc.busy_work
        pub.expect(sum(len(batch.events) for batch in steps))
        me = threading.get_native_id()
        before = _threads()
        start = time.perf_counter()
        for batch in steps:
            work(loops)
            pub.publish(batch)
        pub.wait_sent()  # the steps still queued are part of the cost
        took = time.perf_counter() - start
        after = _threads()
    finally:
        pub.close()
    n = len(steps)
    engine = {k: after[me][k] - before[me][k] for k in after[me]}
    others = []
    for tid, now in after.items():
        if tid != me and tid in before and now["cpu_ns"] - before[tid]["cpu_ns"] > 1_000_000:
            others.append((now["cpu_ns"] - before[tid]["cpu_ns"]) / n / 1e3)
    print(
        f"  {name:28s} {n / took:7.1f} steps/s  engine CPU {engine['cpu_ns'] / n / 1e3:6.0f} us"
        f"  off CPU {(took * 1e9 - engine['cpu_ns']) / n / 1e3:5.0f} us"
        f"  switches vol {engine['voluntary'] / n:.2f} invol {engine['nonvoluntary'] / n:.2f}"
        f"  | other threads, CPU per step: "
        + ", ".join(f"{us:.0f} us" for us in sorted(others, reverse=True)),
        flush=True,
    )
    return n / took


def _interleaved(args: argparse.Namespace) -> int:
    """Every publisher alive at once, alternating per chunk of `args.interleave` steps."""
    pool = event_pool()
    loops = pc.calibrate_busy_work()
    probe = to_vllm_batch(batches(pool, 1, 1)[0], rank=False)
    cache: dict[int, Any] = {}
    shaped = batches(pool, args.events, args.interleave)
    chunk = [to_vllm_batch(b, cache, rank=False) for b in shaped]
    names = _names(args)
    variants = _variants(args)
    pubs: dict[str, Any] = {}
    counters: list[CounterProcess] = []
    try:
        for i, name in enumerate(names):
            endpoint = f"tcp://127.0.0.1:{pc._free_port()}"
            counters.append(CounterProcess("zmq", endpoint))
            pub = (
                pc._Baseline(endpoint)
                if i == 0
                else pc._DropIn(endpoint, variants[i - 1][0], loop=variants[i - 1][1])
            )
            pubs[name] = pub
            counters[-1].wait_ready(partial(pub.publish, probe))
        pubs["engine alone"] = None  # the limit: the same turns without a publisher
        settle = pc._settler(dict(zip(names, counters, strict=True)), len(chunk))
        chunks = pc.whole_rounds(args.chunks, list(pubs))
        took, cpus = pc.busy_chunks(pubs, chunk, loops, chunks, _WARMUP, settle)
        hand_offs = {name: _hand_off(pub) for name, pub in pubs.items()}
    finally:
        for pub in pubs.values():
            if pub is not None:
                pub.close()
        for counter in counters:
            counter.close()
    base = names[0]
    steps = args.interleave * chunks
    print(f"{args.events} events/step, {chunks} turns of {args.interleave} steps per publisher")
    alone = took["engine alone"]
    for name in pubs:  # the publishers, then the engine alone
        total, cpu = took[name], cpus[name]
        print(
            f"  {name:28s} {steps / total:7.1f} steps/s  engine CPU {cpu / steps * 1e6:6.0f} us"
            f"  off CPU {(total - cpu) / steps * 1e6:5.0f} us per step"
            f"  | over the vLLM design: {took[base] / total:.3f}"
            + (
                f", costs the engine {(total - alone) / steps * 1e6:4.0f} us per step"
                if name != "engine alone"
                else ""
            ),
            flush=True,
        )
    total_steps = (chunks + _WARMUP) * args.interleave + 1  # the warm-up turns, a probe
    for name, counts in hand_offs.items():
        if counts:
            print(
                f"  {name:28s} per step: "
                + ", ".join(f"{k} {v / total_steps:.3f}" for k, v in counts.items())
            )
    return 0


def _hand_off(pub: Any) -> dict[str, int]:
    """How kvstream's loop took the steps (`ThreadsafeHandle`'s counters); {} for
    the vLLM design."""
    if not isinstance(pub, pc._DropIn):
        return {}
    handle = pub.pub._runner.handle
    return {
        "wake-ups": handle.wakeups,
        "bursts in the poll's timer": handle.bursts_inline,
        "empty polls": handle.polls_empty,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--events", type=int, default=16, help="events per step (16)")
    p.add_argument("--steps", type=int, default=500, help="steps per run (500)")
    p.add_argument("--rounds", type=int, default=8, help="rounds, each both publishers (8)")
    p.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="N",
        help="publishers side by side, alternating every N steps (0: whole runs)",
    )
    p.add_argument("--chunks", type=int, default=100, help="with --interleave: chunks each (100)")
    p.add_argument(
        "--idle-poll",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[0.005],
        help="kvstream's idle_poll values, comma-separated: one publisher each (0.005)",
    )
    p.add_argument(
        "--loop",
        type=_loops,
        default=["asyncio"],
        help="the event loops of kvstream's loop thread, comma-separated (asyncio, "
        "uvloop): one publisher each per --idle-poll value (asyncio)",
    )
    p.add_argument(
        "--pace",
        type=float,
        default=0.0,
        metavar="S",
        help="whole runs: the engine sleeps to one step every S seconds instead of "
        "working (no GIL contention: what each publisher's threads cost per step)",
    )
    args = p.parse_args()
    if args.interleave:
        return _interleaved(args)
    pool = event_pool()
    loops = pc.calibrate_busy_work()
    names = _names(args)
    endpoints = {name: f"tcp://127.0.0.1:{pc._free_port()}" for name in names}
    counters = {name: CounterProcess("zmq", endpoints[name]) for name in names}
    makers: dict[str, Any] = {names[0]: partial(pc._Baseline, endpoints[names[0]])}
    for name, (idle_poll, loop) in zip(names[1:], _variants(args), strict=True):
        makers[name] = partial(pc._DropIn, endpoints[name], idle_poll, loop=loop)
    probe = to_vllm_batch(batches(pool, 1, 1)[0], rank=False)
    cache: dict[int, Any] = {}
    steps = [to_vllm_batch(b, cache, rank=False) for b in batches(pool, args.events, args.steps)]
    rates: dict[str, list[float]] = {name: [] for name in names}
    try:
        for r in range(args.rounds + 1):  # the first round warms up, untimed
            print(f"round {r}" + (" (warm-up)" if r == 0 else ""))
            for name in names[r % len(names) :] + names[: r % len(names)]:
                rate = _run(name, makers[name], counters[name], steps, probe, loops, args.pace)
                if r:
                    rates[name].append(rate)
    finally:
        for counter in counters.values():
            counter.close()
    if not args.pace:
        for name in names[1:]:
            ratio = statistics.median(
                k / b for k, b in zip(rates[name], rates[names[0]], strict=True)
            )
            print(
                f"{args.events} events/step, {name}: over the vLLM design, "
                f"median of {args.rounds} rounds: {ratio:.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
