"""Reaching an upstream from the command line: the same behaviour on every transport.

* `open_upstream` enters a subscriber (`enter_upstream`), retrying with exponential backoff
  while its upstream cannot be reached: one clear line on the first failure,
  every attempt logged (`-v` shows them), `retry=False` (`--no-retry`)
  raises at once. Once connected, the subscriber's own reconnect rules apply
  (a socket subscriber, entered without its own retries so that its first
  failure is seen here, resumes after a drop unless `--no-retry`).
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
from kvstream.consumers.socket import SocketSubscriber
from kvstream.errors import DecodeError, KVStreamError, TransportError

__all__ = [
    "RETRY_INITIAL",
    "RETRY_MAX",
    "WhenReachable",
    "bind_rule",
    "enter_now",
    "enter_upstream",
    "open_upstream",
    "refuse_foreign_file",
    "unreachable",
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
) -> AsyncIterator[Subscriber]:
    """Enter the subscriber `make()` builds, retrying while `url` is unreachable.

    `make` is called once per attempt (a subscriber is entered once). A
    [`TransportError`][kvstream.errors.TransportError] on entering is retried after
    `initial` seconds, doubling up to `maximum`, unless the peer answered and
    refused (its cause is a kvstream error); any other error, and every failure
    when `retry` is false, propagates.
    """
    backoff = Backoff(initial, maximum, where=f"kvstream {command}: retry")
    shown = redact_url(url)
    while True:
        attempt = backoff.failures + 1
        sub = make()
        stack = AsyncExitStack()
        try:
            await enter_upstream(sub, stack, retry=retry)
        except TransportError as exc:
            if not retry or not unreachable(exc):
                raise
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


async def enter_now(sub: Subscriber, stack: AsyncExitStack, *, later: bool = True) -> bool:
    """`enter_upstream()`; False (not entered) when the upstream cannot be reached yet and
    `later` allows trying again, from another task. Anything else raises."""
    try:
        await enter_upstream(sub, stack)
    except TransportError as exc:
        if not later or not unreachable(exc):
            raise
        return False
    return True


class WhenReachable(Subscriber):
    """A subscriber whose upstream could not be reached at start, for a reader that
    takes subscribers already entered (`Relay`, the index's followers): the task reading
    it enters it, through `open_upstream` (one line, then backoff), at its first item,
    and closes it. `on_reached` is called with the subscriber once it is entered."""

    def __init__(
        self,
        make: Callable[[], Subscriber],
        *,
        url: str,
        command: str,
        on_reached: Callable[[Subscriber], None] | None = None,
    ) -> None:
        self._make = make
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
                open_upstream(self._make, url=self._url, command=self._command)
            )
            self._items = aiter(reached)
            if self._on_reached is not None:
                self._on_reached(reached)
        return await anext(self._items)

    async def aclose(self) -> None:
        await self._stack.aclose()


def unreachable(exc: TransportError) -> bool:
    """Whether `exc` says the upstream could not be reached (worth trying again). A
    peer that answered and refused (a protocol error: a bad token, a `from_seq`
    ahead) will refuse again."""
    return not isinstance(exc.__cause__, KVStreamError)


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
