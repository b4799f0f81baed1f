"""A tiny HTTP/1.1 query endpoint for a [`PrefixIndex`][kvstream.index._prefix.PrefixIndex].

Two routes, JSON out:

    POST /match   {"token_ids": [1, 2, ...], "lora_name": null}
                  -> {"block_size": 16, "blocks": 12,
                      "matches": [{"origin": "engine-0", "data_parallel_rank": null,
                                   "blocks": 9, "medium": "GPU", "stale": false,
                                   "tiers": {"GPU": 9}, "score": 9.0}, ...]}
    GET  /stats   -> the index's statistics()

`/match` also takes `"extra_keys"` (one entry per block), `"include_stale"`
(default true) and `"tier_weights"`; or `"block_hashes"` (an engine's hashes,
with an optional `"origin"` and `"data_parallel_rank"`) instead of
`"token_ids"`. With `Content-Type: application/octet-stream` the body is the
tokens as uint32 little-endian and options go in the query string
(`/match?lora_name=L&include_stale=false`): the fast path. Requests are
bounded (head 16 KiB, body `max_request_bytes`); a malformed one gets a 4xx
naming what was wrong. Connections are kept alive (HTTP/1.1) until the client
closes, says `Connection: close`, or is idle for `idle_timeout` seconds. The
HTTP layer is `kvstream._wire.http` (kvstream's one HTTP/1.1 server, with its limits).
"""

from __future__ import annotations

import logging
from array import array
from contextlib import AsyncExitStack
from typing import Any, Final
from urllib.parse import unquote

import orjson

from kvstream._burst_log import BurstLog
from kvstream._wire.http import HttpLimits, HttpServer, HttpServerStatistics, Request, Response
from kvstream.errors import ClosedError, ConfigError, shorten
from kvstream.index._hashing import tokens_array
from kvstream.index._prefix import PrefixIndex, PrefixMatch
from kvstream.lifetime import TaskOwner

__all__ = ["QueryServer"]

log = logging.getLogger("kvstream.index")

_ROUTES: Final = {"/match": "POST", "/stats": "GET"}


class _HttpError(Exception):
    """A request the index refuses: status and message (answered as JSON)."""

    def __init__(self, status: int, message: str, *, allow: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.allow = allow


class QueryServer(TaskOwner):
    """Serves `index` on `host:port` (port 0: any free port; see `port`).

    An async context manager; `aclose()` is idempotent. The index is read
    from the same event loop that feeds it, so a query sees a consistent state.
    The HTTP layer is kvstream's one server (`HttpServer`),
    with its documented limits: `max_connections` (idle connections make room
    for new ones), head size and time, `max_request_bytes` per body,
    `idle_timeout` for keep-alive; `statistics()` counts every refusal.
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
        limits: HttpLimits | None = None,
    ) -> None:
        TaskOwner.__init__(self)
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
        self.requests = 0
        self.errors = 0
        self._failures = BurstLog(log)
        self._http = HttpServer(
            self._handle,
            host=host,
            port=port,
            limits=limits
            or HttpLimits(
                max_connections=max_connections,
                body_bytes=max_request_bytes,
                idle_timeout=idle_timeout,
            ),
            token=token,
            name="kvstream index",
            error_format=_json_error,
        )

    @property
    def port(self) -> int:
        """The port it listens on (known once entered)."""
        return self._http.port

    @property
    def url(self) -> str:
        return self._http.url

    def statistics(self) -> HttpServerStatistics:
        """The HTTP listener's counters (connections, refusals, timeouts)."""
        return self._http.statistics()

    def reentry_error(self) -> ClosedError:
        return self._http.reentry_error()

    async def open_lifetime(self, stack: AsyncExitStack) -> None:
        await stack.enter_async_context(self._http)

    async def aclose(self) -> None:
        """Stop accepting and close every connection. Idempotent."""
        await self._http.aclose()

    # -- requests --------------------------------------------------------------------------

    async def _handle(self, request: Request) -> Response:
        self.requests += 1
        headers: tuple[tuple[str, str], ...] = ()
        try:
            status, body = self._route(request)
        except _HttpError as exc:
            status, body = exc.status, {"error": str(exc)}
            if exc.allow:
                headers = (("Allow", exc.allow),)
        except Exception as exc:  # a bug must not take the server down
            self._failures.log("index http: request failed: %r", exc)
            log.debug("index http: traceback", exc_info=True)
            status, body = 500, {"error": f"internal error: {exc!r}"}
        if status >= 400:
            self.errors += 1
            return _json_error(status, body["error"])._replace(headers=headers)
        return Response(status, orjson.dumps(body), "application/json", headers)

    def _route(self, request: Request) -> tuple[int, Any]:
        path, _, query = request.target.partition("?")
        method = _ROUTES.get(path)
        if method is None:
            raise _HttpError(404, f"no route {path!r}; expected POST /match or GET /stats")
        if request.method != method and not (method == "GET" and request.method == "HEAD"):
            allow = "GET, HEAD" if method == "GET" else method
            raise _HttpError(405, f"{path} takes {method}, got {request.method}", allow=allow)
        if path == "/stats":
            return 200, self._stats()
        content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if content_type == "application/octet-stream":
            return 200, self._match_binary(request.body, query)
        if query:
            raise _HttpError(
                400,
                f"query string {query!r}: a JSON body carries the options (query parameters "
                "are for a binary body)",
            )
        return 200, self._match(request.body)

    def _stats(self) -> Any:
        stats = self.index.statistics()
        out = stats._asdict()
        out["origins"] = {name: o._asdict() for name, o in stats.origins.items()}
        out["http"] = {"requests": self.requests, "errors": self.errors}
        return out

    def _match(self, body: bytes) -> Any:
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
                    400,
                    f"block_hashes: expected a list of 64-bit integers, got {_short(hashes)}",
                )
            converted = None
        elif type(tokens) is not list:
            raise _HttpError(400, f"token_ids: expected a list of integers, got {_short(tokens)}")
        else:
            converted = _converted_tokens(tokens)
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
                400,
                f"include_stale: expected true or false, got {_short(include_stale)}",
            )
        weights = query.get("tier_weights")
        if weights is not None and type(weights) is not dict:
            raise _HttpError(
                400,
                f"tier_weights: expected an object of medium -> weight, got {_short(weights)}",
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
                        400,
                        f"data_parallel_rank: expected an int or null, got {_short(rank)}",
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
                assert converted is not None
                data, wide = converted
                if wide:  # tokens of 32 bits or more: match() salts their blocks
                    matches = index.match(
                        tokens,
                        lora,
                        extra_keys=extra,
                        include_stale=include_stale,
                        tier_weights=weights,
                    )
                else:  # converted already: the bytes path does not convert again
                    matches = index.match_bytes(
                        memoryview(data).cast("B"),
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


def _converted_tokens(tokens: list[Any]) -> tuple[array[int], bool]:
    """`tokens` converted as the hash needs them (`tokens_array()`: one C pass that
    refuses anything but integers in `[0, 2**64)`, the partial last block too), and
    refused if one is a JSON `true` or `false`, which that conversion takes for 1 or 0.

    Only the tokens converted to 0 or 1 can be bools: a vectorized scan finds them,
    so a prompt is not walked in Python.
    """
    import numpy as np

    try:
        data, wide = tokens_array(tokens)
    except ConfigError as exc:
        raise _HttpError(400, str(exc)) from None
    for i in np.flatnonzero(np.frombuffer(data, dtype="<u4") <= 1).tolist():
        if type(tokens[i]) is bool:
            raise _HttpError(
                400,
                f"token_ids: expected non-negative integers below 2**64, got {_short(tokens[i])}",
            )
    return data, wide


def _json_error(status: int, message: str) -> Response:
    return Response(status, orjson.dumps({"error": message}), "application/json")


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
    """A bad value as the client sent it: JSON (`shorten`'s JSON form)."""
    return shorten(value, as_json=True)
