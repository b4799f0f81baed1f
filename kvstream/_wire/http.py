"""The one HTTP/1.1 server under kvstream's HTTP endpoints (metrics, index queries).

The protocol is h11's (a sans-IO HTTP/1.1 implementation); this module adds the
I/O on anyio, and the limits every listener of kvstream documents and enforces:

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
* **accept failures** (too many open files): counted, logged once per burst, and
  retried with backoff; the listener keeps serving.

Malformed requests (conflicting or non-numeric `Content-Length`, bad header
lines, ...) are refused by h11 and answered `400`. A handler that raises gets
`500` (logged once per burst); the server goes on. Every refusal is counted in
`HttpServer.statistics()`.
"""

from __future__ import annotations

import logging
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

_RECEIVE: Final = 65536
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
    503: b"Service Unavailable",
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
    #: Heads or bodies not complete in time (408), idle keep-alives closed.
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
        with self._serving:
            async with anyio.create_task_group() as tg:
                for listener in self._listener.listeners:
                    assert isinstance(listener, SocketListener)
                    tg.start_soon(self._accept, listener, tg)

    async def _accept(self, listener: SocketListener, tg: TaskGroup) -> None:
        backoff = Backoff(0.05, 1.0, where=f"{self.name}: accept")
        while True:
            try:
                stream = await listener.accept()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:  # EMFILE and friends: back off, keep serving
                self._accept_errors += 1
                self._accept_log.log("%s: accept failed: %s; retrying", self.name, exc)
                await backoff.wait()
                continue
            backoff.reset()
            tg.start_soon(self._connection, stream)

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

    async def _connection(self, stream: SocketStream) -> None:
        self._connections += 1
        async with stream:
            slot = self._admit()
            if slot is None:
                self._refused += 1
                self._errors += 1
                # Refused before any request was read: the answer goes out raw.
                refusal = self._error_format(503, "too many connections; try again later")
                await _send_quietly(stream, _raw_response(503, refusal))
                return
            try:
                with slot.scope:
                    await self._requests_on(stream, slot)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass  # the client went away
            finally:
                self._slots.pop(slot, None)

    async def _requests_on(self, stream: SocketStream, slot: _Slot) -> None:
        limits = self.limits
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.head_bytes)
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
            first: bytes = b""
            if conn.trailing_data[0] == b"":
                with anyio.move_on_after(limits.idle_timeout) as idle:
                    try:
                        first = await stream.receive(_RECEIVE)
                    except anyio.EndOfStream:
                        return
                if idle.cancelled_caught:
                    self._timeouts += 1
                    return
            slot.idle = False
            slot.in_head = True
            try:
                request = await self._read_request(stream, conn, first, slot)
            except _Refusal as refusal:
                await self._refuse(stream, conn, refusal)
                return
            if request is None:
                return
            response = await self._respond(request)
            keep = await self._send(stream, conn, request, response)
            if not keep:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _read_request(
        self, stream: SocketStream, conn: h11.Connection, first: bytes, slot: _Slot
    ) -> Request | None:
        limits = self.limits
        fed = [len(first) + len(conn.trailing_data[0])]
        if first:
            conn.receive_data(first)
        # Deadlines, not scopes around each phase: a request that has arrived whole
        # (the usual one) is read without entering a cancel scope at all.
        head_deadline = anyio.current_time() + limits.head_timeout
        event = await self._next_event(stream, conn, head_deadline, fed)
        slot.in_head = False  # past its head: no longer taken over
        if event is None:
            self._timeouts += 1
            raise _Refusal(408, f"request head not complete within {limits.head_timeout} s")
        # h11 bounds only a head that arrives in pieces; one that arrived whole is
        # measured here (what was fed, less what is left over for the body).
        if fed[0] - len(conn.trailing_data[0]) > limits.head_bytes:
            self._too_large += 1
            raise _Refusal(431, f"request head larger than {limits.head_bytes} bytes")
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise _Refusal(400, "expected a request")
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
        length = headers.get("content-length")
        if length is not None and int(length) > limits.body_bytes:
            self._too_large += 1
            raise _Refusal(
                413, f"request body of {length} bytes exceeds the limit of {limits.body_bytes}"
            )
        body_deadline = anyio.current_time() + limits.body_timeout
        parts: list[bytes] = []
        size = 0
        while True:
            part = await self._next_event(stream, conn, body_deadline)
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
        if not bearer_authorized(headers.get("authorization"), self._token):
            self._unauthorized += 1
            raise _Refusal(401, "missing or wrong bearer token")
        return Request(
            method=event.method.decode("ascii"),
            target=event.target.decode("latin-1"),
            headers=headers,
            body=b"".join(parts),  # h11's pieces are bytearrays: one copy, to bytes
        )

    async def _next_event(
        self,
        stream: SocketStream,
        conn: h11.Connection,
        deadline: float,
        fed: list[int] | None = None,
    ) -> object:
        """h11's next event, reading as needed until `deadline`; None when it passed."""
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint
                if status == 431:
                    self._too_large += 1
                raise _Refusal(status, f"malformed request: {exc}") from None
            if event is not h11.NEED_DATA:
                return event
            with anyio.CancelScope(deadline=deadline) as waiting:
                try:
                    data = await stream.receive(_RECEIVE)
                except anyio.EndOfStream:
                    data = b""
            if waiting.cancelled_caught:
                return None
            if fed is not None:
                fed[0] += len(data)
            conn.receive_data(data)

    async def _respond(self, request: Request) -> Response:
        self._requests += 1
        try:
            response = await self.handler(request)
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

    async def _send(
        self,
        stream: SocketStream,
        conn: h11.Connection,
        request: Request,
        response: Response,
    ) -> bool:
        headers = [
            ("Content-Type", response.content_type),
            ("Content-Length", str(len(response.body))),
            *response.headers,
        ]
        if not self.keep_alive:
            headers.append(("Connection", "close"))
        reason = _REASONS.get(response.status, b"")
        data = conn.send(h11.Response(status_code=response.status, headers=headers, reason=reason))
        if request.method != "HEAD":
            data = (data or b"") + (conn.send(h11.Data(data=response.body)) or b"")
        data = (data or b"") + (conn.send(h11.EndOfMessage()) or b"")
        await stream.send(data)
        return conn.our_state is h11.DONE and conn.their_state is h11.DONE

    async def _refuse(self, stream: SocketStream, conn: h11.Connection, refusal: _Refusal) -> None:
        """Answer a request that never reached the handler, then close."""
        self._errors += 1
        self._requests += 1
        response = self._error_format(refusal.status, str(refusal))
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            try:
                head = conn.send(
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
                await _send_quietly(
                    stream,
                    (head or b"") + response.body + (conn.send(h11.EndOfMessage()) or b""),
                )
                return
            except h11.LocalProtocolError:
                pass  # h11 saw no request line: answer raw
        await _send_quietly(stream, _raw_response(refusal.status, response))


def _raw_response(status: int, response: Response) -> bytes:
    lines = [
        b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Error")),
        f"Content-Type: {response.content_type}".encode("latin-1"),
        b"Content-Length: %d" % len(response.body),
        b"Connection: close",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + response.body


async def _send_quietly(stream: SocketStream, data: bytes) -> None:
    with anyio.move_on_after(1.0):
        try:
            await stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
