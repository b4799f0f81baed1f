"""`kvstream relay`: carry live engine streams into any sinks, one origin per upstream.

Reads every `--source` (any subscriber URL: `zmq+tcp://...` for a vLLM,
SGLang or TensorRT-LLM publisher, with `?replay=...` to repair gaps;
`file:PATH?follow=1`; the other transports as they arrive) and publishes
into every `--sink`, ticking every `--interval` seconds. A source whose
server cannot be reached at start is tried again with backoff while the
others are relayed (`--no-retry` exits instead). Each upstream is its own
origin (`?origin=NAME` on a ZMQ source; kvstream-format upstreams
keep their origins; a bound ZMQ source keeps one origin per connecting
publisher's topic and rank). Each source reads every engine dialect (vLLM map
and positional, SGLang, TensorRT-LLM; `?dialect=` pins one, `?media=normalize`
maps tier names); each ZMQ sink writes the one its consumer reads
(`?profile=map|positional|sglang|sglang-positional|llm-d-2025-12`). An
upstream restart reaches the sinks as `AllBlocksCleared` for that origin; so
does an upstream gap nothing could repair, its metadata saying which batches
were lost (`--on-gap count` only counts it). On Ctrl-C, SIGTERM or SIGHUP it stops
reading, delivers what it has and prints a one-line summary on stderr.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

import anyio

from kvstream._cli.argtypes import non_negative_seconds, positive_seconds
from kvstream._cli.kv_events import add_kv_events_config_option, zmq_sink_from_kv_events_config
from kvstream._cli.longrun import (
    Progress,
    Stop,
    add_metrics_option,
    delivered,
    metrics_token,
    open_metrics,
)
from kvstream._cli.upstream import WhenReachable, first_attempt
from kvstream.config import open_sink, open_subscriber
from kvstream.consumers.base import Subscriber
from kvstream.errors import ConfigError
from kvstream.relay import GAP_POLICIES, Relay
from kvstream.scheduler import CloseReport, Scheduler
from kvstream.sinks.base import Sink

__all__ = ["register", "run"]

EXAMPLES = """\
examples:
  kvstream relay --source 'zmq+tcp://10.0.0.5:5557?replay=tcp://10.0.0.5:5558' --sink file:kv.jsonl
  kvstream relay --source 'zmq+tcp://gpu-0:5557?origin=gpu-0' \\
                 --source 'zmq+tcp://gpu-1:5557?origin=gpu-1' \\
                 --sink 'zmq+tcp://*:6557?replay=tcp://*:6558&model=llama-3-8b'
  kvstream relay --source 'zmq+tcp://127.0.0.1:5557' \\
                 --kv-events-config '{"endpoint": "tcp://*:6557", "replay_endpoint": "tcp://*:6558"}'
  kvstream relay --source 'zmq+tcp://sglang-0:5557?origin=sglang-0' \\
                 --sink 'zmq+tcp://*:6557?profile=map'      # SGLang in, vLLM map out
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "relay",
        help="carry live engine streams (vLLM/SGLang/TensorRT-LLM ZMQ, ...) into sinks",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--source",
        action="append",
        metavar="URL",
        default=[],
        help="an upstream (repeatable): zmq+tcp://HOST:PORT?replay=tcp://HOST:PORT2&origin=NAME, "
        "zmq+ipc://PATH, file:PATH?follow=1, ...",
    )
    p.add_argument(
        "--sink",
        action="append",
        metavar="URL",
        default=[],
        help="where batches go (repeatable): -, file:PATH, zmq+tcp://..., nats://..., ...",
    )
    p.add_argument(
        "--no-retry",
        action="store_true",
        help="exit at once when a source's server cannot be reached at start "
        "(default: relay the others and retry it with backoff)",
    )
    p.add_argument(
        "--interval",
        type=positive_seconds,
        default=0.05,
        metavar="SECONDS",
        help="seconds between ticks: how long events wait to be batched (0.05)",
    )
    p.add_argument(
        "--origin",
        default=None,
        help="the relay's own origin name (it carries no events of its own; default relay@HOST)",
    )
    p.add_argument(
        "--close-timeout",
        type=non_negative_seconds,
        default=5.0,
        metavar="SECONDS",
        help="how long to deliver what is pending when stopping (5)",
    )
    p.add_argument(
        "--on-gap",
        choices=GAP_POLICIES,
        default="clear",
        help="an upstream gap nothing could repair: 'clear' puts an AllBlocksCleared "
        "(metadata upstream_gap) into that origin's output; 'count' only counts it (clear)",
    )
    add_kv_events_config_option(p)
    add_metrics_option(p)
    p.set_defaults(func=run)


def _check_topics(sinks: list[Sink], n_sources: int) -> None:
    """Several upstreams through one ZMQ sink need a topic per origin."""
    if n_sources < 2:
        return
    for sink in sinks:
        if getattr(sink, "per_origin_topics", None) is False:
            raise ConfigError(
                f"{sink.name}: several sources need a topic per origin on a ZMQ sink: "
                "add topic=...{origin}... or model=NAME (topic kv@<origin>@NAME)"
            )


def _summary(relay: Relay, report: CloseReport, sinks: list[Sink], elapsed: float) -> str:
    st = relay.statistics()
    out = sum(s.statistics().batches_out for s in sinks)
    dropped = sum(s.statistics().batches_dropped for s in sinks)
    text = (
        f"kvstream relay: {st.batches_in} batches ({st.events_in} events) in "
        f"{elapsed:.1f} s from {len(st.origins)} origin(s) to {len(sinks)} sink(s); "
        f"{out} batches out, {dropped} dropped, "
        f"{report.undelivered_batches} undelivered; "
        f"{st.gaps} upstream gap(s) ({st.missing} batches, {st.gaps_marked} marked), "
        f"{st.restarts} restart(s)"
    )
    if st.events_refused:
        text += f"; {st.events_refused} event(s) refused (no dialect reads them)"
    if st.failed:
        text += f"; failed: {', '.join(st.failed)}"
    return text


async def run(args: argparse.Namespace) -> int:
    if not args.source:
        raise ConfigError("relay: expected at least one --source URL")
    codecs: dict[str, Any] = {}
    sinks = [open_sink(url, codecs=codecs) for url in args.sink]
    zmq_sink = zmq_sink_from_kv_events_config(args.kv_events_config)
    if zmq_sink is not None:
        sinks.append(zmq_sink)
    if not sinks:
        raise ConfigError("relay: expected at least one --sink URL (or --kv-events-config)")
    _check_topics(sinks, len(args.source))
    subscribers: list[Subscriber] = [open_subscriber(url) for url in args.source]
    started = time.perf_counter()
    origin = args.origin or f"relay@{socket.gethostname()}"
    async with (
        open_metrics(args.metrics, command="relay", token=metrics_token(args)) as metrics,
        AsyncExitStack() as stack,
    ):
        for i, (url, sub) in enumerate(zip(args.source, subscribers, strict=True)):
            # A server not up yet: entered, once reachable, by the task reading it.
            failed = await first_attempt(sub, stack, later=not args.no_retry)
            if failed is not None:
                subscribers[i] = WhenReachable(
                    partial(open_subscriber, url), url=url, command="relay", failed=failed
                )
        scheduler = await stack.enter_async_context(
            Scheduler(
                sinks=sinks,
                origin=origin,
                tick_interval=args.interval,
                close_timeout=args.close_timeout,
            )
        )
        relay = Relay(scheduler, subscribers, names=args.source, on_gap=args.on_gap)
        if metrics is not None:
            metrics.collector.add(scheduler)
            metrics.collector.add(relay, kind="relay")
        print(
            f"kvstream relay: {len(subscribers)} source(s) -> " + ", ".join(s.name for s in sinks),
            file=sys.stderr,
            flush=True,
        )

        def progress_line() -> str:
            st = relay.statistics()
            return f"{st.batches_in:,} batches, {st.events_in:,} events, {st.gaps} gaps"

        progress = Progress("relay", progress_line)
        async with anyio.create_task_group() as tg:
            stop = Stop(relay.stop)
            tg.start_soon(stop.on_signal)
            tg.start_soon(stop.when_stdout_closes, sinks)
            tg.start_soon(progress.run)
            await relay.run()
            tg.cancel_scope.cancel()
        progress.clear()
        with anyio.CancelScope(shield=True):
            report = await scheduler.aclose()
    elapsed = time.perf_counter() - started
    if stop.by:
        print(f"kvstream relay: stopped by {stop.by}", file=sys.stderr)
    print(_summary(relay, report, sinks, elapsed), file=sys.stderr, flush=True)
    return 0 if delivered(report, sinks) else 1
