"""`kvstream demo`: a simulated engine publishing KV cache events into sinks.

Needs no server. One tick per engine step; `--rate` paces the steps. Without
`--sink` or `--out` the batches go to a new file in the working directory,
named for this run (`kvstream-demo-<time>-<random>.jsonl`); the summary says
where and how big. On Ctrl-C, SIGTERM or SIGHUP it stops stepping, delivers what it
has and prints the summary.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.lowlevel

from kvstream._cli.argtypes import non_negative_int, non_negative_number, positive_int
from kvstream._cli.kv_events import add_kv_events_config_option, zmq_sink_from_kv_events_config
from kvstream._cli.longrun import (
    Progress,
    Stop,
    add_metrics_option,
    delivered,
    metrics_token,
    open_metrics,
)
from kvstream._cli.upstream import bind_rule
from kvstream._wire.vllm_zmq import should_bind
from kvstream.config import open_sink
from kvstream.errors import ConfigError
from kvstream.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvstream.scheduler import Scheduler
from kvstream.sim import SimulatedEngine
from kvstream.sinks.base import Sink
from kvstream.sinks.file import FileSink

if TYPE_CHECKING:
    from kvstream.sinks.socket import SocketSink

__all__ = ["register", "run"]

EXAMPLES = """\
examples:
  kvstream demo                                   a few seconds into a new ./kvstream-demo-*.jsonl
  kvstream demo --steps 200 --out demo.jsonl      into demo.jsonl (replaced if it exists)
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
    p.add_argument(
        "--steps",
        type=non_negative_int,
        default=1000,
        help="engine steps; 0 = until stopped (1000)",
    )
    p.add_argument(
        "--rate",
        type=non_negative_number,
        default=250.0,
        help="steps per second; 0 = as fast as possible (250)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (16)")
    p.add_argument("--origin", default="sim-0", help="the engine's origin name (sim-0)")
    p.add_argument(
        "--gpu-blocks", type=positive_int, default=1024, help="GPU pool size in blocks (1024)"
    )
    p.add_argument(
        "--reset-every",
        type=non_negative_int,
        default=0,
        help="reset the cache every N steps; 0 = never",
    )
    p.add_argument(
        "--sink",
        action="append",
        metavar="URL",
        default=[],
        help="where batches go (repeatable): -, file:PATH, tcp://HOST:PORT, unix:PATH, "
        "zmq+tcp://..., nats://..., redis://... (default: a new file, see --out)",
    )
    p.add_argument(
        "--out",
        metavar="PATH",
        default=None,
        help="write the JSON-lines file here, replacing it (default, without --sink: "
        "./kvstream-demo-<time>-<id>.jsonl, new for every run)",
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


#: Seconds a ZMQ sink may have no subscriber before the demo says why that may be.
QUIET_HINT_AFTER: Final = 3.0


def _new_demo_file() -> str:
    """A file name no other run uses: the time plus a random suffix, created exclusively."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    while True:
        path = f"kvstream-demo-{stamp}-{secrets.token_hex(3)}.jsonl"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:  # pragma: no cover - 16M names a second
            continue
        except OSError as exc:
            raise ConfigError(f"cannot create {path} in the working directory: {exc}") from exc
        os.close(fd)
        return path


def _replace_file(path: str) -> None:
    try:
        with open(path, "wb"):
            pass
    except OSError as exc:
        raise ConfigError(f"--out: cannot write {path}: {exc}") from exc


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _zmq_sinks(sinks: list[Sink]) -> list[Any]:
    module = sys.modules.get("kvstream.sinks.zmq")  # loaded if any ZMQ sink exists
    if module is None:
        return []
    return [s for s in sinks if isinstance(s, module.ZmqSink)]


def _socket_sinks(sinks: list[Sink]) -> list[SocketSink]:
    """The sinks that serve snapshots: socket sinks (their module is loaded if one exists)."""
    if "kvstream.sinks.socket" not in sys.modules:
        return []
    from kvstream.sinks.socket import SocketSink

    return [s for s in sinks if isinstance(s, SocketSink)]


def _rule(sink: Any) -> str:
    """How the sink attaches (a bound endpoint shows its resolved address, no '*')."""
    if sink.bind:
        return "binds: subscribers connect to it"
    if should_bind(sink.endpoint):
        return bind_rule(sink.endpoint, False)
    return bind_rule(sink.endpoint)


def _zmq_banner(sink: Any) -> str:
    line = f"  {sink.name}: {sink.endpoint} {_rule(sink)}"
    if sink.replay_endpoint:
        line += f"; replay {sink.replay_endpoint} binds"
    return line


def _zmq_quiet_hint(sink: Any, seconds: float) -> str:
    if sink.bind:
        fix = f"e.g. kvstream tail 'zmq+{sink.endpoint}'"
    else:
        fix = (
            "a subscriber there must bind (kvstream tail 'zmq+tcp://*:PORT'); if it "
            "connects too, nothing arrives: give the sink a '*' endpoint to bind it"
        )
    return (
        f"kvstream demo: nobody has subscribed to {sink.endpoint} in {seconds:.0f} s "
        f"(ZMQ drops what nobody subscribed to); this sink {_rule(sink)}; "
        f"{fix}"
    )


def _size(n: int) -> str:
    for unit in ("bytes", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} bytes"  # pragma: no cover


def _count(batch: EventBatch, counts: Counter[tuple[str, str | None]]) -> None:
    for e in batch.events:
        if isinstance(e, BlockStored | BlockRemoved):
            counts[type(e).__name__, e.medium] += 1
        elif isinstance(e, AllBlocksCleared):
            counts["AllBlocksCleared", None] += 1


async def run(args: argparse.Namespace) -> int:
    urls: list[str] = list(args.sink)
    zmq_sink = zmq_sink_from_kv_events_config(args.kv_events_config)
    codecs: dict[str, Any] = {}
    sinks = [open_sink(url, codecs=codecs) for url in urls]
    if zmq_sink is not None:
        sinks.append(zmq_sink)
    out: str | None = args.out
    if out is None and not sinks:
        out = _new_demo_file()
    elif out is not None:
        _replace_file(out)
    if out is not None:
        sinks.insert(0, FileSink(out))
    engine = SimulatedEngine(
        seed=args.seed,
        block_size=args.block_size,
        gpu_blocks=args.gpu_blocks,
        reset_every=args.reset_every or None,
        origin=args.origin,
    )
    for socket_sink in _socket_sinks(sinks):  # the engine's state for far-behind subscribers
        if socket_sink.snapshot_provider is None:
            socket_sink.snapshot_provider = engine.snapshot
    counts: Counter[tuple[str, str | None]] = Counter()
    batches = 0
    last_seq: int | None = None
    started = time.perf_counter()
    step = 0
    subscribed: set[int] = set()

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
        for source, name in engine.inputs():  # the engine's connectors
            scheduler.add_source(source, name=name)
        print(
            f"kvstream demo: origin {scheduler.origin} epoch {scheduler.epoch} -> "
            + ", ".join(s.name for s in sinks),
            file=sys.stderr,
        )
        zmq_sinks = _zmq_sinks(sinks)
        for sink in zmq_sinks:
            print(_zmq_banner(sink), file=sys.stderr)
        sys.stderr.flush()
        async with anyio.create_task_group() as tg:

            async def watch_subscribers() -> None:
                waited = 0.0
                hinted: set[int] = set()
                while True:
                    await anyio.sleep(0.25)
                    waited += 0.25
                    for sink in zmq_sinks:
                        if sink.statistics().subscriptions > 0:
                            subscribed.add(id(sink))
                        elif (
                            waited >= QUIET_HINT_AFTER
                            and id(sink) not in subscribed
                            and id(sink) not in hinted
                        ):
                            hinted.add(id(sink))
                            print(_zmq_quiet_hint(sink, QUIET_HINT_AFTER), file=sys.stderr)

            if zmq_sinks:
                tg.start_soon(watch_subscribers)

            stop = Stop(tg.cancel_scope.cancel)
            tg.start_soon(stop.on_signal)
            tg.start_soon(stop.when_stdout_closes, sinks)
            tg.start_soon(progress.run)
            interval = 1.0 / args.rate if args.rate else 0.0
            next_at = anyio.current_time()
            while args.steps == 0 or step < args.steps:
                step += 1
                scheduler.emit(engine.run_step())  # the cache manager's own events
                await engine.handed_over()  # the CPU offload's events are in this batch
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
    if stop.by:
        print(f"kvstream demo: stopped by {stop.by}", file=sys.stderr)
    print(_summary(counts, batches, last_seq, elapsed, sinks), file=sys.stderr)
    for sink in _zmq_sinks(sinks):
        if id(sink) not in subscribed:
            print(
                f"  note: {sink.endpoint} never had a subscriber: ZMQ sent those batches to nobody",
                file=sys.stderr,
            )
    if out is not None:
        size = _file_size(out)
        print(
            f"kvstream demo: wrote {_size(size)} to {out} (check it: kvstream verify {out})",
            file=sys.stderr,
        )
    return 0 if delivered(report, sinks) else 1
