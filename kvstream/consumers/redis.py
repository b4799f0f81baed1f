"""Reading batches back from a Redis stream: plain `XREAD` or a consumer group.

`redis://HOST:PORT/STREAM[?group=NAME&consumer=NAME&start=ID]` (redis-py
asyncio, extra `redis`). Every entry is turned back into its batch (codec
from the `codec` field, name from `origin`/`epoch`/`seq`, see
`kvstream._wire.broker`), continuity is checked per `(origin, epoch)`,
and batches and [`Gap`][kvstream.consumers.base.Gap] items are yielded in
stream order.

`start` is where reading begins (`0`: the beginning; `$`: only entries
added from now on; or an entry id). By default, as
`kvstream.config.subscribe()` promises, live batches only (`$`) unless
the reader gives a `from_seq` (then `0`, skipping each origin's batches
below it).

* **Plain** (no `group`): `XREAD` from `start`. The
  subscriber remembers the last id it handed over and continues from there
  after a lost connection or a server restart; `RedisSubscriber.last_id`
  is what to pass as `start` to resume in another process.
* **Group** (`group=NAME`): `XREADGROUP` as `consumer` (default: the
  host name). The group is created at `start` when missing. Entries are
  acknowledged (`XACK`, several at a time) once the caller has taken their
  batch and asked for the next item, and on a clean close; after a restart or
  a reconnect the consumer first re-reads its own pending (delivered, not
  acknowledged) entries, then new ones. Delivery is at least once; the
  tracker drops repeats within one subscriber.

Snapshots (see `kvstream.consumers._broker`; plain mode only): read from
the keys a [`RedisSink`][kvstream.sinks.redis.RedisSink] with
`snapshot_every`/`snapshot_interval` writes beside `STREAM`. On a cold
start with snapshots found, reading starts after the oldest snapshot's entry,
whatever `start` says.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Unpack

import anyio

from kvstream import _checks as checks
from kvstream._wire import redis_client
from kvstream._wire.broker import (
    DEFAULT_REDIS_STREAM,
    Heartbeat,
    SnapshotInfo,
    read_envelope,
    read_envelope_info,
    redis_heartbeats_key,
    redis_position,
    redis_snapshot_index,
    redis_snapshot_key,
)
from kvstream._wire.broker_client import shown_url
from kvstream.consumers._broker import BrokerSubscriber, ReaderOptions
from kvstream.consumers.base import SubscriberItem
from kvstream.errors import ConfigError, DecodeError, TransportError

if TYPE_CHECKING:
    # Named only in a string (the base class's type argument), which ruff does not see.
    from redis.asyncio import Redis

__all__ = ["RedisSubscriber"]

log = logging.getLogger("kvstream.consumers")

#: Bytes of a snapshot read to find its info line (a few hundred, unless it has many parts).
_INFO_BYTES = 65536


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisSubscriber(BrokerSubscriber["Redis"]):
    """Batches from a Redis stream, in order, with gaps reported.

    `start`: `0`, `$` or an entry id (default `$`, or `0` when
    `from_seq` is given); for a group, where it is created. `from_seq` (an
    int, or `{origin: seq}` with `"*"` for the others) skips, in the first
    epoch seen of each origin, the batches below it. `follow=False` stops
    once the subscriber has caught up. `codec` decodes entries that do not
    name their codec (default JSON). `block` is the longest wait of one
    read, in seconds. `connect_timeout`, `retry_initial` and `retry_max`
    are `BrokerSubscriber`'s.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379",
        *,
        stream: str = DEFAULT_REDIS_STREAM,
        group: str | None = None,
        consumer: str | None = None,
        start: str | None = None,
        count: int = 256,
        block: float = 1.0,
        db: int = 0,
        **options: Unpack[ReaderOptions],
    ) -> None:
        redis_client.require_redis()
        shown = shown_url(checks.text("RedisSubscriber.url", url))
        if type(stream) is not str or not stream:
            raise ConfigError(f"{shown}: stream: expected a key name, got {stream!r:.80}")
        if group is not None and (type(group) is not str or not group):
            raise ConfigError(f"{shown}: group: expected a name, got {group!r:.80}")
        checks.text(f"{shown}: consumer", consumer)
        if start is not None and type(start) is not str:
            raise ConfigError(
                f"{shown}: start: expected 0, $ or an entry id like 1700000000000-0, "
                f"got {start!r:.80}"
            )
        if type(count) is not int or count < 1:
            raise ConfigError(f"{shown}: count: expected an int >= 1, got {count!r}")
        checks.seconds(f"{shown}: block", block)
        checks.count(f"{shown}: db", db, minimum=0)
        super().__init__(url, shown, **options)
        if self._snapshots_wanted is None:
            self._snapshots_wanted = self.from_seq is None and group is None
        elif self._snapshots_wanted and group is not None:
            raise ConfigError(
                f"{shown}: snapshots: a group ({group!r}) resumes its own position, which a "
                f"snapshot would contradict; drop group or snapshots"
            )
        if start is None:
            start = "$" if self.from_seq is None else "0"
        if start not in ("0", "$") and not _looks_like_id(start):
            raise ConfigError(
                f"{self.shown}: start: expected 0, $ or an entry id like 1700000000000-0, "
                f"got {start!r}"
            )
        self.stream = stream
        self.group = group
        self.consumer = consumer or socket.gethostname()
        self.start = start
        self.count = count
        self.block = block
        self.db = db
        #: Entries whose fields or payload did not decode (skipped, logged).
        self.bad_entries = 0
        #: Reads that failed and were retried.
        self.read_errors = 0
        #: Plain mode: the id of the last entry handed over (`start` to resume from).
        self.last_id: str | None = None
        self._beats: dict[str, int] = {}
        self._beats_polled = 0.0

    def __repr__(self) -> str:
        mode = f"group={self.group!r}" if self.group else f"start={self.start!r}"
        return f"<RedisSubscriber {self.shown}/{self.stream} {mode}>"

    # -- connection ---------------------------------------------------------------

    async def _connect(self) -> None:
        redis = redis_client.require_redis()
        client = await redis_client.open_stream_client(
            self.url, self.stream, db=self.db, connect_timeout=self.connect_timeout
        )
        async with redis_client.translated_errors(client, self.shown):
            if self.group is not None:
                try:
                    await client.xgroup_create(
                        self.stream, self.group, id=self.start, mkstream=True
                    )
                except redis.exceptions.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise ConfigError(
                            f"{self.shown}: cannot create group {self.group!r} on "
                            f"{self.stream!r}: {redis_client.describe_error(exc)}"
                        ) from exc
            used = await self._cold_start(client)
            if used and self.last_id is None:
                # Right after the oldest snapshot; the tracker drops what each one holds.
                self.last_id = min((info.position for info in used), key=redis_position)
            if self.group is None and self.last_id is None and self.start == "$":
                # Pin "$" to an id now, so a reconnect does not skip what came meanwhile.
                last = await client.xrevrange(self.stream, count=1)
                self.last_id = _text(last[0][0]) if last else "0-0"
        self._client = client

    # -- snapshots ------------------------------------------------------------------

    def _covers(self, info: SnapshotInfo) -> bool:
        return info.where == self.stream

    def _position(self, text: str) -> Any:
        return redis_position(text)

    async def _snapshot_heads(
        self, client: Redis, origin: str | None
    ) -> list[tuple[SnapshotInfo, Any]]:
        redis = redis_client.require_redis()
        try:
            if origin is None:
                origins = sorted(
                    _text(o) for o in await client.smembers(redis_snapshot_index(self.stream))
                )
            else:
                origins = [origin]
            out: list[tuple[SnapshotInfo, Any]] = []
            for name in origins:
                key = redis_snapshot_key(self.stream, name)
                # The info line first (a gap may find the snapshot too old to read whole).
                head = await client.getrange(key, 0, _INFO_BYTES - 1)
                if not isinstance(head, bytes) or not head:
                    continue
                try:
                    info = read_envelope_info(head, f"{self.shown}: snapshot of {name}")
                    if info is None:  # a longer info line than we read: read it all
                        whole = await client.get(key)
                        data = whole if isinstance(whole, bytes) else b""
                        info = read_envelope(data, f"{self.shown}: snapshot of {name}")[0]
                except DecodeError as exc:
                    self.bad_snapshots += 1
                    log.warning("%s: %s", self.shown, exc)
                    continue
                out.append((info, key))
            return out
        except (redis.exceptions.RedisError, OSError) as exc:
            raise TransportError(
                f"{self.shown}: reading snapshots failed: {redis_client.describe_error(exc)}"
            ) from exc

    async def _snapshot_envelope(
        self, client: Redis, info: SnapshotInfo, where: Any
    ) -> bytes | None:
        redis = redis_client.require_redis()
        try:
            data = await client.get(where)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise TransportError(
                f"{self.shown}: reading the snapshot of {info.origin} failed: "
                f"{redis_client.describe_error(exc)}"
            ) from exc
        # One GET: consistent. A newer one written since the info was read is refused
        # by the caller (the info differs) and the gap stays a gap.
        return data if isinstance(data, bytes) else None

    async def _poll_heartbeats(self) -> None:
        """Read the heartbeat hash (at most every `block` seconds): a changed beat is a
        sign of life; then judge who is gone."""
        now = time.monotonic()
        client = self._client
        if client is None or now - self._beats_polled < min(self.block, 1.0):
            self._check_liveness()
            return
        self._beats_polled = now
        redis = redis_client.require_redis()
        try:
            fields = await client.hgetall(redis_heartbeats_key(self.stream))
        except (redis.exceptions.RedisError, OSError) as exc:
            raise TransportError(
                f"{self.shown}: reading heartbeats failed: {redis_client.describe_error(exc)}"
            ) from exc
        for raw in fields.values():
            try:
                hb = Heartbeat.from_json(raw)
            except DecodeError as exc:
                self.bad_entries += 1
                log.warning("%s: heartbeat skipped: %s", self.shown, exc)
                continue
            if self._beats.get(hb.origin) != hb.beat:
                self._beats[hb.origin] = hb.beat
                self._on_heartbeat(hb)
        self._check_liveness()

    async def _disconnect(self) -> None:
        client, self._client = self._client, None
        await redis_client.close_quietly(client)

    # -- reading ------------------------------------------------------------------

    async def _read_entries(self, cursor: str, block: bool) -> list[tuple[Any, Any]]:
        redis = redis_client.require_redis()
        client = self._client
        if client is None:
            raise TransportError(f"{self.shown}: not connected")
        wait = int(self.block * 1000) if block else None
        reply: Any
        try:
            if self.group is None:
                reply = await client.xread({self.stream: cursor}, count=self.count, block=wait)
            else:
                reply = await client.xreadgroup(
                    self.group, self.consumer, {self.stream: cursor}, count=self.count, block=wait
                )
        except (redis.exceptions.RedisError, OSError) as exc:
            if isinstance(exc, redis.exceptions.ResponseError) and "NOGROUP" in str(exc):
                await self._disconnect()  # the server lost the group (restart, no persistence)
            raise TransportError(
                f"{self.shown}: read failed: {redis_client.describe_error(exc)}"
            ) from exc
        entries: list[tuple[Any, Any]] = []
        for _key, items in reply or ():  # RESP2 (the client's protocol): [[key, entries]]
            entries.extend(items)
        return entries

    async def _ack(self, ids: list[Any]) -> None:
        if not ids or self.group is None:
            ids.clear()
            return
        redis = redis_client.require_redis()
        client = self._client
        if client is None:
            return
        try:
            await client.xack(self.stream, self.group, *ids)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise TransportError(
                f"{self.shown}: XACK failed: {redis_client.describe_error(exc)}"
            ) from exc
        ids.clear()

    def _accept(self, entry_id: Any, fields: Any) -> list[SubscriberItem]:
        """Decode one entry and check continuity; [] when it is skipped."""
        try:
            batch = self.decoder.decode_entry(fields)
        except DecodeError as exc:
            self.bad_entries += 1
            log.warning(
                "%s/%s: entry %s skipped: %s", self.shown, self.stream, _text(entry_id), exc
            )
            return []
        return self._admit(batch, redis_position(_text(entry_id)))

    async def _read(self) -> AsyncGenerator[SubscriberItem, None]:
        if self._client is None and not self._closed:
            await self._connect()  # a failure to start is raised as it is
        grouped = self.group is not None
        # Group mode reads its own pending entries (cursor after "0") first, then ">".
        pending_cursor: str | None = "0" if grouped else None
        consumed: list[Any] = []  # group entries handed over, not yet acknowledged
        backoff = self._backoff("retrying")
        try:
            while self._pending:
                yield self._pending.popleft()
            while not self._closed:
                if grouped:
                    cursor = pending_cursor if pending_cursor is not None else ">"
                else:
                    cursor = self.last_id or self.start
                try:
                    if self._client is None:
                        await self._connect()
                    await self._ack(consumed)
                    # Wait for new entries only when following (pending ones are there).
                    wait = self.follow and pending_cursor is None
                    entries = await self._read_entries(cursor, wait)
                    if self.heartbeats:
                        await self._poll_heartbeats()
                except (TransportError, ConfigError) as exc:
                    if self._stopping():
                        break
                    self.read_errors += 1
                    if grouped:
                        pending_cursor = "0"  # what was not acknowledged comes back
                        consumed.clear()
                    await backoff.wait(exc)
                    continue
                backoff.succeeded()
                if not entries:
                    if pending_cursor is not None:
                        pending_cursor = None  # pending entries done: new ones now
                        continue
                    if not self.follow:
                        break
                    continue
                for entry_id, fields in entries:
                    if grouped:
                        consumed.append(entry_id)
                        if pending_cursor is not None:
                            pending_cursor = _text(entry_id)
                    else:
                        self.last_id = _text(entry_id)
                    items = self._accept(entry_id, fields)
                    if self._jumped is not None:
                        items = await self._repair(items)
                    for item in items:
                        yield item
        finally:
            if consumed and self._client is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                    try:
                        await self._ack(consumed)
                    except TransportError as exc:
                        log.debug("%s: final XACK failed: %s", self.shown, exc)


def _looks_like_id(text: str) -> bool:
    ms, sep, seq = text.partition("-")
    return ms.isdigit() and (not sep or seq.isdigit())
