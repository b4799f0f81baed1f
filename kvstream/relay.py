"""Carry subscribers' streams into a scheduler: one scheduler origin per upstream origin.

A `Relay` reads any [`Subscriber`][kvstream.consumers.base.Subscriber] (ZMQ
ingest of vLLM/SGLang/TensorRT-LLM publishers, a kvstream file or socket, a
broker) and feeds each upstream origin's events to the scheduler as a source
of that origin, so the scheduler numbers and batches them per origin and fans
them out to its sinks. Upstream origins keep their names: a ZMQ publisher is
the origin its subscriber names, a kvstream-format upstream carrying several
origins keeps each of them.

* An upstream **restart** (a new epoch of an origin) becomes an
  `AllBlocksCleared` in that origin's stream, once, counted: the relay's own
  epoch goes on, so this is how its consumers learn that everything the origin
  held is gone. An upstream snapshot (a `SnapshotBatch`) begins with its own
  `AllBlocksCleared` and is carried as it is.
* **Recovery downstream.** The relay's sinks serve what engines without
  snapshots lack: a ZMQ sink with `?snapshot=...&heartbeat=...`, or a broker
  sink with `snapshot_every`/`heartbeat`, keeps the state of every origin it
  carries and serves its snapshots and heartbeats.
* An upstream **gap** its subscriber could not repair is counted, logged, and
  kept visible in the output: the relay renumbers each origin contiguously
  (its sinks carry the relay's own `(origin, epoch, seq)`), so a gap cannot
  show as a missing seq there. Instead, with `on_gap="clear"` (the default),
  the origin's stream gets an `AllBlocksCleared` whose `metadata` holds
  `{"upstream_gap": {"epoch", "first_missing", "next_seq", "missing",
  "reason"}}`: what the origin held is unknown after lost events (a missed
  `BlockRemoved` would leave a router sending requests to blocks that are
  gone), so consumers drop it and rebuild from what follows, and the marker
  says why. kvstream-format sinks carry the metadata; on the vLLM wire strict
  readers see the `AllBlocksCleared` alone. `on_gap="count"` only counts
  and logs (the `RelayStatistics` `gaps`/`missing`, the summary
  line, the metrics).
* Two upstreams claiming one origin would mix two sequences: the second one's
  batches are refused, counted and logged.
* `Relay.stop()` is graceful where the subscriber allows it: a ZMQ
  subscriber delivers what has arrived and lets a replay in flight finish
  (within a grace period) before the relay returns.

Each origin's events pass through a bounded channel to the scheduler's source
for that origin (backpressure reaches the subscriber, never memory). On
`Relay.stop()` the readers stop, the channels are drained into the
scheduler, and the caller closes the scheduler to deliver what is pending.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import Final, NamedTuple

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvstream._burst_log import BurstLogs
from kvstream._redact import redact_url
from kvstream.consumers.base import Gap, Subscriber
from kvstream.errors import ConfigError
from kvstream.events import AllBlocksCleared, EventBatch, KVCacheEvent
from kvstream.scheduler import Scheduler
from kvstream.sources._base import SourceHandle

__all__ = ["GAP_POLICIES", "Relay", "RelayStatistics", "gap_marker"]

#: What the relay does with an upstream gap: mark it in the output, or only count it.
GAP_POLICIES: Final = ("clear", "count")

log = logging.getLogger("kvstream.relay")

#: Chunks (upstream batches) waiting per origin before the reader waits.
DEFAULT_QUEUE_CHUNKS: Final = 64
#: How long stop() waits for the channels to drain into the scheduler.
_DRAIN_TIMEOUT: Final = 5.0
#: Seconds a stopping subscriber may take to finish a replay in flight.
STOP_GRACE: Final = 2.0
#: Seconds a burst of refused batches of one conflicting origin lasts: one error each.
CONFLICT_BURST: Final = 10.0


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
    #: Upstream gaps marked in the output (`on_gap="clear"`).
    gaps_marked: int = 0
    #: Events the subscribers' decoders refused (no dialect reads them); the rest of
    #: their batches was carried.
    events_refused: int = 0


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

    `drained` is set once the channel is closed and everything in it was
    yielded (so accepted by the scheduler), or the source was stopped.
    """
    try:
        async with receive:
            async for events in receive:
                yield events
    finally:
        drained.set()


class Relay:
    """Feeds `subscribers` into `scheduler`; see the module doc.


        async with Scheduler(sinks=sinks, tick_interval=0.05) as scheduler:
            relay = Relay(scheduler, [open_subscriber(url) for url in urls])
            await relay.run()           # until the subscribers end or stop()
            await scheduler.aclose()

    The subscribers must be open (entered) while `run()` runs.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        subscribers: Sequence[Subscriber],
        *,
        names: Sequence[str] | None = None,
        queue_chunks: int = DEFAULT_QUEUE_CHUNKS,
        on_gap: str = "clear",
    ) -> None:
        if on_gap not in GAP_POLICIES:
            raise ConfigError(
                f"Relay: on_gap: expected one of {', '.join(GAP_POLICIES)}, got {on_gap!r}"
            )
        self.on_gap = on_gap
        #: Gap markers for origins that have no feed yet (prepended to their first events).
        self._pending_marks: dict[str, list[KVCacheEvent]] = {}
        self._gaps_marked = 0
        self.scheduler = scheduler
        self.subscribers = list(subscribers)
        # Names are shown in logs, task names and statistics: a URL loses its secrets.
        self.names = (
            [redact_url(name) for name in names]
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
        #: One error per origin and burst of conflicting batches.
        self._conflict_log: BurstLogs[str] = BurstLogs(log, CONFLICT_BURST, level=logging.ERROR)
        # counters
        self._batches_in = 0
        self._events_in = 0
        self._gaps = 0
        self._missing = 0
        self._restarts = 0
        self._conflicts = 0
        self._failed: list[str] = []

    async def run(self) -> None:
        """Carry every subscriber until all have ended or `stop()` is called.

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
        """Stop reading; `run()` then hands what it took to the scheduler and returns.

        Subscribers that can stop gracefully (a `stop(grace)` method, as the
        ZMQ subscriber has) deliver what has already arrived and finish replays
        in flight for up to `grace` seconds; the others stop at once.
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
                            if self.on_gap == "clear":
                                await self._mark_gap(index, item)
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

    async def _mark_gap(self, index: int, gap: Gap) -> None:
        """Put the gap into the origin's output stream (see the module doc)."""
        marker = gap_marker(gap)
        self._gaps_marked += 1
        feed = self._feeds.get(gap.origin)
        if feed is None:
            self._pending_marks.setdefault(gap.origin, []).append(marker)
            return
        if feed.owner != index:
            return  # another upstream's origin: its batches are refused too
        await self._send(feed, [marker])

    async def _send(self, feed: _Feed, events: list[KVCacheEvent]) -> None:
        try:
            await feed.send.send(events)
        except anyio.get_cancelled_exc_class():
            # Stopping: the chunk in hand still goes in (the channel drains on stop).
            with anyio.CancelScope(shield=True), anyio.move_on_after(_DRAIN_TIMEOUT):
                await feed.send.send(events)
            raise

    async def _forward(self, index: int, batch: EventBatch) -> None:
        feed = self._feeds.get(batch.origin)
        if feed is None:
            feed = self._open_feed(index, batch)
        elif feed.owner != index:
            self._conflicts += 1
            self._conflict_log.log(
                batch.origin,
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
            if feed.epoch is not None and getattr(batch, "is_snapshot", False):
                # A snapshot under the publisher's own epoch (a ZMQ subscriber names
                # the epoch once it learns it): its AllBlocksCleared is the clear.
                log.info("relay: origin %s continues from a snapshot", batch.origin)
            elif feed.epoch is not None:
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
        marks = self._pending_marks.pop(batch.origin, None)
        if marks:
            events = [*marks, *events]
        if events:
            await self._send(feed, events)

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
            gaps_marked=self._gaps_marked,
            events_refused=sum(_refused_by(sub) for sub in self.subscribers),
        )


def _refused_by(sub: Subscriber) -> int:
    """Events a subscriber's decoder refused: per origin (ZMQ) or its codec's count."""
    stats = getattr(sub, "statistics", None)
    if callable(stats):
        records = stats()
        if isinstance(records, tuple) and all(hasattr(r, "events_refused") for r in records):
            return sum(int(r.events_refused) for r in records)
    refused = getattr(getattr(sub, "codec", None), "events_refused", 0)
    return refused if type(refused) is int else 0


def gap_marker(gap: Gap) -> AllBlocksCleared:
    """The `AllBlocksCleared` that stands for an upstream gap in the relay's output."""
    return AllBlocksCleared(
        metadata={
            "upstream_gap": {
                "epoch": gap.epoch,
                "first_missing": gap.first_missing,
                "next_seq": gap.next_seq,
                "missing": gap.missing,
                "reason": gap.reason[:200],
            }
        }
    )
