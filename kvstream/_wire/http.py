"""The one HTTP/1.1 server under kvstream's HTTP endpoints (metrics, index queries).

Requests are read by h11 (a strict sans-IO HTTP/1.1 implementation), except the
common one whose head arrives whole (HTTP/1.1, one `Host`, at most a
`Content-Length`): `kvstream._wire.http_head` reads that one with h11's own
grammar and rules, and leaves every other request to h11, so both paths accept the
same requests and read them alike; answers are h11's bytes either way. Each
connection is an asyncio `Protocol` (`kvstream._wire.buffered_connection`) served
by one task in the server's task group: reading stays on, writes go straight to
the transport, and nothing outlives the server (every transport is closed and
waited for, every task cancelled). This module adds the limits every listener of
kvstream documents and enforces:

* **connections**: at most `max_connections` at once. When a new one arrives at
  the limit, the connection idle the longest (keep-alive, or connected and silent)
  is closed to make room, or else the oldest one whose request head is still
  arriving (a slow-loris client); only when every connection is past its head is
  the new one refused with `503`. So idle, silent or slow clients cannot lock
  the server out.
* **the request head**: at most `head_bytes` (`431` beyond), complete within
  `head_timeout` seconds of its first byte (`408`): a slow-loris client is cut
  off, whatever its pace.
* **the body**: at most `body_bytes` (`413`, checked against
  `Content-Length` before any of the body is read), within `body_timeout`.
* **keep-alive**: a connection waits `idle_timeout` seconds for its next request.
* **authorization**: with a token, every request needs `Authorization: Bearer`
  (compared in constant time); `401` otherwise.
* **`Expect: 100-continue`**: the server answers `100 Continue` at once (or its
  refusal, `401` or `413`, before the body is sent), so such clients do not wait.
* **bodies are taken as sent**: a `Content-Encoding` other than `identity` is
  answered `415` (nothing is decompressed).
* **accept failures** (too many open files): counted, logged once per burst, and
  retried with backoff; the listener keeps serving.

Malformed requests (conflicting or non-numeric `Content-Length`, bad header
lines, ...) are refused by h11 and answered `400`. A handler that raises, or
returns a response h11 would not send (a header with a line break, a body on a
`204`), gets `500` (logged once per burst); the server goes on. A client that
reads no answers is closed once the answers waiting for it pass the transport's
high-water mark for `idle_timeout` seconds. Every refusal is counted in
`HttpServer.statistics()`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import anyio
import h11
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskGroup
from anyio.streams.stapled import MultiListener

from kvstream._backoff import Backoff
from kvstream._burst_log import BurstLog
from kvstream._wire.buffered_connection import BufferedConnection
from kvstream._wire.http_head import Head, parse_head, response_head, valid_field, valid_value
from kvstream._wire.socket_security import bearer_authorized, check_listen_address
from kvstream.errors import ClosedError, ConfigError, TransportError
from kvstream.lifetime import LifetimeState, TaskOwner

__all__ = [
    "ErrorFormat",
    "HttpLimits",
    "HttpServer",
    "HttpServerStatistics",
    "Request",
    "Response",
    "text_error",
]

log = logging.getLogger("kvstream.http")

#: Unread bytes a connection buffers beyond a head before it stops reading.
_RECEIVE: Final = 65536
#: Seconds a closing connection has to take its last answer.
_CLOSE_GRACE: Final = 1.0
_REASONS: Final = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    415: b"Unsupported Media Type",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    503: b"Service Unavailable",
    505: b"HTTP Version Not Supported",
}


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one HTTP listener allows; every refusal is answered and counted."""

    max_connections: int = 64
    head_bytes: int = 16 * 1024
    head_timeout: float = 5.0
    body_bytes: int = 4 * 1024 * 1024
    body_timeout: float = 30.0
    idle_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "head_bytes", "body_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(f"{name}: expected a positive int, got {value!r}")
        for name in ("head_timeout", "body_timeout", "idle_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"{name}: expected seconds > 0, got {value!r}")


class Request(NamedTuple):
    """One request as the handler sees it (header names lower-cased)."""

    method: str
    target: str
    headers: dict[str, str]
    body: bytes

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]

    @property
    def query(self) -> str:
        return self.target.partition("?")[2]


class Response(NamedTuple):
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[Request], Awaitable[Response]]
#: Formats a refusal the server makes itself (status, message) as a response.
ErrorFormat = Callable[[int, str], Response]


def text_error(status: int, message: str) -> Response:
    """The default refusal: the message as a line of text."""
    return Response(status, f"{message}\n".encode())


class HttpServerStatistics(NamedTuple):
    requests: int
    #: Responses with a status of 400 or more (refusals included).
    errors: int
    connections: int
    connections_open: int
    #: New connections answered 503 because every slot was mid-request.
    connections_refused: int
    #: Idle connections (or ones still sending their head) closed to make room.
    connections_evicted: int
    #: Heads or bodies not complete in time (408), idle keep-alives closed, clients
    #: that read no answers closed.
    timeouts: int
    #: Requests refused for their size (413, 431).
    too_large: int
    #: Requests without the right bearer token (401).
    unauthorized: int
    #: accept() failures (e.g. too many open files), retried with backoff.
    accept_errors: int
    #: Handlers that raised (answered 500).
    handler_errors: int


class _Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class _Slot:
    """One connection's place: idle slots (and then slots still reading a request
    head) can be taken over by newcomers."""

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    idle: bool = True
    in_head: bool = False


class HttpServer(TaskOwner):
    """Serves `handler` on `host:port` (port 0: any free port; see `port`).

    An async context manager; `aclose()` is idempotent. Connections are kept
    alive between requests unless `keep_alive` is false (one request per
    connection, `Connection: close`). `name` appears in log lines and errors;
    `token_hint` says how to give a token when the address is not loopback.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: HttpLimits | None = None,
        token: str | None = None,
        name: str = "http",
        token_hint: str = "--token-env NAME or --token-file PATH",
        keep_alive: bool = True,
        error_format: ErrorFormat = text_error,
    ) -> None:
        TaskOwner.__init__(self)
        check_listen_address(host, token, name, token_hint)
        if type(port) is not int or not 0 <= port <= 65535:
            raise ConfigError(f"{name}: port: expected 0..65535, got {port!r}")
        self.handler = handler
        self.host = host
        self.limits = limits or HttpLimits()
        self.name = name
        self.keep_alive = keep_alive
        self._error_format = error_format
        self._token = token
        self._requested_port = port
        self._listener: MultiListener[SocketStream] | None = None
        self._serving: anyio.CancelScope | None = None
        self._slots: dict[_Slot, None] = {}  # insertion order: the oldest first
        #: The event loop's clock (set when serving starts): deadlines are on it.
        self._now: Callable[[], float] = time.monotonic
        self._handler_log = BurstLog(log)
        self._accept_log = BurstLog(log)
        self._requests = 0
        self._errors = 0
        self._connections = 0
        self._refused = 0
        self._evicted = 0
        self._timeouts = 0
        self._too_large = 0
        self._unauthorized = 0
        self._accept_errors = 0
        self._handler_errors = 0

    # -- lifetime ------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port it listens on (known once entered)."""
        if self._listener is None:
            if self._requested_port:
                return self._requested_port
            raise TransportError(f"{self.name}: the server is not listening yet")
        return int(self._listener.extra(SocketAttribute.local_port))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def reentry_error(self) -> ClosedError:
        return ClosedError(f"{self.name}: a server can be entered only once")

    async def open_lifetime(self, stack: AsyncExitStack) -> None:
        """Listen, then serve in a task; on exit stop serving and close the listener."""
        try:
            listener = await anyio.create_tcp_listener(
                local_host=self.host, local_port=self._requested_port, reuse_port=False
            )
        except OSError as exc:
            raise TransportError(
                f"{self.name}: cannot listen on {self.host}:{self._requested_port}: {exc}"
            ) from exc
        self._listener = listener
        stack.push_async_callback(self._close_listener, listener)
        self._serving = anyio.CancelScope()
        tg = await stack.enter_async_context(anyio.create_task_group())
        # The serving tasks run under a scope of their own, so that aclose()
        # stops them without cancelling the owner's ``async with`` body.
        tg.start_soon(self._serve, name=f"kvstream {self.name} accept")
        stack.push_async_callback(self.aclose)

    @staticmethod
    async def _close_listener(listener: MultiListener[SocketStream]) -> None:
        with anyio.CancelScope(shield=True):
            await listener.aclose()

    async def aclose(self) -> None:
        """Stop accepting and close every connection. Idempotent."""
        self._set_state(LifetimeState.CLOSED)
        if self._serving is not None:
            self._serving.cancel()

    def statistics(self) -> HttpServerStatistics:
        return HttpServerStatistics(
            requests=self._requests,
            errors=self._errors,
            connections=self._connections,
            connections_open=len(self._slots),
            connections_refused=self._refused,
            connections_evicted=self._evicted,
            timeouts=self._timeouts,
            too_large=self._too_large,
            unauthorized=self._unauthorized,
            accept_errors=self._accept_errors,
            handler_errors=self._handler_errors,
        )

    # -- connections ---------------------------------------------------------------------

    async def _serve(self) -> None:
        assert self._listener is not None
        assert self._serving is not None
        self._now = asyncio.get_running_loop().time
        with self._serving:
            async with anyio.create_task_group() as tg:
                for listener in self._listener.listeners:
                    assert isinstance(listener, SocketListener)
                    tg.start_soon(self._accept, listener.extra(SocketAttribute.raw_socket), tg)

    async def _accept(self, listening: socket.socket, tg: TaskGroup) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(0.05, 1.0, where=f"{self.name}: accept")
        while True:
            try:
                sock, _ = await loop.sock_accept(listening)
            except OSError as exc:  # EMFILE and friends: back off, keep serving
                if listening.fileno() < 0:
                    return
                self._accept_errors += 1
                self._accept_log.log("%s: accept failed: %s; retrying", self.name, exc)
                await backoff.wait()
                continue
            backoff.reset()
            tg.start_soon(self._connection, sock)

    def _admit(self) -> _Slot | None:
        if len(self._slots) >= self.limits.max_connections:
            victim = next((slot for slot in self._slots if slot.idle), None) or next(
                (slot for slot in self._slots if slot.in_head), None
            )
            if victim is None:
                return None
            self._evicted += 1
            victim.scope.cancel()
            del self._slots[victim]
        slot = _Slot()
        self._slots[slot] = None
        return slot

    async def _connection(self, sock: socket.socket) -> None:
        self._connections += 1
        limit = self.limits.head_bytes + _RECEIVE
        try:
            _, conn = await asyncio.get_running_loop().connect_accepted_socket(
                lambda: BufferedConnection(limit), sock
            )
        except OSError:
            sock.close()
            return  # gone before it was set up
        except BaseException:
            sock.close()
            raise
        try:
            slot = self._admit()
            if slot is None:
                self._refused += 1
                self._errors += 1
                # Refused before any request was read: the answer goes out raw.
                refusal = self._error_format(503, "too many connections; try again later")
                conn.write(_raw_response(503, refusal))
            else:
                try:
                    with slot.scope:
                        await self._requests_on(conn, slot)
                finally:
                    self._slots.pop(slot, None)
        except BaseException:  # the server is closing: drop what was not sent
            with anyio.CancelScope(shield=True):
                await conn.aclose(0.0)
            raise
        with anyio.CancelScope(shield=True):  # the last answer gets a moment to go out
            await conn.aclose(_CLOSE_GRACE)

    async def _requests_on(self, conn: BufferedConnection, slot: _Slot) -> None:
        limits = self.limits
        while True:
            # Idle: waiting for the first byte of the next request (evictable). The
            # slot goes to the end of the order: the first idle one in it is the one
            # idle the longest, not the oldest connection (which may just have been
            # answered, while a newcomer's request is still on its way).
            slot.idle = True
            slots = self._slots
            if slot in slots:
                del slots[slot]
                slots[slot] = None
            if not conn.buffer:
                deadline = self._now() + limits.idle_timeout
                while not conn.buffer:
                    if conn.eof:
                        return  # closed between requests
                    if not await conn.wait_data(deadline):
                        self._timeouts += 1
                        return
            slot.idle = False
            head = parse_head(conn.buffer, limits.head_bytes)
            h11_conn = None
            request: Request | None
            try:
                if head is not None:
                    request = await self._read_body(conn, head)
                else:  # anything else: h11 reads it (and answers what it refuses)
                    slot.in_head = True
                    h11_conn = h11.Connection(
                        h11.SERVER, max_incomplete_event_size=limits.head_bytes
                    )
                    request = await self._read_request(conn, h11_conn, slot)
            except _Refusal as refusal:
                self._refuse(conn, h11_conn, refusal)
                return
            if request is None:
                return
            response = await self._respond(request)
            if h11_conn is None:
                assert head is not None
                keep = self._send(conn, request, response, close=head.close)
            else:
                keep = self._send_h11(conn, h11_conn, request, response)
            if not keep:
                return
            if conn.writing_paused and not await conn.wait_drained(
                self._now() + limits.idle_timeout
            ):
                self._timeouts += 1  # the client reads no answers
                return

    async def _read_body(self, conn: BufferedConnection, head: Head) -> Request:
        """The body of a request whose head `parse_head()` read (at the buffer's start)."""
        limits = self.limits  # the head is within limits.head_bytes: parse_head() saw to it
        if head.length > limits.body_bytes:
            self._too_large += 1
            raise _Refusal(
                413, f"request body of {head.length} bytes exceeds the limit of {limits.body_bytes}"
            )
        end = head.size + head.length
        if len(conn.buffer) < end:
            deadline = self._now() + limits.body_timeout
            while len(conn.buffer) < end:
                if conn.eof:
                    raise _Refusal(400, "connection closed mid-body")
                if not await conn.wait_data(deadline):
                    self._timeouts += 1
                    raise _Refusal(408, f"request body not complete within {limits.body_timeout} s")
        body = conn.take(head.size, end)  # what follows (a pipelined request) stays
        self._authorize(head.headers)
        return Request(head.method, head.target, head.headers, body)

    async def _read_request(
        self, conn: BufferedConnection, h11_conn: h11.Connection, slot: _Slot
    ) -> Request | None:
        """A request read by h11, from the bytes buffered on; what follows it goes back to
        the buffer once it is answered (`_send_h11()`)."""
        limits = self.limits
        fed = [0]
        _feed(conn, h11_conn, fed)
        # Deadlines, not scopes around each phase: a request that has arrived whole
        # is read without a wait.
        head_deadline = self._now() + limits.head_timeout
        event = await self._next_event(conn, h11_conn, head_deadline, fed)
        slot.in_head = False  # past its head: no longer taken over
        if event is None:
            self._timeouts += 1
            raise _Refusal(408, f"request head not complete within {limits.head_timeout} s")
        # h11 bounds only a head that arrives in pieces; one that arrived whole is
        # measured here (what was fed, less what is left over for the body).
        if fed[0] - len(h11_conn.trailing_data[0]) > limits.head_bytes:
            self._too_large += 1
            raise _Refusal(431, f"request head larger than {limits.head_bytes} bytes")
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise _Refusal(400, "expected a request")
        if not event.http_version.startswith(b"1."):
            version = event.http_version.decode("ascii", "replace")
            raise _Refusal(505, f"HTTP/{version} is not supported; this endpoint speaks HTTP/1.1")
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
        length = headers.get("content-length")
        if length is not None and int(length) > limits.body_bytes:
            self._too_large += 1
            raise _Refusal(
                413, f"request body of {length} bytes exceeds the limit of {limits.body_bytes}"
            )
        if h11_conn.they_are_waiting_for_100_continue:
            # The client sends its body only once told to (or after a wait of its
            # own, a second for curl): a refusal is due now, before the body, and
            # otherwise the go-ahead.
            self._authorize(headers)
            conn.write(
                h11_conn.send(
                    h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
                )
                or b""
            )
        body_deadline = self._now() + limits.body_timeout
        parts: list[bytes] = []
        size = 0
        while True:
            part = await self._next_event(conn, h11_conn, body_deadline, fed)
            if type(part) is h11.Data:
                parts.append(part.data)
                size += len(part.data)
                if size > limits.body_bytes:
                    self._too_large += 1
                    raise _Refusal(
                        413, f"request body exceeds the limit of {limits.body_bytes} bytes"
                    )
            elif type(part) is h11.EndOfMessage:
                break
            elif part is None:
                self._timeouts += 1
                raise _Refusal(408, f"request body not complete within {limits.body_timeout} s")
            else:
                raise _Refusal(400, "connection closed mid-body")
        self._authorize(headers)
        return Request(
            method=event.method.decode("ascii"),
            target=event.target.decode("latin-1"),
            headers=headers,
            body=b"".join(parts),  # h11's pieces are bytearrays: one copy, to bytes
        )

    def _authorize(self, headers: dict[str, str]) -> None:
        """`401` unless the request carries the bearer token (when there is one)."""
        if not bearer_authorized(headers.get("authorization"), self._token):
            self._unauthorized += 1
            raise _Refusal(401, "missing or wrong bearer token")

    async def _next_event(
        self,
        conn: BufferedConnection,
        h11_conn: h11.Connection,
        deadline: float,
        fed: list[int],
    ) -> object:
        """h11's next event, reading as needed until `deadline`; None when it passed."""
        while True:
            try:
                event = h11_conn.next_event()
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint
                if status == 431:
                    self._too_large += 1
                raise _Refusal(status, f"malformed request: {exc}") from None
            if event is not h11.NEED_DATA:
                return event
            if not conn.buffer and not conn.eof and not await conn.wait_data(deadline):
                return None
            _feed(conn, h11_conn, fed)

    async def _respond(self, request: Request) -> Response:
        self._requests += 1
        coding = request.headers.get("content-encoding")
        if coding is not None and coding.strip().lower() != "identity":
            self._errors += 1
            return self._error_format(
                415, f"Content-Encoding: {coding!r} is not supported; send the body unencoded"
            )
        try:
            response = await self.handler(request)
            _check_response(response)
        except Exception as exc:  # a bug in a handler must not take the server down
            self._handler_errors += 1
            self._handler_log.log(
                "%s: %s %s failed: %r", self.name, request.method, request.path, exc
            )
            log.debug("%s: handler traceback", self.name, exc_info=True)
            response = self._error_format(500, "internal error; see the server's log")
        if response.status >= 400:
            self._errors += 1
        return response

    def _send(
        self, conn: BufferedConnection, request: Request, response: Response, *, close: bool
    ) -> bool:
        """Write the response to a request `parse_head()` read, as h11 would write it;
        whether the connection goes on."""
        close = close or not self.keep_alive
        body = response.body
        head = response_head(
            response.status,
            _REASONS.get(response.status, b""),
            response.content_type,
            len(body),
            response.headers,
            close=close,
        )
        conn.write(head if request.method == "HEAD" else head + body)
        return not close

    def _send_h11(
        self,
        conn: BufferedConnection,
        h11_conn: h11.Connection,
        request: Request,
        response: Response,
    ) -> bool:
        """Write the response to a request h11 read, through h11; whether the connection
        goes on (the bytes after the request back in the buffer)."""
        headers = [
            ("Content-Type", response.content_type),
            ("Content-Length", str(len(response.body))),
            *response.headers,
        ]
        if not self.keep_alive:
            headers.append(("Connection", "close"))
        reason = _REASONS.get(response.status, b"")
        data = h11_conn.send(
            h11.Response(status_code=response.status, headers=headers, reason=reason)
        )
        if request.method != "HEAD":
            data = (data or b"") + (h11_conn.send(h11.Data(data=response.body)) or b"")
        data = (data or b"") + (h11_conn.send(h11.EndOfMessage()) or b"")
        conn.write(data)
        if h11_conn.our_state is not h11.DONE or h11_conn.their_state is not h11.DONE:
            return False
        conn.put_back(h11_conn.trailing_data[0])
        return True

    def _refuse(
        self, conn: BufferedConnection, h11_conn: h11.Connection | None, refusal: _Refusal
    ) -> None:
        """Answer a request that never reached the handler (the connection closes next)."""
        self._errors += 1
        self._requests += 1
        response = self._error_format(refusal.status, str(refusal))
        if h11_conn is not None and h11_conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            try:
                head = h11_conn.send(
                    h11.Response(
                        status_code=refusal.status,
                        reason=_REASONS.get(refusal.status, b""),
                        headers=[
                            ("Content-Type", response.content_type),
                            ("Content-Length", str(len(response.body))),
                            ("Connection", "close"),
                        ],
                    )
                )
                conn.write(
                    (head or b"") + response.body + (h11_conn.send(h11.EndOfMessage()) or b"")
                )
                return
            except h11.LocalProtocolError:
                pass  # h11 saw no request line: answer raw
        conn.write(_raw_response(refusal.status, response))


def _feed(conn: BufferedConnection, h11_conn: h11.Connection, fed: list[int]) -> None:
    """Hand h11 what the connection buffered (or its end)."""
    if conn.buffer:
        data = conn.take_all()
        fed[0] += len(data)
        h11_conn.receive_data(bytes(data))
    elif conn.eof:
        h11_conn.receive_data(b"")


def _check_response(response: Response) -> None:
    """Refuse (as a handler's bug) a response h11 would refuse to send."""
    if type(response.status) is not int or not 200 <= response.status <= 999:
        raise ValueError(f"status: expected an int in 200..999, got {response.status!r}")
    if response.status in (204, 304) and response.body:
        raise ValueError(
            f"status {response.status}: expected no body, got {len(response.body)} bytes"
        )
    if not valid_value(response.content_type):
        raise ValueError(f"content type {response.content_type!r} is not a valid HTTP header")
    for name, value in response.headers:
        if not valid_field(name, value):
            raise ValueError(f"header {name!r}: {value!r} is not a valid HTTP header")


def _raw_response(status: int, response: Response) -> bytes:
    lines = [
        b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Error")),
        f"Content-Type: {response.content_type}".encode("latin-1"),
        b"Content-Length: %d" % len(response.body),
        b"Connection: close",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + response.body
