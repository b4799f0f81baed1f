"""Carry subscribers' streams into a scheduler: one scheduler origin per upstream origin.

A :class:`Relay` reads any :class:`~kvstream.consumers.base.Subscriber` (ZMQ
ingest of vLLM/SGLang/TensorRT-LLM publishers, a kvstream file or socket, a
broker) and feeds each upstream origin's events to the scheduler as a source
of that origin, so the scheduler numbers and batches them per origin and fans
them out to its sinks. Upstream origins keep their names: a ZMQ publisher is
the origin its subscriber names, a kvstream-format upstream carrying several
origins keeps each of them.

* An upstream **restart** (a new epoch of an origin) becomes an
  ``AllBlocksCleared`` in that origin's stream: the relay's own epoch goes on,
  so this is how its consumers learn that everything the origin held is gone.
* An upstream **gap** its subscriber could not repair is counted and logged;
  the events are gone and cannot be invented.
* Two upstreams claiming one origin would mix two sequences: the second one's
  batches are refused, counted and logged.
* :meth:`Relay.stop` is graceful where the subscriber allows it: a ZMQ
  subscriber delivers what has arrived and lets a replay in flight finish
  (within a grace period) before the relay returns.

Each origin's events pass through a bounded channel to the scheduler's source
for that origin (backpressure reaches the subscriber, never memory). On
:meth:`Relay.stop` the readers stop, the channels are drained into the
scheduler, and the caller closes the scheduler to deliver what is pending.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import Final, NamedTuple

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvstream.consumers.base import Gap, Subscriber
from kvstream.events import AllBlocksCleared, EventBatch, KVCacheEvent
from kvstream.scheduler import Scheduler
from kvstream.sources.base import SourceHandle

__all__ = ["Relay", "RelayStatistics"]

log = logging.getLogger("kvstream.relay")

#: Chunks (upstream batches) waiting per origin before the reader waits.
DEFAULT_QUEUE_CHUNKS: Final = 64
#: How long stop() waits for the channels to drain into the scheduler.
_DRAIN_TIMEOUT: Final = 5.0
#: Seconds a stopping subscriber may take to finish a replay in flight.
STOP_GRACE: Final = 2.0


class RelayStatistics(NamedTuple):
    """What a relay carried."""

    batches_in: int
    events_in: int
    #: Gaps reported by the subscribers, and the batches missing in them.
    gaps: int
    missing: int
    #: Upstream restarts turned into AllBlocksCleared.
    restarts: int
    #: Batches refused because another upstream already feeds their origin.
    conflicts: int
    origins: tuple[str, ...]
    #: Upstreams whose subscriber failed (by name).
    failed: tuple[str, ...]


class _Feed:
    __slots__ = ("drained", "epoch", "handle", "owner", "send")

    def __init__(
        self,
        owner: int,
        send: MemoryObjectSendStream[list[KVCacheEvent]],
        handle: SourceHandle,
        drained: anyio.Event,
    ) -> None:
        self.owner = owner
        self.send = send
        self.handle = handle
        self.drained = drained
        self.epoch: str | None = None


async def _drain(
    receive: MemoryObjectReceiveStream[list[KVCacheEvent]], drained: anyio.Event
) -> AsyncIterator[list[KVCacheEvent]]:
    """The scheduler source of one origin: what the relay's reader hands over.

    ``drained`` is set once the channel is closed and everything in it was
    yielded (so accepted by the scheduler), or the source was stopped.
    """
    try:
        async with receive:
            async for events in receive:
                yield events
    finally:
        drained.set()


class Relay:
    """Feeds ``subscribers`` into ``scheduler``; see the module doc.

    ::

        async with Scheduler(sinks=sinks, tick_interval=0.05) as scheduler:
            relay = Relay(scheduler, [open_subscriber(url) for url in urls])
            await relay.run()           # until the subscribers end or stop()
            await scheduler.aclose()

    The subscribers must be open (entered) while :meth:`run` runs.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        subscribers: Sequence[Subscriber],
        *,
        names: Sequence[str] | None = None,
        queue_chunks: int = DEFAULT_QUEUE_CHUNKS,
    ) -> None:
        self.scheduler = scheduler
        self.subscribers = list(subscribers)
        self.names = (
            list(names)
            if names is not None
            else [f"{type(s).__name__}#{i}" for i, s in enumerate(self.subscribers)]
        )
        if len(self.names) != len(self.subscribers):
            raise ValueError("Relay: names: expected one name per subscriber")
        self.queue_chunks = queue_chunks
        self._feeds: dict[str, _Feed] = {}
        self._scope: anyio.CancelScope | None = None
        self._reader_scopes: dict[int, anyio.CancelScope] = {}
        self._stop_requested = anyio.Event()
        self._grace = STOP_GRACE
        self._running = 0
        self._stopping = False
        self._ran = False
        self._conflict_logged: set[str] = set()
        # counters
        self._batches_in = 0
        self._events_in = 0
        self._gaps = 0
        self._missing = 0
        self._restarts = 0
        self._conflicts = 0
        self._failed: list[str] = []

    async def run(self) -> None:
        """Carry every subscriber until all have ended or :meth:`stop` is called.

        On return every event the readers took is in the scheduler (accepted).
        """
        if self._ran:
            raise RuntimeError("Relay.run: a relay runs once")
        self._ran = True
        self._running = len(self.subscribers)
        if not self.subscribers:
            return
        try:
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                tg.start_soon(self._watchdog, name="kvstream relay stop watchdog")
                for i, sub in enumerate(self.subscribers):
                    tg.start_soon(self._read, i, sub, name=f"kvstream relay {self.names[i]}")
        finally:
            self._scope = None
            with anyio.CancelScope(shield=True):
                await self._close_feeds()

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop reading; :meth:`run` then hands what it took to the scheduler and returns.

        Subscribers that can stop gracefully (a ``stop(grace)`` method, as the
        ZMQ subscriber has) deliver what has already arrived and finish replays
        in flight for up to ``grace`` seconds; the others stop at once.
        """
        if self._stopping:
            return
        self._stopping = True
        self._grace = grace
        for i, sub in enumerate(self.subscribers):
            graceful = getattr(sub, "stop", None)
            if callable(graceful):
                graceful(grace)
            else:
                scope = self._reader_scopes.get(i)
                if scope is not None:
                    scope.cancel()
        self._stop_requested.set()

    async def _watchdog(self) -> None:
        """After a stop, give the readers their grace period, then cancel what is left."""
        await self._stop_requested.wait()
        await anyio.sleep(self._grace + 1.0)
        if self._scope is not None:
            self._scope.cancel()

    def _reader_done(self) -> None:
        self._running -= 1
        if self._running <= 0 and self._scope is not None:
            self._scope.cancel()  # every upstream ended: stop the watchdog too

    # -- reading ----------------------------------------------------------------------------

    async def _read(self, index: int, sub: Subscriber) -> None:
        name = self.names[index]
        try:
            with anyio.CancelScope() as scope:
                self._reader_scopes[index] = scope
                if self._stopping and not callable(getattr(sub, "stop", None)):
                    scope.cancel()
                iterator = aiter(sub)
                try:
                    async for item in iterator:
                        if isinstance(item, Gap):
                            self._gap(name, item)
                        else:
                            await self._forward(index, item)
                except Exception as exc:  # one failing upstream never stops the others
                    self._failed.append(name)
                    log.error("relay: upstream %s failed: %s: %s", name, type(exc).__name__, exc)
                finally:
                    aclose = getattr(iterator, "aclose", None)
                    if aclose is not None:
                        with anyio.CancelScope(shield=True):
                            await aclose()
        finally:
            self._reader_done()

    def _gap(self, name: str, gap: Gap) -> None:
        self._gaps += 1
        self._missing += gap.missing
        log.warning(
            "relay: %s: origin %s lost batches %d..%d (%s)",
            name,
            gap.origin,
            gap.first_missing,
            gap.next_seq - 1,
            gap.reason,
        )

    async def _forward(self, index: int, batch: EventBatch) -> None:
        feed = self._feeds.get(batch.origin)
        if feed is None:
            feed = self._open_feed(index, batch)
        elif feed.owner != index:
            self._conflicts += 1
            if batch.origin not in self._conflict_logged:
                self._conflict_logged.add(batch.origin)
                log.error(
                    "relay: %s and %s both carry origin %r; batches from %s refused "
                    "(name the origins apart, e.g. ?origin=...)",
                    self.names[feed.owner],
                    self.names[index],
                    batch.origin,
                    self.names[index],
                )
            return
        self._batches_in += 1
        self._events_in += len(batch.events)
        events = batch.events
        if feed.epoch != batch.epoch:
            if feed.epoch is not None:
                self._restarts += 1
                log.warning(
                    "relay: origin %s restarted upstream (epoch %s -> %s); "
                    "forwarding AllBlocksCleared",
                    batch.origin,
                    feed.epoch,
                    batch.epoch,
                )
                if not (events and type(events[0]) is AllBlocksCleared):
                    events = [AllBlocksCleared(), *events]
            feed.epoch = batch.epoch
        if events:
            try:
                await feed.send.send(events)
            except anyio.get_cancelled_exc_class():
                # Stopping: the chunk in hand still goes in (the channel drains on stop).
                with anyio.CancelScope(shield=True), anyio.move_on_after(_DRAIN_TIMEOUT):
                    await feed.send.send(events)
                raise

    def _open_feed(self, index: int, batch: EventBatch) -> _Feed:
        send, receive = anyio.create_memory_object_stream[list[KVCacheEvent]](self.queue_chunks)
        drained = anyio.Event()
        handle = self.scheduler.add_source(
            _drain(receive, drained),
            name=f"{self.names[index]}:{batch.origin}",
            origin=batch.origin,
            data_parallel_rank=batch.data_parallel_rank,
        )
        feed = self._feeds[batch.origin] = _Feed(index, send, handle, drained)
        log.info("relay: origin %s from %s", batch.origin, self.names[index])
        return feed

    async def _close_feeds(self) -> None:
        """Close every channel and wait until the scheduler has taken what is in them."""
        for feed in self._feeds.values():
            feed.send.close()
        with anyio.move_on_after(_DRAIN_TIMEOUT):
            for feed in self._feeds.values():
                if feed.handle.running:
                    await feed.drained.wait()

    # -- introspection ------------------------------------------------------------------------

    def statistics(self) -> RelayStatistics:
        return RelayStatistics(
            batches_in=self._batches_in,
            events_in=self._events_in,
            gaps=self._gaps,
            missing=self._missing,
            restarts=self._restarts,
            conflicts=self._conflicts,
            origins=tuple(self._feeds),
            failed=tuple(self._failed),
        )
