"""Where an HTTP `/match` round trip's time goes: the handler inside the server, against
the same calls in a tight loop.

    python benchmarks/profile_index_http.py [--blocks 100000] [--requests 2000] [--body binary]
    py-spy record -f raw -r 2000 -o http.txt -- python benchmarks/profile_index_http.py
    python benchmarks/pyspy_top.py http.txt --within "_connection (kvstream/_wire/http.py"

Serves an index of `--blocks` blocks (the corpus of `benchmarks/bench_index.py`) on
loopback and sends it `--requests` kept-alive 8k-token queries (`--body json` or
`binary`) from a client in the same event loop. Prints, per request and in CPU time
(medians of `--repeat` rounds): the whole round trip, the handler alone as the server
ran it (`QueryServer`'s request handler, from the parsed request to the response
record), and the same index call (`match()` or `match_bytes()`) on the same prompts back
to back, outside the server.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from array import array

import anyio
import orjson

from kvstream._bench.index_measure import Corpus
from kvstream._wire.http import Request, Response
from kvstream.index import PrefixIndex
from kvstream.index._http import QueryServer

clock = time.process_time


class _TimedServer(QueryServer):
    """The index's server, adding up the CPU time of its request handler."""

    handler_seconds = 0.0

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

    async def run() -> None:
        async with _TimedServer(index, port=0) as server:
            stream = await anyio.connect_tcp("127.0.0.1", server.port)
            async with stream:
                buffer = bytearray()

                async def round_trip(raw: bytes) -> None:
                    await stream.send(raw)
                    while True:
                        end = buffer.find(b"\r\n\r\n")
                        if end >= 0:
                            head = bytes(buffer[:end]).lower()
                            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
                            if len(buffer) >= end + 4 + length:
                                del buffer[: end + 4 + length]
                                return
                        buffer.extend(await stream.receive(1 << 20))

                for raw in raws[:50]:  # warm-up
                    await round_trip(raw)
                for _ in range(args.repeat):
                    server.handler_seconds = 0.0
                    started = clock()
                    for i in range(n):
                        await round_trip(raws[i % len(raws)])
                    totals.append((clock() - started) / n)
                    handlers.append(server.handler_seconds / n)

    anyio.run(run)
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
        f"{args.body} body, {index.statistics().distinct_blocks:,} blocks, 8192 tokens, "
        f"CPU µs per request (median of {args.repeat}): round trip "
        f"{1e6 * statistics.median(totals):.0f}; the handler in the server "
        f"{1e6 * statistics.median(handlers):.0f}; {call} back to back "
        f"{1e6 * statistics.median(loop):.0f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
