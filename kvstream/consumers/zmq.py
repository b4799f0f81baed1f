"""ZMQ ingest: read vLLM / SGLang / TensorRT-LLM publishers, repairing gaps by replay.

`zmq+tcp://HOST:PORT?replay=tcp://HOST:PORT2&origin=NAME` (pyzmq, extra
`zmq`). Each publisher is one origin (`origin=`, by default its endpoint
without the scheme) and one sequence space. The subscriber connects a SUB to
it (or binds, when the endpoint holds `*`, for publishers that connect to a
central consumer) and, when it has a replay endpoint, a DEALER to that.

Per publisher it keeps continuity (`kvstream._wire.vllm_zmq` reads the
frames):

* **Start.** A publisher counts its batches from 0, so a fresh publisher first
  heard at seq > 0 (the subscriber started first: ZMQ's slow joiner drops
  what was sent before the connection) is replayed from 0 when it has a replay
  endpoint, and what its ring no longer has is reported as a [`Gap`][kvstream.consumers.base.Gap];
  without a replay endpoint the batches before the first one heard are
  reported as a gap. `join="live"` joins at the first batch heard instead,
  silently (for a tail that only wants what comes next). With `from_seq` it
  asks for a replay from there at once and holds live batches until the
  replay ends.
* **Gaps.** A live batch past the next expected one starts a replay of what
  is missing. While a replay is in flight, live batches wait in a bounded
  reorder buffer; replayed and held batches are delivered in sequence order,
  duplicates dropped by `seq`. Both reply layouts (with and without the topic
  frame) are read. Whatever the replay could not provide (older than the ring,
  a timeout, no replay endpoint) is reported as a [`Gap`][kvstream.consumers.base.Gap] item, never
  hidden. A buffer overflow drops the live batch (counted); the gap it leaves
  is repaired by the next replay.
* **Restarts and duplicates.** PUB/SUB delivers in order, so a live `seq`
  that goes back (normally to 0) means the publisher restarted: the origin
  gets a new epoch, and batches it missed since are asked from the new
  instance's ring. A live `seq` equal to the last one is a duplicate (a
  publisher resending), dropped and counted, never a restart.
* **Fan-in.** A bound subscriber (`*` in the endpoint, or `bind=1`) may have
  many publishers connected to it (vLLM connects its PUB when its endpoint
  has no `*`; llm-d's centralised mode): it keeps one origin per
  `(topic, data_parallel_rank)`, each with its own continuity, named
  `ORIGIN/TOPIC#dpRANK` (the topic part when the topic is not empty, the
  rank part when the batch carries one). Replays, when the bound endpoint has
  a replay endpoint, are asked and answered one at a time per link, each
  reply routed to the origin that asked.
* **Refused events.** A payload is decoded per event: an event no dialect
  reads is counted (`events_refused`) and logged once per burst, the rest
  of its batch is delivered.
* **Malformed frames** (wrong frame count, a seq frame not 8 bytes, a payload
  that does not decode) are skipped, counted and logged; a payload that does
  not decode under a valid seq is reported as a one-batch [`Gap`][kvstream.consumers.base.Gap].

The protocol state of one publisher (`PublisherStream`) does no I/O;
`ZmqSubscriber` moves frames between it and the sockets, all in the
consumer's task (a `zmq.asyncio` poller; no task of its own).
"""

from __future__ import annotations

import logging
import math
import secrets
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple, TypeAlias

import anyio
import msgspec

from kvstream._burst_log import BurstLog
from kvstream._checks import count, flag, function, seconds
from kvstream._wire.broker import Heartbeat
from kvstream._wire.vllm_zmq import (
    DEFAULT_HWM,
    ReplayBatch,
    normalize_endpoint,
    parse_live,
    parse_replay_reply,
    replay_request,
)
from kvstream._wire.zmq_recovery import (
    HEARTBEAT_TOPIC,
    SnapshotHead,
    SnapshotMessage,
    parse_heartbeat,
    parse_snapshot_message,
    snapshot_request,
)
from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.consumers._broker import as_snapshot_batch
from kvstream.consumers.base import (
    Continuity,
    Gap,
    Liveness,
    LivenessChange,
    LivenessTracker,
    Subscriber,
    SubscriberItem,
    continuity,
    report_liveness,
)
from kvstream.errors import (
    ClosedError,
    ConfigError,
    DecodeError,
    MissingDependencyError,
    TransportError,
)
from kvstream.events import EventBatch, KVCacheEvent

try:
    import zmq
    import zmq.asyncio
    from zmq.utils.monitor import parse_monitor_message
except ImportError as exc:  # pragma: no cover - the extra is installed in tests
    raise MissingDependencyError.for_extra("pyzmq", "zmq", exc) from exc

__all__ = [
    "PublisherStream",
    "ZmqPublisher",
    "ZmqPublisherStatistics",
    "ZmqSubscriber",
    "default_origin",
]

log = logging.getLogger("kvstream.consumers")
#: The continuity rule's usual answer, as a global (a member looked up on its enum: ~80 ns).
_NEXT: Final = Continuity.NEXT

DEFAULT_REPLAY_TIMEOUT: Final = 5.0
DEFAULT_MAX_REORDER: Final = 10_000
DEFAULT_MAX_REORDER_BYTES: Final = 64 * 1024 * 1024
#: The largest ZMQ message (a live payload, a replay reply) the subscriber takes
#: (`ZMQ_MAXMSGSIZE`): libzmq drops the connection on a bigger one before
#: allocating it.
DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
#: After a replay timed out, gaps are reported at once for this many timeouts.
_SUSPEND_FACTOR: Final = 6.0
#: Messages read from one socket before the others get a turn.
_READ_BUDGET: Final = 256
#: Origins one bound endpoint keeps apart; messages of further ones are refused
#: (counted, logged once), so a peer inventing topics cannot grow memory without bound.
MAX_FAN_IN: Final = 1024

#: Where a fresh publisher's stream begins: at seq 0 (replayed or reported as a
#: gap) or at the first batch heard.
Join: TypeAlias = Literal["start", "live"]
JOINS: Final = ("start", "live")


class _RankPeek(msgspec.Struct, array_like=True, gc=False):
    """The batch's rank without decoding its events (fan-in routing)."""

    ts: msgspec.Raw
    events: msgspec.Raw
    data_parallel_rank: int | None = None


_PEEK: Final = msgspec.msgpack.Decoder(_RankPeek)


def peek_rank(payload: bytes) -> int | None:
    """The `data_parallel_rank` of a payload frame (None when absent or unreadable)."""
    try:
        return _PEEK.decode(payload).data_parallel_rank
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def default_origin(endpoint: str) -> str:
    """The origin of a publisher nobody named: its endpoint without `tcp://`."""
    return endpoint[len("tcp://") :] if endpoint.startswith("tcp://") else endpoint


def _new_epoch() -> str:
    return secrets.token_hex(8)


@dataclass(frozen=True)
class ZmqPublisher:
    """One upstream publisher: its live endpoint, replay endpoint and origin name."""

    endpoint: str
    replay_endpoint: str | None = None
    #: The origin its batches get; default: `default_origin()` of the endpoint.
    origin: str | None = None
    #: SUB subscription (a topic prefix); replies of other topics are ignored too.
    topic: str = ""
    #: Replay from this sequence number at start (needs `replay_endpoint`).
    from_seq: int | None = None
    #: Override the rule (bind when the endpoint holds `*`, else connect).
    bind: bool | None = None
    #: `start`: a fresh publisher's stream begins at seq 0 (replayed, or a gap);
    #: `live`: at the first batch heard.
    join: Join = "start"
    #: kvstream's snapshot endpoint of the publisher (`ZmqSink(snapshot_endpoint=...)`):
    #: taken on a cold start and for a gap the replay ring cannot fill.
    snapshot_endpoint: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoint", normalize_endpoint(self.endpoint))
        if self.replay_endpoint is not None:
            object.__setattr__(
                self, "replay_endpoint", normalize_endpoint(self.replay_endpoint, "replay")
            )
        if self.origin is not None and (type(self.origin) is not str or not self.origin):
            raise ConfigError(f"origin: expected a non-empty str, got {self.origin!r}")
        if self.from_seq is not None and (type(self.from_seq) is not int or self.from_seq < 0):
            raise ConfigError(f"from_seq: expected an int >= 0, got {self.from_seq!r}")
        if self.join not in JOINS:
            raise ConfigError(f"join: expected one of {', '.join(JOINS)}, got {self.join!r}")
        if self.snapshot_endpoint is not None:
            object.__setattr__(
                self, "snapshot_endpoint", normalize_endpoint(self.snapshot_endpoint, "snapshot")
            )
            if self.binds:
                raise ConfigError(
                    f"snapshot: a bound (fan-in) endpoint {self.endpoint} has many publishers; "
                    "snapshots need a connected one"
                )

    @property
    def origin_name(self) -> str:
        return self.origin or default_origin(self.endpoint)

    @property
    def binds(self) -> bool:
        return "*" in self.endpoint if self.bind is None else self.bind


class ZmqPublisherStatistics(NamedTuple):
    """Counters of one publisher's stream."""

    origin: str
    epoch: str
    #: The next sequence number expected, None before the first batch.
    next_seq: int | None
    batches: int
    events: int
    gaps: int
    #: Batches reported missing in those gaps.
    missing: int
    duplicates: int
    #: Frames skipped: wrong frame count, bad seq frame, undecodable payload.
    malformed: int
    replays_requested: int
    replays_completed: int
    replays_timed_out: int
    #: Replayed batches delivered (filling gaps).
    replayed: int
    #: Live batches dropped because the reorder buffer was full.
    reorder_overflow: int
    restarts: int
    #: Events left out of delivered batches because no dialect reads them.
    events_refused: int = 0
    #: Snapshots delivered, and snapshot requests that got none (or timed out).
    snapshots: int = 0
    snapshots_failed: int = 0
    #: Heartbeats heard.
    heartbeats: int = 0


class PublisherStream:
    """Continuity, replay and reordering for one publisher. No I/O.

    Feed it with `on_live()`, `on_replay()` and `on_timer()`; each
    returns the items now ready, in order. Replay requests it wants sent are
    queued in `requests` (start sequence numbers); `reset_dealer`
    asks for a new replay socket (so late replies to an abandoned request are
    never mistaken for a new one's).
    """

    def __init__(
        self,
        origin: str,
        *,
        codec: MsgpackCodec,
        has_replay: bool,
        topic: bytes = b"",
        replay_timeout: float = DEFAULT_REPLAY_TIMEOUT,
        max_reorder: int = DEFAULT_MAX_REORDER,
        max_reorder_bytes: int = DEFAULT_MAX_REORDER_BYTES,
        join: Join = "start",
        exact_topic: bool = False,
        has_snapshot: bool = False,
    ) -> None:
        self.origin = origin
        self.has_snapshot = has_snapshot
        self.join = join
        #: Replies must carry exactly `topic` (a fan-in origin), not only start with it.
        self.exact_topic = exact_topic
        self.codec = codec
        self.has_replay = has_replay
        self.topic = topic
        self.replay_timeout = replay_timeout
        self.max_reorder = max_reorder
        self.max_reorder_bytes = max_reorder_bytes
        self.epoch = _new_epoch()
        self.expected: int | None = None
        self.last_live: int | None = None
        self.replaying = False
        self.replay_until: int | None = None
        self.replay_deadline = math.inf
        self.replay_suspended_until = -math.inf
        self.held: dict[int, bytes] = {}
        self.held_bytes = 0
        self.requests: list[int] = []
        self.reset_dealer = False
        #: Set when the subscriber is stopping: no new replay starts.
        self.stopping = False
        self._malformed_log = BurstLog(log, math.inf)
        self._overflow_log = BurstLog(log, math.inf)
        self._refused_log = BurstLog(log, math.inf)
        self.events_refused = 0
        # counters
        self.batches = 0
        self.events = 0
        self.gaps = 0
        self.missing = 0
        self.duplicates = 0
        self.malformed = 0
        self.replays_requested = 0
        self.replays_completed = 0
        self.replays_timed_out = 0
        self.replayed = 0
        self.reorder_overflow = 0
        self.restarts = 0
        # snapshots (kvstream's extension): in flight, its head and events so far
        self.snapshotting = False
        self.snapshot_deadline = math.inf
        #: Set when a snapshot request should be sent (on a new socket).
        self.snapshot_wanted = False
        self._snap_head: SnapshotHead | None = None
        self._snap_events: list[KVCacheEvent] = []
        #: The position a snapshot was last taken or tried at (never twice for one).
        self._snap_tried: int | None = None
        self.snapshots = 0
        self.snapshots_failed = 0
        #: The publisher's own epoch when known (snapshots, heartbeats), else None.
        self.publisher_epoch: str | None = None
        #: The current publisher was told apart from the last by its seq going back
        #: alone: its epoch is not known yet (its first heartbeat tells it).
        self._restart_by_seq = False
        self.heartbeats = 0
        #: A snapshot was delivered and no live batch was heard since.
        self._after_snapshot = False

    # -- inputs -------------------------------------------------------------------------

    def start(self, from_seq: int | None, now: float) -> list[SubscriberItem]:
        """Begin: from `from_seq` (replayed when possible), from 0, or at the first live batch."""
        if from_seq is not None:
            self.expected = from_seq
            if self.has_replay:
                self._begin_replay(from_seq, None, now)
        elif self.join == "start":
            self.expected = 0  # a fresh publisher counts from 0: what came before is asked
            if self.has_snapshot:
                self._begin_snapshot(now)
        return []

    def on_live(self, seq: int, payload: bytes, now: float) -> list[SubscriberItem]:
        """A live batch arrived."""
        out: list[SubscriberItem] = []
        self._malformed_log.clear()
        last = self.last_live
        if last is not None and seq <= last:
            if seq == last:  # the same batch again: a duplicate, never a restart
                self.duplicates += 1
                return out
            out.extend(self._restart(seq))
        elif last is None and seq == 0 and self._after_snapshot and self.expected:
            # Nothing heard live since a snapshot: a seq 0 below it is a new
            # instance (were it an old batch in flight, the stream from 0 that
            # follows it rebuilds the same state under a new epoch).
            out.extend(self._restart(seq))
        self.last_live = seq
        self._after_snapshot = False
        if self.replaying or self.snapshotting:
            self._hold(seq, payload)
            return out
        expected = self.expected
        # The epoch is this subscriber's own (the vLLM wire has none): restarts are
        # told by seq going back, above; within it, the one continuity rule.
        epoch = self.epoch
        place = continuity(None if expected is None else (epoch, expected), epoch, seq)
        if place is _NEXT:
            pass
        elif place is Continuity.FIRST:
            self.expected = seq
        elif place is Continuity.DUPLICATE:
            self.duplicates += 1
            return out
        elif place is Continuity.GAP:
            assert expected is not None
            if self._can_replay(now):
                self._begin_replay(expected, seq, now)
                self._hold(seq, payload)
                return out
            if not self.has_replay:
                why = "no replay endpoint"
                if self.batches == 0 and expected == 0:
                    why += "; published before the subscriber heard the publisher"
            elif self.stopping:
                why = "the subscriber is stopping"
            else:
                why = "replay suspended after a timeout"
            out.append(self._gap(expected, seq, f"missed on the live stream ({why})"))
        out.extend(self._deliver(seq, payload, replayed=False))
        return out

    def on_replay(self, reply: ReplayBatch | None, now: float) -> list[SubscriberItem]:
        """A replay message arrived (None: the end marker)."""
        if not self.replaying:
            return []  # a late reply to an abandoned request
        self.replay_deadline = now + self.replay_timeout
        if reply is None:
            self.replays_completed += 1
            return self._finish_replay(now, None)
        if reply.topic is not None and (
            reply.topic != self.topic
            if self.exact_topic
            else not reply.topic.startswith(self.topic)
        ):
            return []  # another stream of a multi-origin publisher
        expected = self.expected
        assert expected is not None  # a replay always starts from a known position
        seq = reply.seq
        place = continuity((self.epoch, expected), self.epoch, seq)
        if place is not _NEXT and place is Continuity.DUPLICATE:
            self.duplicates += 1
            return []
        out: list[SubscriberItem] = []
        if place is not _NEXT and place is Continuity.GAP:
            if self._can_snapshot(expected):
                # Beyond the ring: the snapshot stands in for what it forgot.
                self.replaying = False
                self.replay_until = None
                self.reset_dealer = True
                self._hold(seq, reply.payload)
                self._begin_snapshot(now)
                return out
            out.append(self._gap(expected, seq, "not in the publisher's replay ring"))
        out.extend(self._deliver(seq, reply.payload, replayed=True))
        return out

    def on_snapshot(self, message: SnapshotMessage, now: float) -> list[SubscriberItem]:
        """A message of the snapshot reply arrived."""
        if not self.snapshotting or message.topic != self.topic:
            return []  # a late reply to an abandoned request, or another stream's
        self.snapshot_deadline = now + self.replay_timeout
        kind = message.kind
        if kind == "none":
            return self._snapshot_failed(now, message.body.decode("utf-8", "replace"))
        if kind == "head":
            try:
                self._snap_head = SnapshotHead.from_json(message.body)
            except DecodeError as exc:
                return self._snapshot_failed(now, str(exc))
            self._snap_events = []
            return []
        head = self._snap_head
        if head is None:
            return self._snapshot_failed(now, f"a {kind} message before the head")
        if kind == "part":
            try:
                part, _ = self.codec.decode_screened(
                    message.body, seq=head.resume_seq - 1, origin=self.origin, epoch=head.epoch
                )
            except DecodeError as exc:
                return self._snapshot_failed(now, f"a part does not decode: {exc}")
            self._snap_events.extend(part.events)
            return []
        return self._snapshot_done(head, now)

    def on_timer(self, now: float) -> list[SubscriberItem]:
        """Give up a replay or a snapshot that has not answered within the timeout."""
        if self.snapshotting and now >= self.snapshot_deadline:
            return self._snapshot_failed(now, f"timed out after {self.replay_timeout:g} s")
        if self.replaying and now >= self.replay_deadline:
            self.replays_timed_out += 1
            self.reset_dealer = True
            self.replay_suspended_until = now + _SUSPEND_FACTOR * self.replay_timeout
            log.warning(
                "origin %s: replay timed out after %g s; reporting the gap",
                self.origin,
                self.replay_timeout,
            )
            return self._finish_replay(now, f"replay timed out after {self.replay_timeout:g} s")
        return []

    def on_stop(self, now: float) -> list[SubscriberItem]:
        """The subscriber stops: give up a replay in flight, deliver what is held."""
        self.stopping = True
        if self.snapshotting:
            return self._snapshot_failed(now, "the subscriber stopped")
        if self.replaying:
            return self._finish_replay(now, "the subscriber stopped during a replay")
        return []

    def on_malformed(self, reason: str) -> None:
        """A live or replay message that could not be read at all (no usable seq)."""
        self.malformed += 1
        self._malformed_log.log("origin %s: malformed message skipped: %s", self.origin, reason)

    def on_heartbeat(self, hb: Heartbeat, now: float) -> list[SubscriberItem]:
        """The publisher's heartbeat: a restart while idle, or batches missed at the tail."""
        self.heartbeats += 1
        out: list[SubscriberItem] = []
        known = self.publisher_epoch
        expected = self.expected
        # A publisher whose epoch is not known yet (it restarted before it was idle
        # long enough to heartbeat) tells a restart by its last seq: behind what this
        # stream already delivered, it cannot be the publisher that sent those.
        behind = known is None and expected is not None and hb.seq + 1 < expected
        # A publisher told apart from the last one by its seq alone, whose first heartbeat
        # announces batches never received: they may be those of yet another instance
        # (it restarted again and its live batches were lost), which a replay of the tail
        # would join to this one's. Start over from that heartbeat's epoch instead: a
        # needless restart costs a resynchronisation, a missed one a wrong state.
        unsure = (
            known is None and self._restart_by_seq and expected is not None and hb.seq >= expected
        )
        if unsure and (self.replaying or self.held):
            # A repair of this stream is under way: the tail may be its own. Decided by a
            # later heartbeat (the epoch is not taken yet), once the repair has ended.
            return out
        if (known is not None and known != hb.epoch) or behind or unsure:
            if self.snapshotting:
                # A restart while a snapshot is in flight: decided once it ends. The
                # epoch is not taken yet, so the next heartbeat tells the restart again.
                return out
            out.extend(self._restart(-1))
            self.epoch = hb.epoch
        self.publisher_epoch = hb.epoch
        self._restart_by_seq = False
        expected = self.expected
        if (
            hb.seq >= 0
            and expected is not None
            and hb.seq >= expected
            and not (self.replaying or self.snapshotting)
            and known in (None, hb.epoch)
        ):
            # Its last batch never reached us: repair as a live gap would be.
            if self._can_replay(now):
                self._begin_replay(expected, hb.seq + 1, now)
            elif self._can_snapshot(expected):
                self._begin_snapshot(now)
            else:
                out.append(self._gap(expected, hb.seq + 1, "missed on the live stream"))
                self.expected = hb.seq + 1
        return out

    @property
    def deadline(self) -> float:
        if self.snapshotting:
            return self.snapshot_deadline
        return self.replay_deadline if self.replaying else math.inf

    # -- the rules ----------------------------------------------------------------------

    def _can_replay(self, now: float) -> bool:
        return self.has_replay and not self.stopping and now >= self.replay_suspended_until

    def _can_snapshot(self, expected: int) -> bool:
        return self.has_snapshot and not self.stopping and self._snap_tried != expected

    def _begin_snapshot(self, now: float) -> None:
        self.snapshotting = True
        self.snapshot_wanted = True
        self.snapshot_deadline = now + self.replay_timeout
        self._snap_tried = self.expected
        self._snap_head = None
        self._snap_events = []

    def _end_snapshot(self) -> None:
        self.snapshotting = False
        self.snapshot_wanted = False
        self.snapshot_deadline = math.inf
        self._snap_head = None
        self._snap_events = []

    def _snapshot_done(self, head: SnapshotHead, now: float) -> list[SubscriberItem]:
        """The whole snapshot arrived: deliver it, then what was held after it."""
        events = self._snap_events
        self._end_snapshot()
        first_missing = self.expected if self.expected is not None else 0
        self.epoch = self.publisher_epoch = head.epoch
        self._restart_by_seq = False
        self.expected = head.resume_seq
        self._after_snapshot = self.last_live is None
        self.snapshots += 1
        log.info(
            "origin %s: snapshot of %d blocks taken (epoch %s, resume at seq %d)",
            self.origin,
            head.blocks,
            head.epoch,
            head.resume_seq,
        )
        batch = EventBatch._trusted(
            head.resume_seq - 1,
            head.ts,
            events,
            head.data_parallel_rank,
            self.origin,
            head.epoch,
        )
        self.batches += 1
        self.events += len(events)
        out: list[SubscriberItem] = [as_snapshot_batch(batch, first_missing)]
        out.extend(self._finish_replay(now, None))
        return out

    def _snapshot_failed(self, now: float, reason: str) -> list[SubscriberItem]:
        """No snapshot: go on as without one (replay what is missing, or report it)."""
        self._end_snapshot()
        self.snapshots_failed += 1
        log.warning(
            "origin %s: no snapshot (%s); the replay ring is what remains", self.origin, reason
        )
        return self._finish_replay(now, None)

    def _begin_replay(self, from_seq: int, until: int | None, now: float) -> None:
        self.replaying = True
        self.replay_until = until
        self.replay_deadline = now + self.replay_timeout
        self.requests.append(from_seq)
        self.replays_requested += 1

    def _hold(self, seq: int, payload: bytes) -> None:
        expected = self.expected
        if (expected is not None and seq < expected) or seq in self.held:
            self.duplicates += 1
            return
        if (
            len(self.held) >= self.max_reorder
            or self.held_bytes + len(payload) > self.max_reorder_bytes
        ):
            self.reorder_overflow += 1
            self._overflow_log.log(
                "origin %s: reorder buffer full (%d batches, %d bytes) while a replay "
                "is in flight; live batch %d dropped, to be replayed later",
                self.origin,
                len(self.held),
                self.held_bytes,
                seq,
            )
            return
        self.held[seq] = payload
        self.held_bytes += len(payload)

    def _finish_replay(self, now: float, failure: str | None) -> list[SubscriberItem]:
        """The replay ended: deliver the held live batches in order, handling what is left.

        A gap below `replay_until` is one the ring could not fill (reported); a
        gap at or past it was lost while the replay ran, so a new replay asks for
        it (the rest stays held). Each new replay starts further on, so this ends.
        """
        self.replaying = False
        self._overflow_log.clear()
        until, self.replay_until = self.replay_until, None
        out: list[SubscriberItem] = []
        for seq in sorted(self.held):
            expected = self.expected
            assert expected is not None
            if seq < expected:
                self.duplicates += 1
                self.held_bytes -= len(self.held.pop(seq))
                continue
            if seq > expected:
                unfilled = until is not None and expected < until
                if failure is None and not unfilled and self._can_replay(now):
                    self._begin_replay(expected, seq, now)
                    return out
                if failure is None and self._can_snapshot(expected):
                    self._begin_snapshot(now)  # beyond the ring, or no ring
                    return out
                if failure is not None:
                    reason = failure
                elif unfilled:
                    reason = "not in the publisher's replay ring"
                else:
                    reason = "missed on the live stream"
                out.append(self._gap(expected, seq, reason))
            payload = self.held.pop(seq)
            self.held_bytes -= len(payload)
            out.extend(self._deliver(seq, payload, replayed=False))
        expected = self.expected
        if failure is None and until is not None and expected is not None and expected < until:
            # The ring ended before `until` (a tail a heartbeat announced, say).
            if self._can_snapshot(expected):
                self._begin_snapshot(now)
            else:
                out.append(self._gap(expected, until, "not in the publisher's replay ring"))
                self.expected = until
        return out

    def _restart(self, seq: int) -> list[SubscriberItem]:
        """The live seq went back: the publisher restarted. Close the old epoch."""
        out: list[SubscriberItem] = []
        if self.replaying:
            self.replaying = False
            self.replay_until = None
            self.reset_dealer = True
            self.requests.clear()
        if self.snapshotting:
            self._end_snapshot()
        self.publisher_epoch = None
        self._snap_tried = None
        for held_seq in sorted(self.held):
            expected = self.expected
            assert expected is not None
            if held_seq > expected:
                out.append(self._gap(expected, held_seq, "publisher restarted during a replay"))
            if held_seq >= expected:
                out.extend(self._deliver(held_seq, self.held[held_seq], replayed=False))
        self.held.clear()
        self.held_bytes = 0
        self.restarts += 1
        if seq < 0:
            log.warning(
                "origin %s: its heartbeat has a new epoch: the publisher restarted", self.origin
            )
        else:
            log.warning(
                "origin %s: sequence went back from %s to %d: the publisher restarted (new epoch)",
                self.origin,
                self.last_live,
                seq,
            )
        self.epoch = _new_epoch()
        self.expected = 0  # a restarted publisher counts from 0
        self.last_live = None
        self._restart_by_seq = seq >= 0
        return out

    def _gap(self, first: int, next_seq: int, reason: str) -> Gap:
        self.gaps += 1
        self.missing += next_seq - first
        return Gap(self.origin, self.epoch, first, next_seq, reason)

    def _deliver(self, seq: int, payload: bytes, *, replayed: bool) -> list[SubscriberItem]:
        self.expected = seq + 1
        try:
            batch, refused = self.codec.decode_screened(
                payload, seq=seq, origin=self.origin, epoch=self.epoch
            )
        except DecodeError as exc:
            self.malformed += 1
            log.warning("origin %s: batch %d does not decode, skipped: %s", self.origin, seq, exc)
            return [self._gap(seq, seq + 1, f"undecodable payload: {exc}")]
        if refused:
            self.events_refused += len(refused)
            first = refused[0]
            self._refused_log.log(
                "origin %s: batch %d: %d event(s) no dialect reads were refused, the rest "
                "delivered (first: events[%d] %s: %s); counted only for the rest of the burst",
                self.origin,
                seq,
                len(refused),
                first.position,
                first.event_type,
                first.reason,
            )
        else:
            self._refused_log.clear()
        self.batches += 1
        self.events += len(batch.events)
        if replayed:
            self.replayed += 1
        return [batch]

    def statistics(self) -> ZmqPublisherStatistics:
        return ZmqPublisherStatistics(
            origin=self.origin,
            epoch=self.epoch,
            next_seq=self.expected,
            batches=self.batches,
            events=self.events,
            gaps=self.gaps,
            missing=self.missing,
            duplicates=self.duplicates,
            malformed=self.malformed,
            replays_requested=self.replays_requested,
            replays_completed=self.replays_completed,
            replays_timed_out=self.replays_timed_out,
            replayed=self.replayed,
            reorder_overflow=self.reorder_overflow,
            restarts=self.restarts,
            events_refused=self.events_refused,
            snapshots=self.snapshots,
            snapshots_failed=self.snapshots_failed,
            heartbeats=self.heartbeats,
        )

    def resend(self, now: float) -> None:
        """The replay socket was replaced under this stream's replay: ask again."""
        if self.replaying and self.expected is not None:
            self.requests.append(self.expected)
            self.replay_deadline = now + self.replay_timeout


_StreamKey: TypeAlias = tuple[bytes, int | None]
#: What a subscriber's socket reads: the live stream, replay replies, snapshot replies.
_SocketKind: TypeAlias = Literal["live", "replay", "snapshot"]


class _Link:
    """The sockets of one publisher endpoint and the stream state behind it.

    A connecting link has one stream (one publisher, one sequence space). A
    bound link may have many publishers connected to it: one stream per
    `(topic, data_parallel_rank)`, created when first heard.
    """

    __slots__ = (
        "dealer",
        "dropped",
        "factory",
        "inflight",
        "monitor",
        "primary",
        "snap_dealer",
        "spec",
        "streams",
        "sub",
    )

    def __init__(self, spec: ZmqPublisher, factory: Any) -> None:
        self.spec = spec
        #: `factory(origin, topic, exact)` makes a PublisherStream.
        self.factory = factory
        self.streams: dict[_StreamKey, PublisherStream] = {}
        self.primary: PublisherStream | None = None
        if not spec.binds:
            self.primary = factory(spec.origin_name, spec.topic.encode(), False)
        #: Streams whose replay request was sent, oldest first: replies answer them in turn.
        self.inflight: deque[PublisherStream] = deque()
        self.sub: zmq.asyncio.Socket | None = None
        self.dealer: zmq.asyncio.Socket | None = None
        #: the SUB's disconnect events (`EVENT_DISCONNECTED`)
        self.monitor: zmq.asyncio.Socket | None = None
        #: a dropped connection waits to be made again (a connecting SUB)
        self.dropped = False
        #: To the snapshot endpoint, made anew for each request.
        self.snap_dealer: zmq.asyncio.Socket | None = None

    def all_streams(self) -> Iterator[PublisherStream]:
        if self.primary is not None:
            yield self.primary
        yield from self.streams.values()

    def stream_for(self, topic: bytes, payload: bytes, now: float) -> tuple[PublisherStream, bool]:
        """The stream a live message belongs to, and whether it was just made."""
        if self.primary is not None:
            return self.primary, False
        key = (topic, peek_rank(payload))
        stream = self.streams.get(key)
        if stream is not None:
            return stream, False
        if len(self.streams) >= MAX_FAN_IN:
            raise DecodeError(
                f"fan-in: {len(self.streams)} origins on {self.spec.endpoint} already (the "
                f"limit); topic {topic[:60]!r} rank {key[1]!r} refused"
            )
        name = self.spec.origin_name
        if topic:
            name += "/" + topic.decode("utf-8", "replace")
        if key[1] is not None:
            name += f"#dp{key[1]}"
        stream = self.streams[key] = self.factory(name, topic, True)
        log.info("fan-in: new publisher on %s: origin %s", self.spec.endpoint, name)
        return stream, True

    def streams_of_topic(self, topic: bytes) -> list[PublisherStream]:
        """The streams a heartbeat of `topic` speaks for."""
        primary = self.primary
        if primary is not None:
            return [primary] if topic.startswith(primary.topic) else []
        return [s for (t, _), s in self.streams.items() if t == topic]

    def route_reply(self, reply: ReplayBatch | None) -> PublisherStream | None:
        """The stream a replay message answers (the oldest request in flight)."""
        if not self.inflight:
            return None
        head = self.inflight[0]
        if reply is None:
            self.inflight.popleft()
            return head
        if self.primary is None and peek_rank(reply.payload) != self._rank_of(head):
            return None  # another fan-in origin's batch in a shared ring
        return head

    def _rank_of(self, stream: PublisherStream) -> int | None:
        for (_, rank), s in self.streams.items():
            if s is stream:
                return rank
        return None


class ZmqSubscriber(Subscriber):
    """Batches from one or more vLLM-wire publishers, each its own origin.


        sub = ZmqSubscriber(ZmqPublisher("tcp://10.0.0.5:5557",
                                         replay_endpoint="tcp://10.0.0.5:5558"))
        async with sub:
            async for item in sub:      # EventBatch or Gap, in order per origin
                ...

    `codec` reads both msgpack profiles. `replay_timeout`: seconds without a
    reply before a replay is given up. `max_reorder` / `max_reorder_bytes`
    bound the live batches held while a replay is in flight. `hwm`: the SUB's
    receive high-water mark. `max_message_bytes`: the largest message taken
    on the SUB and the replay DEALER (`ZMQ_MAXMSGSIZE`, default 64 MiB); libzmq
    drops a connection that sends a bigger one before allocating it. Each
    dropped connection is counted (`dropped_connections`), logged once per
    burst and made again; the batches it cost arrive as a gap (or by replay).
    """

    def __init__(
        self,
        publishers: ZmqPublisher | Sequence[ZmqPublisher],
        *,
        codec: MsgpackCodec | None = None,
        replay_timeout: float = DEFAULT_REPLAY_TIMEOUT,
        max_reorder: int = DEFAULT_MAX_REORDER,
        max_reorder_bytes: int = DEFAULT_MAX_REORDER_BYTES,
        hwm: int = DEFAULT_HWM,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        poll_interval: float = 0.1,
        heartbeats: bool = False,
        on_liveness: Callable[[LivenessChange], object] | None = None,
    ) -> None:
        given: object = publishers
        specs: list[Any] = (
            [given]
            if isinstance(given, ZmqPublisher)
            else list(given)
            if isinstance(given, list | tuple)
            else [given]
        )
        bad = next((s for s in specs if not isinstance(s, ZmqPublisher)), None)
        if bad is not None:
            raise ConfigError(
                f"ZmqSubscriber.publishers: expected a ZmqPublisher or a list of them, "
                f"got {bad!r:.80}"
            )
        if not specs:
            raise ConfigError("ZmqSubscriber: expected at least one publisher")
        origins = [s.origin_name for s in specs]
        if len(set(origins)) != len(origins):
            raise ConfigError(f"ZmqSubscriber: origins must differ, got {origins!r}")
        seconds("ZmqSubscriber.replay_timeout", replay_timeout)
        for key, value in (("max_reorder", max_reorder), ("max_reorder_bytes", max_reorder_bytes)):
            if type(value) is not int or value < 1:
                raise ConfigError(f"{key}: expected an int >= 1, got {value!r}")
        if type(max_message_bytes) is not int or max_message_bytes < 1024:
            raise ConfigError(
                f"max_message_bytes: expected an int >= 1024, got {max_message_bytes!r}"
            )
        if codec is not None and not isinstance(codec, MsgpackCodec):
            raise ConfigError(f"ZmqSubscriber.codec: expected a MsgpackCodec, got {codec!r:.80}")
        count("ZmqSubscriber.hwm", hwm, minimum=0)
        flag("ZmqSubscriber.heartbeats", heartbeats)
        function("ZmqSubscriber.on_liveness", on_liveness)
        self.codec = codec or MsgpackCodec()
        self.hwm = hwm
        self.max_message_bytes = max_message_bytes
        self.poll_interval = seconds("ZmqSubscriber.poll_interval", poll_interval)

        def factory(spec: ZmqPublisher) -> Any:
            def make(origin: str, topic: bytes, exact: bool) -> PublisherStream:
                return PublisherStream(
                    origin,
                    codec=self.codec,
                    has_replay=spec.replay_endpoint is not None,
                    topic=topic,
                    replay_timeout=replay_timeout,
                    max_reorder=max_reorder,
                    max_reorder_bytes=max_reorder_bytes,
                    join=spec.join,
                    exact_topic=exact,
                    has_snapshot=spec.snapshot_endpoint is not None,
                )

            return make

        self._links = [_Link(spec, factory(spec)) for spec in specs]
        self._gen: AsyncGenerator[SubscriberItem, None] | None = None
        #: Malformed messages on a bound link that no origin could be told from.
        self._fan_in_malformed = 0
        self._fan_in_log = BurstLog(log, math.inf)
        self._dropped_connections = 0
        self._drops = BurstLog(log)
        self._closed = False
        self._stopping = False
        self._stop_grace = 0.0
        self._done = anyio.Event()
        #: Whether heartbeats are listened to (and origins judged gone without them).
        self.heartbeats = heartbeats
        self.on_liveness = on_liveness
        self.liveness_tracker = LivenessTracker(anyio.current_time)
        #: Liveness changes reported (gone, back, restarted).
        self.liveness_changes = 0

    @property
    def publishers(self) -> tuple[ZmqPublisher, ...]:
        return tuple(link.spec for link in self._links)

    def statistics(self) -> tuple[ZmqPublisherStatistics, ...]:
        """One record per origin: per connected publisher, per fan-in origin heard."""
        return tuple(s.statistics() for s in self._streams())

    @property
    def unattributed(self) -> int:
        """Messages on a bound endpoint skipped before any origin could be told from them.

        Malformed frames, and publishers beyond `MAX_FAN_IN` origins.
        """
        return self._fan_in_malformed

    @property
    def dropped_connections(self) -> int:
        """Publisher connections libzmq dropped: a message over `max_message_bytes`
        (libzmq refuses it by closing the connection) or the publisher going away."""
        return self._dropped_connections

    def liveness(self) -> dict[str, Liveness]:
        """`{origin: Liveness}`: who was heard from when, and who is gone (`heartbeats`)."""
        return self.liveness_tracker.snapshot()

    def _report(self, changes: list[LivenessChange]) -> None:
        self.liveness_changes += report_liveness(changes, "ZMQ subscriber", self.on_liveness)

    def _delivered(
        self, stream: PublisherStream, items: list[SubscriberItem]
    ) -> list[SubscriberItem]:
        """`items` of `stream`, each batch counted as a sign of life (with heartbeats)."""
        if self.heartbeats:
            tracker = self.liveness_tracker
            for item in items:
                if isinstance(item, EventBatch):
                    if getattr(item, "is_snapshot", False):
                        tracker.forget(stream.origin)  # the epoch is the publisher's from now
                    epoch = stream.publisher_epoch or item.epoch
                    self._report(tracker.heard(stream.origin, epoch, item.seq))
        return items

    def _on_heartbeat(
        self, link: _Link, frames: list[bytes], now: float, out: list[SubscriberItem]
    ) -> None:
        topic, hb = parse_heartbeat(frames)
        for stream in link.streams_of_topic(topic):
            fresh = stream.publisher_epoch is None
            out.extend(self._delivered(stream, stream.on_heartbeat(hb, now)))
            if self.heartbeats:
                if fresh:  # until now its batches were known by the subscriber's epoch
                    self.liveness_tracker.forget(stream.origin)
                self._report(
                    self.liveness_tracker.heard(stream.origin, hb.epoch, hb.seq, hb.interval)
                )

    def _streams(self) -> Iterator[PublisherStream]:
        for link in self._links:
            yield from link.all_streams()

    def __aiter__(self) -> AsyncIterator[SubscriberItem]:
        if self._closed:
            raise ClosedError("ZmqSubscriber: closed")
        if self._gen is not None:
            raise ClosedError("ZmqSubscriber: can be iterated only once")
        self._gen = self._run()
        return self._gen

    def stop(self, grace: float = 2.0) -> None:
        """End the iteration gracefully: deliver what has arrived, then stop.

        Replays in flight get up to `grace` seconds to finish (no new one
        starts); what they leave missing is reported as gaps. The iterator then
        ends (`async for` finishes) and the sockets are closed. Call it on the
        event loop, from any task.
        """
        self._stopping = True
        self._stop_grace = grace

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        gen = self._gen
        if gen is None:
            self._done.set()
            return
        if not getattr(gen, "ag_running", False):
            await gen.aclose()
        else:  # another task is inside the loop: it sees the flag within a poll interval
            with anyio.move_on_after(max(2 * self.poll_interval, 1.0)):
                await self._done.wait()

    # -- the loop -------------------------------------------------------------------------

    async def _run(self) -> AsyncGenerator[SubscriberItem, None]:
        ctx = zmq.asyncio.Context()
        poller = zmq.asyncio.Poller()
        by_socket: dict[zmq.asyncio.Socket, tuple[_Link, _SocketKind]] = {}
        try:
            monitors: dict[zmq.asyncio.Socket, _Link] = {}
            for link in self._links:
                link.sub = self._open_sub(ctx, link.spec)
                poller.register(link.sub, zmq.POLLIN)
                by_socket[link.sub] = (link, "live")
                link.monitor = link.sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                poller.register(link.monitor, zmq.POLLIN)
                monitors[link.monitor] = link
                if link.spec.replay_endpoint is not None:
                    self._open_dealer(ctx, poller, by_socket, link)
            now = anyio.current_time()
            pending: list[SubscriberItem] = []
            for link in self._links:
                if link.primary is not None:
                    pending.extend(link.primary.start(link.spec.from_seq, now))
            stop_deadline: float | None = None
            while True:
                await self._send_requests(ctx, poller, by_socket)
                if pending:
                    items, pending = pending, []
                    for item in items:
                        yield item
                    continue
                if self._closed:
                    break
                now = anyio.current_time()
                if self._stopping:
                    if stop_deadline is None:
                        stop_deadline = now + self._stop_grace
                        for stream in self._streams():
                            stream.stopping = True
                    if now >= stop_deadline or not any(st.replaying for st in self._streams()):
                        # Last round: what already arrived, then what replays left held.
                        for sock, (link, kind) in list(by_socket.items()):
                            pending.extend(await self._read(sock, link, kind, now))
                        for stream in list(self._streams()):
                            pending.extend(stream.on_stop(now))
                        for item in pending:
                            yield item
                        break
                deadline = min((st.deadline for st in self._streams()), default=math.inf)
                if stop_deadline is not None:
                    deadline = min(deadline, stop_deadline)
                wait = min(self.poll_interval, max(deadline - now, 0.0))
                ready = await poller.poll(math.ceil(wait * 1000))
                now = anyio.current_time()
                for sock, _ in ready:
                    entry = by_socket.get(sock)
                    if entry is not None:
                        link, kind = entry
                        pending.extend(await self._read(sock, link, kind, now))
                    elif sock in monitors:
                        await self._on_disconnects(monitors[sock])
                for link in self._links:
                    if link.dropped:
                        self._reconnect(link)
                for stream in list(self._streams()):
                    pending.extend(stream.on_timer(now))
                if self.heartbeats:
                    self._report(self.liveness_tracker.check())
        finally:
            for link in self._links:
                if link.monitor is not None:
                    link.monitor.close(linger=0)
                    link.monitor = None
            for sock in list(by_socket):
                sock.close(linger=0)
            ctx.term()
            self._done.set()

    def _open_sub(self, ctx: zmq.asyncio.Context, spec: ZmqPublisher) -> zmq.asyncio.Socket:
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self.hwm)
            sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            sub.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
            if spec.binds:
                sub.bind(spec.endpoint)
            else:
                sub.connect(spec.endpoint)
            if self.heartbeats or spec.snapshot_endpoint is not None:
                sub.setsockopt(zmq.SUBSCRIBE, HEARTBEAT_TOPIC)
        except zmq.ZMQError as exc:
            sub.close(linger=0)
            verb = "bind" if spec.binds else "connect"
            raise TransportError(f"ZMQ subscriber: cannot {verb} {spec.endpoint}: {exc}") from exc
        return sub

    def _open_dealer(
        self,
        ctx: zmq.asyncio.Context,
        poller: zmq.asyncio.Poller,
        by_socket: dict[zmq.asyncio.Socket, tuple[_Link, _SocketKind]],
        link: _Link,
    ) -> None:
        endpoint = link.spec.replay_endpoint
        assert endpoint is not None
        old, link.dealer = link.dealer, None
        link.dealer = _new_dealer(
            ctx, poller, by_socket, link, old, endpoint, "replay", self.max_message_bytes
        )

    async def _on_disconnects(self, link: _Link) -> None:
        """Count the SUB's dropped connections; a connecting SUB is to connect again
        (libzmq does not reconnect after a refused oversized message)."""
        monitor = link.monitor
        assert monitor is not None
        while True:
            try:
                frames = await monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if parse_monitor_message(frames)["event"] != zmq.EVENT_DISCONNECTED:
                continue
            self._dropped_connections += 1
            self._drops.log(
                "%s: the connection to the publisher dropped (a message over "
                "max_message_bytes %d, or the publisher went away); connecting again",
                link.spec.endpoint,
                self.max_message_bytes,
            )
            if not link.spec.binds:
                link.dropped = True

    def _reconnect(self, link: _Link) -> None:
        """Connect a dropped SUB again, once what it received is read."""
        sub = link.sub
        assert sub is not None
        events = sub.getsockopt(zmq.EVENTS)
        if isinstance(events, int) and events & zmq.POLLIN:
            return  # read those first: disconnecting discards them
        link.dropped = False
        endpoint = link.spec.endpoint
        try:
            sub.disconnect(endpoint)
        except zmq.ZMQError:
            pass  # already gone
        try:
            sub.connect(endpoint)
        except zmq.ZMQError as exc:
            raise TransportError(f"ZMQ subscriber: cannot connect {endpoint}: {exc}") from exc

    async def _send_requests(
        self,
        ctx: zmq.asyncio.Context,
        poller: zmq.asyncio.Poller,
        by_socket: dict[zmq.asyncio.Socket, tuple[_Link, _SocketKind]],
    ) -> None:
        now = anyio.current_time()
        for link in self._links:
            primary = link.primary
            if primary is not None and primary.snapshot_wanted:
                primary.snapshot_wanted = False
                self._ask_snapshot(ctx, poller, by_socket, link, primary)
            streams = list(link.all_streams())
            if any(st.reset_dealer for st in streams):
                # A new socket: replies to the old one's requests never come, so
                # every other stream still replaying asks again on the new one.
                link.inflight.clear()
                for stream in streams:
                    if stream.reset_dealer:
                        stream.reset_dealer = False
                    else:
                        stream.resend(now)
                self._open_dealer(ctx, poller, by_socket, link)
            for stream in streams:
                while stream.requests:
                    start = stream.requests.pop(0)
                    dealer = link.dealer
                    assert dealer is not None
                    try:
                        await dealer.send_multipart(replay_request(start), flags=zmq.NOBLOCK)
                    except zmq.ZMQError as exc:
                        # Not sent (no connection yet, or a full pipe): the timeout reports it.
                        log.warning(
                            "origin %s: replay request from %d not sent: %s",
                            stream.origin,
                            start,
                            exc,
                        )
                    else:
                        link.inflight.append(stream)
                        log.info("origin %s: replay requested from seq %d", stream.origin, start)

    def _ask_snapshot(
        self,
        ctx: zmq.asyncio.Context,
        poller: zmq.asyncio.Poller,
        by_socket: dict[zmq.asyncio.Socket, tuple[_Link, _SocketKind]],
        link: _Link,
        stream: PublisherStream,
    ) -> None:
        """Send a snapshot request on a new socket (late replies to an old one never come)."""
        endpoint = link.spec.snapshot_endpoint
        assert endpoint is not None
        old, link.snap_dealer = link.snap_dealer, None
        dealer = _new_dealer(
            ctx, poller, by_socket, link, old, endpoint, "snapshot", self.max_message_bytes
        )
        link.snap_dealer = dealer
        try:
            # Queued until connected (a DEALER holds it); the timeout reports no answer.
            dealer.send_multipart(snapshot_request(stream.topic), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("origin %s: snapshot request not sent: %s", stream.origin, exc)
            return
        log.info("origin %s: snapshot requested", stream.origin)

    async def _read(
        self, sock: zmq.asyncio.Socket, link: _Link, kind: _SocketKind, now: float
    ) -> list[SubscriberItem]:
        out: list[SubscriberItem] = []
        for _ in range(_READ_BUDGET):
            try:
                frames = await sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                raise TransportError(f"{link.spec.endpoint}: cannot receive: {exc}") from exc
            stream: PublisherStream | None = link.primary
            try:
                if kind == "replay":
                    reply = parse_replay_reply(frames)
                    stream = link.route_reply(reply)
                    if stream is not None:
                        out.extend(self._delivered(stream, stream.on_replay(reply, now)))
                elif kind == "snapshot":
                    if stream is not None:
                        out.extend(
                            self._delivered(
                                stream, stream.on_snapshot(parse_snapshot_message(frames), now)
                            )
                        )
                elif frames and frames[0] == HEARTBEAT_TOPIC:
                    stream = None
                    self._on_heartbeat(link, frames, now, out)
                else:
                    live = parse_live(frames)
                    stream, fresh = link.stream_for(live.topic, live.payload, now)
                    if fresh:
                        out.extend(stream.start(link.spec.from_seq, now))
                    out.extend(self._delivered(stream, stream.on_live(live.seq, live.payload, now)))
            except DecodeError as exc:
                if stream is not None:
                    stream.on_malformed(str(exc))
                else:
                    self._fan_in_malformed += 1
                    self._fan_in_log.log(
                        "%s: message skipped (counted only for the rest of the burst): %s",
                        link.spec.endpoint,
                        exc,
                    )
                continue
            self._fan_in_log.clear()
            if stream is not None and (
                stream.requests or stream.reset_dealer or stream.snapshot_wanted
            ):
                break  # let the loop send the next replay request first
        return out


def _new_dealer(
    ctx: zmq.asyncio.Context,
    poller: zmq.asyncio.Poller,
    by_socket: dict[zmq.asyncio.Socket, tuple[_Link, _SocketKind]],
    link: _Link,
    old: zmq.asyncio.Socket | None,
    endpoint: str,
    kind: _SocketKind,
    max_message_bytes: int,
) -> zmq.asyncio.Socket:
    """A DEALER connected to `endpoint` and polled as `kind`, in place of `old`.

    A reply over `max_message_bytes` drops the DEALER's connection (libzmq's
    MAXMSGSIZE); the request then times out and a new DEALER asks again.
    """
    if old is not None:
        poller.unregister(old)
        by_socket.pop(old, None)
        old.close(linger=0)
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        dealer.connect(endpoint)
    except zmq.ZMQError as exc:
        dealer.close(linger=0)
        raise TransportError(f"ZMQ subscriber: cannot connect {endpoint}: {exc}") from exc
    poller.register(dealer, zmq.POLLIN)
    by_socket[dealer] = (link, kind)
    return dealer
