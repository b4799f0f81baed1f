"""Reading batches back from a Redis stream: plain ``XREAD`` or a consumer group.

``redis://HOST:PORT/STREAM[?group=NAME&consumer=NAME&start=ID]`` (redis-py
asyncio, extra ``redis``). Every entry is turned back into its batch (codec
from the ``codec`` field, name from ``origin``/``epoch``/``seq``, see
:mod:`kvstream.wire.broker`), continuity is checked per ``(origin, epoch)``,
and batches and :class:`~kvstream.consumers.base.Gap` items are yielded in
stream order.

``start`` is where reading begins (``0``: the beginning; ``$``: only entries
added from now on; or an entry id). By default, as
:func:`kvstream.config.subscribe` promises, live batches only (``$``) unless
the reader gives a ``from_seq`` (then ``0``, skipping each origin's batches
below it).

* **Plain** (no ``group``): ``XREAD`` from ``start``. The
  subscriber remembers the last id it handed over and continues from there
  after a lost connection or a server restart; :attr:`RedisSubscriber.last_id`
  is what to pass as ``start`` to resume in another process.
* **Group** (``group=NAME``): ``XREADGROUP`` as ``consumer`` (default: the
  host name). The group is created at ``start`` when missing. Entries are
  acknowledged (``XACK``, several at a time) once the caller has taken their
  batch and asked for the next item, and on a clean close; after a restart or
  a reconnect the consumer first re-reads its own pending (delivered, not
  acknowledged) entries, then new ones. Delivery is at least once; the
  tracker drops repeats within one subscriber.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, Self

import anyio

from kvstream.codecs.base import Codec
from kvstream.consumers.base import Continuity, SequenceTracker, Subscriber, SubscriberItem
from kvstream.errors import ClosedError, ConfigError, DecodeError, TransportError
from kvstream.wire.broker import (
    DEFAULT_REDIS_STREAM,
    FIELD_CODEC,
    FIELD_PAYLOAD,
    FromSeq,
    PayloadDecoder,
    check_from_seq,
    client_url,
    key_from_fields,
    start_seq,
)
from kvstream.wire.redis_client import (
    close_quietly,
    describe_error,
    open_client,
    require_redis,
    shown_url,
    stream_type_check,
)

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from kvstream.config import Options, ParsedURL

__all__ = ["RedisSubscriber", "subscriber_from_url"]

log = logging.getLogger("kvstream.consumers")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisSubscriber(Subscriber):
    """Batches from a Redis stream, in order, with gaps reported.

    ``start``: ``0``, ``$`` or an entry id (default ``$``, or ``0`` when
    ``from_seq`` is given); for a group, where it is created. ``from_seq`` (an
    int, or ``{origin: seq}`` with ``"*"`` for the others) skips, in the first
    epoch seen of each origin, the batches below it. ``follow=False`` stops
    once the subscriber has caught up. ``codec`` decodes entries that do not
    name their codec (default JSON). ``block`` is the longest wait of one
    read, in seconds.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379",
        *,
        stream: str = DEFAULT_REDIS_STREAM,
        group: str | None = None,
        consumer: str | None = None,
        start: str | None = None,
        follow: bool = True,
        from_seq: FromSeq = None,
        codec: Codec | None = None,
        count: int = 256,
        block: float = 1.0,
        db: int = 0,
        connect_timeout: float = 5.0,
        retry_initial: float = 0.05,
        retry_max: float = 5.0,
    ) -> None:
        require_redis()
        self.url = url
        self.shown = shown_url(url)
        if not stream:
            raise ConfigError(f"{self.shown}: stream: expected a key name, got {stream!r}")
        if group is not None and not group:
            raise ConfigError(f"{self.shown}: group: expected a name, got {group!r}")
        if type(count) is not int or count < 1:
            raise ConfigError(f"{self.shown}: count: expected an int >= 1, got {count!r}")
        if not block > 0:
            raise ConfigError(f"{self.shown}: block: expected seconds > 0, got {block!r}")
        from_seq = check_from_seq(from_seq, self.shown)
        if start is None:
            start = "$" if from_seq is None else "0"
        if start not in ("0", "$") and not _looks_like_id(start):
            raise ConfigError(
                f"{self.shown}: start: expected 0, $ or an entry id like 1700000000000-0, "
                f"got {start!r}"
            )
        self.stream = stream
        self.group = group
        self.consumer = consumer or socket.gethostname()
        self.start = start
        self.follow = follow
        self.from_seq = from_seq
        self.decoder = PayloadDecoder(codec)
        self.count = count
        self.block = block
        self.db = db
        self.connect_timeout = connect_timeout
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self.tracker = SequenceTracker()
        #: Entries whose fields or payload did not decode (skipped, logged).
        self.bad_entries = 0
        #: Reads that failed and were retried.
        self.read_errors = 0
        #: Plain mode: the id of the last entry handed over (``start`` to resume from).
        self.last_id: str | None = None
        self._client: Redis | None = None
        self._gen: AsyncGenerator[SubscriberItem, None] | None = None
        self._closed = False

    def __repr__(self) -> str:
        mode = f"group={self.group!r}" if self.group else f"start={self.start!r}"
        return f"<RedisSubscriber {self.shown}/{self.stream} {mode}>"

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
        gen, self._gen = self._gen, None
        with anyio.CancelScope(shield=True):
            try:
                if gen is not None:
                    try:
                        await gen.aclose()
                    except RuntimeError:  # being iterated in another task: it sees _closed
                        pass
            finally:
                client, self._client = self._client, None
                await close_quietly(client)

    def __aiter__(self) -> AsyncIterator[SubscriberItem]:
        if self._closed:
            raise ClosedError(f"{self!r}: the subscriber is closed")
        if self._gen is None:
            self._gen = self._read()
        return self._gen

    def _stopping(self) -> bool:
        return self._closed  # a call, so that type checkers do not assume it unchanged

    # -- connection ---------------------------------------------------------------

    async def _connect(self) -> None:
        redis = require_redis()
        client = await open_client(self.url, db=self.db, connect_timeout=self.connect_timeout)
        try:
            await stream_type_check(client, self.stream, self.shown)
            if self.group is not None:
                try:
                    await client.xgroup_create(
                        self.stream, self.group, id=self.start, mkstream=True
                    )
                except redis.exceptions.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise ConfigError(
                            f"{self.shown}: cannot create group {self.group!r} on "
                            f"{self.stream!r}: {describe_error(exc)}"
                        ) from exc
            elif self.last_id is None and self.start == "$":
                # Pin "$" to an id now, so a reconnect does not skip what came meanwhile.
                last = await client.xrevrange(self.stream, count=1)
                self.last_id = _text(last[0][0]) if last else "0-0"
        except (redis.exceptions.RedisError, OSError) as exc:
            await close_quietly(client)
            raise TransportError(f"{self.shown}: {describe_error(exc)}") from exc
        except BaseException:
            with anyio.CancelScope(shield=True):
                await close_quietly(client)
            raise
        self._client = client

    # -- reading ------------------------------------------------------------------

    async def _read_entries(self, cursor: str, block: bool) -> list[tuple[Any, Any]]:
        redis = require_redis()
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
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" in str(exc):  # the server lost it (restart without persistence)
                await self._close_client()
            raise TransportError(f"{self.shown}: read failed: {describe_error(exc)}") from exc
        except (redis.exceptions.RedisError, OSError) as exc:
            raise TransportError(f"{self.shown}: read failed: {describe_error(exc)}") from exc
        entries: list[tuple[Any, Any]] = []
        for _key, items in reply or ():  # RESP2 (the client's protocol): [[key, entries]]
            entries.extend(items)
        return entries

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        await close_quietly(client)

    async def _ack(self, ids: list[Any]) -> None:
        if not ids or self.group is None:
            ids.clear()
            return
        redis = require_redis()
        client = self._client
        if client is None:
            return
        try:
            await client.xack(self.stream, self.group, *ids)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise TransportError(f"{self.shown}: XACK failed: {describe_error(exc)}") from exc
        ids.clear()

    def _accept(self, entry_id: Any, fields: Any) -> list[SubscriberItem]:
        """Decode one entry and check continuity; [] when it is skipped."""
        try:
            key = key_from_fields(fields)
            payload = fields.get(FIELD_PAYLOAD)
            if type(payload) is not bytes:
                raise DecodeError("entry: expected a payload field")
            codec = fields.get(FIELD_CODEC)
            batch = self.decoder.decode(payload, key, _text(codec) if codec else None)
        except DecodeError as exc:
            self.bad_entries += 1
            log.warning(
                "%s/%s: entry %s skipped: %s", self.shown, self.stream, _text(entry_id), exc
            )
            return []
        if self.from_seq is not None and self.tracker.position(batch.origin) is None:
            first = start_seq(self.from_seq, batch.origin)
            if first is not None and batch.seq < first:
                return []
        state, gap = self.tracker.check(batch)
        if state is Continuity.DUPLICATE:
            return []
        return [gap, batch] if gap is not None else [batch]

    async def _read(self) -> AsyncGenerator[SubscriberItem, None]:
        if self._client is None and not self._closed:
            await self._connect()  # a failure to start is raised as it is
        grouped = self.group is not None
        # Group mode reads its own pending entries (cursor after "0") first, then ">".
        pending_cursor: str | None = "0" if grouped else None
        consumed: list[Any] = []  # group entries handed over, not yet acknowledged
        delay = self._retry_initial
        failures = 0
        try:
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
                except (TransportError, ConfigError) as exc:
                    if self._stopping():
                        break
                    if failures == 0:
                        log.warning("%s: %s; retrying with backoff", self.shown, exc)
                    failures += 1
                    self.read_errors += 1
                    if grouped:
                        pending_cursor = "0"  # what was not acknowledged comes back
                        consumed.clear()
                    await anyio.sleep(delay)
                    delay = min(delay * 2, self._retry_max)
                    continue
                if failures:
                    log.warning("%s: reading again after %d failed attempts", self.shown, failures)
                    failures = 0
                    delay = self._retry_initial
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
                    for item in self._accept(entry_id, fields):
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


# -- URL factory (kvstream.config's _SUBSCRIBERS) -------------------------------------


def subscriber_from_url(parsed: ParsedURL, opts: Options, kwargs: dict[str, Any]) -> Subscriber:
    """``redis://HOST:PORT[/STREAM]?group=NAME&consumer=NAME&start=ID`` -> RedisSubscriber."""
    from kvstream.config import make_codec

    codec_name = opts.pop_str("codec")
    if codec_name is not None:
        kwargs["codec"] = make_codec(codec_name, opts)
    return RedisSubscriber(
        client_url(parsed.raw, parsed.scheme, 6379),
        stream=parsed.path or DEFAULT_REDIS_STREAM,
        group=opts.pop_str("group") or None,
        consumer=opts.pop_str("consumer") or None,
        start=opts.pop_str("start") or None,
        follow=opts.pop_bool("follow", kwargs.pop("follow", True)),
        from_seq=opts.pop_int("from_seq", kwargs.pop("from_seq", None)),
        count=opts.pop_int("count", 256, minimum=1) or 256,
        block=opts.pop_float("block", 1.0) or 1.0,
        db=opts.pop_int("db", 0) or 0,
        connect_timeout=opts.pop_float("connect_timeout", 5.0) or 5.0,
        **kwargs,
    )
