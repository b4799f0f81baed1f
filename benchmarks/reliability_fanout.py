"""Fan-out: one socket sink, many subscribers in another process, some of them slow.

The producer (this process) serves a `SocketSink` on a free loopback port and, once
every subscriber has said its hello, ticks `--batches` batches of `--per-batch`
seeded events as fast as it can. A child process runs `--subscribers`
`SocketSubscriber`s in one event loop; `--slow` of them sleep after every
batch. Each subscriber checks every seq once and in order; the first also
checks every event against the stream regenerated from the seed. A subscriber
that falls more than `--subscriber-bytes` behind is disconnected by the sink
(`slow="disconnect"`) and resumes from the ring where it was, so with a ring
that holds the run nothing may be missing.

Reported: per subscriber batches received, gaps, out-of-order batches and
wrong events (all but the count must be 0), the sink's slow disconnects and
refused connections, the producer's wall time, and its open files before and
after (nothing may be left open).

    python benchmarks/reliability_fanout.py --subscribers 60 --batches 2000 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import anyio
import anyio.lowlevel

from kvstream import Scheduler
from kvstream.consumers.base import Gap
from kvstream.consumers.socket import SocketSubscriber
from kvstream.events import EventBatch
from kvstream.sinks.socket import SocketSink
from kvstream.testing import SeededEvents

SEED = 20261204


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


async def produce(
    *,
    subscribers: int,
    batches: int,
    per_batch: int,
    slow: int,
    subscriber_bytes: int,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Serve the batches to a child process of subscribers; the result of both sides."""
    seeded = SeededEvents(SEED)
    files_before = _open_files()
    sink = SocketSink(
        port=0,
        ring_bytes=1 << 30,
        subscriber_bytes=subscriber_bytes,
        max_subscribers=subscribers + 8,
        max_pending_hellos=subscribers + 8,
        name="fanout",
    )
    async with Scheduler(sinks=[sink], origin="fanout", epoch="e") as scheduler:
        port = int(sink.address.rpartition(":")[2])
        command = [
            sys.executable,
            __file__,
            "--role",
            "subscribers",
            *("--port", str(port), "--subscribers", str(subscribers)),
            *("--batches", str(batches), "--per-batch", str(per_batch), "--slow", str(slow)),
        ]
        child = await anyio.open_process(command, stdout=subprocess.PIPE)
        try:
            with anyio.fail_after(timeout):
                # The sink has no event for a new subscriber: poll its counter.
                while sink.statistics().subscribers < subscribers:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
                started = time.perf_counter()
                index = 0
                for _ in range(batches):
                    scheduler.emit([seeded.event(index + k) for k in range(per_batch)])
                    index += per_batch
                    await scheduler.tick()
                    await anyio.lowlevel.checkpoint()
                produced = time.perf_counter() - started
                assert child.stdout is not None
                out = b""
                async for chunk in child.stdout:
                    out += chunk
                await child.wait()
        finally:
            if child.returncode is None:
                child.kill()
                with anyio.CancelScope(shield=True):
                    await child.wait()
            await child.aclose()
        delivered = time.perf_counter() - started
        stats = sink.statistics()
    result: dict[str, Any] = json.loads(out)
    result.update(
        batches=batches,
        per_batch=per_batch,
        produced_s=round(produced, 3),
        delivered_s=round(delivered, 3),
        slow_disconnects=stats.slow_disconnects,
        connections_accepted=stats.connections_accepted,
        connections_refused=stats.connections_refused,
        open_files_before=files_before,
        open_files_after=_open_files(),
    )
    return result


async def _subscribe(port: int, subscribers: int, batches: int, per_batch: int, slow: int) -> None:
    seeded = SeededEvents(SEED)
    results: list[dict[str, int]] = [{} for _ in range(subscribers)]

    async def one(k: int) -> None:
        got = gaps = disorder = wrong = 0
        expect = 0
        async with SocketSubscriber(port=port, from_seq=0) as sub:
            async for item in sub:
                if isinstance(item, Gap):
                    gaps += item.missing
                    expect = item.next_seq
                elif isinstance(item, EventBatch):
                    disorder += item.seq != expect
                    if k == 0:
                        first = item.seq * per_batch
                        wanted = [seeded.event(first + i) for i in range(per_batch)]
                        wrong += sum(a != b for a, b in zip(item.events, wanted, strict=True))
                    expect = item.seq + 1
                    got += 1
                    if k < slow:
                        await anyio.sleep(0.002)
                    if expect >= batches:
                        break
        results[k] = {"batches": got, "gaps": gaps, "out_of_order": disorder, "wrong": wrong}

    async with anyio.create_task_group() as tg:
        for k in range(subscribers):
            tg.start_soon(one, k)
    print(json.dumps({"subscribers": results, "slow": slow}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("producer", "subscribers"), default="producer")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--subscribers", type=int, default=60)
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--per-batch", type=int, default=50)
    p.add_argument("--slow", type=int, default=3, help="subscribers that sleep 2 ms a batch")
    p.add_argument("--subscriber-bytes", type=int, default=16 << 20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.role == "subscribers":
        anyio.run(_subscribe, args.port, args.subscribers, args.batches, args.per_batch, args.slow)
        return 0
    result = anyio.run(
        lambda: produce(
            subscribers=args.subscribers,
            batches=args.batches,
            per_batch=args.per_batch,
            slow=args.slow,
            subscriber_bytes=args.subscriber_bytes,
        )
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    subs = result["subscribers"]
    whole = sum(s["batches"] == args.batches for s in subs)
    print(
        f"{len(subs)} subscribers ({result['slow']} slow): {whole} received all "
        f"{args.batches} batches; gaps {sum(s['gaps'] for s in subs)}, out of order "
        f"{sum(s['out_of_order'] for s in subs)}, wrong events {sum(s['wrong'] for s in subs)}; "
        f"slow disconnects {result['slow_disconnects']}, refused connections "
        f"{result['connections_refused']}; produced in {result['produced_s']} s, delivered "
        f"in {result['delivered_s']} s; open files {result['open_files_before']} -> "
        f"{result['open_files_after']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
