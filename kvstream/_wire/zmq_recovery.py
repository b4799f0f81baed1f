"""kvstream's recovery extension of vLLM's ZMQ wire: snapshots and heartbeats, both ends.

Both are opt-in and leave the live endpoint's bytes as they are: a snapshot is
served on an endpoint of its own (a ROUTER, always bound), and heartbeats go on
the live XPUB under the topic `HEARTBEAT_TOPIC` (it begins with a NUL byte),
which a consumer subscribed to its stream's (printable) topic never receives.
`docs/vllm-wire.md` describes the frames byte for byte; this module builds and
reads them, without I/O.

Snapshot request, DEALER to ROUTER (the ROUTER sees the identity first):

    [b"", b"KVSNAP1", topic]

Reply, in order, each message `[b"", b"KVSNAP1", kind, topic, body]`:

* `head`: body is one JSON object (`SnapshotHead`): `origin`, `epoch`,
  `resume_seq` (the first live seq the snapshot does not include), `blocks`,
  `parts`, `data_parallel_rank`, `ts`;
* `part` (`parts` times): body is the batch `resume_seq - 1` encoded by the
  sink's codec (the live payload format), carrying a slice of the snapshot's
  events (`AllBlocksCleared` first, then `BlockStored`, parents first);
* `end`: body empty;
* or instead of all three, `none`: body is the reason (UTF-8) the publisher
  has no snapshot of that topic (nothing published yet, or its state unknown).

Heartbeat, on the live endpoint: `[b"\x00kvstream.heartbeat", topic, heartbeat]`
with `heartbeat` the JSON `Heartbeat` of `kvstream._wire.broker` (origin,
epoch, last seq, interval, beat) and `topic` the stream's own topic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal, NamedTuple, TypeAlias

import orjson

from kvstream._wire.broker import Heartbeat
from kvstream.errors import DecodeError

__all__ = [
    "HEARTBEAT_TOPIC",
    "SNAPSHOT_MAGIC",
    "SnapshotHead",
    "SnapshotKind",
    "SnapshotMessage",
    "heartbeat_frames",
    "parse_heartbeat",
    "parse_snapshot_message",
    "parse_snapshot_request",
    "snapshot_message",
    "snapshot_request",
]

SNAPSHOT_MAGIC: Final = b"KVSNAP1"
#: Begins with a NUL byte, so that no printable topic is a prefix of it: a SUB
#: subscribed to its stream's topic (`kv-events`, `kv@pod@model`) never gets it.
#: Only a SUB subscribed to every topic (`""`) does.
HEARTBEAT_TOPIC: Final = b"\x00kvstream.heartbeat"

SnapshotKind: TypeAlias = Literal["head", "part", "end", "none"]
_KINDS: Final[dict[bytes, SnapshotKind]] = {
    b"head": "head",
    b"part": "part",
    b"end": "end",
    b"none": "none",
}


class SnapshotHead(NamedTuple):
    """What a snapshot reply announces before its parts."""

    origin: str
    epoch: str
    #: The first live seq the snapshot does not include.
    resume_seq: int
    blocks: int
    parts: int
    data_parallel_rank: int | None
    ts: float

    def to_json(self) -> bytes:
        return orjson.dumps(self._asdict())

    @classmethod
    def from_json(cls, data: bytes) -> SnapshotHead:
        try:
            obj = orjson.loads(data)
            head = cls(**obj)
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise DecodeError(f"snapshot head: not a head record: {exc}") from None
        if not (
            type(head.origin) is str
            and type(head.epoch) is str
            and type(head.resume_seq) is int
            and head.resume_seq >= 1
            and type(head.blocks) is int
            and type(head.parts) is int
            and head.parts >= 0
            and (head.data_parallel_rank is None or type(head.data_parallel_rank) is int)
            and isinstance(head.ts, int | float)
        ):
            raise DecodeError(f"snapshot head: a field of the wrong type: {obj!r:.120}")
        return head._replace(ts=float(head.ts))


class SnapshotMessage(NamedTuple):
    kind: SnapshotKind
    topic: bytes
    body: bytes


def snapshot_request(topic: bytes) -> list[bytes]:
    """The frames a DEALER sends to ask for the snapshot of `topic`'s stream."""
    return [b"", SNAPSHOT_MAGIC, topic]


def parse_snapshot_request(frames: Sequence[bytes]) -> tuple[bytes, bytes]:
    """`(identity, topic)` of a request as the ROUTER receives it."""
    if len(frames) != 4 or frames[1] != b"" or frames[2] != SNAPSHOT_MAGIC:
        raise DecodeError(
            f"snapshot request: expected [identity, b'', {SNAPSHOT_MAGIC!r}, topic], "
            f"got {len(frames)} frames"
        )
    return frames[0], frames[3]


def snapshot_message(identity: bytes, kind: SnapshotKind, topic: bytes, body: bytes) -> list[bytes]:
    """One reply message as the ROUTER sends it."""
    return [identity, b"", SNAPSHOT_MAGIC, kind.encode(), topic, body]


def parse_snapshot_message(frames: Sequence[bytes]) -> SnapshotMessage:
    """One reply message as the DEALER receives it (without the identity)."""
    if len(frames) != 5 or frames[0] != b"" or frames[1] != SNAPSHOT_MAGIC:
        raise DecodeError(
            f"snapshot reply: expected [b'', {SNAPSHOT_MAGIC!r}, kind, topic, body], "
            f"got {len(frames)} frames"
        )
    kind = _KINDS.get(frames[2])
    if kind is None:
        raise DecodeError(f"snapshot reply: unknown kind {frames[2][:20]!r}")
    return SnapshotMessage(kind, frames[3], frames[4])


def heartbeat_frames(topic: bytes, heartbeat: Heartbeat) -> list[bytes]:
    """The live-endpoint message announcing `heartbeat` for the stream of `topic`."""
    return [HEARTBEAT_TOPIC, topic, heartbeat.to_json()]


def parse_heartbeat(frames: Sequence[bytes]) -> tuple[bytes, Heartbeat]:
    """`(topic, heartbeat)` of a heartbeat message; `DecodeError` when it is not one."""
    if len(frames) != 3 or frames[0] != HEARTBEAT_TOPIC:
        raise DecodeError(
            f"heartbeat: expected [{HEARTBEAT_TOPIC!r}, topic, heartbeat], got {len(frames)} frames"
        )
    return frames[1], Heartbeat.from_json(frames[2])
