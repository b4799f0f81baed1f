"""What the NATS and Redis subscribers share: lifetime, backoff, where to start, continuity.

Both read a broker that keeps history, one message per batch with the batch's
name beside its payload (`kvstream._wire.broker`). They differ in how they
connect, fetch and acknowledge; the rest is written here once:

* **where to start**: `from_seq` (an int, or `{origin: seq}` with `"*"`
  for the others) skips, in the first epoch seen of each origin, the batches
  below it; then the [`SequenceTracker`][kvstream.consumers.base.SequenceTracker] drops
  repeats and reports gaps (`BrokerSubscriber._admit()`);
* **backoff**: a failed read waits `retry_initial` seconds, doubling up to
  `retry_max`, and an outage is logged twice: when it starts and when
  reading works again (`Outage`, waiting by `kvstream._backoff.Backoff`);
* **lifetime**: `async with` connects (a failure to start is raised as it
  is), iteration runs one reading generator, and `BrokerSubscriber.aclose()`
  ends that generator (so it can acknowledge what was handed over) and closes
  the connection, even when the graceful part fails;
* **snapshots** (where the sink publishes them, see `docs/recovery.md`): on
  a cold start the subscriber delivers the newest snapshot of every origin its
  subject or stream covers, each as one
  [`SnapshotBatch`][kvstream.consumers.socket.SnapshotBatch], and reads the stream from
  the oldest of their positions, dropping what each snapshot already holds;
  and when an origin's batches jump (a [`Gap`][kvstream.consumers.base.Gap], or the first batch seen
  of an epoch is not seq 0) and its newest snapshot covers the jump, the
  snapshot is delivered instead of the gap and reading goes on exactly after
  it. A gap no snapshot covers is reported as before. `snapshots=None` (the
  default) turns this on unless the reader asked for a position of its own
  (`from_seq`, a durable consumer, a Redis group);
* **liveness** (`heartbeats=True`, where the sink sends heartbeats): every
  batch and heartbeat of an origin is a sign of life; an origin that announced
  a heartbeat interval and was not heard from for two of them is reported
  `gone` (and `back` or `restarted` when it is heard again), to the
  `on_liveness` callback, in the log, and in `BrokerSubscriber.liveness()`,
  so an index can expire it ([`mark_stale()`][kvstream.index._prefix.PrefixIndex.mark_stale]
  or `forget`). The check runs while the subscriber is read (each read waits
  at most its poll interval);
* the URL options every broker subscriber takes (`reader_options()`).
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Generic, Self, TypedDict, TypeVar

import anyio
import anyio.lowlevel

from kvstream._backoff import Backoff
from kvstream._one_reader import OneReader
from kvstream._wire.broker import Heartbeat, PayloadDecoder, SnapshotInfo, read_envelope
from kvstream._wire.codec_names import CodecByName
from kvstream._wire.from_seq import FromSeq, check_from_seq, start_seq
from kvstream.codecs.base import Codec
from kvstream.consumers.base import (
    Continuity,
    Gap,
    Liveness,
    LivenessChange,
    LivenessTracker,
    SequenceTracker,
    Subscriber,
    SubscriberItem,
    report_liveness,
)
from kvstream.consumers.socket import SnapshotBatch
from kvstream.errors import ClosedError, DecodeError, KVStreamError
from kvstream.events import EventBatch, KVCacheEvent

__all__ = ["BrokerSubscriber", "Outage", "ReaderOptions", "as_snapshot_batch"]

log = logging.getLogger("kvstream.consumers")

ClientT = TypeVar("ClientT")


class ReaderOptions(TypedDict, total=False):
    """The keyword arguments every broker subscriber takes (see `BrokerSubscriber`)."""

    follow: bool
    from_seq: FromSeq
    codec: Codec | None
    connect_timeout: float
    retry_initial: float
    retry_max: float
    snapshots: bool | None
    heartbeats: bool
    on_liveness: Callable[[LivenessChange], object] | None
    codecs: CodecByName | None


class Outage:
    """One reading loop's retries: waits by a `Backoff`, logs an outage once.

    The first failure of an outage is logged at WARNING (`<where>: <error>;
    <retrying> with backoff`), the ones after it are only counted, and the
    first success after them logs how many attempts failed.
    """

    __slots__ = ("backoff", "retrying", "where")

    def __init__(self, backoff: Backoff, where: str, retrying: str) -> None:
        self.backoff = backoff
        self.where = where
        self.retrying = retrying

    @property
    def failures(self) -> int:
        """Failed attempts since the last success."""
        return self.backoff.failures

    async def wait(self, exc: Exception) -> None:
        """Count the failure `exc` and sleep before the next attempt."""
        if self.backoff.failures == 0:
            said = str(exc)  # kvstream's errors already start with the URL
            if not said.startswith(self.where):
                said = f"{self.where}: {said}"
            log.warning("%s; %s with backoff", said, self.retrying)
        await self.backoff.wait()

    def succeeded(self) -> None:
        """An attempt worked: the next failure starts a new outage."""
        if self.backoff.failures:
            failures = self.backoff.failures
            log.warning(
                "%s: reading again after %d failed attempt%s",
                self.where,
                failures,
                "" if failures == 1 else "s",
            )
            self.backoff.reset()


class BrokerSubscriber(Subscriber, Generic[ClientT]):
    """The broker-independent part of [`NatsSubscriber`][kvstream.consumers.nats.NatsSubscriber]
    and [`RedisSubscriber`][kvstream.consumers.redis.RedisSubscriber].

    `url` is what the client connects to, `shown` the same without
    credentials (for messages). `follow=False` stops once the subscriber has
    caught up. `codec` decodes messages that do not name their codec
    (default JSON); `codecs` finds the codec a message names (default:
    kvstream's own; through a URL, the registry's). See the module doc for
    `from_seq`, `retry_initial` and `retry_max`.

    A subclass connects in `_connect()` (setting `_client`), closes in
    `_disconnect()`, and reads in `_read()`, an async generator that
    turns each decoded batch into items with `_admit()`.
    """

    def __init__(
        self,
        url: str,
        shown: str,
        *,
        follow: bool = True,
        from_seq: FromSeq = None,
        codec: Codec | None = None,
        connect_timeout: float = 5.0,
        retry_initial: float = 0.05,
        retry_max: float = 5.0,
        snapshots: bool | None = None,
        heartbeats: bool = False,
        on_liveness: Callable[[LivenessChange], object] | None = None,
        codecs: CodecByName | None = None,
    ) -> None:
        self.url = url
        self.shown = shown
        self.follow = follow
        self.from_seq = check_from_seq(from_seq, shown)
        self.decoder = PayloadDecoder(codec, codecs)
        self.connect_timeout = connect_timeout
        Backoff(retry_initial, retry_max, where=f"{shown}: retry")  # refuses bad values now
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self.tracker = SequenceTracker()
        self._client: ClientT | None = None
        self._gen: AsyncGenerator[SubscriberItem, None] | None = None
        self._closed = False
        #: None: decided by the subclass (on unless the reader chose a position).
        self._snapshots_wanted = snapshots
        #: Snapshots delivered (cold start and repaired gaps).
        self.snapshots_delivered = 0
        #: Stored snapshots that could not be read (skipped, logged).
        self.bad_snapshots = 0
        self._cold_started = False
        self._pending: deque[SubscriberItem] = deque()
        # The batch whose arrival showed a jump a snapshot might cover, with its
        # position in the stream (see _admit).
        self._jumped: tuple[EventBatch, Any, int] | None = None
        #: Whether heartbeats are listened to (see the module doc).
        self.heartbeats = heartbeats
        self.on_liveness = on_liveness
        self.liveness_tracker = LivenessTracker(time.monotonic)
        #: Liveness changes reported (gone, back, restarted).
        self.liveness_changes = 0
        # origin -> stream position of its delivered snapshot: its batches up to
        # there (of any epoch) are in the snapshot or older than it, and skipped.
        self._covered: dict[str, Any] = {}

    # -- what a broker provides ---------------------------------------------------------

    @abstractmethod
    async def _connect(self) -> None:
        """Connect and set `_client`; raise a `KVStreamError` on failure."""

    @abstractmethod
    async def _disconnect(self) -> None:
        """Forget `_client` (and what hangs on it) and close it, without raising."""

    @abstractmethod
    def _read(self) -> AsyncGenerator[SubscriberItem, None]:
        """The items, in stream order; the generator `__aiter__()` returns."""

    def _interrupt(self) -> None:
        """Stop a wait another task may be in, at `aclose()` (by default nothing)."""

    async def _snapshot_heads(
        self, client: ClientT, origin: str | None
    ) -> list[tuple[SnapshotInfo, Any]]:
        """The newest stored snapshot of `origin` (None: of every origin), as its info and
        whatever `_snapshot_envelope()` needs to fetch it. By default none."""
        return []

    async def _snapshot_envelope(
        self, client: ClientT, info: SnapshotInfo, where: Any
    ) -> bytes | None:
        """The envelope of a snapshot `_snapshot_heads()` named (None: gone meanwhile)."""
        return None

    def _covers(self, info: SnapshotInfo) -> bool:
        """True when the origin's batches are on what this subscriber reads."""
        return True

    def _position(self, text: str) -> Any:
        """A stream position (of a snapshot's info) as a value that compares in stream order."""
        return int(text)

    # -- liveness -------------------------------------------------------------------

    def liveness(self) -> dict[str, Liveness]:
        """`{origin: Liveness}`: who was heard from when, and who is gone."""
        return self.liveness_tracker.snapshot()

    def _on_heartbeat(self, hb: Heartbeat) -> None:
        self._report(self.liveness_tracker.heard(hb.origin, hb.epoch, hb.seq, hb.interval))

    def _check_liveness(self) -> None:
        if self.heartbeats:
            self._report(self.liveness_tracker.check())

    def _report(self, changes: list[LivenessChange]) -> None:
        self.liveness_changes += report_liveness(changes, self.shown, self.on_liveness)

    @property
    def snapshots(self) -> bool:
        """Whether this subscriber takes snapshots (see the module doc)."""
        return bool(self._snapshots_wanted)

    # -- lifetime -----------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._closed:
            raise ClosedError(f"{self!r}: the subscriber is closed")
        if self._client is None:
            await self._connect()
        return self

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._interrupt()
        gen, self._gen = self._gen, None
        with anyio.CancelScope(shield=True):
            try:
                if gen is not None:
                    try:
                        await gen.aclose()
                    except RuntimeError:  # being iterated in another task: it sees _closed
                        pass
            finally:
                await self._disconnect()

    def __aiter__(self) -> AsyncIterator[SubscriberItem]:
        if self._closed:
            raise ClosedError(f"{self!r}: the subscriber is closed")
        if self._gen is None:
            self._gen = self._read()
        return OneReader(self._gen, repr(self), type(self).__name__)

    def _stopping(self) -> bool:
        return self._closed  # a call, so that type checkers do not assume it unchanged

    def _backoff(self, retrying: str) -> Outage:
        """A fresh `Outage` for one reading loop."""
        backoff = Backoff(self._retry_initial, self._retry_max, where=f"{self.shown}: retry")
        return Outage(backoff, self.shown, retrying)

    # -- from a decoded batch to items --------------------------------------------------

    def _admit(self, batch: EventBatch, position: Any = None) -> list[SubscriberItem]:
        """`batch` and the gap before it, if any; [] when it is skipped or a repeat.

        `position` is the batch's place in the stream (as `_position()`
        makes them). When snapshots are on, a batch at or before its origin's
        delivered snapshot is skipped (it is in the snapshot, or of an older
        epoch), and a batch that shows a jump is remembered for `_repair()`,
        which the reading loop awaits before yielding.
        """
        covered = self._covered.get(batch.origin) if self._covered else None
        if covered is not None and position is not None and position <= covered:
            return []
        if self.from_seq is not None and self.tracker.position(batch.origin) is None:
            first = start_seq(self.from_seq, batch.origin)
            if first is not None and batch.seq < first:
                return []
        state, gap = self.tracker.check(batch)
        if state is Continuity.DUPLICATE:
            return []
        if self.heartbeats:
            self._report(self.liveness_tracker.heard(batch.origin, batch.epoch, batch.seq))
        if self.snapshots:
            if gap is not None:
                self._jumped = (batch, position, gap.first_missing)
            elif state in (Continuity.FIRST, Continuity.NEW_EPOCH) and batch.seq > 0:
                self._jumped = (batch, position, 0)
        return [gap, batch] if gap is not None else [batch]

    async def _repair(self, items: list[SubscriberItem]) -> list[SubscriberItem]:
        """`items`, or the snapshot that covers the jump they show and what follows it."""
        jumped, self._jumped = self._jumped, None
        client = self._client
        if jumped is None or client is None:
            return items
        batch, position, first_missing = jumped
        try:
            heads = await self._snapshot_heads(client, batch.origin)
        except KVStreamError as exc:
            log.warning("%s: snapshot of %s not read: %s", self.shown, batch.origin, exc)
            return items
        for info, where in heads:
            if info.origin != batch.origin or not self._covers(info):
                continue
            at = self._position(info.position)
            later = position is not None and at >= position  # holds this batch (or a newer epoch)
            if not later and (info.epoch != batch.epoch or info.resume_seq < batch.seq):
                continue  # older than the jump: it cannot fill it
            snap = await self._load_snapshot(client, info, where, first_missing)
            if snap is None:
                continue
            tracker = self.tracker
            if items and isinstance(items[0], Gap):  # repaired: not a loss
                tracker.gaps -= 1
                tracker.missing -= items[0].missing
            tracker.expect(snap.origin, snap.epoch, snap.next_seq)
            self._covered[snap.origin] = at
            if later:
                return [snap]
            state, _ = tracker.check(batch)
            return [snap, batch] if state is Continuity.NEXT else [snap]
        return items

    async def _cold_start(self, client: ClientT) -> list[SnapshotInfo]:
        """Queue the newest snapshot of every origin this subscriber covers; their infos.

        Runs once, on the first connection, when snapshots are on.
        """
        if self._cold_started or not self.snapshots:
            return []
        self._cold_started = True
        used: list[SnapshotInfo] = []
        for info, where in await self._snapshot_heads(client, None):
            if not self._covers(info):
                continue
            snap = await self._load_snapshot(client, info, where, 0)
            if snap is None:
                continue
            self.tracker.expect(snap.origin, snap.epoch, snap.next_seq)
            self._covered[snap.origin] = self._position(info.position)
            self._pending.append(snap)
            used.append(info)
        return used

    async def _load_snapshot(
        self, client: ClientT, info: SnapshotInfo, where: Any, first_missing: int
    ) -> SnapshotBatch | None:
        try:
            data = await self._snapshot_envelope(client, info, where)
            if data is None:
                return None
            stored, parts = read_envelope(data, f"{self.shown}: snapshot of {info.origin}")
            if stored._replace(parts=()) != info._replace(parts=()):
                return None  # replaced meanwhile by a newer one
            key = (info.origin, info.epoch, info.resume_seq - 1)
            events: list[KVCacheEvent] = []
            batch: EventBatch | None = None
            for part in parts:
                batch = self.decoder.decode(bytes(part), key, info.codec)
                events.extend(batch.events)
                await anyio.lowlevel.checkpoint()
        except (DecodeError, ValueError) as exc:
            self.bad_snapshots += 1
            log.warning("%s: snapshot of %s skipped: %s", self.shown, info.origin, exc)
            return None
        rank = batch.data_parallel_rank if batch is not None else None
        whole = EventBatch._trusted(
            info.resume_seq - 1, info.ts, events, rank, info.origin, info.epoch
        )
        self.snapshots_delivered += 1
        return as_snapshot_batch(whole, first_missing)


def as_snapshot_batch(batch: EventBatch, first_missing: int) -> SnapshotBatch:
    """`batch` (a snapshot encoded as the batch `resume_seq - 1`) as a `SnapshotBatch`.

    One snapshot type for every transport: the socket subscriber's.
    """
    snap = SnapshotBatch._trusted(
        batch.seq, batch.ts, batch.events, batch.data_parallel_rank, batch.origin, batch.epoch
    )
    assert isinstance(snap, SnapshotBatch)
    snap.first_missing = first_missing
    return snap
