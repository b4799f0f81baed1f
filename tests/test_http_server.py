"""kvstream's one HTTP server: limits enforced with a clear refusal and a counter."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import anyio
import pytest
from anyio.abc import SocketStream
from servers import wait_until

from kvstream._wire.http import HttpLimits, HttpServer, Request, Response
from kvstream.errors import ClosedError, ConfigError


async def _echo(request: Request) -> Response:
    if request.path == "/boom":
        raise RuntimeError("handler bug")
    return Response(
        200, b"%s %s %d" % (request.method.encode(), request.path.encode(), len(request.body))
    )


async def _read_response(stream: SocketStream) -> tuple[int, bytes]:
    """One response (status, body), read by Content-Length; (0, b"") at EOF."""
    data = b""
    with anyio.fail_after(10):
        while b"\r\n\r\n" not in data:
            try:
                data += await stream.receive()
            except anyio.EndOfStream:
                return 0, b""
        head, _, rest = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            rest += await stream.receive()
    return int(head.split()[1]), rest[:length]


async def _exchange(port: int, raw: bytes) -> tuple[int, bytes]:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(raw)
        return await _read_response(stream)


def _get(path: str = "/", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n{extra}\r\n".encode()


async def test_keep_alive_serves_several_requests_on_one_connection() -> None:
    async with (
        HttpServer(_echo, port=0) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as stream,
    ):
        for path in ("/a", "/b"):
            await stream.send(_get(path))
            assert await _read_response(stream) == (200, f"GET {path} 0".encode())
        body = b"x" * 1000
        await stream.send(b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n" + body)
        assert await _read_response(stream) == (200, b"POST /p 1000")
        assert server.statistics().requests == 3
        assert server.statistics().connections == 1


@pytest.mark.parametrize(
    ("raw", "status", "reason"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", 400, b"Host"),
        (
            b"GET / HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nab",
            400,
            b"",
        ),
        ("GET / HTTP/1.1\r\nHost: t\r\nContent-Length: \u00b2\r\n\r\n".encode(), 400, b""),
        (b"NONSENSE\r\n\r\n", 400, b""),
        (b"GET / HTTP/1.1\r\nHost: t\r\nbad header line\r\n\r\n", 400, b""),
    ],
)
async def test_malformed_requests_are_refused_with_400(
    raw: bytes, status: int, reason: bytes
) -> None:
    async with HttpServer(_echo, port=0) as server:
        got, body = await _exchange(server.port, raw)
        assert got == status
        assert reason in body
        # The server is still serving.
        assert await _exchange(server.port, _get()) == (200, b"GET / 0")
        assert server.statistics().errors == 1


async def test_size_limits_refuse_before_reading() -> None:
    limits = HttpLimits(head_bytes=1024, body_bytes=100)
    async with HttpServer(_echo, port=0, limits=limits) as server:
        # A declared body over the limit is refused without sending the body.
        status, body = await _exchange(
            server.port, b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100000000\r\n\r\n"
        )
        assert status == 413
        assert b"100000000" in body
        # A chunked body that grows past the limit too.
        chunks = b"".join(b"40\r\n" + b"y" * 64 + b"\r\n" for _ in range(4)) + b"0\r\n\r\n"
        status, _ = await _exchange(
            server.port,
            b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks,
        )
        assert status == 413
        status, _ = await _exchange(server.port, _get(extra="X-Big: " + "z" * 4000 + "\r\n"))
        assert status == 431
        assert server.statistics().too_large == 3


async def test_a_slow_head_gets_408_while_others_are_served() -> None:
    limits = HttpLimits(head_timeout=0.3)
    async with (
        HttpServer(_echo, port=0, limits=limits) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as slow,
    ):
        await slow.send(b"GET / HT")  # and never more
        assert await _exchange(server.port, _get()) == (200, b"GET / 0")
        status, body = await _read_response(slow)
        assert status == 408
        assert b"not complete" in body
        assert server.statistics().timeouts == 1


async def test_a_head_trickled_in_gets_408_however_steady_its_pace() -> None:
    # The head's deadline runs from its first byte: a byte every 50 ms keeps each
    # read short, and the head is still cut off.
    limits = HttpLimits(head_timeout=0.3)
    async with (
        HttpServer(_echo, port=0, limits=limits) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as slow,
    ):
        status = 0
        with anyio.fail_after(10):
            for byte in b"GET / HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 1000:
                try:
                    await slow.send(bytes([byte]))
                except (anyio.BrokenResourceError, OSError):
                    break
                await anyio.sleep(0.05)
                if server.statistics().timeouts:
                    break
            status, body = await _read_response(slow)
        assert status == 408
        assert b"request head not complete" in body
        assert server.statistics().timeouts == 1


async def test_a_body_in_pieces_is_read_whole_and_a_slow_one_gets_408() -> None:
    limits = HttpLimits(body_timeout=0.3)
    head = b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 9000\r\n\r\n"
    async with HttpServer(_echo, port=0, limits=limits) as server:
        async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
            await stream.send(head + b"a" * 1000)
            for _ in range(8):
                await anyio.sleep(0.01)
                await stream.send(b"b" * 1000)
            assert await _read_response(stream) == (200, b"POST /x 9000")
        async with await anyio.connect_tcp("127.0.0.1", server.port) as slow:
            await slow.send(head + b"a" * 100)  # and never the rest
            status, body = await _read_response(slow)
        assert status == 408
        assert b"request body not complete" in body
        assert server.statistics().timeouts == 1


async def test_the_handler_gets_the_body_as_bytes_whole_or_in_pieces() -> None:
    seen: list[object] = []

    async def keep(request: Request) -> Response:
        seen.append(request.body)
        return Response(200, b"ok")

    head = b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 6\r\n\r\n"
    async with (
        HttpServer(keep, port=0) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as stream,
    ):
        await stream.send(head + b"abcdef")  # one piece
        assert await _read_response(stream) == (200, b"ok")
        await stream.send(head + b"abc")
        await anyio.sleep(0.05)
        await stream.send(b"def")  # two
        assert await _read_response(stream) == (200, b"ok")
    assert seen == [b"abcdef", b"abcdef"]
    assert [type(body) for body in seen] == [bytes, bytes]


async def test_idle_connections_make_room_instead_of_locking_the_server_out() -> None:
    limits = HttpLimits(max_connections=4)
    async with HttpServer(_echo, port=0, limits=limits) as server:
        idle = [await anyio.connect_tcp("127.0.0.1", server.port) for _ in range(8)]
        try:
            # Every slot is taken by a silent client, yet a real request is answered.
            for _ in range(3):
                assert await _exchange(server.port, _get()) == (200, b"GET / 0")
            stats = server.statistics()
            assert stats.connections_evicted >= 4
            assert stats.connections_open <= 4
            assert stats.connections_refused == 0
        finally:
            for stream in idle:
                await stream.aclose()


async def test_the_connection_idle_the_longest_makes_room_not_the_oldest() -> None:
    # `old` connected first but was just answered; `silent` connected after it and
    # never spoke. A newcomer takes the silent one's place, and `old` goes on.
    limits = HttpLimits(max_connections=2)
    async with (
        HttpServer(_echo, port=0, limits=limits) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as old,
    ):
        await wait_until(lambda: server.statistics().connections_open == 1)
        async with await anyio.connect_tcp("127.0.0.1", server.port) as silent:
            await wait_until(lambda: server.statistics().connections_open == 2)
            await old.send(_get("/first"))
            assert await _read_response(old) == (200, b"GET /first 0")
            assert await _exchange(server.port, _get("/new")) == (200, b"GET /new 0")
            assert server.statistics().connections_evicted == 1
            assert await _read_response(silent) == (0, b"")  # it was the one closed
            await old.send(_get("/again"))
            assert await _read_response(old) == (200, b"GET /again 0")


async def test_a_new_connection_is_refused_when_every_slot_is_mid_request() -> None:
    limits = HttpLimits(max_connections=2, head_timeout=5.0)
    async with HttpServer(_echo, port=0, limits=limits) as server:
        busy = [await anyio.connect_tcp("127.0.0.1", server.port) for _ in range(2)]
        try:
            for stream in busy:  # past the head, mid-body: not evictable
                await stream.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\nab")
            await wait_until(lambda: server.statistics().connections == 2)
            await anyio.sleep(0.05)
            status, body = await _exchange(server.port, _get())
            assert status == 503
            assert b"too many connections" in body
            assert server.statistics().connections_refused == 1
            # The busy ones finish their requests and are answered.
            for stream in busy:
                await stream.send(b"cd")
                assert await _read_response(stream) == (200, b"POST / 4")
        finally:
            for stream in busy:
                await stream.aclose()


async def test_a_failing_handler_answers_500_and_logs_once_per_burst(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstream.http")
    async with HttpServer(_echo, port=0) as server:
        for _ in range(20):
            status, body = await _exchange(server.port, _get("/boom"))
            assert status == 500
            assert b"handler bug" not in body  # internals stay in the log
        assert await _exchange(server.port, _get()) == (200, b"GET / 0")
        assert server.statistics().handler_errors == 20
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "handler bug" in warnings[0].getMessage()


async def test_a_token_is_required_on_every_request() -> None:
    async with HttpServer(_echo, port=0, token="s3cret") as server:
        assert (await _exchange(server.port, _get()))[0] == 401
        assert (await _exchange(server.port, _get(extra="Authorization: Bearer no\r\n")))[0] == 401
        ok = _get(extra="Authorization: Bearer s3cret\r\n")
        assert await _exchange(server.port, ok) == (200, b"GET / 0")
        assert server.statistics().unauthorized == 2


async def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    """A client that sends `Expect: 100-continue` waits for the go-ahead (curl waits a
    second, then sends anyway): it gets `100 Continue` at once, or the refusal."""
    head = b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n"
    async with (
        HttpServer(_echo, port=0, token="s3cret", limits=HttpLimits(body_bytes=100)) as server,
    ):
        async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
            await stream.send(head + b"Authorization: Bearer s3cret\r\n\r\n")
            # Answered without the body: the client sends none until told to.
            with anyio.fail_after(10):
                interim = await stream.receive()
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            await stream.send(b"hello")
            assert await _read_response(stream) == (200, b"POST /p 5")
            # The connection goes on: the next request is read as usual.
            await stream.send(_get("/next", "Authorization: Bearer s3cret\r\n"))
            assert await _read_response(stream) == (200, b"GET /next 0")
        # Refusals come before the body, not after a wait.
        async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
            await stream.send(head + b"\r\n")  # no token
            with anyio.fail_after(10):
                assert (await _read_response(stream))[0] == 401
        too_big = head.replace(b"Content-Length: 5", b"Content-Length: 500")
        async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
            await stream.send(too_big + b"Authorization: Bearer s3cret\r\n\r\n")
            with anyio.fail_after(10):
                assert (await _read_response(stream))[0] == 413
        assert server.statistics().unauthorized == 1
        assert server.statistics().too_large == 1


@pytest.mark.parametrize("coding", ["gzip", "br", "deflate, gzip"])
async def test_an_encoded_body_is_refused_with_415_not_read_as_plain(coding: str) -> None:
    async with HttpServer(_echo, port=0) as server:
        raw = (
            f"POST /p HTTP/1.1\r\nHost: t\r\nContent-Encoding: {coding}\r\n"
            "Content-Length: 3\r\n\r\nabc"
        ).encode()
        async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
            await stream.send(raw)
            status, body = await _read_response(stream)
            assert status == 415
            assert coding.encode() in body
            # The body was read whole: the connection serves the next request.
            await stream.send(_get("/after"))
            assert await _read_response(stream) == (200, b"GET /after 0")
        raw = raw.replace(coding.encode(), b"identity")
        assert await _exchange(server.port, raw) == (200, b"POST /p 3")
        assert server.statistics().errors == 1


async def test_lifetime_and_configuration_errors() -> None:
    server = HttpServer(_echo, port=0)
    async with server:
        pass
    with pytest.raises(ClosedError, match="entered only once"):
        async with server:
            pass
    with pytest.raises(ConfigError, match=r"max_connections: expected a positive int, got 0"):
        HttpLimits(max_connections=0)
    with pytest.raises(ConfigError, match=r"head_timeout: expected seconds > 0, got -1"):
        HttpLimits(head_timeout=-1)
    with pytest.raises(ConfigError, match="needs a token"):
        HttpServer(_echo, host="0.0.0.0", port=0)


_EMFILE_SERVER = textwrap.dedent(
    """
    import resource, sys
    import anyio
    from kvstream.metrics import MetricsServer, StatisticsCollector

    async def main():
        async with MetricsServer(StatisticsCollector(), "127.0.0.1:0", process_metrics=False) as m:
            print(m.port, flush=True)
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            import os
            used = len(os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (used + 8, hard))
            await anyio.to_thread.run_sync(sys.stdin.readline)
            print(m.statistics().accept_errors, flush=True)

    anyio.run(main)
    """
)


async def test_the_metrics_listener_survives_running_out_of_file_descriptors() -> None:
    with subprocess.Popen(  # noqa: ASYNC220 - a child process talked to over pipes
        [sys.executable, "-c", _EMFILE_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdin is not None
        assert proc.stdout is not None
        port = int(await anyio.to_thread.run_sync(proc.stdout.readline))
        flood = []
        try:
            for _ in range(40):  # far more than the server has descriptors for
                flood.append(await anyio.connect_tcp("127.0.0.1", port))
            await anyio.sleep(0.5)
        finally:
            for stream in flood:
                await stream.aclose()
        # The flood is gone: the listener answers again.
        with anyio.fail_after(10):
            while True:
                status, _ = await _exchange(port, _get("/metrics"))
                if status == 200:
                    break
                await anyio.sleep(0.1)
        proc.stdin.write("\n")
        proc.stdin.flush()
        accept_errors = int(await anyio.to_thread.run_sync(proc.stdout.readline))
        assert accept_errors > 0
        assert proc.wait(10) == 0
