"""Slow-loris clients cannot lock an HTTP listener (index, metrics) out.

Before, a connection still sending its request head counted as mid-request and
was never closed to make room: 64 clients each sending a byte every 0.2 s
(within the 5 s head deadline, reconnecting when cut off) kept every new client
refused with `503` (`benchmarks/bench_attacks.py`: 200 of 200 refused). Now,
when no connection is idle, the oldest one still sending its head is closed
for the newcomer (counted in `connections_evicted`); only connections past
their head (a body arriving, a response being made) are never taken over.
"""

from __future__ import annotations

import anyio
import anyio.abc
import pytest
from servers import wait_until
from test_reliability_peers import _talk

from kvstream._wire.http import HttpLimits, HttpServer, Request, Response

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


async def _ok(request: Request) -> Response:
    return Response(200, b"ok")


async def _get(port: int) -> int:
    got = await _talk(port, b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    return int(got.split(b" ", 2)[1])


async def test_slow_heads_make_room_for_a_client_that_sends_its_request() -> None:
    limits = HttpLimits(max_connections=8, head_timeout=30.0)
    async with HttpServer(_ok, port=0, limits=limits) as server:
        slow: list[anyio.abc.SocketStream] = []
        try:
            for _ in range(8):
                stream = await anyio.connect_tcp("127.0.0.1", server.port)
                await stream.send(b"GET / HTTP/1.1\r\nX-Slow: ")  # a head that never ends
                slow.append(stream)
            await wait_until(lambda: server.statistics().connections == 8)
            await anyio.sleep(0.05)  # every one is in its head now
            for _ in range(5):
                assert await _get(server.port) == 200
            stats = server.statistics()
            assert stats.connections_refused == 0
            assert stats.connections_evicted >= 1  # a slow head made room; then a slot was free
            assert stats.connections_open <= 8
        finally:
            for stream in slow:
                await stream.aclose()
