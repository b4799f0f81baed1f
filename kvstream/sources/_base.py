"""Sources: what feeds the scheduler, and the handle it keeps for each.

Three kinds of input, as DESIGN.md names them:

* an **async source**: any async iterable yielding events or chunks (lists or
  tuples) of events, such as a connector written as an async generator;
* a **polled connector**: any object with a vLLM-style `take_events()`
  method, adapted by `from_take_events()` and polled once per tick;
* the host's own `Scheduler.emit(...)`, which needs no source at all.

An item is *accepted* the moment the source yields it: the driver appends it to
the source's buffer inside the task that pulled it, so a tick only swaps
buffers. A source that raises is closed and reported; the others go on.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from typing import Final, NamedTuple, Protocol, TypeAlias, runtime_checkable

import anyio
import anyio.lowlevel

from kvstream.errors import InvalidEventTypeError
from kvstream.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = [
    "AsyncSource",
    "PolledConnector",
    "SourceHandle",
    "SourceStatistics",
    "TakeEventsConnector",
    "check_events",
    "from_take_events",
]

log = logging.getLogger("kvstream.sources")

#: An async source yields events, or chunks of events (cheaper: one hand-off each).
AsyncSource: TypeAlias = AsyncIterable[KVCacheEvent | Sequence[KVCacheEvent]]

_EVENT_TYPES: Final = frozenset((BlockStored, BlockRemoved, AllBlocksCleared))

#: How many items a source may yield before its driver lets other tasks run.
_CHECKPOINT_EVERY: Final = 64


@runtime_checkable
class TakeEventsConnector(Protocol):
    """A vLLM-style connector: returns (and forgets) the events since the last call."""

    def take_events(self) -> Iterable[KVCacheEvent]: ...


class PolledConnector:
    """A `take_events()` connector adapted as a synchronous scheduler input.

    Made by `from_take_events()`. The scheduler calls `poll()` once per
    tick, without awaiting and without a thread, so the connector's events of a
    step land in that step's batch.
    """

    __slots__ = ("connector", "name")

    def __init__(self, connector: TakeEventsConnector, name: str | None = None) -> None:
        if not callable(getattr(connector, "take_events", None)):
            raise InvalidEventTypeError(
                f"connector: expected an object with a take_events() method, got {connector!r}"
            )
        self.connector = connector
        self.name = name or type(connector).__name__

    def poll(self) -> list[KVCacheEvent]:
        events = self.connector.take_events()
        if not events:
            return []
        checked = check_events(events, self.name)
        # The batch must own its list: a connector may reuse the one it returned.
        return list(checked) if checked is events else checked


def from_take_events(connector: TakeEventsConnector, *, name: str | None = None) -> PolledConnector:
    """Adapt a vLLM-style connector (`take_events()`) as a scheduler input."""
    return PolledConnector(connector, name)


def check_events(items: object, where: str) -> list[KVCacheEvent]:
    """Return `items` (one event or an iterable of events) as a list of events, or raise."""
    # Fast path, in C: a list whose items are all exactly one of the three events.
    if type(items) is list and _EVENT_TYPES.issuperset(map(type, items)):
        return items
    if isinstance(items, KVCacheEvent):
        return [items]
    if isinstance(items, str | bytes) or not isinstance(items, Iterable):
        raise InvalidEventTypeError(
            f"{where}: expected a KV cache event or a list of them, got {type(items).__name__}"
        )
    out = items if type(items) is list else list(items)
    for i, e in enumerate(out):
        if not isinstance(e, KVCacheEvent):
            raise InvalidEventTypeError(
                f"{where}[{i}]: expected a KV cache event, got {type(e).__name__}: {e!r:.80}"
            )
    return out


class SourceStatistics(NamedTuple):
    name: str
    origin: str
    kind: str  # "async" or "polled"
    events_accepted: int
    pending_events: int
    running: bool
    #: The exception that ended the source, as text, or None.
    error: str | None


class SourceHandle:
    """The scheduler's record of one input; returned by `add_source`.

    Holds the input's buffer of accepted events, waiting for the next tick.
    """

    __slots__ = (
        "_drained",
        "_error",
        "_ran",
        "_removed",
        "_scope",
        "accepted",
        "buffer",
        "max_pending",
        "name",
        "origin",
        "polled",
        "running",
        "source",
    )

    def __init__(
        self,
        source: AsyncSource | PolledConnector,
        *,
        name: str,
        origin: str,
        max_pending: int,
    ) -> None:
        self.source = source
        self.name = name
        self.origin = origin
        self.max_pending = max_pending
        self.polled = isinstance(source, PolledConnector)
        self.buffer: list[KVCacheEvent] = []
        self.accepted = 0
        self.running = not self.polled
        self._ran = False
        self._removed = False
        self._error: BaseException | None = None
        self._scope: anyio.CancelScope | None = None
        self._drained: anyio.Event | None = None

    # -- the tick's side ------------------------------------------------------------

    def take(self) -> list[KVCacheEvent]:
        """Hand over the buffered events (the tick calls this; no await)."""
        if self.polled:
            if self._error is not None or self._removed:
                return []
            try:
                events = self.source.poll()  # type: ignore[union-attr]
            except Exception as exc:
                self._report(exc)
                return []
            self.accepted += len(events)
            return events
        buffer = self.buffer
        if not buffer:
            return buffer
        self.buffer = []
        drained = self._drained
        if drained is not None:
            self._drained = None
            drained.set()
        return buffer

    # -- the driver's side ----------------------------------------------------------

    async def pump(self) -> None:
        """Pull the async source to its end, appending every item as it is yielded.

        Runs in the task that aiostream's merge created for this source. Returns
        when the source ends, fails (reported, not raised) or is removed.
        """
        if self._ran:
            return
        self._ran = True
        with anyio.CancelScope() as scope:
            self._scope = scope
            if self._removed:
                scope.cancel()
            iterator: AsyncIterator[KVCacheEvent | Sequence[KVCacheEvent]] = aiter(
                self.source  # type: ignore[arg-type]
            )
            try:
                if not self._removed:  # removed before it ran: never ask it for an item
                    await self._pull(iterator)
            except Exception as exc:
                self._report(exc)
            finally:
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                        try:
                            await aclose()
                        except Exception as exc:  # a source failing in its finally
                            log.warning("source %s: error while closing: %r", self.name, exc)
        self.running = False
        self._scope = None

    async def _pull(self, iterator: AsyncIterator[KVCacheEvent | Sequence[KVCacheEvent]]) -> None:
        since_checkpoint = 0
        async for item in iterator:
            if isinstance(item, KVCacheEvent):
                self.buffer.append(item)
                self.accepted += 1
            else:
                events = check_events(item, f"source {self.name}")
                self.buffer.extend(events)
                self.accepted += len(events)
            if self._removed:
                # Stop asking: an item produced while the removal (or the close)
                # was under way is kept, but no other is accepted afterwards.
                return
            if len(self.buffer) >= self.max_pending:
                # Backpressure: wait for a tick to take what is buffered.
                drained = self._drained = anyio.Event()
                await drained.wait()
                since_checkpoint = 0
            else:
                since_checkpoint += 1
                if since_checkpoint >= _CHECKPOINT_EVERY:
                    # A source that never awaits must not starve the loop.
                    since_checkpoint = 0
                    await anyio.lowlevel.checkpoint()

    def _report(self, exc: BaseException) -> None:
        self._error = exc
        self.running = False
        log.error(
            "source %s (origin %s) failed and was closed: %s: %s",
            self.name,
            self.origin,
            type(exc).__name__,
            exc,
        )

    def cancel(self) -> None:
        """Stop the source; what it already yielded stays accepted."""
        self._removed = True
        if self._scope is not None:
            self._scope.cancel()
        self.running = False

    @property
    def error(self) -> BaseException | None:
        return self._error

    def statistics(self) -> SourceStatistics:
        return SourceStatistics(
            name=self.name,
            origin=self.origin,
            kind="polled" if self.polled else "async",
            events_accepted=self.accepted,
            pending_events=len(self.buffer),
            running=self.running,
            error=None if self._error is None else f"{type(self._error).__name__}: {self._error}",
        )

    def __repr__(self) -> str:
        return f"<SourceHandle {self.name!r} origin={self.origin!r}>"
