"""Connecting to Redis the way both kvstream ends need it (redis-py asyncio, extra `redis`).

redis-py's own command retries are switched off: a retried `XADD` whose
first attempt reached the server would add the entry twice. The sink retries
itself, after checking what the stream already holds; the subscriber retries
reads with its own backoff. A connection error at start becomes
`TransportError("cannot reach redis://127.0.0.1:6379: ...")`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from kvstream._wire.broker_client import closed_on_error, import_extra, shown_url
from kvstream.errors import ConfigError, KVStreamError, TransportError

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = [
    "close_quietly",
    "describe_error",
    "make_client",
    "open_client",
    "open_stream_client",
    "require_redis",
    "shown_url",
    "stream_type_check",
    "translated_errors",
]

log = logging.getLogger("kvstream.redis")


def require_redis() -> Any:
    """The `redis` package, or `MissingDependencyError` naming the extra."""
    return import_extra("redis", "redis", "redis", "redis.asyncio", "redis.exceptions")


def describe_error(exc: BaseException) -> str:
    text = str(exc).strip()
    return text or type(exc).__name__


def make_client(url: str, *, db: int = 0, connect_timeout: float = 5.0) -> Redis:
    """A client for `redis://[[USER]:PASSWORD@]HOST[:PORT]` (`rediss://` for TLS)."""
    redis = require_redis()
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError(f"{shown_url(url)}: expected a redis:// or rediss:// URL")
    client: Redis = redis.asyncio.Redis(
        host=parts.hostname or "localhost",
        port=parts.port or 6379,
        db=db,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        ssl=parts.scheme == "rediss",
        socket_connect_timeout=connect_timeout,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )
    return client


async def open_client(url: str, *, db: int = 0, connect_timeout: float = 5.0) -> Redis:
    """A client that answered `PING`; `TransportError` naming the server otherwise."""
    redis = require_redis()
    client = make_client(url, db=db, connect_timeout=connect_timeout)
    try:
        await client.ping()
    except redis.exceptions.AuthenticationError as exc:
        await close_quietly(client)
        raise TransportError(
            f"cannot reach {shown_url(url)}: authentication failed ({describe_error(exc)}); "
            f"check the user and password in the URL"
        ) from exc
    except (redis.exceptions.RedisError, OSError) as exc:
        await close_quietly(client)
        raise TransportError(f"cannot reach {shown_url(url)}: {describe_error(exc)}") from exc
    except BaseException:
        await close_quietly(client)
        raise
    return client


async def stream_type_check(client: Redis, key: str, where: str) -> None:
    """ConfigError when `key` exists and is not a stream."""
    redis = require_redis()
    try:
        kind = await client.type(key)
    except (redis.exceptions.RedisError, OSError) as exc:
        raise TransportError(f"{where}: TYPE {key} failed: {describe_error(exc)}") from exc
    if isinstance(kind, bytes):
        kind = kind.decode()
    if kind not in ("none", "stream"):
        raise ConfigError(f"{where}: key {key!r} holds a {kind}, expected a stream")


async def open_stream_client(
    url: str, stream: str, *, db: int = 0, connect_timeout: float = 5.0
) -> Redis:
    """`open_client()`, then ConfigError (the client closed) when `stream` is not a stream."""
    client = await open_client(url, db=db, connect_timeout=connect_timeout)
    async with closed_on_error(lambda: close_quietly(client)):
        await stream_type_check(client, stream, shown_url(url))
    return client


@asynccontextmanager
async def translated_errors(client: Redis, where: str) -> AsyncIterator[None]:
    """Around a set-up step of a new `client`: if the step fails, close the client.

    Redis and socket errors of the step become `TransportError("<where>: ...")`.
    """
    redis = require_redis()
    async with closed_on_error(lambda: close_quietly(client)):
        try:
            yield
        except KVStreamError:
            raise
        except (redis.exceptions.RedisError, OSError) as exc:
            raise TransportError(f"{where}: {describe_error(exc)}") from exc


async def close_quietly(client: Redis | None) -> None:
    """Close `client` and its pool, logging (not raising) what goes wrong."""
    if client is None:
        return
    try:
        await client.aclose()
    except Exception as exc:
        log.debug("closing the Redis connection: %s", describe_error(exc))
