"""The HTTP listeners (metrics, prefix index) are loopback-only unless a token guards them."""

from __future__ import annotations

import anyio
import orjson
import pytest

from kvstream import ConfigError, PrefixIndex
from kvstream.index._http import QueryServer
from kvstream.metrics import MetricsServer, StatisticsCollector


async def _request(port: int, head: str, body: bytes = b"") -> tuple[int, bytes]:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(head.encode("latin-1") + b"\r\n" + body)
        data = b""
        with anyio.fail_after(10):
            while True:
                try:
                    data += await stream.receive()
                except anyio.EndOfStream:
                    break
                if b"\r\n\r\n" in data:
                    top, _, rest = data.partition(b"\r\n\r\n")
                    length = [
                        int(line.split(b":")[1])
                        for line in top.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ]
                    if length and len(rest) >= length[0]:
                        break
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def test_listening_beyond_loopback_needs_a_token() -> None:
    with pytest.raises(ConfigError, match=r"0\.0\.0\.0 \(not loopback\) needs a token"):
        MetricsServer(StatisticsCollector(), "0.0.0.0:0")
    with pytest.raises(ConfigError, match=r"needs a token"):
        QueryServer(PrefixIndex(block_size=16), host="0.0.0.0", port=0)
    # With a token the address is accepted (not bound here: only loopback is used in tests).
    MetricsServer(StatisticsCollector(), "0.0.0.0:0", token="s3cret")
    QueryServer(PrefixIndex(block_size=16), host="0.0.0.0", port=0, token="s3cret")


async def test_metrics_server_checks_the_bearer_token() -> None:
    async with MetricsServer(StatisticsCollector(), "127.0.0.1:0", token="s3cret") as server:
        status, _ = await _request(server.port, "GET /metrics HTTP/1.1\r\nHost: x\r\n")
        assert status == 401
        status, _ = await _request(
            server.port, "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
        )
        assert status == 401
        status, body = await _request(
            server.port, "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
        )
        assert status == 200
        assert b"process_" in body or b"python_" in body


async def test_index_server_checks_the_bearer_token() -> None:
    query = orjson.dumps({"token_ids": list(range(32))})
    head = (
        "POST /match HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(query)}\r\nConnection: close\r\n"
    )
    async with QueryServer(PrefixIndex(block_size=16), port=0, token="s3cret") as server:
        status, body = await _request(server.port, head, query)
        assert status == 401
        assert b"bearer token" in body
        status, body = await _request(server.port, head + "Authorization: Bearer s3cret\r\n", query)
        assert status == 200, body
