"""RedisSink: one Redis Streams entry per batch, never written twice.

`redis://HOST:PORT/STREAM?maxlen=N` (redis-py asyncio, extra `redis`).
Each batch is one `XADD` with the fields `payload`, `origin`, `epoch`,
`seq` and `codec` (see `kvstream._wire.broker`), trimmed with
`MAXLEN ~ N` when `maxlen` is given. Several queued batches go out in one
`MULTI`/`EXEC` round trip (up to `RedisSink.max_coalesce`): all of
them are added or none.

`XADD` is not idempotent, and a connection that breaks after the server
applied a command but before the reply arrived leaves the outcome unknown. So
after any failure the next attempt first reads the entries added since the
last one this sink knows it wrote, and skips every batch it finds there by its
`(origin, epoch, seq)`: a retry never duplicates and never loses a batch.

Snapshots (opt-in: `snapshot_every=N` batches and/or `snapshot_interval=T`
seconds): the sink keeps the state of the batches it wrote
(`SinkSnapshots`) and, when one is due, writes the
origin's snapshot with one `SET` to the key `<stream>:snapshot:<origin>`
(the latest replaces the one before at once) and adds the origin to the set
`<stream>:snapshots`. A key rather than a capped stream: a key keeps exactly
one value per origin and is replaced atomically however large the snapshot,
where a stream capped to one entry per origin would need one stream per origin.
Heartbeats (opt-in: `heartbeat=T` seconds): every origin that wrote nothing
for `T` seconds sets its field of the hash `<stream>:heartbeats` to its
epoch, last seq and a counter (readers poll it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from kvstream._checks import count, seconds, text
from kvstream._wire import redis_client
from kvstream._wire.broker import (
    DEFAULT_REDIS_STREAM,
    BatchKey,
    Heartbeat,
    key_from_fields,
    redis_fields,
    redis_heartbeats_key,
    redis_snapshot_index,
    redis_snapshot_key,
)
from kvstream._wire.broker_client import shown_url
from kvstream.codecs.json import JsonCodec
from kvstream.errors import ConfigError, DecodeError, TransportError
from kvstream.events import EventBatch
from kvstream.sinks._broker import BrokerSink
from kvstream.state import DEFAULT_MAX_BYTES

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = ["RedisSink"]

log = logging.getLogger("kvstream.sinks")

_SCAN_PAGE = 512


def _as_id(value: object) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if not isinstance(value, bytes):
        raise TransportError(f"expected a stream entry id, got {value!r:.40}")
    return value


def _next_id(entry_id: bytes) -> bytes:
    """The smallest stream id after `entry_id` (`ms-seq` -> `ms-(seq+1)`)."""
    ms, _, seq = entry_id.partition(b"-")
    return ms + b"-" + str(int(seq or b"0") + 1).encode()


class RedisSink(BrokerSink):
    """Append every batch to the Redis stream `stream` with `XADD`.

    `maxlen` trims the stream to about that many entries (`MAXLEN ~`).
    `dedup_scan` bounds how many entries a retry reads to find batches
    already written (entries other producers added meanwhile count too).
    """

    max_coalesce = 64

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379",
        *,
        stream: str = DEFAULT_REDIS_STREAM,
        maxlen: int | None = None,
        db: int = 0,
        connect_timeout: float = 5.0,
        dedup_scan: int = 100_000,
        snapshot_every: int | None = None,
        snapshot_interval: float | None = None,
        snapshot_max_bytes: int = DEFAULT_MAX_BYTES,
        heartbeat: float | None = None,
        **options: Any,
    ) -> None:
        redis_client.require_redis()  # a missing extra fails here, not at the first send
        self.url = text("RedisSink.url", url)
        self.shown = shown_url(url)
        count(f"{self.shown}: db", db, minimum=0)
        seconds(f"{self.shown}: connect_timeout", connect_timeout)
        count(f"{self.shown}: dedup_scan", dedup_scan)
        if type(stream) is not str or not stream:
            raise ConfigError(f"{self.shown}: stream: expected a key name, got {stream!r:.80}")
        if maxlen is not None and (type(maxlen) is not int or maxlen < 1):
            raise ConfigError(f"{self.shown}: maxlen: expected an int >= 1, got {maxlen!r}")
        options.setdefault("codec", JsonCodec())
        options.setdefault("name", f"{self.shown}/{stream}")
        super().__init__(
            snapshot_every=snapshot_every,
            snapshot_interval=snapshot_interval,
            snapshot_max_bytes=snapshot_max_bytes,
            heartbeat=heartbeat,
            **options,
        )
        if self.codec is None:
            raise ConfigError("RedisSink: codec: expected a codec, got None")
        self.stream = stream
        self.maxlen = maxlen
        self.db = db
        self.connect_timeout = connect_timeout
        self.dedup_scan = dedup_scan
        self._client: Redis | None = None
        # The id of the last entry this sink knows it wrote (or the stream's
        # last entry when it started): what a retry scans after.
        self._last_id = b"0-0"
        # True from the start of an XADD until its reply: the next attempt
        # first looks for what the failed one may have written.
        self._uncertain = False
        #: Batches a retry found already written (and did not write again).
        self.duplicates = 0

    async def open(self) -> None:
        client = await redis_client.open_stream_client(
            self.url, self.stream, db=self.db, connect_timeout=self.connect_timeout
        )
        async with redis_client.translated_errors(client, self.shown):
            last = await client.xrevrange(self.stream, count=1)
        self._last_id = _as_id(last[0][0]) if last else b"0-0"
        self._client = client

    async def recover(self, exc: Exception) -> None:
        """Open the connection a server not up at start kept from opening (a client
        once open reconnects by itself, checking before each command)."""
        if self._client is not None:
            return
        await self._connecting(self.open)

    def _unreachable(self, exc: TransportError) -> bool:
        redis = redis_client.require_redis()
        cause = exc.__cause__
        return isinstance(
            cause, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError | OSError
        ) and not isinstance(cause, redis.exceptions.AuthenticationError)

    async def write(self, data: bytes, batch: EventBatch) -> None:
        await self.write_many([(data, batch)])

    async def write_many(self, items: Sequence[tuple[bytes, EventBatch]]) -> None:
        redis = redis_client.require_redis()
        client = self._client
        if client is None:
            raise self._not_connected()
        codec = self.codec
        assert codec is not None
        try:
            if self._uncertain:
                found = await self._written({batch.key for _, batch in items})
                if found:
                    self.duplicates += len(found)
                    log.info(
                        "%s: %d batch(es) of the failed attempt were written; not adding again",
                        self.name,
                        len(found),
                    )
                    for _, b in items:  # written by the failed attempt: keep them now
                        entry = found.get(b.key)
                        if entry is not None:
                            await self._delivered(b, entry.decode())
                    items = [(d, b) for d, b in items if b.key not in found]
                if not items:
                    self._uncertain = False
                    return
            self._uncertain = True
            if len(items) == 1:
                data, batch = items[0]
                ids = [
                    await client.xadd(
                        self.stream, redis_fields(batch, data, codec.name), maxlen=self.maxlen
                    )
                ]
            else:
                async with client.pipeline(transaction=True) as pipe:
                    for data, batch in items:
                        pipe.xadd(
                            self.stream, redis_fields(batch, data, codec.name), maxlen=self.maxlen
                        )
                    ids = await pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            raise TransportError(
                f"{self.shown}: XADD to {self.stream} failed: {redis_client.describe_error(exc)}"
            ) from exc
        self._uncertain = False
        self._last_id = _as_id(ids[-1])
        for (_, batch), entry_id in zip(items, ids, strict=True):
            await self._delivered(batch, _as_id(entry_id).decode())

    async def _written(self, wanted: set[BatchKey]) -> dict[BatchKey, bytes]:
        """Which of `wanted` the stream holds after the last entry known written
        (with the id of the entry that holds each)."""
        client = self._client
        assert client is not None
        found: dict[BatchKey, bytes] = {}
        start = _next_id(self._last_id)
        scanned = 0
        while scanned < self.dedup_scan and len(found) < len(wanted):
            entries = await client.xrange(self.stream, min=start, max="+", count=_SCAN_PAGE)
            if not entries:
                break
            for entry_id, fields in entries:
                try:
                    key = key_from_fields(fields)
                except DecodeError:
                    continue
                if key in wanted:
                    found[key] = self._last_id = _as_id(entry_id)
            scanned += len(entries)
            start = _next_id(_as_id(entries[-1][0]))
        else:
            if scanned >= self.dedup_scan:
                log.warning(
                    "%s: looked at %d entries for the batches of a failed attempt, stopped "
                    "(dedup_scan); batches not found are written again",
                    self.name,
                    scanned,
                )
        return found

    # -- snapshots and heartbeats ----------------------------------------------------

    async def _delivered(self, batch: EventBatch, entry_id: str) -> None:
        if self._keep_delivered(batch, entry_id):
            await self.publish_snapshot(batch.origin)

    async def publish_snapshot(self, origin: str) -> bool:
        """Write `origin`'s snapshot now; False when there is none to write or it failed.

        A failure is logged and counted (`snapshots.failed`) and does not fail
        the batch that made it due; the next snapshot is tried when it is due again.
        """
        redis = redis_client.require_redis()
        snapshots = self.snapshots
        client = self._client
        if snapshots is None or client is None:
            return False
        made = await self._snapshot_envelope(origin, self.stream)
        if made is None:
            return False
        snap, _, envelope = made
        try:
            async with client.pipeline(transaction=True) as pipe:
                pipe.set(redis_snapshot_key(self.stream, origin), envelope)
                pipe.sadd(redis_snapshot_index(self.stream), origin.encode())
                await pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            return snapshots.stored(origin, snap.epoch, redis_client.describe_error(exc))
        return snapshots.stored(origin, snap.epoch)

    async def _beat(self, heartbeat: Heartbeat) -> None:
        client = self._client
        if client is None:
            return
        await client.hset(
            redis_heartbeats_key(self.stream), heartbeat.origin.encode(), heartbeat.to_json()
        )

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            client, self._client = self._client, None
            with anyio.CancelScope(shield=True):
                await redis_client.close_quietly(client)
