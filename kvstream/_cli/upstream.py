"""Reaching an upstream from the command line: the same behaviour on every transport.

* `open_upstream` enters a subscriber (`enter_upstream`), retrying with exponential
  backoff while its upstream is not there yet (its server cannot be reached, or a NATS
  stream does not exist yet: a reader started before the sink that creates it): one
  clear line on the first failure, every attempt logged (`-v` shows them),
  `retry=False` (`--no-retry`) raises at once. Once connected, the subscriber's own
  reconnect rules apply (a socket subscriber, entered without its own retries so that
  its first failure is seen here, resumes after a drop unless `--no-retry`).
* `WhenReachable` is such a subscriber for a reader that takes them entered
  (`kvstream relay`): it is entered, with those retries, by the task reading it.
* `refuse_foreign_file` refuses, with one line, a file whose first line is not
  a kvstream batch, instead of skipping every line of it.
* `bind_rule` says whether a ZMQ URL binds or connects, and why, for banners
  and for the "nothing arrived" hint.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Final, Self

import anyio

from kvstream._backoff import Backoff
from kvstream._redact import redact_url
from kvstream._wire.vllm_zmq import should_bind
from kvstream.codecs.json import JsonCodec
from kvstream.consumers.base import Subscriber, SubscriberItem
from kvstream.consumers.nats import NatsSubscriber
from kvstream.consumers.socket import SocketSubscriber
from kvstream.errors import DecodeError, KVStreamError, MissingStreamError, TransportError

__all__ = [
    "RETRY_INITIAL",
    "RETRY_MAX",
    "WhenReachable",
    "bind_rule",
    "enter_upstream",
    "first_attempt",
    "not_there_yet",
    "open_upstream",
    "refuse_foreign_file",
]

log = logging.getLogger("kvstream.cli")

#: Seconds before the second attempt; doubled per failure up to `RETRY_MAX`.
RETRY_INITIAL: Final = 0.5
RETRY_MAX: Final = 5.0
#: How much of a file is read to find its first line.
_FIRST_LINE_LIMIT: Final = 16 << 20


@asynccontextmanager
async def open_upstream(
    make: Callable[[], Subscriber],
    *,
    url: str,
    command: str,
    retry: bool = True,
    initial: float = RETRY_INITIAL,
    maximum: float = RETRY_MAX,
    failed: KVStreamError | None = None,
) -> AsyncIterator[Subscriber]:
    """Enter the subscriber `make()` builds, retrying while `url` is not there yet.

    `make` is called once per attempt (a subscriber is entered once). An error
    `not_there_yet()` accepts is retried after `initial` seconds, doubling up to
    `maximum`; any other error, and every failure when `retry` is false, propagates.
    `failed` is the error of an attempt made before (`first_attempt()`).

    A NATS stream that did not exist at an earlier attempt is read from its start:
    every message in it is newer than this reader ("new" would skip those stored
    between its creation and the attempt that finds it).
    """
    backoff = Backoff(initial, maximum, where=f"kvstream {command}: retry")
    shown = redact_url(url)
    missing = isinstance(failed, MissingStreamError)
    while True:
        attempt = backoff.failures + 1
        sub = make()
        if missing:
            _read_from_start(sub)
        stack = AsyncExitStack()
        try:
            await enter_upstream(sub, stack, retry=retry)
        except (TransportError, MissingStreamError) as exc:
            if not retry or not not_there_yet(exc):
                raise
            missing = missing or isinstance(exc, MissingStreamError)
            delay = backoff.next_delay()
            if attempt == 1:
                print(
                    f"kvstream {command}: {exc}; retrying with backoff "
                    "(-v shows every attempt; --no-retry exits at once)",
                    file=sys.stderr,
                    flush=True,
                )
            log.info(
                "%s: attempt %d failed (%s); next attempt in %.1f s", shown, attempt, exc, delay
            )
            await anyio.sleep(delay)
            continue
        if attempt > 1:
            log.warning("%s: connected after %d attempts", shown, attempt)
        break
    async with stack:
        yield sub


async def enter_upstream(sub: Subscriber, stack: AsyncExitStack, *, retry: bool = True) -> None:
    """Enter `sub` on `stack`, once; `TransportError` when its upstream cannot be reached.

    A socket subscriber would retry inside its entry, unseen: it is entered without,
    so that its first failure is raised here, and once connected it resumes after
    drops on its own (unless `retry` is false).
    """
    socket = sub if isinstance(sub, SocketSubscriber) and sub.reconnect else None
    if socket is not None:
        socket.reconnect = False
    await stack.enter_async_context(sub)
    if socket is not None and retry:
        socket.reconnect = True


def _read_from_start(sub: Subscriber) -> None:
    """Make a NATS subscriber that would read only new messages read all of its stream."""
    if isinstance(sub, NatsSubscriber) and sub.deliver == "new":
        sub.deliver = "all"


async def first_attempt(
    sub: Subscriber, stack: AsyncExitStack, *, later: bool = True
) -> KVStreamError | None:
    """`enter_upstream()`: None when entered; the error when the upstream is not there
    yet and `later` allows trying again, from another task (pass it to `open_upstream`
    or `WhenReachable` as `failed`). Anything else raises."""
    try:
        await enter_upstream(sub, stack)
    except (TransportError, MissingStreamError) as exc:
        if not later or not not_there_yet(exc):
            raise
        return exc
    return None


class WhenReachable(Subscriber):
    """A subscriber whose upstream could not be reached at start, for a reader that
    takes subscribers already entered (`Relay`, the index's followers): the task reading
    it enters it, through `open_upstream` (one line, then backoff), at its first item,
    and closes it. `on_reached` is called with the subscriber once it is entered;
    `failed` is why the first attempt (`first_attempt()`) did not enter it."""

    def __init__(
        self,
        make: Callable[[], Subscriber],
        *,
        url: str,
        command: str,
        on_reached: Callable[[Subscriber], None] | None = None,
        failed: KVStreamError | None = None,
    ) -> None:
        self._make = make
        self._failed = failed
        self._url = url
        self._command = command
        self._on_reached = on_reached
        self._stack = AsyncExitStack()
        self._items: AsyncIterator[SubscriberItem] | None = None

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SubscriberItem:
        if self._items is None:
            reached = await self._stack.enter_async_context(
                open_upstream(self._make, url=self._url, command=self._command, failed=self._failed)
            )
            self._items = aiter(reached)
            if self._on_reached is not None:
                self._on_reached(reached)
        return await anext(self._items)

    async def aclose(self) -> None:
        await self._stack.aclose()


def not_there_yet(exc: KVStreamError) -> bool:
    """Whether `exc` says the upstream is not there yet (worth trying again): its
    server could not be reached, or the stream it reads does not exist yet. A
    peer that answered and refused (a protocol error: a bad token, a `from_seq`
    ahead) will refuse again."""
    if isinstance(exc, MissingStreamError):
        return True
    return isinstance(exc, TransportError) and not isinstance(exc.__cause__, KVStreamError)


def refuse_foreign_file(path: str) -> None:
    """Raise `DecodeError` unless `path` starts with a kvstream batch.

    An empty file passes (it may still be written). A missing file raises
    [`TransportError`][kvstream.errors.TransportError].
    """
    try:
        with Path(path).open("rb") as f:
            head = f.read(_FIRST_LINE_LIMIT)
    except OSError as exc:
        raise TransportError(f"cannot read {path}: {exc}") from exc
    first = head.lstrip().split(b"\n", 1)[0].strip()
    if not first:
        return
    try:
        JsonCodec().decode(first)
    except DecodeError as exc:
        raise DecodeError(
            f"{path}: not a kvstream JSON-lines file (its first line is not a batch: {exc})"
        ) from exc


def bind_rule(endpoint: str, bind: bool | None = None) -> str:
    """`"binds"` or `"connects"`, with the reason, for a ZMQ endpoint."""
    if bind is not None:
        return "binds (bind=1)" if bind else "connects (bind=0)"
    if should_bind(endpoint):
        return "binds (the endpoint has '*', '::', ipc:// or inproc://)"
    return "connects (no '*' in the endpoint: something else must bind it)"
