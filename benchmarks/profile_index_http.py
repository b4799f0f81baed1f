"""Where an HTTP `/match` round trip's time goes: the handler and the index call inside
the server, against the same calls in a tight loop.

    python benchmarks/profile_index_http.py [--blocks 100000] [--requests 2000] [--body binary]
        [--client lean|anyio]
    py-spy record -f raw -r 2000 -o http.txt -- python benchmarks/profile_index_http.py --untimed
    python benchmarks/pyspy_top.py http.txt --within "_connection (kvstream/_wire/http.py"

Serves an index of `--blocks` blocks (the corpus of `benchmarks/bench_index.py`) on
loopback and sends it `--requests` kept-alive 8k-token queries (`--body json` or
`binary`) from a client in the same event loop (`--client lean`: on an asyncio
`Protocol`, `kvstream._bench.http_client`; `anyio`: anyio's socket stream, the
benchmark's other client). Prints, per request and in CPU time (medians of `--repeat`
rounds): the whole round trip, the handler alone as the server ran it (`QueryServer`'s
request handler, from the parsed request to the response record), the index call
(`match()` or `match_bytes()`) inside it, and the same index call on the same prompts
back to back, outside the server. `--untimed` leaves the clock out of the server (for
a profiler: reading the CPU clock is a system call, which samplers overweight);
`--immediate` serves a handler that answers at once, with the index's answer made
before, for the cost of the HTTP layer alone; `--uvloop` runs it all on uvloop (not a
dependency of kvstream: install it apart to compare).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from array import array
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson

from kvstream._bench.http_client import connect, message_end
from kvstream._bench.index_measure import Corpus
from kvstream._wire.http import HttpServer, Request, Response
from kvstream.index import PrefixIndex
from kvstream.index._http import QueryServer

clock = time.process_time


class _TimedServer(QueryServer):
    """The index's server, adding up the CPU time of its request handler and of the
    index call in it."""

    handler_seconds = 0.0
    index_seconds = 0.0

    def __init__(self, index: PrefixIndex) -> None:
        super().__init__(index, port=0)
        for name in ("match", "match_bytes"):
            setattr(index, name, self._timed(getattr(index, name)))

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = clock()
            try:
                return call(*args, **kwargs)
            finally:
                self.index_seconds += clock() - started

        return timed

    async def _handle(self, request: Request) -> Response:
        started = clock()
        try:
            return await super()._handle(request)
        finally:
            self.handler_seconds += clock() - started


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=100_000, help="indexed blocks (100000)")
    p.add_argument("--requests", type=int, default=2000, help="requests per round (2000)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (3)")
    p.add_argument("--body", choices=("json", "binary"), default="binary")
    p.add_argument("--client", choices=("lean", "anyio"), default="lean")
    p.add_argument("--untimed", action="store_true", help="no clock in the server")
    p.add_argument(
        "--immediate",
        action="store_true",
        help="a handler answering at once (the index's answer, made before): HTTP alone",
    )
    p.add_argument("--uvloop", action="store_true", help="on uvloop (installed apart)")
    args = p.parse_args()
    corpus = Corpus(args.blocks)
    index = PrefixIndex(block_size=16)
    for batch in corpus.batches():
        index.apply(batch)
    rng = random.Random(2)
    prompts = [rng.choice(corpus.chains)[:8192] for _ in range(200)]
    binary = args.body == "binary"
    bodies = [
        array("I", t).tobytes() if binary else orjson.dumps({"token_ids": t}) for t in prompts
    ]
    kind = "application/octet-stream" if binary else "application/json"
    raws = [
        f"POST /match HTTP/1.1\r\nHost: x\r\nContent-Type: {kind}\r\n"
        f"Content-Length: {len(b)}\r\n\r\n".encode()
        + b
        for b in bodies
    ]
    n = args.requests
    totals: list[float] = []
    handlers: list[float] = []
    calls: list[float] = []

    async def run_with(round_trip: Callable[[bytes], Awaitable[None]], server: Any) -> None:
        for raw in raws[:50]:  # warm-up
            await round_trip(raw)
        for _ in range(args.repeat):
            server.handler_seconds = server.index_seconds = 0.0
            started = clock()
            for i in range(n):
                await round_trip(raws[i % len(raws)])
            totals.append((clock() - started) / n)
            handlers.append(server.handler_seconds / n)
            calls.append(server.index_seconds / n)

    async def run() -> None:
        server: Any
        if args.immediate:
            first = Request("POST", "/match", {"content-type": kind}, bodies[0])
            answer = await QueryServer(index)._handle(first)
            assert answer.status == 200, answer

            async def at_once(request: Request) -> Response:
                return answer

            server = HttpServer(at_once, port=0)
        elif args.untimed:
            server = QueryServer(index, port=0)
        else:
            server = _TimedServer(index)
        async with server:
            if args.client == "lean":
                async with connect(server.port) as client:
                    await run_with(client.round_trip, server)
                return
            async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
                buffer = bytearray()

                async def round_trip(raw: bytes) -> None:
                    await stream.send(raw)
                    while (end := message_end(buffer)) < 0:
                        buffer.extend(await stream.receive(1 << 20))
                    del buffer[:end]

                await run_with(round_trip, server)

    anyio.run(run, backend_options={"use_uvloop": True} if args.uvloop else {})
    for name in ("match", "match_bytes"):  # the index's own calls again, unwrapped
        vars(index).pop(name, None)
    loop: list[float] = []
    for _ in range(args.repeat):
        started = clock()
        for i in range(n):
            if binary:
                index.match_bytes(bodies[i % len(bodies)])
            else:
                index.match(prompts[i % len(prompts)])
        loop.append((clock() - started) / n)
    call = "match_bytes()" if binary else "match(list)"
    print(
        f"{args.body} body, {args.client} client{', uvloop' if args.uvloop else ''}, "
        f"{index.statistics().distinct_blocks:,} "
        f"blocks, 8192 tokens, CPU µs per request (median of {args.repeat}): round trip "
        f"{1e6 * statistics.median(totals):.0f}; "
        + (
            ("a handler answering at once" if args.immediate else "the server untimed")
            if args.untimed or args.immediate
            else f"the handler in the server {1e6 * statistics.median(handlers):.0f}, "
            f"the index call in it {1e6 * statistics.median(calls):.0f}"
        )
        + f"; {call} back to back {1e6 * statistics.median(loop):.0f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
