"""Connecting to NATS the way both kvstream ends need it (nats-py, extra `nats`).

nats-py's own reconnection is switched off: when the server goes away the
client closes, whoever owns it learns it at once (`on_lost`), and the owner
reconnects with its own backoff. That keeps every retry visible to kvstream's
logic (the sink's de-duplication check, the subscriber's resume position)
instead of hiding it in a buffer, and it makes a first connection fail fast
with a clear [`TransportError`][kvstream.errors.TransportError] instead of retrying for
minutes. nats-py's error callbacks are replaced with one-line log records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kvstream._wire.broker import subject_covers
from kvstream._wire.broker_client import import_extra, shown_url
from kvstream.errors import ConfigError, KVStreamError, MissingStreamError, TransportError

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = [
    "close_quietly",
    "connect",
    "describe_error",
    "find_stream",
    "jetstream_errors",
    "no_stream_error",
    "require_nats",
    "shown_url",
]

log = logging.getLogger("kvstream.nats")


def require_nats() -> Any:
    """The `nats` package, or `MissingDependencyError` naming the extra."""
    return import_extra("nats-py", "nats", "nats", "nats.js.errors")


def describe_error(exc: BaseException) -> str:
    """A one-line description of a nats-py (or socket) error."""
    text = str(exc).strip()
    name = type(exc).__name__
    if not text or text == "None":
        return name
    if "Authorization Violation" in text:
        return "authorization violation (check the user, password or token in the URL)"
    return text if text.startswith("nats:") or isinstance(exc, OSError) else f"{name}: {text}"


async def connect(
    url: str,
    *,
    name: str,
    connect_timeout: float,
    on_lost: Callable[[], None],
) -> Client:
    """Connect once; raise `TransportError("cannot reach nats://...: ...")` on failure.

    `on_lost` is called (from nats-py's task) when the connection drops or
    closes; the client does not reconnect by itself.
    """
    nats = require_nats()
    shown = shown_url(url)
    seen: list[BaseException] = []

    async def error_cb(exc: Exception) -> None:
        if len(seen) < 8:
            seen.append(exc)
        log.debug("%s: %s", shown, describe_error(exc))

    async def lost_cb() -> None:
        on_lost()

    from nats.aio.client import Client

    client = Client()
    try:
        await client.connect(
            url,
            name=name,
            # One attempt (nats-py makes two when the limit is 1), no reconnection.
            allow_reconnect=False,
            max_reconnect_attempts=1,
            # nats-py annotates these as int; it uses them as seconds, floats work.
            reconnect_time_wait=0.05,  # type: ignore[arg-type]
            connect_timeout=connect_timeout,  # type: ignore[arg-type]
            error_cb=error_cb,
            disconnected_cb=lost_cb,
            closed_cb=lost_cb,
        )
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        # nats-py leaves the socket of a refused handshake (auth) open: close it.
        await close_quietly(client, force=True)
        # The most telling error: a refusal by the server beats a reset socket.
        refusals = [e for e in seen if isinstance(e, nats.errors.Error) and str(e) != "None"]
        cause = refusals[-1] if refusals else seen[-1] if seen else exc
        raise TransportError(f"cannot reach {shown}: {describe_error(cause)}") from cause
    except BaseException:
        await close_quietly(client, force=True)
        raise
    return client


async def find_stream(client: Client, subject: str, stream: str | None, where: str) -> Any | None:
    """The `StreamInfo` of the stream named `stream` or covering `subject`.

    Returns None when there is none. Raises [`ConfigError`][kvstream.errors.ConfigError] when the
    stream found does not cover `subject` (JetStream's lookup matches
    overlapping subjects, kvstream needs covering ones), and
    [`TransportError`][kvstream.errors.TransportError] when the server has no JetStream.
    """
    nats = require_nats()
    jsm = client.jsm()
    try:
        if stream is None:
            try:
                stream = await client.jetstream().find_stream_name_by_subject(subject)
            except nats.js.errors.NotFoundError:
                return None
        try:
            info = await jsm.stream_info(stream)
        except nats.js.errors.NotFoundError:
            return None
    except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError) as exc:
        raise TransportError(
            f"{where}: JetStream is not enabled on the server (start it with nats-server -js)"
        ) from exc
    except (nats.errors.Error, OSError) as exc:
        raise TransportError(
            f"{where}: cannot look up stream {stream}: {describe_error(exc)}"
        ) from exc
    subjects = list(info.config.subjects or [])
    if not any(subject_covers(pattern, subject) for pattern in subjects):
        raise ConfigError(
            f"{where}: stream {info.config.name!r} has subjects {subjects}, none of which covers "
            f"{subject!r}; kvstream never changes an existing stream: add the subject to it "
            f"yourself, or name another stream or subject"
        )
    return info


@contextmanager
def jetstream_errors(where: str, doing: str) -> Iterator[None]:
    """Translate the errors of JetStream management calls (streams, consumers).

    The server refusing the request (an API error: a bad name, a limit, a
    permission) is a `ConfigError`, since trying again would not help;
    a lost connection is a [`TransportError`][kvstream.errors.TransportError]. Both read
    `"<where>: cannot <doing>: <why>"`. kvstream's own errors pass unchanged.
    """
    nats = require_nats()
    try:
        yield
    except KVStreamError:
        raise
    except nats.js.errors.APIError as exc:
        raise ConfigError(
            f"{where}: cannot {doing}: {exc.description or describe_error(exc)}"
        ) from exc
    except (nats.errors.Error, OSError) as exc:
        raise TransportError(f"{where}: cannot {doing}: {describe_error(exc)}") from exc


def no_stream_error(
    where: str, stream: str | None, subject: str, remedy: str
) -> MissingStreamError:
    """The error for a missing stream (the one named `stream`, or any covering `subject`).

    `remedy` completes "create it, or ...": what the user can do instead.
    """
    which = (
        f"stream {stream!r} does not exist"
        if stream
        else f"no JetStream stream covers subject {subject!r}"
    )
    return MissingStreamError(f"{where}: {which}; create it, or {remedy}")


async def close_quietly(client: Client | None, *, force: bool = False) -> None:
    """Close `client` if it is open (or `force`), logging (not raising) what goes wrong."""
    if client is None or (client.is_closed and not force):
        return
    try:
        await client.close()
    except Exception as exc:
        log.debug("closing the NATS connection: %s", describe_error(exc))
