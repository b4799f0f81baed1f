"""Attacks on every kvstream listener, and how a well-behaved client fares meanwhile.

Each listener runs for real on 127.0.0.1 in this process: the socket sink
(under a scheduler publishing 200 batches/s), the ZMQ sink's replay ROUTER, the
prefix index's HTTP server and the metrics HTTP server. For each attack the
script measures a well-behaved client's latency (`--requests` requests, one
after the other) with no attack (the baseline, in the same run) and while the
attack runs, and reports the median, the p99, the requests that failed or
took over 5 s, the listener's refusal counters and the process's peak RSS
growth during the attack.

The well-behaved clients: the socket sink's is a new subscriber (connect, hello,
welcome); the replay ROUTER's asks for the ring's last 10 batches and reads
them to the end marker; the index's POSTs a 64-token `/match`; the metrics
server's GETs `/metrics`.

Attackers and client share this process's event loop with the listener (two
shared cores here), so the numbers include that contention.

    python benchmarks/bench_attacks.py --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import orjson
import zmq
import zmq.asyncio

from kvstream import BlockRemoved, Scheduler
from kvstream._wire import vllm_zmq
from kvstream.index import PrefixIndex
from kvstream.index._http import QueryServer
from kvstream.metrics import MetricsServer, StatisticsCollector
from kvstream.sinks.socket import SocketSink
from kvstream.sinks.zmq import ZmqSink

CONNECTIONS = 64
TIMEOUT = 5.0

Probe = Callable[[], Awaitable[None]]
Attack = Callable[[anyio.abc.TaskGroup], Awaitable[None]]


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- well-behaved clients --------------------------------------------------------------------


async def _http(port: int, head: str, body: bytes = b"") -> int:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(head.encode() + b"\r\n" + body)
        got = bytearray()
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            while True:
                got += await stream.receive()
    status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else 0
    if status != 200:
        raise RuntimeError(f"HTTP {status}")
    return status


def metrics_probe(port: int) -> Probe:
    head = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"

    async def probe() -> None:
        await _http(port, head)

    return probe


def index_probe(port: int) -> Probe:
    body = orjson.dumps({"token_ids": list(range(64))})
    head = (
        "POST /match HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
    )

    async def probe() -> None:
        await _http(port, head, body)

    return probe


def socket_probe(port: int) -> Probe:
    async def probe() -> None:
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(b"{}\n")
            got = bytearray()
            while b"\n" not in got:
                got += await stream.receive()
            if not got.startswith(b'{"type":"welcome"'):
                raise RuntimeError(got[:120].decode(errors="replace"))

    return probe


def replay_probe(ctx: zmq.asyncio.Context, endpoint: str, newest: Callable[[], int]) -> Probe:
    async def probe() -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        try:
            await dealer.send_multipart(vllm_zmq.replay_request(max(newest() - 9, 0)))
            n = 0
            while vllm_zmq.parse_replay_reply(await dealer.recv_multipart()) is not None:
                n += 1
            if n == 0:
                raise RuntimeError("empty replay")
        finally:
            dealer.close(linger=0)

    return probe


# -- attacks ---------------------------------------------------------------------------------


def idle_connections(port: int, n: int = CONNECTIONS) -> Attack:
    """`n` connections that send nothing, held open (reopened when the listener closes one)."""

    async def attack(tg: anyio.abc.TaskGroup) -> None:
        async def hold() -> None:
            while True:
                with contextlib.suppress(OSError):
                    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                            while True:
                                await stream.receive()
                await anyio.sleep(0.05)

        for _ in range(n):
            tg.start_soon(hold)

    return attack


def slowloris(port: int, opening: bytes, n: int = CONNECTIONS) -> Attack:
    """`n` connections sending `opening` and then one byte every 0.2 s, never ending."""

    async def attack(tg: anyio.abc.TaskGroup) -> None:
        async def drip() -> None:
            while True:
                with contextlib.suppress(OSError, anyio.BrokenResourceError):
                    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                        await stream.send(opening)
                        while True:
                            await anyio.sleep(0.2)
                            await stream.send(b"a")
                await anyio.sleep(0.05)

        for _ in range(n):
            tg.start_soon(drip)

    return attack


def flood(port: int, payload: bytes, workers: int = 4) -> Attack:
    """`workers` loops: connect, send `payload`, read the answer, close; again."""

    async def attack(tg: anyio.abc.TaskGroup) -> None:
        async def hammer() -> None:
            while True:
                with contextlib.suppress(OSError, anyio.BrokenResourceError):
                    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                        await stream.send(payload)
                        with contextlib.suppress(anyio.EndOfStream):
                            while await stream.receive():
                                pass
                await anyio.lowlevel.checkpoint()

        for _ in range(workers):
            tg.start_soon(hammer)

    return attack


def huge_bodies(port: int, workers: int = 4) -> Attack:
    """Requests claiming a 100 MB body, then sending it as fast as the server reads."""
    head = (
        b"POST /match HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 104857600\r\n\r\n"
    )
    chunk = b"1," * 32768

    async def attack(tg: anyio.abc.TaskGroup) -> None:
        async def push() -> None:
            while True:
                with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.EndOfStream):
                    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                        await stream.send(head)
                        for _ in range(1600):
                            await stream.send(chunk)
                await anyio.lowlevel.checkpoint()

        for _ in range(workers):
            tg.start_soon(push)

    return attack


def never_reading_subscribers(port: int, n: int = 8) -> Attack:
    """Subscribers asking for everything from seq 0 that never read; new ones every 3 s."""

    async def attack(tg: anyio.abc.TaskGroup) -> None:
        async def sit() -> None:
            while True:
                with contextlib.suppress(OSError, anyio.BrokenResourceError):
                    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                        raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
                        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                        await stream.send(b'{"from_seq": 0}\n')
                        await anyio.sleep(3.0)  # reading nothing
                await anyio.sleep(0.05)

        for _ in range(n):
            tg.start_soon(sit)

    return attack


def replay_hoarders(ctx: zmq.asyncio.Context, endpoint: str, n: int = CONNECTIONS) -> Attack:
    """`n` replay clients that ask for the whole ring and never read; new ones keep coming."""

    async def attack(tg: anyio.abc.TaskGroup) -> None:
        async def hoard() -> None:
            while True:
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.setsockopt(zmq.RCVHWM, 1)
                dealer.connect(endpoint)
                try:
                    await dealer.send_multipart(vllm_zmq.replay_request(0))
                    await anyio.sleep(2.0)
                finally:
                    dealer.close(linger=0)

        for _ in range(n):
            tg.start_soon(hoard)

    return attack


def replay_garbage(ctx: zmq.asyncio.Context, endpoint: str) -> Attack:
    """One client sending malformed replay requests as fast as it can."""

    async def attack(tg: anyio.abc.TaskGroup) -> None:
        async def spray() -> None:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            try:
                while True:
                    await dealer.send_multipart([b"", b"\x00\x01"])
                    await anyio.lowlevel.checkpoint()
            finally:
                dealer.close(linger=0)

        tg.start_soon(spray)

    return attack


# -- measuring -------------------------------------------------------------------------------


async def _measure(probe: Probe, requests: int) -> dict[str, Any]:
    times: list[float] = []
    failed = 0
    errors: set[str] = set()
    for _ in range(requests):
        start = time.perf_counter()
        try:
            with anyio.fail_after(TIMEOUT):
                await probe()
        except Exception as exc:
            failed += 1
            errors.add(f"{type(exc).__name__}: {exc}"[:80])
        else:
            times.append(time.perf_counter() - start)
        await anyio.sleep(0.005)
    times.sort()
    out: dict[str, Any] = {"requests": requests, "failed": failed}
    if times:
        out["median_ms"] = round(statistics.median(times) * 1000, 2)
        out["p99_ms"] = round(times[min(len(times) - 1, int(len(times) * 0.99))] * 1000, 2)
    if errors:
        out["errors"] = sorted(errors)[:3]
    return out


async def _case(
    listener: str,
    attack_name: str,
    probe: Probe,
    attack: Attack,
    counters: Callable[[], dict[str, int]],
    requests: int,
) -> dict[str, Any]:
    baseline = await _measure(probe, requests)
    before = counters()
    rss0 = peak = _rss()
    async with anyio.create_task_group() as tg:
        await attack(tg)
        await anyio.sleep(1.0)  # let the attack settle in

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, _rss())
                await anyio.sleep(0.05)

        tg.start_soon(sample)
        attacked = await _measure(probe, requests)
        tg.cancel_scope.cancel()
    after = counters()
    await anyio.sleep(0.5)  # let the listener clean up before the next case
    return {
        "listener": listener,
        "attack": attack_name,
        "baseline": baseline,
        "attacked": attacked,
        "counters": {k: after[k] - before.get(k, 0) for k in after},
        "rss_growth_mb": round((peak - rss0) / 2**20, 1),
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    n = args.requests
    results: list[dict[str, Any]] = []

    # The socket sink, behind a scheduler publishing 200 batches per second.
    sink = SocketSink(port=0, ring_bytes=16 << 20)
    async with Scheduler(sinks=[sink], origin="eng") as scheduler:

        async def produce() -> None:
            i = 0
            while True:
                scheduler.emit([BlockRemoved(block_hashes=[i + 1], medium="GPU")] * 8)
                await scheduler.tick()
                i += 1
                await anyio.sleep(0.005)

        async with anyio.create_task_group() as producers:
            producers.start_soon(produce)
            port = int(sink.address.rsplit(":", 1)[1])

            def sink_counters() -> dict[str, int]:
                st = sink.statistics()
                return {
                    "connections_refused": st.connections_refused,
                    "hellos_evicted": st.hellos_evicted,
                    "slow_disconnects": st.slow_disconnects,
                }

            probe = socket_probe(port)
            for name, attack in (
                ("64 connections that never say hello", idle_connections(port)),
                ("64 slowloris hellos (1 byte / 0.2 s)", slowloris(port, b'{"from_seq": 0')),
                ("garbage hellos, 4 loops", flood(port, b"\x00\xff garbage\n")),
                ("8 subscribers from seq 0 that never read", never_reading_subscribers(port)),
            ):
                results.append(await _case("socket sink", name, probe, attack, sink_counters, n))
            producers.cancel_scope.cancel()
        await scheduler.aclose()

    # The ZMQ sink's replay ROUTER, its ring full.
    replay_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    zsink = ZmqSink(
        f"tcp://127.0.0.1:{_free_port()}",
        bind=True,
        replay_endpoint=replay_endpoint,
        buffer_steps=2000,
        linger=0,
    )
    ctx = zmq.asyncio.Context()
    try:
        async with Scheduler(sinks=[zsink], origin="eng") as scheduler:
            newest = -1
            for i in range(2000):
                scheduler.emit([BlockRemoved(block_hashes=[i + 1], medium="GPU")] * 16)
                await scheduler.tick()
                newest += 1

            def zmq_counters() -> dict[str, int]:
                st = zsink.statistics()
                return {
                    "replay_busy": st.replay_busy,
                    "replay_malformed": st.replay_malformed,
                    "replays_abandoned": st.replays_abandoned,
                }

            probe = replay_probe(ctx, replay_endpoint, lambda: newest)
            for name, attack in (
                ("64 replay clients that never read", replay_hoarders(ctx, replay_endpoint)),
                (
                    "malformed replay requests, one flooding client",
                    replay_garbage(ctx, replay_endpoint),
                ),
            ):
                results.append(await _case("ZMQ replay", name, probe, attack, zmq_counters, n))
            await scheduler.aclose()
    finally:
        ctx.destroy(linger=0)

    # The index's and the metrics' HTTP servers.
    index = PrefixIndex(block_size=16)
    async with (
        QueryServer(index, port=0) as query,
        MetricsServer(StatisticsCollector(), "127.0.0.1:0", process_metrics=False) as metrics,
    ):
        for listener, server, probe in (
            ("index HTTP", query, index_probe(query.port)),
            ("metrics HTTP", metrics, metrics_probe(metrics.port)),
        ):

            def http_counters(server: Any = server) -> dict[str, int]:
                st = server.statistics()
                return {k: v for k, v in st._asdict().items() if isinstance(v, int)}

            port = server.port
            attacks = [
                ("64 idle connections", idle_connections(port)),
                ("64 slowloris heads (1 byte / 0.2 s)", slowloris(port, b"GET / HTTP/1.1\r\nX: ")),
            ]
            if listener == "index HTTP":
                attacks.append(("100 MB bodies, 4 loops", huge_bodies(port)))
            for name, attack in attacks:
                results.append(await _case(listener, name, probe, attack, http_counters, n))
    return results


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| listener | attack | p99 baseline (ms) | p99 attacked (ms) | median attacked (ms) "
        "| failed | refusals counted | RSS growth |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        counted = ", ".join(f"{k} {v}" for k, v in r["counters"].items() if v) or "—"
        b, a = r["baseline"], r["attacked"]
        lines.append(
            f"| {r['listener']} | {r['attack']} | {b.get('p99_ms', '—')} | {a.get('p99_ms', '—')} "
            f"| {a.get('median_ms', '—')} | {a['failed']} of {a['requests']} | {counted} "
            f"| {r['rss_growth_mb']} MB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per measurement")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 4096), hard), hard))
    except (ImportError, ValueError, OSError):
        pass
    results = anyio.run(run, args)
    if args.json:
        json.dump(
            {"python": sys.version.split()[0], "pid": os.getpid(), "results": results},
            sys.stdout,
            indent=2,
        )
        print()
    else:
        print(_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
