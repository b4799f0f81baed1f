"""A tiny HTTP/1.1 query endpoint for a :class:`~kvstream.index.PrefixIndex`.

Two routes, JSON out::

    POST /match   {"token_ids": [1, 2, ...], "lora_name": null}
                  -> {"block_size": 16, "blocks": 12,
                      "matches": [{"origin": "engine-0", "data_parallel_rank": null,
                                   "blocks": 9, "medium": "GPU", "stale": false,
                                   "tiers": {"GPU": 9}, "score": 9.0}, ...]}
    GET  /stats   -> the index's statistics()

``/match`` also takes ``"extra_keys"`` (one entry per block), ``"include_stale"``
(default true) and ``"tier_weights"``; or ``"block_hashes"`` (an engine's hashes,
with an optional ``"origin"`` and ``"data_parallel_rank"``) instead of
``"token_ids"``. With ``Content-Type: application/octet-stream`` the body is the
tokens as uint32 little-endian and options go in the query string
(``/match?lora_name=L&include_stale=false``): the fast path. Requests are
bounded (head 16 KiB, body ``max_request_bytes``); a malformed one gets a 4xx
with ``{"error": "..."}`` naming what was wrong. Connections are kept alive
(HTTP/1.1) until the client closes, says ``Connection: close``, or is idle for
``idle_timeout`` seconds. Written directly on anyio: no web framework.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any, Final, Self
from urllib.parse import unquote

import anyio
import orjson
from anyio.abc import Listener, SocketAttribute, SocketStream, TaskGroup

from kvstream.errors import ClosedError, ConfigError, TransportError
from kvstream.index.prefix import PrefixIndex, PrefixMatch
from kvstream.wire.socket_security import bearer_authorized, check_listen_address

__all__ = ["QueryServer"]

log = logging.getLogger("kvstream.index")

MAX_HEAD_BYTES: Final = 16 * 1024
_REASONS: Final = {
    401: "Unauthorized",
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}
_ROUTES: Final = {"/match": "POST", "/stats": "GET"}


class _HttpError(Exception):
    """A request the server refuses: status, message, and whether to close."""

    def __init__(
        self, status: int, message: str, *, close: bool = False, allow: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.close = close
        self.allow = allow


class _Request:
    __slots__ = ("body", "close", "content_type", "method", "target")

    def __init__(
        self, method: str, target: str, body: bytes, close: bool, content_type: str = ""
    ) -> None:
        self.content_type = content_type
        self.method = method
        self.target = target
        self.body = body
        self.close = close


class QueryServer:
    """Serves ``index`` on ``host:port`` (port 0: any free port; see :attr:`port`).

    An async context manager; :meth:`aclose` is idempotent. The index is read
    from the same event loop that feeds it, so a query sees a consistent state.
    """

    def __init__(
        self,
        index: PrefixIndex,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_request_bytes: int = 4 * 1024 * 1024,
        max_connections: int = 64,
        idle_timeout: float = 30.0,
        token: str | None = None,
    ) -> None:
        check_listen_address(host, token, "kvstream index")
        if type(max_request_bytes) is not int or max_request_bytes <= 0:
            raise ConfigError(
                f"max_request_bytes: expected a positive int, got {max_request_bytes!r}"
            )
        if type(max_connections) is not int or max_connections <= 0:
            raise ConfigError(f"max_connections: expected a positive int, got {max_connections!r}")
        self.index = index
        self.host = host
        self.max_request_bytes = max_request_bytes
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self._token = token
        self.requests = 0
        self.errors = 0
        self._port = port
        self._connections = 0
        self._listener: Listener[SocketStream] | None = None
        self._tg: TaskGroup | None = None
        self._closed = False

    @property
    def port(self) -> int:
        """The port it listens on (known once entered)."""
        if self._listener is None:
            return self._port
        return int(self._listener.extra(SocketAttribute.local_port))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def __aenter__(self) -> Self:
        if self._closed or self._listener is not None:
            raise ClosedError("QueryServer: a server can be entered only once")
        try:
            listener = await anyio.create_tcp_listener(
                local_host=self.host, local_port=self._port, reuse_port=False
            )
        except OSError as exc:
            raise TransportError(f"cannot listen on {self.host}:{self._port}: {exc}") from exc
        self._listener = listener
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._accept, name="kvstream index http accept")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            with anyio.CancelScope(shield=True):
                await self.aclose()
        finally:
            tg, self._tg = self._tg, None
            if tg is not None:
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
            # Closed only once nothing accepts on it any more.
            if self._listener is not None:
                with anyio.CancelScope(shield=True):
                    await self._listener.aclose()

    async def aclose(self) -> None:
        """Stop accepting and close every connection (the socket is released when
        the ``async with`` block exits). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    # -- connections -----------------------------------------------------------------------

    async def _accept(self) -> None:
        assert self._listener is not None
        assert self._tg is not None
        while True:
            try:
                await self._listener.serve(self._connection, task_group=self._tg)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:  # e.g. too many open files: back off, go on
                log.warning("index http: accept failed: %s", exc)
                await anyio.sleep(0.1)

    async def _connection(self, stream: SocketStream) -> None:
        self._connections += 1
        try:
            async with stream:
                if self._connections > self.max_connections:
                    await self._send(stream, 503, {"error": "too many connections"}, close=True)
                    return
                buffer = bytearray()
                while True:
                    close = True
                    try:
                        with anyio.fail_after(self.idle_timeout):
                            request = await self._read_request(stream, buffer)
                        if request is None:
                            return
                        close = request.close
                        status, body = self._route(request)
                        allow = None
                    except TimeoutError:
                        return
                    except _HttpError as exc:
                        status, body, allow = exc.status, {"error": str(exc)}, exc.allow
                        close = close or exc.close
                    except Exception as exc:  # a bug must not take the server down
                        log.exception("index http: request failed")
                        status, body, allow = 500, {"error": f"internal error: {exc!r}"}, None
                    self.requests += 1
                    if status >= 400:
                        self.errors += 1
                    await self._send(stream, status, body, close=close, allow=allow)
                    if close:
                        return
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return
        finally:
            self._connections -= 1

    async def _read_request(self, stream: SocketStream, buffer: bytearray) -> _Request | None:
        """One request from the connection; None when the client closed between requests."""
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buffer) > MAX_HEAD_BYTES:
                raise _HttpError(
                    431, f"request head larger than {MAX_HEAD_BYTES} bytes", close=True
                )
            try:
                chunk = await stream.receive(65536)
            except anyio.EndOfStream:
                if buffer.strip():
                    raise _HttpError(400, "connection closed mid-request", close=True) from None
                return None
            buffer += chunk
        if end > MAX_HEAD_BYTES:
            raise _HttpError(431, f"request head larger than {MAX_HEAD_BYTES} bytes", close=True)
        head = bytes(buffer[:end]).decode("latin-1")
        del buffer[: end + 4]
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _HttpError(400, f"malformed request line {lines[0][:100]!r}", close=True)
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise _HttpError(400, f"malformed header line {line[:100]!r}", close=True)
            headers[name.lower()] = value.strip()
        connection = headers.get("connection", "").lower()
        close = connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive")
        if "transfer-encoding" in headers:
            raise _HttpError(
                501, "Transfer-Encoding is not supported; send Content-Length", close=True
            )
        length_text = headers.get("content-length", "0")
        if not length_text.isdigit():
            raise _HttpError(
                400, f"Content-Length: expected a number, got {length_text!r}", close=True
            )
        length = int(length_text)
        if length > self.max_request_bytes:
            raise _HttpError(
                413,
                f"request body of {length} bytes exceeds the limit of {self.max_request_bytes}",
                close=True,
            )
        while len(buffer) < length:
            try:
                buffer += await stream.receive(65536)
            except anyio.EndOfStream:
                raise _HttpError(400, "connection closed mid-body", close=True) from None
        body = bytes(buffer[:length])
        del buffer[:length]
        if not bearer_authorized(headers.get("authorization"), self._token):
            raise _HttpError(401, "missing or wrong bearer token", close=True)
        content_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        return _Request(method, target, body, close, content_type)

    async def _send(
        self,
        stream: SocketStream,
        status: int,
        body: Any,
        *,
        close: bool = False,
        allow: str | None = None,
    ) -> None:
        payload = orjson.dumps(body)
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n"
        )
        if allow:
            head += f"Allow: {allow}\r\n"
        if close:
            head += "Connection: close\r\n"
        await stream.send(head.encode("latin-1") + b"\r\n" + payload)

    # -- routes ----------------------------------------------------------------------------

    def _route(self, request: _Request) -> tuple[int, Any]:
        path = request.target.partition("?")[0]
        method = _ROUTES.get(path)
        if method is None:
            raise _HttpError(404, f"no route {path!r}; expected POST /match or GET /stats")
        if request.method != method:
            raise _HttpError(405, f"{path} takes {method}, got {request.method}", allow=method)
        if path == "/stats":
            return 200, self._stats()
        return 200, self._match(
            request.body, request.content_type, request.target.partition("?")[2]
        )

    def _stats(self) -> Any:
        stats = self.index.statistics()
        out = stats._asdict()
        out["origins"] = {name: o._asdict() for name, o in stats.origins.items()}
        out["http"] = {"requests": self.requests, "errors": self.errors}
        return out

    def _match(self, body: bytes, content_type: str, query_string: str) -> Any:
        if content_type == "application/octet-stream":
            return self._match_binary(body, query_string)
        try:
            query = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise _HttpError(400, f"body: expected JSON, {exc}") from None
        if type(query) is not dict:
            raise _HttpError(400, f"body: expected a JSON object, got {type(query).__name__}")
        unknown = set(query) - _MATCH_FIELDS
        if unknown:
            raise _HttpError(400, f"unknown field(s): {', '.join(sorted(unknown))}")
        hashes = query.get("block_hashes")
        tokens = query.get("token_ids")
        if hashes is not None:
            if tokens is not None:
                raise _HttpError(400, "token_ids, block_hashes: expected one of them, got both")
            if type(hashes) is not list or not all(
                type(h) is int and -(2**63) <= h < 2**64 for h in hashes
            ):
                raise _HttpError(
                    400, f"block_hashes: expected a list of 64-bit integers, got {_short(hashes)}"
                )
        elif type(tokens) is not list:
            raise _HttpError(400, f"token_ids: expected a list of integers, got {_short(tokens)}")
        elif (
            tokens
            and (
                b"true" in body
                or b"false" in body
                or any(  # the partial last block is not converted by match(): check it here
                    type(t) is not int or not 0 <= t < 2**64
                    for t in tokens[len(tokens) - len(tokens) % self.index.block_size :]
                )
            )
        ):
            # Only then can a token be a bool (floats and negatives are refused
            # by the conversion in match()): check them one by one.
            bad = next((t for t in tokens if type(t) is not int or not 0 <= t < 2**64), None)
            if bad is not None:
                raise _HttpError(
                    400, f"token_ids: expected non-negative integers below 2**64, got {_short(bad)}"
                )
        lora = query.get("lora_name")
        if lora is not None and type(lora) is not str:
            raise _HttpError(400, f"lora_name: expected a string or null, got {_short(lora)}")
        extra = query.get("extra_keys")
        if extra is not None and (
            type(extra) is not list or any(e is not None and type(e) is not list for e in extra)
        ):
            raise _HttpError(
                400,
                "extra_keys: expected a list of (list or null), one per block, "
                f"got {_short(extra)}",
            )
        include_stale = query.get("include_stale", True)
        if type(include_stale) is not bool:
            raise _HttpError(
                400, f"include_stale: expected true or false, got {_short(include_stale)}"
            )
        weights = query.get("tier_weights")
        if weights is not None and type(weights) is not dict:
            raise _HttpError(
                400, f"tier_weights: expected an object of medium -> weight, got {_short(weights)}"
            )
        index = self.index
        try:
            if hashes is not None:
                origin = query.get("origin")
                if origin is not None and type(origin) is not str:
                    raise _HttpError(400, f"origin: expected a string, got {_short(origin)}")
                rank = query.get("data_parallel_rank")
                if rank is not None and type(rank) is not int:
                    raise _HttpError(
                        400, f"data_parallel_rank: expected an int or null, got {_short(rank)}"
                    )
                matches = index.match_engine_hashes(
                    hashes,
                    origin=origin,
                    data_parallel_rank=rank,
                    include_stale=include_stale,
                    tier_weights=weights,
                )
                blocks = len(hashes)
            else:
                assert tokens is not None
                matches = index.match(
                    tokens,
                    lora,
                    extra_keys=extra,
                    include_stale=include_stale,
                    tier_weights=weights,
                )
                blocks = len(tokens) // index.block_size
        except ConfigError as exc:
            raise _HttpError(400, str(exc)) from None
        return _answer(index.block_size, blocks, matches)

    def _match_binary(self, body: bytes, query_string: str) -> Any:
        """Tokens as uint32 little-endian bytes; options in the query string."""
        lora: str | None = None
        include_stale = True
        for pair in query_string.split("&") if query_string else ():
            name, _, value = pair.partition("=")
            value = unquote(value)
            if name == "lora_name":
                lora = value
            elif name == "include_stale":
                if value not in ("true", "false"):
                    raise _HttpError(400, f"include_stale: expected true or false, got {value!r}")
                include_stale = value == "true"
            else:
                raise _HttpError(
                    400, f"unknown query parameter {name!r}; expected lora_name, include_stale"
                )
        try:
            matches = self.index.match_bytes(body, lora, include_stale=include_stale)
        except ConfigError as exc:
            raise _HttpError(400, str(exc)) from None
        return _answer(self.index.block_size, len(body) // 4 // self.index.block_size, matches)


_MATCH_FIELDS: Final = frozenset(
    {
        "token_ids",
        "block_hashes",
        "origin",
        "data_parallel_rank",
        "lora_name",
        "extra_keys",
        "include_stale",
        "tier_weights",
    }
)


def _answer(block_size: int, blocks: int, matches: list[PrefixMatch]) -> Any:
    return {
        "block_size": block_size,
        "blocks": blocks,
        "matches": [
            {
                "origin": m.origin,
                "data_parallel_rank": m.data_parallel_rank,
                "blocks": m.blocks,
                "medium": m.medium,
                "stale": m.stale,
                "tiers": dict(m.tiers),
                "score": m.score,
            }
            for m in matches
        ],
    }


def _short(value: object) -> str:
    shown = orjson.dumps(value, default=repr).decode()
    return shown if len(shown) <= 80 else shown[:77] + "..."
