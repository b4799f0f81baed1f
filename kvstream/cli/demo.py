"""``kvstream demo``: a simulated engine publishing KV cache events into sinks.

Needs no server. One tick per engine step; ``--rate`` paces the steps. On
Ctrl-C or SIGTERM it stops stepping, delivers what it has and prints the
summary.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections import Counter
from typing import Any

import anyio
import anyio.lowlevel

from kvstream.cli.kv_events import add_kv_events_config_option, zmq_sink_from_kv_events_config
from kvstream.cli.longrun import Progress, add_metrics_option, metrics_token, open_metrics
from kvstream.config import open_sink
from kvstream.errors import ConfigError
from kvstream.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvstream.scheduler import Scheduler
from kvstream.sim import SimulatedEngine
from kvstream.sinks.base import Sink

__all__ = ["register", "run"]

EXAMPLES = """\
examples:
  kvstream demo                                   a few seconds into ./kvstream-demo-<time>.jsonl
  kvstream demo --steps 0 --rate 50 --sink -      run until Ctrl-C, JSON lines on stdout
  kvstream demo --sink file:kv.jsonl --sink tcp://127.0.0.1:5600
  kvstream demo --rate 0 --steps 20000 --sink 'file:kv.jsonl?policy=drop_oldest'
  kvstream demo --steps 0 --metrics 127.0.0.1:9464   Prometheus metrics while it runs
  kvstream demo --kv-events-config '{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run a simulated engine and publish its KV cache events (no server needed)",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=1000, help="engine steps; 0 = until stopped (1000)")
    p.add_argument(
        "--rate", type=float, default=250.0, help="steps per second; 0 = as fast as possible (250)"
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    p.add_argument("--origin", default="sim-0", help="the engine's origin name (sim-0)")
    p.add_argument("--gpu-blocks", type=int, default=1024, help="GPU pool size in blocks (1024)")
    p.add_argument(
        "--reset-every", type=int, default=0, help="reset the cache every N steps; 0 = never"
    )
    p.add_argument(
        "--sink",
        action="append",
        metavar="URL",
        default=[],
        help="where batches go (repeatable): -, file:PATH, tcp://HOST:PORT, unix:PATH, "
        "zmq+tcp://..., nats://..., redis://... (default: ./kvstream-demo-<time>.jsonl)",
    )
    add_metrics_option(p)
    add_kv_events_config_option(p)
    p.set_defaults(func=run)


def _summary(
    counts: Counter[tuple[str, str | None]],
    batches: int,
    last_seq: int | None,
    elapsed: float,
    sinks: list[Sink],
) -> str:
    events = sum(counts.values())
    lines = [
        f"kvstream demo: {batches} batches, {events} events in {elapsed:.2f} s "
        f"({events / elapsed if elapsed > 0 else 0:,.0f} events/s), last seq {last_seq}"
    ]
    for (kind, medium), n in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        lines.append(f"  {kind:<17} {medium or '(all tiers)':<12} {n:>9,}")
    for sink in sinks:
        st = sink.statistics()
        extra = ""
        if st.batches_dropped:
            extra += f", {st.batches_dropped} dropped ({st.events_dropped} events)"
        if st.undelivered_batches:
            extra += f", {st.undelivered_batches} NOT delivered"
        lines.append(f"  -> {st.name}: {st.batches_out} batches, {st.bytes_out:,} bytes{extra}")
    return "\n".join(lines)


def _count(batch: EventBatch, counts: Counter[tuple[str, str | None]]) -> None:
    for e in batch.events:
        if isinstance(e, BlockStored | BlockRemoved):
            counts[type(e).__name__, e.medium] += 1
        elif isinstance(e, AllBlocksCleared):
            counts["AllBlocksCleared", None] += 1


async def run(args: argparse.Namespace) -> int:
    if args.steps < 0:
        raise ConfigError(f"--steps: expected >= 0, got {args.steps}")
    if args.rate < 0:
        raise ConfigError(f"--rate: expected >= 0, got {args.rate}")
    urls: list[str] = list(args.sink)
    zmq_sink = zmq_sink_from_kv_events_config(args.kv_events_config)
    if not urls and zmq_sink is None:
        urls = [f"file:kvstream-demo-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"]
    codecs: dict[str, Any] = {}
    sinks = [open_sink(url, codecs=codecs) for url in urls]
    if zmq_sink is not None:
        sinks.append(zmq_sink)
    engine = SimulatedEngine(
        seed=args.seed,
        block_size=args.block_size,
        gpu_blocks=args.gpu_blocks,
        reset_every=args.reset_every or None,
        origin=args.origin,
    )
    for sink in sinks:
        if getattr(sink, "snapshot_provider", False) is None:
            sink.snapshot_provider = engine.snapshot  # type: ignore[attr-defined]
    counts: Counter[tuple[str, str | None]] = Counter()
    batches = 0
    last_seq: int | None = None
    started = time.perf_counter()
    stopped_by: str | None = None
    step = 0

    def progress_line() -> str:
        events = sum(counts.values())
        rate = events / progress.elapsed if progress.elapsed > 0 else 0.0
        return f"step {step:,}, {batches:,} batches, {events:,} events ({rate:,.0f} events/s)"

    progress = Progress("demo", progress_line)
    async with (
        open_metrics(args.metrics, command="demo", token=metrics_token(args)) as metrics,
        Scheduler(sinks=sinks, origin=args.origin) as scheduler,
    ):
        if metrics is not None:
            metrics.collector.add(scheduler)
        engine.attach(scheduler)
        print(
            f"kvstream demo: origin {scheduler.origin} epoch {scheduler.epoch} -> "
            + ", ".join(s.name for s in sinks),
            file=sys.stderr,
        )
        async with anyio.create_task_group() as tg:

            async def watch_signals() -> None:
                nonlocal stopped_by
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        stopped_by = signal.Signals(signum).name
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_signals)
            tg.start_soon(progress.run)
            interval = 1.0 / args.rate if args.rate else 0.0
            next_at = anyio.current_time()
            while args.steps == 0 or step < args.steps:
                step += 1
                await engine.astep(scheduler)
                batch = await scheduler.tick()
                if batch is not None:
                    batches += 1
                    last_seq = batch.seq
                    _count(batch, counts)
                if interval:
                    next_at += interval
                    delay = next_at - anyio.current_time()
                    if delay > 0:
                        await anyio.sleep(delay)
                    else:
                        next_at = anyio.current_time()
                elif step % 64 == 0:
                    await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        engine.close()
        with anyio.CancelScope(shield=True):
            report = await scheduler.aclose()
            # Anything the last tick of aclose sealed is counted too.
            extra = scheduler.statistics().next_seq.get(scheduler.origin, 0)
            if extra and (last_seq is None or extra - 1 > last_seq):
                last_seq = extra - 1
                batches = extra
    elapsed = time.perf_counter() - started
    if stopped_by:
        print(f"kvstream demo: stopped by {stopped_by}", file=sys.stderr)
    print(_summary(counts, batches, last_seq, elapsed, sinks), file=sys.stderr)
    return 0 if report.complete else 1
