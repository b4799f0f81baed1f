"""The ZMQ sink's snapshot endpoint: the state of what it published, served on a ROUTER.

Opt-in (`ZmqSink(snapshot_endpoint=...)`, `?snapshot=tcp://...`); without it
the sink keeps nothing. The tick only appends each published batch to a list
(`SnapshotServer.record`); the server's task applies that list to its
`StateKeeper` between requests (every few milliseconds while idle), so the
keeper's cost is off the tick. A request is answered by the snapshot of the
requested topic's origin taken at a batch boundary: every batch recorded before
it, in publishing order, which is the ring's order too, so `resume_seq` is
exactly where the live stream and the replay ring continue. While the parts are
encoded, batches published meanwhile wait in the list, so the keeper does not
change under the snapshot. The frames are `kvstream._wire.zmq_recovery`'s.

Requests are served one at a time, each paced (a full pipe waits, never loses a
frame) and abandoned after `timeout` seconds stalled or when its client is
gone; others wait in ZMQ's queue meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import anyio
import anyio.lowlevel

from kvstream._burst_log import BurstLog
from kvstream._wire.broker import snapshot_parts
from kvstream._wire.zmq_recovery import (
    SnapshotHead,
    parse_snapshot_request,
    snapshot_message,
)
from kvstream.codecs.base import Codec
from kvstream.errors import DecodeError
from kvstream.events import EventBatch
from kvstream.sinks.zmq._frames import pipe_backoff
from kvstream.state import StateError, StateKeeper, StateLimitError

try:
    import zmq
except ImportError:  # pragma: no cover - kvstream.sinks.zmq reports the missing extra
    pass

__all__ = ["SnapshotServer", "SnapshotServerStatistics", "next_request"]

log = logging.getLogger("kvstream.sinks")

#: How often an idle server applies what the tick recorded, and looks at its socket.
_IDLE_INTERVAL: Final = 0.02


class SnapshotServerStatistics(NamedTuple):
    endpoint: str
    requests: int
    #: Snapshots sent whole (head, every part, end).
    served: int
    #: Requests answered `none` (no origin for the topic, or its state unknown).
    unavailable: int
    malformed: int
    #: Replies given up: the client went away or its pipe stayed full too long.
    abandoned: int
    #: Blocks held over all origins, and the keeper's estimated bytes.
    blocks: int
    bytes: int


class SnapshotServer:
    """State of the published batches, and the task that serves its snapshots.

    `origin_of(topic)` names the origin whose stream has that topic (None: no
    such stream). `codec` encodes the parts (the sink's, so a consumer reads
    them as it reads live payloads).
    """

    def __init__(
        self,
        where: str,
        *,
        codec: Codec,
        origin_of: Callable[[bytes], str | None],
        max_bytes: int,
        timeout: float,
    ) -> None:
        self.where = where
        self.codec = codec
        self.origin_of = origin_of
        self.timeout = timeout
        self.keeper = StateKeeper(max_bytes=max_bytes)
        #: Batches published and not yet applied to the keeper (the tick appends).
        self.pending: list[EventBatch] = []
        self.endpoint = ""
        self._requests = 0
        self._served = 0
        self._unavailable = 0
        self._malformed = 0
        self._malformed_log = BurstLog(log)
        self._abandoned = 0

    def apply_pending(self) -> None:
        pending, self.pending = self.pending, []
        for batch in pending:
            try:
                self.keeper.apply(batch)
            except StateLimitError as exc:
                log.error("%s: no snapshots of this origin for now: %s", self.where, exc)

    def statistics(self) -> SnapshotServerStatistics:
        kept = self.keeper.statistics()
        return SnapshotServerStatistics(
            endpoint=self.endpoint,
            requests=self._requests,
            served=self._served,
            unavailable=self._unavailable,
            malformed=self._malformed,
            abandoned=self._abandoned,
            blocks=kept.blocks,
            bytes=kept.bytes,
        )

    async def serve(self, router: zmq.Socket[bytes]) -> None:
        """Answer requests until cancelled (a task of the sink's)."""
        while True:
            frames = await next_request(
                router, f"{self.where}: snapshot server", self.apply_pending
            )
            if frames is None:
                return
            try:
                identity, topic = parse_snapshot_request(frames)
            except DecodeError as exc:
                self._malformed += 1
                self._malformed_log.log(
                    "%s: malformed snapshot request ignored: %s", self.where, exc
                )
                continue
            self._requests += 1
            await self._answer(router, identity, topic)

    async def _answer(self, router: zmq.Socket[bytes], identity: bytes, topic: bytes) -> None:
        self.apply_pending()
        messages = await self._messages(identity, topic)
        backoff = pipe_backoff()
        stalled_since: float | None = None
        for frames in messages:
            while True:
                try:
                    router.send_multipart(frames, zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    now = anyio.current_time()
                    if stalled_since is None:
                        stalled_since = now
                    elif now - stalled_since > self.timeout:
                        self._abandon(identity, f"its pipe stayed full for {self.timeout:g} s")
                        return
                    self.apply_pending()
                    await backoff.wait()
                    continue
                except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the client is gone
                    self._abandon(identity, str(exc))
                    return
                stalled_since = None
                backoff.reset()
                break
        if len(messages) > 1:
            self._served += 1
        else:
            self._unavailable += 1

    async def _messages(self, identity: bytes, topic: bytes) -> list[list[bytes]]:
        """The reply: head, parts and end, or one `none` message."""
        origin = self.origin_of(topic)
        if origin is None:
            return [snapshot_message(identity, "none", topic, b"no stream has this topic")]
        keeper = self.keeper
        try:
            snap = keeper.snapshot_header(origin)
        except StateError as exc:
            return [snapshot_message(identity, "none", topic, str(exc).encode())]
        # Batches published from here on wait in `pending`: the keeper does not
        # change while its events are taken, a slice at a time.
        parts: list[Any] = []
        for part in snapshot_parts(snap, keeper.snapshot_events(origin), self.codec):
            parts.append(snapshot_message(identity, "part", topic, part))
            await anyio.lowlevel.checkpoint()
        head = SnapshotHead(
            origin=snap.origin,
            epoch=snap.epoch,
            resume_seq=snap.resume_seq,
            blocks=snap.blocks,
            parts=len(parts),
            data_parallel_rank=snap.data_parallel_rank,
            ts=snap.ts,
        )
        return [
            snapshot_message(identity, "head", topic, head.to_json()),
            *parts,
            snapshot_message(identity, "end", topic, b""),
        ]

    def _abandon(self, identity: bytes, reason: str) -> None:
        self._abandoned += 1
        log.warning("%s: snapshot to %s abandoned: %s", self.where, identity.hex(), reason)


async def next_request(
    router: zmq.Socket[bytes],
    what: str,
    on_idle: Callable[[], object] | None = None,
    interval: Callable[[], float] | None = None,
) -> list[bytes] | None:
    """The next request on a ROUTER served from the loop (replies, snapshots); None
    once the socket is closed. While none is there, `on_idle()` runs and the
    descriptor is watched, with a timeout (`interval()` seconds, default
    `_IDLE_INTERVAL`): a reply sent on the same socket can take its signal.
    """
    while True:
        try:
            return router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            if on_idle is not None:
                on_idle()
            with anyio.move_on_after(_IDLE_INTERVAL if interval is None else interval()):
                await anyio.wait_readable(router.FD)
        except zmq.ZMQError as exc:
            log.debug("%s stopped: %s", what, exc)
            return None
