"""Where the ZMQ comparison's time goes: a long run of one side, for a profiler.

    py-spy record -f raw -r 1000 -o zmq.txt -- python benchmarks/profile_zmq.py --side kvstream
    python benchmarks/pyspy_top.py zmq.txt --within _kvstream_run
    python benchmarks/profile_zmq.py --side both --batch 16 --batches 3000
    python benchmarks/profile_zmq.py --side kvstream --ring-mib 64      # replay ring on

Publishes `--batches` pre-built batches of `--batch` events, as
`kvstream bench --only zmq` does (same workload, same counting subscriber
process), `--repeat` times per side, and prints CPU microseconds per batch
and per event (median). With `--side both` the sides alternate.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from typing import Any

import anyio

from kvstream._bench.frame_counter import CounterProcess
from kvstream._bench.measure import Sample
from kvstream._bench.vllm_baseline import to_vllm_batch
from kvstream._bench.workload import batches, chunks, event_pool
from kvstream._bench.zmq_compare import _baseline_run, _kvstream_run, free_tcp_port


async def main(args: argparse.Namespace) -> None:
    pool = event_pool(4096)
    gc.collect()
    gc.freeze()
    n, count = args.batch, args.batches
    ring_bytes = args.ring_mib * 1024 * 1024 or None
    kchunks = chunks(pool, n, count)
    cache: dict[int, Any] = {}
    vbatches = [to_vllm_batch(b, cache) for b in batches(pool, n, count)]
    probe = to_vllm_batch(batches(pool, 1, 1)[0])
    kv_endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    base_endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    kv_counter = CounterProcess("zmq", kv_endpoint)
    base_counter = CounterProcess("zmq", base_endpoint)
    runs: dict[str, list[Sample]] = {"kvstream": [], "vllm-design": []}
    try:
        for _ in range(args.repeat):
            if args.side in ("kvstream", "both"):
                runs["kvstream"].append(
                    await _kvstream_run(
                        kv_endpoint, kv_counter, kchunks, n * count, pool[:1], ring_bytes
                    )
                )
            if args.side in ("baseline", "both"):
                runs["vllm-design"].append(
                    await _baseline_run(base_endpoint, base_counter, vbatches, n * count, probe)
                )
    finally:
        kv_counter.close()
        base_counter.close()
    for side, samples in runs.items():
        if not samples:
            continue
        per_event = statistics.median(s.cpu_us_per_event for s in samples)
        rate = statistics.median(s.events_per_s for s in samples)
        print(
            f"{side:12} {n:4}/batch: {per_event * n:8.1f} us CPU/batch, {per_event:6.2f} us "
            f"CPU/event, {rate:10,.0f} events/s (median of {len(samples)})"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--side", choices=("kvstream", "baseline", "both"), default="kvstream")
    p.add_argument("--batch", type=int, default=16, help="events per batch (16)")
    p.add_argument("--batches", type=int, default=20_000, help="batches per run (20000)")
    p.add_argument("--repeat", type=int, default=3, help="runs per side (3)")
    p.add_argument("--ring-mib", type=int, default=0, help="replay ring bound, MiB (0: off)")
    anyio.run(main, p.parse_args())
