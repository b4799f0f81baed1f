"""The least a client and an echo server in the benchmark's own process add to an HTTP
round trip: both on asyncio `Protocol`s, framing by `Content-Length` only.

    async with connect(port) as client:
        await client.round_trip(raw_request)   # one whole response read, status 200 checked

    server = await echo_server(canned_response)  # answers every whole request with it

For `kvstream._bench.index_measure.bench_http` and `benchmarks/profile_index_http.py`:
the HTTP rows measured with this client leave out what anyio's streams cost on the
client's side, so they show the server's work more closely.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

__all__ = ["KeepAliveClient", "connect", "echo_server", "message_end"]


def message_end(data: bytes | bytearray) -> int:
    """Where the first whole message (head, then a `Content-Length` body) in `data`
    ends; -1 while it is incomplete."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return -1
    head = bytes(data[:end]).lower()
    _, found, rest = head.partition(b"\r\ncontent-length:")
    length = int(rest.partition(b"\r\n")[0]) if found else 0
    total = end + 4 + length
    return total if len(data) >= total else -1


class KeepAliveClient(asyncio.Protocol):
    """One kept-alive connection; one request in flight at a time."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._answered: asyncio.Future[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        end = message_end(self._buffer)
        if end >= 0 and self._answered is not None and not self._answered.done():
            answer = bytes(self._buffer[:end])
            del self._buffer[:end]
            self._answered.set_result(answer)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._answered is not None and not self._answered.done():
            self._answered.set_exception(ConnectionError("the server closed the connection"))

    async def round_trip(self, raw: bytes) -> None:
        """Send `raw` (a whole request) and wait for its whole response, a 200."""
        assert self._transport is not None
        self._answered = asyncio.get_running_loop().create_future()
        self._transport.write(raw)
        answer = await self._answered
        if not answer.startswith(b"HTTP/1.1 200 "):
            raise ConnectionError(f"expected a 200 answer, got {answer[:80]!r}")

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


@asynccontextmanager
async def connect(port: int) -> AsyncIterator[KeepAliveClient]:
    """A client connected to `127.0.0.1:port`, closed on exit."""
    _, client = await asyncio.get_running_loop().create_connection(
        KeepAliveClient, "127.0.0.1", port
    )
    try:
        yield client
    finally:
        client.close()
        await asyncio.sleep(0)  # the transport closes its socket in the next turn


class _Echo(asyncio.Protocol):
    def __init__(self, answer: bytes) -> None:
        self._answer = answer
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        self._buffer += data
        while (end := message_end(self._buffer)) >= 0:
            del self._buffer[:end]
            self._transport.write(self._answer)


async def echo_server(answer: bytes) -> asyncio.Server:
    """A server on a free loopback port answering each whole request with `answer` (no
    HTTP parsing, no handler: the floor of a Protocol server). Close it after use."""
    return await asyncio.get_running_loop().create_server(lambda: _Echo(answer), "127.0.0.1", 0)
