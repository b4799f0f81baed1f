"""What the broker sinks (NATS JetStream, Redis Streams) share: snapshots and heartbeats.

A broker sink keeps the state of the batches its broker acknowledged, to
publish an origin's snapshot when one is due (`SinkSnapshots`), and announces
origins that went quiet (`Heartbeats`). The rules for both, and how a due
snapshot becomes one stored envelope, are written once here; each sink adds
only where its broker stores the envelope and the beats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from anyio.abc import TaskGroup

from kvstream._checks import count, flag, seconds
from kvstream._wire.broker import (
    Heartbeat,
    Heartbeats,
    SinkSnapshots,
    SnapshotInfo,
    snapshot_envelope,
)
from kvstream.errors import KVStreamError, TransportError
from kvstream.events import EventBatch
from kvstream.sinks.base import Sink
from kvstream.state import DEFAULT_MAX_BYTES, Snapshot

__all__ = ["BrokerSink"]

log = logging.getLogger("kvstream.sinks")


class BrokerSink(Sink):
    """A sink that stores batches in a broker, with opt-in snapshots and heartbeats.

    `snapshot_every` (batches) and/or `snapshot_interval` (seconds) turn
    snapshots on, each at most `snapshot_max_bytes` of state; `heartbeat`
    (seconds) turns heartbeats on. A subclass sets `shown` (the broker's URL
    without credentials) before calling this constructor, calls
    `_keep_delivered()` after each batch its broker acknowledged, in stream
    order, stores a due snapshot's `_snapshot_envelope()`, and implements
    `_beat()`.

    `retry_connect` (default true): a server that cannot be reached at start
    does not fail the entry: the sink enters unhealthy and connects once the
    server is there (`Sink.opens_later()`); batches wait in its outbox
    meanwhile, under its policy. A server that answers and refuses (a wrong
    password) still fails it. A subclass says which errors are "unreachable"
    (`_unreachable()`) and opens the connection in `recover()` when it has none.
    """

    shown: str

    def __init__(
        self,
        *,
        snapshot_every: int | None = None,
        snapshot_interval: float | None = None,
        snapshot_max_bytes: int = DEFAULT_MAX_BYTES,
        heartbeat: float | None = None,
        retry_connect: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.retry_connect = flag(f"{self.shown}: retry_connect", retry_connect)
        #: Why the last attempt to connect failed (None once connected).
        self.connect_error: str | None = None
        seconds(f"{self.shown}: heartbeat", heartbeat)
        seconds(f"{self.shown}: snapshot_interval", snapshot_interval)
        count(f"{self.shown}: snapshot_every", snapshot_every)
        count(f"{self.shown}: snapshot_max_bytes", snapshot_max_bytes)
        #: The state kept for snapshots (None: snapshots are off).
        self.snapshots: SinkSnapshots | None = None
        if snapshot_every is not None or snapshot_interval is not None:
            self.snapshots = SinkSnapshots(
                self.shown,
                every=snapshot_every,
                interval=snapshot_interval,
                max_bytes=snapshot_max_bytes,
                clock=time.monotonic,
            )
        self.heartbeat = heartbeat
        self._heartbeats = (
            Heartbeats(heartbeat, self.shown, self._beat, clock=time.monotonic)
            if heartbeat is not None
            else None
        )

    def _keep_delivered(self, batch: EventBatch, position: str) -> bool:
        """`batch` is stored at `position`: keep it; True when its origin's snapshot
        is due (the subclass then publishes it)."""
        if self._heartbeats is not None:
            self._heartbeats.delivered(batch)
        snapshots = self.snapshots
        return snapshots is not None and snapshots.delivered(batch, position)

    async def _snapshot_envelope(
        self, origin: str, where: str
    ) -> tuple[Snapshot, SnapshotInfo, bytes] | None:
        """`origin`'s snapshot, its info (`where`: the subject or stream key its
        batches go to) and the envelope to store; None when it has none."""
        snapshots = self.snapshots
        if snapshots is None:
            return None
        encoded = await snapshots.encode(origin)
        if encoded is None:
            return None
        snap, position, parts = encoded
        info = SnapshotInfo(
            origin=snap.origin,
            epoch=snap.epoch,
            resume_seq=snap.resume_seq,
            position=position,
            where=where,
            blocks=snap.blocks,
            ts=snap.ts,
        )
        return snap, info, snapshot_envelope(info, parts)

    async def _beat(self, heartbeat: Heartbeat) -> None:
        """Announce `heartbeat` on the broker (a failure is logged by `Heartbeats`)."""
        raise NotImplementedError

    def opens_later(self, exc: TransportError) -> bool:
        if self.retry_connect and self._unreachable(exc):
            self.connect_error = str(exc)
            return True
        return False

    def _unreachable(self, exc: TransportError) -> bool:
        """Whether `exc` (raised while connecting) says the server could not be
        reached, rather than that it refused."""
        return False

    async def _connecting(self, connect: Callable[[], Awaitable[None]]) -> None:
        """`connect()`, keeping why it failed in `connect_error` (cleared once it worked)."""
        try:
            await connect()
        except KVStreamError as error:  # unreachable still, or reached and refused
            self.connect_error = str(error)
            raise
        self.connect_error = None
        log.info("%s: connected", self.name)

    def _not_connected(self) -> TransportError:
        """The error of a send with no connection (why the last attempt failed)."""
        why = f" ({self.connect_error})" if self.connect_error else ""
        return TransportError(f"{self.shown}: not connected{why}")

    def start_tasks(self, tg: TaskGroup) -> None:
        if self._heartbeats is not None:
            tg.start_soon(self._heartbeats.run, name=f"kvstream heartbeats {self.name}")
