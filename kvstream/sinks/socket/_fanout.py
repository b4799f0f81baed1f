"""The socket sink's fan-out: one replay ring, read by every subscriber at its own pace.

`Fanout` is what [`SocketSink`][kvstream.sinks.socket.SocketSink] does with
batches, without the sockets (see that module's doc for the guarantees):

* `Fanout.publish()` frames a batch once and appends it to the ring; it
  never waits. A subscriber the ring outran, or whose lag passed
  `subscriber_bytes`, is handled by the `slow` policy: `disconnect`
  cancels its connection, `drop` skips batches and queues a gap notice;
* `Fanout.join()` plans a new subscriber's replay from its hello and
  registers it in one step, so no batch falls between the two; where the
  ring no longer holds what it asks for it gets a gap notice or, with a
  snapshot provider and a scheduler, waits for a snapshot;
* `Fanout.at_barrier()` takes that snapshot inside the scheduler's tick;
* `Fanout.gather()` hands a subscriber's writer its next frames.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Final, Literal, get_args

import anyio
import anyio.abc

from kvstream._burst_log import BurstLog
from kvstream._wire.socket_protocol import (
    Hello,
    OriginInfo,
    ProtocolError,
    batch_message,
    control_message,
    framing_of,
    message_size,
    welcome_line,
)
from kvstream.codecs.base import Codec
from kvstream.events import EventBatch, KVCacheEvent
from kvstream.sinks._encoding import held_bytes
from kvstream.sinks._replay_ring import Fifo, ReplayRing
from kvstream.sinks.socket._subscription import (
    RingEntry,
    SharedSnapshot,
    SnapshotWait,
    Subscription,
)

__all__ = [
    "SLOW_POLICIES",
    "BarrierRequest",
    "Fanout",
    "OriginState",
    "SlowPolicy",
    "SnapshotProvider",
]

log = logging.getLogger("kvstream.sinks.socket")

SlowPolicy = Literal["disconnect", "drop"]
SLOW_POLICIES: Final[tuple[str, ...]] = get_args(SlowPolicy)
#: A zero-argument callable returning the events that rebuild the producer's
#: current state: `AllBlocksCleared` then `BlockStored` events, parents first.
SnapshotProvider = Callable[[], Iterable[KVCacheEvent]]
#: `call_at_barrier(callback)`: the scheduler calls ``callback(origin, epoch,
#: next_seq)`` once, inside its next tick, right after sealing.
BarrierRequest = Callable[[Callable[[str, str, int], None]], None]

#: What a ring entry costs beyond its frame (the entry tuple and its seq, the
#: ring's list slots and offset, the origin's position index), measured.
_ENTRY_OVERHEAD: Final = 256
#: A writer sends up to this many bytes of frames per write.
_CHUNK_BYTES: Final = 256 * 1024


class OriginState:
    """What the sink knows of one origin's current epoch."""

    __slots__ = ("data_parallel_rank", "epoch", "newest", "positions")

    def __init__(self, epoch: str) -> None:
        self.epoch = epoch
        self.newest = -1
        self.data_parallel_rank: int | None = None
        #: ring positions of this epoch's entries, oldest first
        self.positions: Fifo[int] = Fifo()


class Fanout:
    """The replay ring, the origins it holds, and the subscribers reading it.

    `name` is the sink's, for log records. See the module doc.
    """

    def __init__(
        self,
        *,
        name: str,
        codec: Codec,
        ring_bytes: int,
        subscriber_bytes: int,
        slow: SlowPolicy,
        snapshot_timeout: float,
        snapshot_provider: SnapshotProvider | None,
    ) -> None:
        self.name = name
        self.codec = codec
        self.framing = framing_of(codec)
        self.subscriber_bytes = subscriber_bytes
        self.slow: SlowPolicy = slow
        self.snapshot_timeout = snapshot_timeout
        self.snapshot_provider = snapshot_provider
        self.ring: ReplayRing[RingEntry] = ReplayRing(ring_bytes)
        self.origins: dict[str, OriginState] = {}
        self.subscriptions: list[Subscription] = []
        #: How to reach the scheduler's tick barrier (set by the scheduler).
        self.barrier: BarrierRequest | None = None
        self._barrier_pending = False
        self._slowness = BurstLog(log)
        self._oversize = BurstLog(log)
        # counters
        self.slow_disconnects = 0
        self.batches_dropped = 0
        self.gap_notices = 0
        #: Batches (and snapshots) bigger than their subscriber's message cap.
        self.too_large = 0

    # -- publishing ---------------------------------------------------------------------

    def publish(self, data: bytes, batch: EventBatch) -> None:
        """Append one batch to the ring and wake the subscribers. Never waits."""
        frame = batch_message(data, batch, self.framing)
        origin = batch.origin
        state = self.origins.get(origin)
        if state is None or state.epoch != batch.epoch:
            state = self.origins[origin] = OriginState(batch.epoch)
        ring = self.ring
        pos = ring.end_pos
        # What the entry really costs: the frame as allocated, and its bookkeeping.
        evicted = ring.append(
            (origin, batch.epoch, batch.seq, frame), held_bytes(len(frame)) + _ENTRY_OVERHEAD
        )
        state.positions.append(pos)
        state.newest = batch.seq
        state.data_parallel_rank = batch.data_parallel_rank
        for old_pos, entry in evicted:
            old = self.origins.get(entry[0])
            if (
                old is not None
                and old.epoch == entry[1]
                and old.positions
                and old.positions[0] == old_pos
            ):
                old.positions.popleft()
        if not self.subscriptions:
            return
        first = ring.first_pos
        limit = self.subscriber_bytes
        end_offset = ring.end_offset
        for sub in self.subscriptions:
            if sub.cursor < first:
                self._fell_behind(sub, evicted)
            if not sub.gone:
                start = sub.cursor if sub.cursor > sub.replay_end else sub.replay_end
                if end_offset - ring.offset(start) > limit:
                    self._too_slow(sub)
            sub.wake()
        if any(s.gone for s in self.subscriptions):
            self.subscriptions = [s for s in self.subscriptions if not s.gone]

    def _fell_behind(self, sub: Subscription, evicted: list[tuple[int, RingEntry]]) -> None:
        """Entries `sub` had not taken were evicted (a replay the ring outran, or a
        batch bigger than the ring's room). Only those it would have been sent count."""
        lost = [
            entry
            for pos, entry in evicted
            if pos >= sub.cursor and entry[0] not in sub.awaiting and sub.wants(pos, entry)
        ]
        sub.cursor = self.ring.first_pos
        if not lost:
            return
        if self.slow == "disconnect":
            self._disconnect_slow(sub)
            return
        for entry in lost:
            self._note_drop(sub, entry)
        self._announce_drops(sub)

    def _too_slow(self, sub: Subscription) -> None:
        if self.slow == "disconnect":
            self._disconnect_slow(sub)
            return
        ring = self.ring
        target = ring.end_offset - self.subscriber_bytes
        pos = sub.cursor
        end = ring.end_pos
        while pos < end and ring.offset(max(pos, sub.replay_end)) < target:
            entry = ring.get(pos)
            if sub.wants(pos, entry):
                self._note_drop(sub, entry)
            pos += 1
        sub.cursor = pos
        self._announce_drops(sub)

    def _disconnect_slow(self, sub: Subscription) -> None:
        sub.gone = True
        sub.scope.cancel()
        self.slow_disconnects += 1
        self._slowness.log(
            "%s: subscriber %s fell more than %d bytes behind; disconnected "
            "(it can resume from the ring)",
            self.name,
            sub.peer,
            self.subscriber_bytes,
        )

    def _note_drop(self, sub: Subscription, entry: RingEntry) -> None:
        origin, epoch, seq = entry[0], entry[1], entry[2]
        if origin in sub.awaiting:  # the snapshot it waits for replaces these
            return
        sub.batches_dropped += 1
        self.batches_dropped += 1
        gap = sub.drop_gaps.get(origin)
        if gap is not None and gap[0] == epoch and gap[2] == seq:
            gap[2] = seq + 1
            return
        if gap is not None:
            self._queue_gap(sub, origin, gap[0], gap[1], gap[2], "dropped")
        sub.drop_gaps[origin] = [epoch, seq, seq + 1]

    def _announce_drops(self, sub: Subscription) -> None:
        if not sub.drop_gaps:
            return
        n = sum(g[2] - g[1] for g in sub.drop_gaps.values())
        for origin, (epoch, first, nxt) in sub.drop_gaps.items():
            self._queue_gap(sub, origin, epoch, first, nxt, "dropped")
        sub.drop_gaps.clear()
        self._slowness.log(
            "%s: subscriber %s fell more than %d bytes behind; %d batches skipped for it",
            self.name,
            sub.peer,
            self.subscriber_bytes,
            n,
        )

    def too_large_for(
        self, sub: Subscription, origin: str, epoch: str, first: int, nxt: int, size: int
    ) -> None:
        """A message of `size` bytes for batches `[first, nxt)` is over what `sub`
        reads: it gets a gap notice instead (sent, the subscriber would drop the
        connection, reconnect and be sent it again, for ever)."""
        self.too_large += 1
        self._oversize.log(
            "%s: %s epoch %s seq %d..%d is %d bytes, more than subscriber %s reads "
            "(max_message_bytes %d); sent a gap notice instead",
            self.name,
            origin,
            epoch,
            first,
            nxt - 1,
            size,
            sub.peer,
            sub.max_message,
        )
        self._queue_gap(sub, origin, epoch, first, nxt, "too_large")

    def _queue_gap(
        self, sub: Subscription, origin: str, epoch: str, first: int, nxt: int, reason: str
    ) -> None:
        self.gap_notices += 1
        sub.control.append(
            control_message(
                {
                    "type": "gap",
                    "origin": origin,
                    "epoch": epoch,
                    "first_missing": first,
                    "next_seq": nxt,
                    "reason": reason,
                },
                self.framing,
            )
        )

    # -- subscribers --------------------------------------------------------------------

    def join(
        self, hello: Hello, peer: str, stream: anyio.abc.ByteStream, scope: anyio.CancelScope
    ) -> Subscription:
        """Plan the replay and register, in one step: nothing published can fall between."""
        ring = self.ring
        head = ring.end_pos
        sub = Subscription(peer, stream, scope, hello.max_message_bytes)
        infos: dict[str, OriginInfo] = {}
        gaps: list[tuple[str, str, int, int]] = []
        can_snapshot = self.snapshot_provider is not None and self.barrier is not None
        for origin, state in self.origins.items():
            held = len(state.positions) > 0
            oldest = ring.get(state.positions[0])[2] if held else state.newest + 1
            infos[origin] = OriginInfo(state.epoch, oldest if held else None, state.newest)
            n = hello.start_for(origin)
            if n is None:
                continue
            asked_epoch = hello.epoch_for(origin)
            if asked_epoch is not None and asked_epoch != state.epoch:
                n = 0  # the producer restarted since: all of the new epoch
            elif n > state.newest + 1:
                raise ProtocolError(
                    f"from_seq {n} of origin {origin!r} is ahead of the newest batch "
                    f"{state.newest} of epoch {state.epoch}",
                    "from_seq_ahead",
                )
            if n >= oldest:
                sub.starts[origin] = _position_of(ring, state, n, head)
                continue
            sub.starts[origin] = state.positions[0] if held else head
            if can_snapshot:
                sub.awaiting[origin] = SnapshotWait(state.epoch, n, oldest)
            else:
                gaps.append((origin, state.epoch, n, oldest))
        sub.replay_end = head
        sub.cursor = min(sub.starts.values(), default=head)
        sub.control.append(welcome_line(self.codec, infos, snapshot=can_snapshot))
        for origin, epoch, first, nxt in gaps:
            self._queue_gap(sub, origin, epoch, first, nxt, "evicted")
        if sub.awaiting:
            sub.snapshot_deadline = anyio.current_time() + self.snapshot_timeout
            if not self._barrier_pending and self.barrier is not None:
                self._barrier_pending = True
                self.barrier(self.at_barrier)
        self.subscriptions.append(sub)
        log.debug("%s: subscriber %s joined (from_seq %r)", self.name, peer, hello.from_seq)
        return sub

    def leave(self, sub: Subscription) -> None:
        """`sub`'s connection ended: stop serving it."""
        sub.gone = True
        if sub in self.subscriptions:
            self.subscriptions.remove(sub)

    def wake_all(self) -> None:
        """Wake every subscriber's writer (the sink is closing)."""
        for sub in self.subscriptions:
            sub.wake()

    def gather(self, sub: Subscription) -> tuple[bytearray, int]:
        """Frames for `sub` from its cursor, up to `_CHUNK_BYTES`; advances it.

        A batch bigger than the subscriber reads ends the chunk: it is counted as
        dropped for `sub` and a gap notice queued, to be sent after the chunk.
        """
        ring = self.ring
        pos = max(sub.cursor, ring.first_pos)
        end = ring.end_pos
        out = bytearray()
        n = 0
        wants = sub.wants
        get = ring.get
        cap = sub.max_message
        while pos < end and len(out) < _CHUNK_BYTES:
            entry = get(pos)
            pos += 1
            if wants(pos - 1, entry):
                frame = entry[3]
                if len(frame) > cap and message_size(frame, self.framing) > cap:
                    sub.batches_dropped += 1
                    self.batches_dropped += 1
                    origin, epoch, seq = entry[0], entry[1], entry[2]
                    self.too_large_for(sub, origin, epoch, seq, seq + 1, len(frame))
                    break
                out += frame
                n += 1
        sub.cursor = pos
        return out, n

    def lag_bytes(self, sub: Subscription) -> int:
        """Bytes that arrived since `sub` connected and are not yet written to it."""
        ring = self.ring
        start = max(sub.cursor, sub.replay_end, ring.first_pos)
        return ring.end_offset - ring.offset(start)

    # -- snapshots ------------------------------------------------------------------

    def at_barrier(self, origin: str, epoch: str, next_seq: int) -> None:
        """Inside the scheduler's tick, right after it sealed: take the snapshot now."""
        self._barrier_pending = False
        waiting = [s for s in self.subscriptions if s.awaiting]
        if not waiting:
            return
        serve = [s for s in waiting if origin in s.awaiting]
        snapshot: SharedSnapshot | None = None
        provider = self.snapshot_provider
        if serve and provider is not None:
            try:
                events = list(provider())
                for i, e in enumerate(events):
                    if not isinstance(e, KVCacheEvent):
                        raise TypeError(f"item {i} is {type(e).__name__}, not a KV cache event")
            except Exception as exc:
                log.error("%s: snapshot provider failed: %r; sending gap notices", self.name, exc)
            else:
                state = self.origins.get(origin)
                rank = state.data_parallel_rank if state is not None else None
                snapshot = SharedSnapshot(origin, epoch, next_seq, rank, events)
        for sub in waiting:
            if snapshot is not None and origin in sub.awaiting:
                wait = sub.awaiting.pop(origin)
                sub.snapshots.append((snapshot, wait.first_missing))
                sub.min_seq[origin] = (epoch, next_seq)
            # Only the scheduler's own origin has a snapshot: the others get gaps.
            for other in list(sub.awaiting):
                self.no_snapshot(sub, "no snapshot for this origin", other)
            sub.wake()

    def no_snapshot(self, sub: Subscription, why: str, origin: str | None = None) -> None:
        """`sub` gets a gap notice instead of the snapshot of `origin` (None: of all)."""
        for name in [origin] if origin is not None else list(sub.awaiting):
            wait = sub.awaiting.pop(name)
            log.info(
                "%s: subscriber %s gets a gap for %s instead of a snapshot: %s",
                self.name,
                sub.peer,
                name,
                why,
            )
            self._queue_gap(sub, name, wait.epoch, wait.first_missing, wait.oldest, "evicted")


def _position_of(ring: ReplayRing[RingEntry], state: OriginState, seq: int, head: int) -> int:
    """Ring position of the origin's first held batch with a seq >= `seq` (or `head`)."""
    positions = state.positions
    lo, hi = 0, len(positions)
    if hi == 0:
        return head
    guess = seq - ring.get(positions[0])[2]  # exact when no seq is missing
    if 0 <= guess < hi and ring.get(positions[guess])[2] == seq:
        return positions[guess]
    while lo < hi:
        mid = (lo + hi) // 2
        if ring.get(positions[mid])[2] < seq:
            lo = mid + 1
        else:
            hi = mid
    return positions[lo] if lo < len(positions) else head
