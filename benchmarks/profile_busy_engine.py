"""What a publisher costs a busy engine, thread by thread (issue 12, target 2).

    python benchmarks/profile_busy_engine.py --events 16 --rounds 14
    nice -n -15 python benchmarks/profile_busy_engine.py --events 256   # on a shared machine

The engine's thread does about 2 ms of Python per step and then publishes one
step of vLLM's structs (the same workload and calibration as
`kvstream bench --only publisher`), 500 steps per run, the vLLM-design
publisher and kvstream's `EventPublisher` alternating, each to a counting
subscriber in another process. Per run it prints the engine's steps/s, its
thread CPU and time off CPU per step, its context switches per step
(voluntary: it waited, mostly for the GIL; involuntary: it was preempted),
and the CPU per step of every other thread of the process that ran (the
publisher's thread or loop, ZMQ's I/O thread), from `/proc/self/task/*`
(Linux). The last lines are the medians of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any

from kvstream._bench import publisher_compare as pc
from kvstream._bench.frame_counter import CounterProcess
from kvstream._bench.vllm_baseline import to_vllm_batch
from kvstream._bench.workload import batches, event_pool


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


def _run(make: Any, counter: CounterProcess, steps: list[Any], probe: Any, loops: int) -> float:
    pub = make()
    try:
        counter.wait_ready(lambda: pub.publish(probe))
        me = threading.get_native_id()
        before = _threads()
        start = time.perf_counter()
        for batch in steps:
            pc.busy_work(loops)
            pub.publish(batch)
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
        f"  {pub.name:25s} {n / took:7.1f} steps/s  engine CPU {engine['cpu_ns'] / n / 1e3:6.0f} us"
        f"  off CPU {(took * 1e9 - engine['cpu_ns']) / n / 1e3:5.0f} us"
        f"  switches vol {engine['voluntary'] / n:.2f} invol {engine['nonvoluntary'] / n:.2f}"
        f"  | other threads, CPU per step: "
        + ", ".join(f"{us:.0f} us" for us in sorted(others, reverse=True)),
        flush=True,
    )
    return n / took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--events", type=int, default=16, help="events per step (16)")
    p.add_argument("--steps", type=int, default=500, help="steps per run (500)")
    p.add_argument("--rounds", type=int, default=8, help="rounds, each both publishers (8)")
    args = p.parse_args()
    pool = event_pool()
    loops = pc.calibrate_busy_work()
    endpoints = {k: f"tcp://127.0.0.1:{pc._free_port()}" for k in ("baseline", "kvstream")}
    counters = {k: CounterProcess("zmq", v) for k, v in endpoints.items()}
    makers = {
        "baseline": lambda: pc._Baseline(endpoints["baseline"]),
        "kvstream": lambda: pc._DropIn(endpoints["kvstream"]),
    }
    probe = to_vllm_batch(batches(pool, 1, 1)[0], rank=False)
    cache: dict[int, Any] = {}
    steps = [to_vllm_batch(b, cache, rank=False) for b in batches(pool, args.events, args.steps)]
    rates: dict[str, list[float]] = {"baseline": [], "kvstream": []}
    try:
        for r in range(args.rounds + 1):  # the first round warms up, untimed
            print(f"round {r}" + (" (warm-up)" if r == 0 else ""))
            for name in ("baseline", "kvstream") if r % 2 else ("kvstream", "baseline"):
                rate = _run(makers[name], counters[name], steps, probe, loops)
                if r:
                    rates[name].append(rate)
    finally:
        for counter in counters.values():
            counter.close()
    ratio = statistics.median(
        k / b for k, b in zip(rates["kvstream"], rates["baseline"], strict=True)
    )
    print(
        f"{args.events} events/step: kvstream over the vLLM design, "
        f"median of {args.rounds} rounds: {ratio:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
