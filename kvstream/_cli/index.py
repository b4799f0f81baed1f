"""`kvstream index`: follow streams into a prefix index and answer queries over HTTP.

`kvstream index URL [URL ...]` reads batches from any subscriber URLs (a JSON-lines
file, followed as it grows; ZMQ, NATS, Redis, ...), all into one
[`PrefixIndex`][kvstream.index._prefix.PrefixIndex], and serves `POST /match` and
`GET /stats` on 127.0.0.1. One URL per engine is the usual fleet (each ZMQ
publisher is its own origin, named by `origin=` or its endpoint). It runs until
Ctrl-C, SIGTERM or SIGHUP, and keeps answering from what it has if a stream ends. A
stream whose server cannot be reached at start (a broker not up yet) is tried
again with backoff while the index serves (`--no-retry` exits instead); a bad
option stops it at once.

With `--state FILE` the index is loaded from FILE at start (when it exists),
saved every `--save-interval` seconds and on shutdown (written to a temporary
file, then renamed over FILE), so a restarted router is warm.

`kvstream index --demo` routes simulated requests over a simulated fleet (DP
ranks, restarts, an engine lost) with the tier-weighted index, the index on GPU
alone, and at random, and prints the hit rates.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from kvstream._cli.argtypes import positive_int, positive_seconds
from kvstream._cli.longrun import Stop, add_metrics_option, metrics_token, open_metrics
from kvstream._cli.upstream import WhenReachable, first_attempt
from kvstream._wire.socket_security import read_token
from kvstream.config import open_subscriber, parse_url, redact_url
from kvstream.consumers.base import Gap, Subscriber
from kvstream.errors import ConfigError, KVStreamError
from kvstream.events import EventBatch
from kvstream.index._demo import RoutingResult, compare_routing
from kvstream.index._http import QueryServer
from kvstream.index._prefix import PrefixIndex

__all__ = ["register", "run"]

DEFAULT_PORT = 5690

EXAMPLES = """\
examples:
  kvstream index kv.jsonl                         follow a file, serve on 127.0.0.1:5690
  kvstream index zmq+tcp://127.0.0.1:5557 --port 0
  kvstream index 'zmq+tcp://10.0.0.1:5557?origin=engine-0' 'zmq+tcp://10.0.0.2:5557?origin=engine-1'
                                                  one index of two engines
  curl -s localhost:5690/match -d '{"token_ids": [1, 2, 3, 4]}'
  curl -s localhost:5690/stats
  kvstream index kv.jsonl --state index.state     warm after a restart
  curl -s localhost:5690/match -H 'Content-Type: application/octet-stream' \
       --data-binary @tokens.u32                    tokens as uint32 little-endian
  kvstream index --demo --engines 4 --requests 2000
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "index",
        help="follow streams into one prefix index; answer /match and /stats over HTTP",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "url",
        nargs="*",
        metavar="URL",
        help="the streams to follow (subscriber URLs), all into one index",
    )
    p.add_argument(
        "--no-retry",
        action="store_true",
        help="exit at once when a stream's server cannot be reached at start "
        "(default: serve the others and retry it with backoff)",
    )
    p.add_argument(
        "--block-size", type=positive_int, default=16, help="the engines' block size (16)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port; 0 = any free port ({DEFAULT_PORT})"
    )
    p.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=4 * 1024 * 1024,
        help="largest request body accepted (4194304)",
    )
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=64,
        metavar="N",
        help="connections served at once (64); at the limit a new one takes the place of the "
        "connection idle the longest, and is answered 503 only when all N are mid-request",
    )
    p.add_argument(
        "--token-env",
        metavar="NAME",
        default=None,
        help="environment variable holding a bearer token queries must send "
        "(required to listen beyond loopback)",
    )
    p.add_argument(
        "--token-file", metavar="PATH", default=None, help="file holding that bearer token"
    )
    p.add_argument("--seed", type=int, default=0, help="the index's hash seed; the demo's too (0)")
    p.add_argument(
        "--state",
        metavar="FILE",
        default=None,
        help="load the index from FILE at start; save it there periodically and on shutdown",
    )
    p.add_argument(
        "--save-interval",
        type=positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="with --state: seconds between saves (60)",
    )
    p.add_argument(
        "--ttl",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="drop a stream after this long without a batch (default: never)",
    )
    p.add_argument(
        "--max-blocks",
        type=positive_int,
        default=None,
        help="bound the (stream, block) entries; the least recently stored go first",
    )
    p.add_argument(
        "--tier-weight",
        action="append",
        default=[],
        metavar="MEDIUM=W",
        help="weight of a block on MEDIUM in match scores (repeatable; "
        "defaults GPU=1, CPU=0.8, DISK=0.5, EXTERNAL=0.3)",
    )
    p.add_argument("--demo", action="store_true", help="compare index and random routing")
    p.add_argument("--engines", type=positive_int, default=4, help="demo: simulated engines (4)")
    p.add_argument(
        "--requests", type=positive_int, default=2000, help="demo: requests routed (2000)"
    )
    p.add_argument(
        "--gpu-blocks", type=positive_int, default=1024, help="demo: GPU blocks per engine"
    )
    p.add_argument(
        "--ranks", type=positive_int, default=2, help="demo: data-parallel ranks per engine (2)"
    )
    add_metrics_option(p)
    p.set_defaults(func=run)


async def run(args: argparse.Namespace) -> int:
    if args.demo:
        if args.url:
            raise ConfigError(f"--demo takes no URL, got {' '.join(args.url)!r}")
        return _demo(args)
    if not args.url:
        raise ConfigError(
            "URL: expected the streams to follow (file:PATH, zmq+tcp://..., nats://..., "
            "redis://...), or --demo"
        )
    twice = next((url for i, url in enumerate(args.url) if url in args.url[:i]), None)
    if twice is not None:
        raise ConfigError(f"URL: {redact_url(twice)!r} given twice (each stream is followed once)")
    named: dict[str, str] = {}
    for url in args.url:
        origin = parse_url(url).options.get("origin")
        if origin is not None and named.setdefault(origin, url) != url:
            raise ConfigError(
                f"URL: origin={origin!r} given to {redact_url(named[origin])!r} and "
                f"{redact_url(url)!r}; each stream needs an origin of its own"
            )
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: expected 0-65535, got {args.port}")
    index = PrefixIndex(
        block_size=args.block_size,
        seed=args.seed,
        ttl=args.ttl,
        max_blocks=args.max_blocks,
        tier_weights=_weights(args.tier_weight),
    )
    state_path = Path(args.state) if args.state else None
    if state_path is not None and state_path.exists():
        try:
            data = state_path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"--state: cannot read {state_path}: {exc}") from exc
        try:
            index.load(data)
        except ConfigError as exc:  # say which file: the index's message names the field
            raise ConfigError(f"--state {state_path}: {exc}") from exc
        stats = index.statistics()
        print(
            f"kvstream index: loaded {state_path}: {stats.distinct_blocks:,} blocks over "
            f"{len(stats.origins)} stream(s)",
            file=sys.stderr,
        )
    #: The subscriber following each URL, once its server was reached.
    followed: dict[str, Subscriber] = {}
    #: Streams whose subscriber failed: the others are still served; all failed ends it.
    failed: list[str] = []
    async with (
        open_metrics(args.metrics, command="index", token=metrics_token(args)) as metrics,
        AsyncExitStack() as stack,
        QueryServer(
            index,
            host=args.host,
            port=args.port,
            max_request_bytes=args.max_request_bytes,
            max_connections=args.max_connections,
            token=read_token(env=args.token_env, file=args.token_file, where="kvstream index"),
        ) as server,
        anyio.create_task_group() as tg,
    ):
        unreached: dict[str, KVStreamError] = {}  # url -> why the first attempt failed
        for url in args.url:
            subscriber = _subscriber(url)
            # A server (or stream) not up yet is reached later, in the background;
            # a bad option stops.
            why = await first_attempt(subscriber, stack, later=not args.no_retry)
            if why is None:
                followed[url] = subscriber
            else:
                unreached[url] = why
        if metrics is not None:
            metrics.collector.add(index, kind="index")
        print(
            "kvstream index: "
            + (f"following {', '.join(map(redact_url, followed))}; " if followed else "")
            + (f"waiting for {', '.join(map(redact_url, unreached))}; " if unreached else "")
            + f"serving {server.url}/ (POST /match, GET /stats)",
            flush=True,
        )

        stop = Stop(tg.cancel_scope.cancel)

        def reached(url: str, subscriber: Subscriber) -> None:
            followed[url] = subscriber
            print(f"kvstream index: following {redact_url(url)}", file=sys.stderr)

        def _failed(url: str, exc: KVStreamError, fed: set[tuple[str, int | None]]) -> None:
            # One stream's fault stays its own: the others are still followed, and
            # what the index holds is still served, until every stream has failed.
            failed.append(redact_url(url))
            # What it fed is as of its last batch: answers from it are hints now.
            for origin, rank in fed:
                index.mark_stale(origin, f"its stream {redact_url(url)} failed", rank)
            left = len(args.url) - len(failed)
            print(
                f"kvstream index: the stream {redact_url(url)} failed: {exc}; "
                + (f"still serving, {left} stream(s) followed" if left else "stopping"),
                file=sys.stderr,
            )
            if not left:
                tg.cancel_scope.cancel()

        async def follow(subscriber: Subscriber, url: str) -> None:
            iterator = aiter(subscriber)
            fed: set[tuple[str, int | None]] = set()  # the streams this URL carried
            try:
                async for item in iterator:
                    if isinstance(item, EventBatch):
                        fed.add((item.origin, item.data_parallel_rank))
                    if isinstance(item, Gap):
                        print(
                            f"kvstream index: {item.origin}: batches {item.first_missing}.."
                            f"{item.next_seq - 1} missing ({item.reason}); marked stale",
                            file=sys.stderr,
                        )
                    index.apply(item)
            except KVStreamError as exc:
                _failed(url, exc, fed)
                return
            finally:
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True):
                        await aclose()
            print(
                f"kvstream index: the stream {redact_url(url)} ended; still serving",
                file=sys.stderr,
            )

        async def keep_alive() -> None:
            """Publishers heard from (their heartbeats, with `?heartbeats=true`) keep
            their streams alive under --ttl while idle; one gone stops, and expires."""
            if args.ttl is None:
                return
            while True:
                await anyio.sleep(min(args.ttl / 4, 1.0))
                for subscriber in list(followed.values()):  # those reached so far
                    liveness = getattr(subscriber, "liveness", None)
                    if liveness is None:
                        continue
                    for origin, heard in liveness().items():
                        if heard.alive and heard.interval is not None:
                            index.heartbeat(origin, ...)

        async def save_periodically() -> None:
            assert state_path is not None
            while True:
                await anyio.sleep(args.save_interval)
                data = index.dump()  # between two batches: consistent per stream
                try:
                    await anyio.to_thread.run_sync(_write_state, state_path, data)
                except ConfigError as exc:  # a full disk must not stop the index
                    print(f"kvstream index: {exc}; will retry", file=sys.stderr)

        tg.start_soon(stop.on_signal)
        for url, subscriber in followed.items():
            tg.start_soon(follow, subscriber, url)
        for url, why in unreached.items():  # reached with backoff, in the task following it
            later = WhenReachable(
                partial(_subscriber, url),
                url=url,
                command="index",
                on_reached=partial(reached, url),
                failed=why,
            )
            tg.start_soon(follow, later, url)
        tg.start_soon(keep_alive)
        if state_path is not None:
            tg.start_soon(save_periodically)
    if state_path is not None:
        started = time.perf_counter()
        _write_state(state_path, index.dump())
        print(
            f"kvstream index: saved {state_path} ({time.perf_counter() - started:.2f} s)",
            file=sys.stderr,
        )
    stats = index.statistics()
    never = [url for url in args.url if url not in followed and redact_url(url) not in failed]
    if stop.by:
        print(f"kvstream index: stopped by {stop.by}", file=sys.stderr)
    print(
        f"kvstream index: {stats.batches:,} batches, {stats.distinct_blocks:,} blocks "
        f"over {len(stats.origins)} origin(s); {server.requests:,} queries served"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + (f"; never reached: {', '.join(map(redact_url, never))}" if never else ""),
        file=sys.stderr,
    )
    # Status 1 when no stream is left that was followed or may still be reached.
    return 1 if failed and len(failed) == len(args.url) else 0


def _subscriber(url: str) -> Subscriber:
    """The subscriber of `url`; a file is followed as it grows."""
    options: dict[str, Any] = {"follow": True} if parse_url(url).scheme == "file" else {}
    return open_subscriber(url, **options)


def _weights(pairs: list[str]) -> dict[str, float] | None:
    if not pairs:
        return None
    from kvstream.index._prefix import DEFAULT_TIER_WEIGHTS

    out = dict(DEFAULT_TIER_WEIGHTS)
    for pair in pairs:
        name, sep, value = pair.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not name or not 0 <= weight < float("inf"):
            raise ConfigError(f"--tier-weight: expected MEDIUM=WEIGHT (WEIGHT >= 0), got {pair!r}")
        out[name] = weight
    return out


def _write_state(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all (a temporary file, then a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"--state: cannot write {path}: {exc}") from exc


def _describe(result: RoutingResult) -> str:
    return (
        f"  {result.policy + ' routing':<19}: hit rate {100 * result.hit_rate:5.1f}% on GPU, "
        f"{100 * result.reusable_rate:5.1f}% reusable on any tier "
        f"({result.blocks_hit:,} / {result.blocks_reusable:,} of {result.blocks_requested:,} "
        f"prompt blocks); misrouted to the lost engine {result.misrouted}"
    )


def _demo(args: argparse.Namespace) -> int:
    quiet = logging.getLogger("kvstream.index")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # expiries are expected here: the summary counts them
    try:
        results = compare_routing(
            engines=args.engines,
            requests=args.requests,
            seed=args.seed,
            block_size=args.block_size,
            gpu_blocks=args.gpu_blocks,
            ranks=args.ranks,
        )
    finally:
        quiet.setLevel(level)
    print(
        f"kvstream index demo: {args.engines} simulated engines x {args.ranks} DP ranks, "
        f"{args.requests:,} requests (seed {args.seed}, block size {args.block_size}, "
        f"{args.gpu_blocks} GPU blocks each); a rank restarts every {max(args.requests // 5, 1)} "
        "requests (late batches of its old epoch follow), engine-0 is lost at mid-run"
    )
    for result in results:
        print(_describe(result))
    stats = results[0].index
    if stats is not None:
        tiers: dict[str, int] = {}
        for origin in stats.origins.values():
            for medium, n in origin.by_medium.items():
                tiers[medium] = tiers.get(medium, 0) + n
        per_tier = ", ".join(f"{m} {n:,}" for m, n in tiers.items())
        mean = 1e6 * results[0].match_seconds / results[0].matches if results[0].matches else 0.0
        print(
            f"  index: {len(stats.origins)} live streams, {stats.distinct_blocks:,} distinct "
            f"blocks ({per_tier}), about {stats.memory_bytes / 2**20:.1f} MiB; "
            f"{stats.restarts} restarts, {stats.retired_epoch_batches} late batches of retired "
            f"epochs dropped, {stats.expired} streams expired (ttl); mean match {mean:.0f} µs"
        )
    return 0
