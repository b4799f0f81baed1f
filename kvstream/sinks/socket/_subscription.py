"""One subscriber of a [`SocketSink`][kvstream.sinks.socket.SocketSink]: what it is owed.

A `Subscription` is the sink's record of one connected subscriber: its
cursor into the replay ring, which of the ring's batches it wants (its replay
plan and, after a snapshot, the seqs the snapshot replaced), and what it must
be sent before its next batch: control lines (the welcome, gap notices) and
snapshots. The sink's writer for that subscriber sends them; the fan-out
(`kvstream.sinks.socket._fanout`) fills them in.
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import anyio
import anyio.abc

from kvstream._wire.socket_protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    framing_of,
    message_size,
    snapshot_messages,
)
from kvstream.codecs.base import Codec
from kvstream.events import KVCacheEvent

__all__ = ["RingEntry", "SharedSnapshot", "SnapshotWait", "Subscription"]

#: A batch in the sink's replay ring: (origin, epoch, seq, frame).
RingEntry = tuple[str, str, int, bytes]


class SnapshotWait(NamedTuple):
    """A snapshot a subscriber waits for, and the gap it gets if none comes."""

    epoch: str
    first_missing: int
    #: the oldest seq of the origin the ring held when the subscriber connected
    oldest: int


class SharedSnapshot:
    """One provider call, shared by every subscriber it serves; encoded lazily."""

    __slots__ = (
        "_encoded",
        "_largest",
        "data_parallel_rank",
        "epoch",
        "events",
        "next_seq",
        "origin",
        "ts",
    )

    def __init__(
        self,
        origin: str,
        epoch: str,
        next_seq: int,
        data_parallel_rank: int | None,
        events: list[KVCacheEvent],
    ) -> None:
        self.origin = origin
        self.epoch = epoch
        self.next_seq = next_seq
        self.ts = time.time()
        self.data_parallel_rank = data_parallel_rank
        self.events = events
        self._encoded: dict[int, bytes] = {}
        self._largest: dict[int, int] = {}

    def encoded(self, codec: Codec, first_missing: int) -> bytes:
        """The snapshot's messages for a subscriber that misses `first_missing` on."""
        data = self._encoded.get(first_missing)
        if data is None:
            messages = snapshot_messages(
                codec,
                origin=self.origin,
                epoch=self.epoch,
                next_seq=self.next_seq,
                first_missing=first_missing,
                ts=self.ts,
                data_parallel_rank=self.data_parallel_rank,
                events=self.events,
            )
            framing = framing_of(codec)
            self._largest[first_missing] = max(message_size(m, framing) for m in messages)
            data = self._encoded[first_missing] = b"".join(messages)
        return data

    def largest_message(self, codec: Codec, first_missing: int) -> int:
        """The size of the biggest of the snapshot's messages, as a reader counts it."""
        self.encoded(codec, first_missing)
        return self._largest[first_missing]


class Subscription:
    """One connected subscriber: its cursor, its filter and its pending messages."""

    __slots__ = (
        "awaiting",
        "batches_dropped",
        "batches_sent",
        "bytes_sent",
        "control",
        "cursor",
        "drop_gaps",
        "gone",
        "max_message",
        "min_seq",
        "peer",
        "replay_end",
        "scope",
        "snapshot_deadline",
        "snapshots",
        "starts",
        "stream",
        "wakeup",
    )

    def __init__(
        self,
        peer: str,
        stream: anyio.abc.ByteStream,
        scope: anyio.CancelScope,
        max_message: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.peer = peer
        #: the largest message the subscriber reads (its hello's `max_message_bytes`)
        self.max_message = max_message
        self.stream = stream
        self.scope = scope
        self.cursor = 0
        self.replay_end = 0
        #: origin -> first ring position to replay (positions < replay_end only)
        self.starts: dict[str, int] = {}
        #: origin -> (epoch, seq): nothing of that epoch below seq (after a snapshot)
        self.min_seq: dict[str, tuple[str, int]] = {}
        self.control: list[bytes] = []
        self.awaiting: dict[str, SnapshotWait] = {}
        self.snapshots: list[tuple[SharedSnapshot, int]] = []
        self.snapshot_deadline = math.inf
        #: origin -> [epoch, first, next] of batches skipped, not yet announced
        self.drop_gaps: dict[str, list[Any]] = {}
        self.wakeup: anyio.Event | None = None
        self.gone = False
        self.batches_sent = 0
        self.bytes_sent = 0
        self.batches_dropped = 0

    def wants(self, pos: int, entry: RingEntry) -> bool:
        """Whether the ring's batch `entry` at `pos` is to be sent to this subscriber."""
        origin = entry[0]
        if pos < self.replay_end:
            start = self.starts.get(origin)
            if start is None or pos < start:
                return False
        if self.min_seq:
            floor = self.min_seq.get(origin)
            if floor is not None and floor[0] == entry[1] and entry[2] < floor[1]:
                return False
        return True

    def wake(self) -> None:
        """Wake the subscriber's writer if it waits for something to send."""
        w = self.wakeup
        if w is not None:
            self.wakeup = None
            w.set()
