"""The HTTP server's own reader of complete request heads (`kvstream._wire.http_head`)
against h11: it reads a head exactly as h11 does or leaves it to h11, and the server's
answers are h11's bytes."""

from __future__ import annotations

import random

import anyio
import h11
import pytest
from anyio.abc import SocketStream
from servers import wait_until

from kvstream._wire.http import HttpLimits, HttpServer, Request, Response
from kvstream._wire.http_head import parse_head

Reading = tuple[str, str, dict[str, str], int, bool]


def _h11_reading(raw: bytes) -> Reading | None:
    """What h11 reads in a request head (method, target, headers, body length, close
    after it), or None when it refuses it or needs more of the head. A body cut short
    is padded (up to 1 KiB) to learn its length."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(raw)
    try:
        event = conn.next_event()
        if type(event) is not h11.Request:
            return None
        length = 0
        padded = False
        while True:
            part = conn.next_event()
            if type(part) is h11.Data:
                length += len(part.data)
            elif type(part) is h11.EndOfMessage:
                break
            elif part is h11.NEED_DATA and not padded:
                conn.receive_data(b"\0" * 1024)
                padded = True
            else:
                return None
    except h11.RemoteProtocolError:
        return None
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
    return (
        event.method.decode("ascii"),
        event.target.decode("latin-1"),
        headers,
        length,
        conn.their_state is h11.MUST_CLOSE,
    )


def _fast_reading(raw: bytes) -> Reading | None:
    head = parse_head(raw, 16 * 1024)
    if head is None:
        return None
    return head.method, head.target, head.headers, head.length, head.close


_READ_HERE = [
    b"GET / HTTP/1.1\r\nHost: t\r\n\r\n",
    b"POST /match?lora_name=a%20b HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello",
    b"HEAD /metrics HTTP/1.1\r\nhOsT: t\r\ncontent-LENGTH: 0\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost:t\r\nX-Spaces: \t a  b \t \r\nX-Empty:\r\nX-Empty2:  \r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\nX-Obs: caf\xe9 \x80\xff\r\nX-Ctl: a\x01b\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\nConnection: keep-alive, Close\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\nConnection: closed\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\nConnection: upgrade\r\nConnection: close\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\nX-Twice: 1\r\nX-Twice: 2\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 007\r\n\r\n1234567",
    b"GET http://t/x HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer s3cret\r\n\r\n",
    b"OPTIONS * HTTP/1.1\r\nHost: t\r\n\r\n",
]

_LEFT_TO_H11 = [
    b"GET / HTTP/1.0\r\n\r\n",  # another version
    b"GET / HTTP/1.1\r\nHost: t\r\nX-Fold: a\r\n  folded\r\n\r\n",  # obs-fold
    b"GET / HTTP/1.1\nHost: t\n\n",  # bare LF
    b"GET / HTTP/1.1\r\nHost: t\n\r\n",
    b"\r\nGET / HTTP/1.1\r\nHost: t\r\n\r\n",  # a blank line first
    b"GET / HTTP/1.1\r\n\r\n",  # no Host
    b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",  # two
    b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5, 5\r\n\r\nhello",
    b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
    b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\na",
    b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: +1\r\n\r\na",
    b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: " + b"1" * 21 + b"\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\na",
    b"GET / HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
    b"CONNECT t:443 HTTP/1.1\r\nHost: t\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\nX-Nul: a\x00b\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\nX-CR: a\rb\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost : t\r\n\r\n",  # space before the colon
    b"GET / HTTP/1.1\r\nHo st: t\r\n\r\n",
    b"G(T / HTTP/1.1\r\nHost: t\r\n\r\n",
    b"GET /a b HTTP/1.1\r\nHost: t\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\n",  # not complete yet
    b"GET / HTTP/1.1\r\nHost: t\r\nX-Long: " + b"a" * 100,
]


@pytest.mark.parametrize("raw", _READ_HERE)
def test_common_heads_are_read_here_exactly_as_h11_reads_them(raw: bytes) -> None:
    fast = _fast_reading(raw)
    assert fast is not None
    assert fast == _h11_reading(raw)


@pytest.mark.parametrize("raw", _LEFT_TO_H11)
def test_everything_else_is_left_to_h11(raw: bytes) -> None:
    assert parse_head(raw, 16 * 1024) is None


def test_a_head_past_the_limit_is_left_to_h11_which_refuses_it() -> None:
    raw = b"GET / HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"p" * 100 + b"\r\n\r\nbody"
    size = raw.index(b"body")
    assert parse_head(raw, size) is not None
    assert parse_head(raw, size - 1) is None  # not even read: h11 answers 431 for it


_REQUEST_LINES = [
    b"GET / HTTP/1.1",
    b"POST /match HTTP/1.1",
    b"get /x?y=z HTTP/1.1",
]
_ODD_REQUEST_LINES = [
    b"GET / HTTP/1.0",
    b"GET / HTTP/2.0",
    b"GET  / HTTP/1.1",
    b"GET / http/1.1",
    b"G\xc3T / HTTP/1.1",
    b"GET /\x7f HTTP/1.1",
    b"GET / HTTP/1.1 ",
    b"",
]
_HEADER_LINES = [
    b"Host: t",
    b"host:t",
    b"HOST: \tt\t",
    b"Host: a b",
    b"Content-Length: 3",
    b"Content-Length: 03",
    b"content-length:3 ",
    b"Content-Length: 4",
    b"Connection: close",
    b"Connection: Keep-Alive",
    b"Connection: ,close,",
    b"X-A: \x80\xfe",
    b"X-B: \x01\x7f",
    b"X-C:",
]
_ODD_HEADER_LINES = [
    b"X-D: a\x00",
    b"X-E: a\x0bb",
    b" X-F: folded",
    b"\tcontinued",
    b"X-G : v",
    b"X@H: v",
    b": v",
    b"X-I v",
    b"Content-Length: 3,3",
    b"Content-Length: -3",
    b"Content-Length: 3 3",
    b"Transfer-Encoding: chunked",
    b"Expect: 100-continue",
    b"Upgrade: h2c",
]


def test_random_heads_are_read_as_h11_reads_them_or_left_to_it() -> None:
    rng = random.Random(17)
    read_here = 0

    def pick(usual: list[bytes], odd: list[bytes]) -> bytes:
        return rng.choice(odd if rng.random() < 0.1 else usual)

    for _ in range(3000):
        lines = [pick(_REQUEST_LINES, _ODD_REQUEST_LINES)]
        lines += [pick(_HEADER_LINES, _ODD_HEADER_LINES) for _ in range(rng.randrange(6))]
        if rng.random() < 0.7:
            lines.insert(1, b"Host: t")
        ends = [b"\n" if rng.random() < 0.03 else b"\r\n" for _ in lines]
        raw = b"".join(line + end for line, end in zip(lines, ends, strict=True))
        raw += (b"\n" if rng.random() < 0.03 else b"\r\n") + b"abc"
        fast = _fast_reading(raw)
        if fast is not None:
            read_here += 1
            assert fast == _h11_reading(raw), raw
    assert read_here > 200  # the comparison covered the path, not only refusals


# -- the server's answers ------------------------------------------------------------------


async def _read_exactly(stream: SocketStream, size: int) -> bytes:
    data = b""
    with anyio.fail_after(10):
        while len(data) < size:
            data += await stream.receive()
    return data


def _h11_answer(raw: bytes, response: Response, *, keep_alive: bool = True) -> bytes:
    """The bytes h11 writes for `response` to the request `raw`, headed as the server
    heads them."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(raw)
    request = conn.next_event()
    assert type(request) is h11.Request
    while type(conn.next_event()) is not h11.EndOfMessage:
        pass
    headers = [
        ("Content-Type", response.content_type),
        ("Content-Length", str(len(response.body))),
        *response.headers,
    ]
    if not keep_alive:
        headers.append(("Connection", "close"))
    reasons = {200: b"OK", 404: b"Not Found", 405: b"Method Not Allowed", 299: b""}
    out = conn.send(
        h11.Response(status_code=response.status, headers=headers, reason=reasons[response.status])
    )
    assert out is not None
    if request.method != b"HEAD":
        out += conn.send(h11.Data(data=response.body)) or b""
    return out + (conn.send(h11.EndOfMessage()) or b"")


_ANSWERS = [
    (b"GET / HTTP/1.1\r\nHost: t\r\n\r\n", Response(200, b"ok\n")),
    (
        b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        Response(200, b'{"a": 1}', "application/json"),
    ),
    (
        b"HEAD /metrics HTTP/1.1\r\nHost: t\r\n\r\n",
        Response(200, b"# metrics\n", "text/plain; version=0.0.4"),
    ),
    (
        b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nab",
        Response(405, b"no\n", headers=(("Allow", "GET, HEAD"),)),
    ),
    (b"GET /gone HTTP/1.1\r\nHost: t\r\n\r\n", Response(404, b"")),
    (b"GET /odd HTTP/1.1\r\nHost: t\r\n\r\n", Response(299, b"unusual")),
]


@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize(("raw", "response"), _ANSWERS)
async def test_the_server_answers_with_the_bytes_h11_writes(
    raw: bytes, response: Response, keep_alive: bool
) -> None:
    assert parse_head(raw, 16 * 1024) is not None  # this is the path under test

    async def answer(request: Request) -> Response:
        return response

    expected = _h11_answer(raw, response, keep_alive=keep_alive)
    async with (
        HttpServer(answer, port=0, keep_alive=keep_alive) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as stream,
    ):
        await stream.send(raw)
        assert await _read_exactly(stream, len(expected)) == expected


async def test_pipelined_requests_are_answered_in_order_on_either_path() -> None:
    seen: list[tuple[str, bytes]] = []

    async def keep(request: Request) -> Response:
        seen.append((request.path, request.body))
        return Response(200, request.path.encode())

    requests = [
        b"POST /one HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc",
        # chunked: h11 reads this one, and gives back the bytes after it
        b"POST /two HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nde\r\n0\r\n\r\n",
        b"GET /three HTTP/1.1\r\nHost: t\r\n\r\n",
        b"POST /four HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\nf",
    ]
    async with (
        HttpServer(keep, port=0) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as stream,
    ):
        await stream.send(b"".join(requests))
        answers = [
            _h11_answer(raw, Response(200, path))
            for raw, path in zip(requests, (b"/one", b"/two", b"/three", b"/four"), strict=True)
        ]
        expected = b"".join(answers)
        assert await _read_exactly(stream, len(expected)) == expected
        assert server.statistics().connections == 1
    assert seen == [("/one", b"abc"), ("/two", b"de"), ("/three", b""), ("/four", b"f")]


async def test_a_head_in_pieces_then_whole_ones_on_one_connection() -> None:
    async def echo(request: Request) -> Response:
        return Response(200, request.body)

    raw = b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\nbody"
    expected = _h11_answer(raw, Response(200, b"body"))
    async with (
        HttpServer(echo, port=0) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as stream,
    ):
        await stream.send(raw[:10])  # h11 reads this one
        await anyio.sleep(0.05)
        await stream.send(raw[10:])
        assert await _read_exactly(stream, len(expected)) == expected
        for _ in range(3):
            await stream.send(raw)
            assert await _read_exactly(stream, len(expected)) == expected
        assert server.statistics().requests == 4


async def _half_closed(port: int, raw: bytes) -> bytes:
    """Send `raw`, then the end of the stream; everything answered until the server closes."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(raw)
        await stream.send_eof()
        return await _read_to_end(stream)


async def test_a_client_that_stops_sending_still_gets_its_answer() -> None:
    raw = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"
    async with HttpServer(_ok, port=0) as server:
        assert await _half_closed(server.port, raw) == _h11_answer(raw, Response(200, b"ok"))
        await wait_until(lambda: server.statistics().connections_open == 0)


async def test_a_body_cut_short_by_the_client_is_refused_with_400() -> None:
    async with HttpServer(_ok, port=0) as server:
        raw = b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc"
        data = await _half_closed(server.port, raw)
        assert data.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert b"connection closed mid-body" in data
        assert server.statistics().errors == 1


async def _ok(request: Request) -> Response:
    return Response(200, b"ok")


@pytest.mark.parametrize(
    "response",
    [
        Response(200, b"x", "text/plain\r\nX-Injected: 1"),
        Response(200, b"x", headers=(("X-Bad Name", "v"),)),
        Response(200, b"x", headers=(("X-Value", "caf\u00e9"),)),
        Response(204, b"not empty"),
        Response(99, b""),
    ],
)
async def test_a_response_h11_would_not_send_is_a_handler_error_answered_500(
    response: Response,
) -> None:
    async def bad(request: Request) -> Response:
        return response if request.path == "/bad" else Response(200, b"ok")

    async with HttpServer(bad, port=0) as server:
        for _ in range(2):  # the server goes on serving
            async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
                await stream.send(b"GET /bad HTTP/1.1\r\nHost: t\r\n\r\n")
                answer = await _read_exactly(stream, 12)
                assert answer.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
        assert server.statistics().handler_errors == 2


async def test_a_client_that_reads_no_answers_is_closed_after_the_idle_timeout() -> None:
    big = b"z" * (1 << 20)

    async def large(request: Request) -> Response:
        return Response(200, big)

    limits = HttpLimits(idle_timeout=0.3)
    async with (
        HttpServer(large, port=0, limits=limits) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as stream,
    ):
        request = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"
        with anyio.fail_after(10):
            for _ in range(64):  # answers pile up unread, far past the socket's buffers
                try:
                    await stream.send(request)
                except (anyio.BrokenResourceError, OSError):
                    break
                if server.statistics().timeouts:
                    break
                await anyio.sleep(0.01)
            await wait_until(lambda: server.statistics().connections_open == 0)
        assert server.statistics().timeouts == 1
        assert server.statistics().requests < 64


async def test_closing_the_server_closes_every_connection_whatever_its_phase() -> None:
    async with HttpServer(_ok, port=0) as server:
        idle = await anyio.connect_tcp("127.0.0.1", server.port)
        in_head = await anyio.connect_tcp("127.0.0.1", server.port)
        in_body = await anyio.connect_tcp("127.0.0.1", server.port)
        await in_head.send(b"GET / HTTP/1.1\r\nHo")
        await in_body.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 9\r\n\r\nab")
        await wait_until(lambda: server.statistics().connections == 3)
        await anyio.sleep(0.05)
    for stream in (idle, in_head, in_body):
        async with stream:
            assert await _read_to_end(stream) == b""


async def _read_to_end(stream: SocketStream) -> bytes:
    data = b""
    with anyio.fail_after(10):
        while True:
            try:
                data += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return data


async def test_a_flood_of_pipelined_requests_is_read_in_bounded_steps_and_all_answered() -> None:
    # Far more pipelined bytes than the connection buffers unread (head limit + 64 KiB):
    # reading pauses while the handler is busy and resumes as requests are taken.
    release = anyio.Event()
    paths: list[str] = []

    async def slow_then_fast(request: Request) -> Response:
        await release.wait()
        paths.append(request.path)
        return Response(200, b"k")

    limits = HttpLimits(head_bytes=1024)
    requests = [f"GET /{i} HTTP/1.1\r\nHost: t\r\nX-Pad: {'p' * 200}\r\n\r\n" for i in range(2000)]
    raw = "".join(requests).encode()
    assert len(raw) > 4 * (1024 + 65536)
    async with (
        HttpServer(slow_then_fast, port=0, limits=limits) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as stream,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(stream.send, raw)
        await anyio.sleep(0.1)
        release.set()
        one = _h11_answer(requests[0].encode(), Response(200, b"k"))
        answers = await _read_exactly(stream, len(one) * len(requests))
        assert answers == one * len(requests)
    assert paths == [f"/{i}" for i in range(2000)]


async def test_each_request_starts_a_new_idle_deadline() -> None:
    # One timer serves the deadlines: it is moved only when it fires before the current
    # one. Requests spaced well inside the idle timeout keep the connection open past it.
    limits = HttpLimits(idle_timeout=1.0)
    raw = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"
    expected = _h11_answer(raw, Response(200, b"ok"))
    async with (
        HttpServer(_ok, port=0, limits=limits) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as stream,
    ):
        for _ in range(8):  # 1.6 s in all
            await stream.send(raw)
            assert await _read_exactly(stream, len(expected)) == expected
            await anyio.sleep(0.2)
        assert server.statistics().timeouts == 0
        assert await _read_to_end(stream) == b""  # then idle: closed
        assert server.statistics().timeouts == 1
        assert server.statistics().connections == 1
