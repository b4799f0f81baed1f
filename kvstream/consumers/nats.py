"""Reading batches back from NATS JetStream with a pull consumer.

`nats://HOST:PORT/SUBJECT?durable=NAME` (nats-py, extra `nats`). The
subscriber pulls messages of `SUBJECT` (default `kv.events.>`: every
origin) in stream order, turns each back into its batch (codec from the
`Kv-Codec` header, name from the `Kv-*` headers, see
`kvstream._wire.broker`), checks continuity per `(origin, epoch)` and
yields batches and [`Gap`][kvstream.consumers.base.Gap] items.

Acknowledgement: a message is acked once the caller has taken its batch and
asked for the next item, and on a clean `NatsSubscriber.aclose()` (the
last batch handed over counts as consumed). A crash therefore re-delivers at
most the batches not yet acked: delivery is at least once, and within one
subscriber the tracker drops the repeats.

Where a new consumer starts is `deliver` (`all`, `new` or `last`);
by default, as `kvstream.config.subscribe()` promises, live batches only
(`new`) unless the reader gives a `from_seq` (then `all`, skipping each
origin's batches below it). With `durable=NAME` the consumer lives on the
server and a restarted subscriber resumes after the last batch acked under
that name, whatever `deliver` says. Every independent reader (each router)
needs its own name; readers sharing one share the messages. Without a durable
name the consumer is ephemeral. Either way, when the server goes away the
subscriber reconnects with backoff and continues after the last message it
handed over.

Snapshots (see `kvstream.consumers._broker`): read from the stream
`snapshot_stream` (default `KV_SNAPSHOTS`) that a [`NatsSink`][kvstream.sinks.nats.NatsSink]
with `snapshot_every`/`snapshot_interval` writes. On a cold start with
snapshots found, the consumer starts at the stream sequence after the oldest
snapshot's position, whatever `deliver` says. Not with `durable`: a durable
consumer resumes a position of its own, which a snapshot would contradict.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Final, Literal, Unpack

import anyio
import orjson

from kvstream._checks import seconds, text
from kvstream._wire import nats_client
from kvstream._wire.broker import (
    DEFAULT_SNAPSHOT_STREAM,
    DEFAULT_SUBJECT_FILTER,
    HEARTBEAT_SUBJECT_PREFIX,
    SNAPSHOT_HEADS,
    SUBJECT_PREFIX,
    Heartbeat,
    SnapshotInfo,
    check_subject,
    snapshot_subjects,
    subject_covers,
)
from kvstream._wire.broker_client import closed_on_error, shown_url
from kvstream.consumers._broker import BrokerSubscriber, ReaderOptions
from kvstream.consumers.base import SubscriberItem
from kvstream.errors import ConfigError, DecodeError, KVStreamError, TransportError

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js.client import JetStreamContext

__all__ = ["NatsSubscriber"]

log = logging.getLogger("kvstream.consumers")

Deliver = Literal["all", "new", "last"]
DELIVER: Final[tuple[str, ...]] = ("all", "new", "last")
#: How long the server keeps an ephemeral consumer nobody pulls from.
_EPHEMERAL_IDLE: Final = 60.0


class NatsSubscriber(BrokerSubscriber["Client"]):
    """Batches from a JetStream stream, in order, with gaps reported.

    `subject`: the filter (wildcards allowed; default `kv.events.>`).
    `stream`: the stream to read (None: the one covering the subject).
    `durable`: consumer name to resume from; None for an ephemeral consumer.
    `deliver`: where a new consumer starts (default `new`, or `all` when
    `from_seq` is given). `from_seq` (an int, or `{origin: seq}` with
    `"*"` for the others) skips, in the first epoch seen of each origin, the
    batches below it. `follow=False` stops once the subscriber has caught up
    with the stream. `codec` decodes messages that do not name their codec
    (default JSON). `connect_timeout`, `retry_initial` and `retry_max`
    are `BrokerSubscriber`'s.
    """

    def __init__(
        self,
        url: str = "nats://127.0.0.1:4222",
        *,
        subject: str | None = None,
        stream: str | None = None,
        durable: str | None = None,
        deliver: Deliver | None = None,
        fetch_batch: int = 256,
        poll_interval: float = 1.0,
        ack_wait: float = 30.0,
        snapshot_stream: str = DEFAULT_SNAPSHOT_STREAM,
        **options: Unpack[ReaderOptions],
    ) -> None:
        nats_client.require_nats()
        shown = shown_url(text("NatsSubscriber.url", url))
        text(f"{shown}: subject", subject)
        text(f"{shown}: stream", stream)
        text(f"{shown}: durable", durable)
        text(f"{shown}: snapshot_stream", snapshot_stream)
        seconds(f"{shown}: ack_wait", ack_wait)
        subject = check_subject(subject or DEFAULT_SUBJECT_FILTER, wildcards=True, where=shown)
        super().__init__(url, shown, **options)
        if deliver is None:
            deliver = "new" if self.from_seq is None else "all"
        if deliver not in DELIVER:
            raise ConfigError(
                f"{self.shown}: deliver: expected one of {', '.join(DELIVER)}, got {deliver!r}"
            )
        if durable is not None and (not durable or any(c in durable for c in " .*>")):
            raise ConfigError(
                f"{self.shown}: durable: expected a name without spaces, dots, * or >, "
                f"got {durable!r}"
            )
        if type(fetch_batch) is not int or fetch_batch < 1:
            raise ConfigError(
                f"{self.shown}: fetch_batch: expected an int >= 1, got {fetch_batch!r}"
            )
        seconds(f"{self.shown}: poll_interval", poll_interval)
        if self._snapshots_wanted is None:
            self._snapshots_wanted = self.from_seq is None and durable is None
        elif self._snapshots_wanted and durable is not None:
            raise ConfigError(
                f"{self.shown}: snapshots: a durable consumer ({durable!r}) resumes its own "
                f"position, which a snapshot would contradict; drop durable or snapshots"
            )
        self.snapshot_stream = snapshot_stream
        self._snapshot_direct: bool | None = None  # known at the first read of the stream
        self.subject = subject
        self.stream = stream
        self.durable = durable
        self.deliver: Deliver = deliver
        self.fetch_batch = fetch_batch
        self.poll_interval = poll_interval
        self.ack_wait = ack_wait
        #: Messages whose payload or headers did not decode (skipped, logged).
        self.bad_messages = 0
        #: Connections made after the first one.
        self.reconnects = 0
        self._psub: JetStreamContext.PullSubscription | None = None
        self._stream_name: str | None = None
        self._ack_all = True
        self._last_stream_seq: int | None = None
        self._lost = False
        self._fetch_scope: anyio.CancelScope | None = None

    def __repr__(self) -> str:
        return f"<NatsSubscriber {self.shown} subject={self.subject!r} durable={self.durable!r}>"

    @property
    def stream_name(self) -> str | None:
        """The stream being read (known once connected)."""
        return self._stream_name

    # -- connection ---------------------------------------------------------------

    def _interrupt(self) -> None:
        scope = self._fetch_scope  # a fetch in another task: stop waiting
        if scope is not None:
            scope.cancel()

    def _on_lost(self) -> None:
        self._lost = True
        self._interrupt()

    async def _connect(self) -> None:
        client = await nats_client.connect(
            self.url,
            name="kvstream subscriber",
            connect_timeout=self.connect_timeout,
            on_lost=self._on_lost,
        )
        self._lost = False
        async with closed_on_error(lambda: nats_client.close_quietly(client)):
            used = await self._cold_start(client)
            if used and self._last_stream_seq is None:
                # Right after the oldest snapshot; the tracker drops what each one holds.
                self._last_stream_seq = min(int(info.position) for info in used)
            self._psub = await self._bind(client)
            if self.heartbeats:
                await client.subscribe(self._heartbeat_filter(), cb=self._heartbeat_msg)
        self._client = client

    def _heartbeat_filter(self) -> str:
        """The heartbeats of the origins this subscriber reads (all, for a custom subject)."""
        if self.subject.startswith(SUBJECT_PREFIX):
            return HEARTBEAT_SUBJECT_PREFIX + self.subject[len(SUBJECT_PREFIX) :]
        return HEARTBEAT_SUBJECT_PREFIX + ">"

    async def _heartbeat_msg(self, msg: Msg) -> None:
        try:
            hb = Heartbeat.from_json(msg.data)
        except DecodeError as exc:
            self.bad_messages += 1
            log.warning("%s: heartbeat on %s skipped: %s", self.shown, msg.subject, exc)
            return
        self._on_heartbeat(hb)

    # -- snapshots ------------------------------------------------------------------

    def _covers(self, info: SnapshotInfo) -> bool:
        return subject_covers(self.subject, info.where)

    async def _snapshot_heads(
        self, client: Client, origin: str | None
    ) -> list[tuple[SnapshotInfo, Any]]:
        nats = nats_client.require_nats()
        jsm = client.jsm()
        stream = self.snapshot_stream
        heads: list[Any] = []
        try:
            if self._snapshot_direct is None:
                stream_info = await jsm.stream_info(stream)
                self._snapshot_direct = bool(stream_info.config.allow_direct)
            direct = self._snapshot_direct
            if origin is not None:
                head = snapshot_subjects(origin)[0]
                heads.append(await jsm.get_msg(stream, subject=head, direct=direct))
            else:
                seq = 1
                while True:
                    msg = await jsm.get_msg(
                        stream, seq=seq, subject=SNAPSHOT_HEADS, next=True, direct=direct
                    )
                    heads.append(msg)
                    seq = int(msg.seq or seq) + 1
        except nats.js.errors.NotFoundError:
            pass
        except (nats.errors.Error, OSError) as exc:
            raise TransportError(
                f"{self.shown}: reading snapshots from stream {stream!r} failed: "
                f"{nats_client.describe_error(exc)}"
            ) from exc
        out: list[tuple[SnapshotInfo, Any]] = []
        for msg in heads:
            try:
                head = orjson.loads(msg.data or b"")
                info = SnapshotInfo.from_json(orjson.dumps(head["info"]), self.shown)
                where = (int(head["first"]), int(head["last"]), int(head["bytes"]))
            except (orjson.JSONDecodeError, DecodeError, KeyError, TypeError, ValueError) as exc:
                self.bad_snapshots += 1
                log.warning("%s: snapshot head %s skipped: %s", self.shown, msg.subject, exc)
                continue
            out.append((info, where))
        return out

    async def _snapshot_envelope(
        self, client: Client, info: SnapshotInfo, where: Any
    ) -> bytes | None:
        nats = nats_client.require_nats()
        first, last, size = where
        part_subject = snapshot_subjects(info.origin)[1]
        jsm = client.jsm()
        data = bytearray()
        seq = first
        try:
            while True:
                msg = await jsm.get_msg(
                    self.snapshot_stream,
                    seq=seq,
                    subject=part_subject,
                    next=True,
                    direct=bool(self._snapshot_direct),
                )
                got = int(msg.seq or 0)
                if got > last:
                    return None  # purged: a newer snapshot replaced it
                data += msg.data or b""
                if got == last:
                    break
                seq = got + 1
        except nats.js.errors.NotFoundError:
            return None
        except (nats.errors.Error, OSError) as exc:
            raise TransportError(
                f"{self.shown}: reading the snapshot of {info.origin} failed: "
                f"{nats_client.describe_error(exc)}"
            ) from exc
        if len(data) != size:
            return None
        return bytes(data)

    async def _disconnect(self) -> None:
        client, self._client, self._psub = self._client, None, None
        await nats_client.close_quietly(client)

    async def _bind(self, client: Client) -> JetStreamContext.PullSubscription:
        nats = nats_client.require_nats()
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        info = await nats_client.find_stream(client, self.subject, self.stream, self.shown)
        if info is None:
            raise nats_client.no_stream_error(
                self.shown, self.stream, self.subject, "start a sink with ?create=true first"
            )
        stream: str = info.config.name
        self._stream_name = stream
        config = ConsumerConfig(
            durable_name=self.durable,
            filter_subject=self.subject,
            ack_policy=AckPolicy.ALL,
            ack_wait=self.ack_wait,
            max_ack_pending=max(4 * self.fetch_batch, 1024),
        )
        if self._last_stream_seq is not None:  # continue after what was handed over
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self._last_stream_seq + 1
        else:
            config.deliver_policy = {
                "all": DeliverPolicy.ALL,
                "new": DeliverPolicy.NEW,
                "last": DeliverPolicy.LAST,
            }[self.deliver]
        if self.durable is None:
            config.inactive_threshold = max(_EPHEMERAL_IDLE, 10 * self.poll_interval)
        jsm = client.jsm()
        consumer = self.durable or "(ephemeral)"
        with nats_client.jetstream_errors(
            self.shown, f"use consumer {consumer} on stream {stream!r}"
        ):
            existing = None
            if self.durable is not None:
                try:
                    existing = await jsm.consumer_info(stream, self.durable)
                except nats.js.errors.NotFoundError:
                    existing = None
            if existing is not None:
                self._check_consumer(existing)
                name = self.durable
            else:
                created = await jsm.add_consumer(stream, config)
                name = created.name
                self._ack_all = True
            return await client.jetstream().pull_subscribe_bind(consumer=name, stream=stream)

    def _check_consumer(self, info: Any) -> None:
        config = info.config
        if config.deliver_subject:
            raise ConfigError(
                f"{self.shown}: durable {self.durable!r} is a push consumer; kvstream reads "
                f"with a pull consumer: choose another durable name"
            )
        if config.filter_subject not in (None, "", self.subject):
            raise ConfigError(
                f"{self.shown}: durable {self.durable!r} exists with filter subject "
                f"{config.filter_subject!r}, not {self.subject!r}; kvstream never changes an "
                f"existing consumer: choose another durable name or delete it"
            )
        policy = getattr(config.ack_policy, "value", config.ack_policy)
        if policy == "none":
            raise ConfigError(
                f"{self.shown}: durable {self.durable!r} has ack policy none; choose another name"
            )
        self._ack_all = policy == "all"

    async def _reconnect(self) -> None:
        await self._disconnect()
        await self._connect()
        self.reconnects += 1

    # -- reading ------------------------------------------------------------------

    async def _fetch(self) -> list[Msg]:
        nats = nats_client.require_nats()
        psub = self._psub
        if psub is None or self._lost:
            raise TransportError(f"{self.shown}: not connected")
        with anyio.CancelScope() as scope:
            self._fetch_scope = scope
            try:
                return await psub.fetch(batch=self.fetch_batch, timeout=self.poll_interval)
            except TimeoutError:  # nats-py's, or asyncio's when the poll's deadline ran out
                return []
            except (nats.errors.Error, OSError) as exc:
                raise TransportError(
                    f"{self.shown}: fetch failed: {nats_client.describe_error(exc)}"
                ) from exc
            finally:
                self._fetch_scope = None
        raise TransportError(f"{self.shown}: connection lost")

    async def _ack(self, done: list[Msg]) -> None:
        """Acknowledge consumed messages (the last one alone under ack policy all)."""
        if not done:
            return
        targets = done[-1:] if self._ack_all else done
        done.clear()
        for msg in targets:
            try:
                await msg.ack()
            except Exception as exc:  # the connection went: the server re-delivers
                log.debug("%s: ack failed: %s", self.shown, nats_client.describe_error(exc))
                return

    async def _nak(self, unread: deque[Msg]) -> None:
        """Give fetched messages nobody read back to the server, for the next reader."""
        while unread:
            msg = unread.popleft()
            try:
                await msg.nak()
            except Exception as exc:
                log.debug("%s: nak failed: %s", self.shown, nats_client.describe_error(exc))
                return

    def _accept(self, msg: Msg) -> list[SubscriberItem]:
        """Decode one message and check continuity; [] when it is skipped."""
        try:
            self._last_stream_seq = msg.metadata.sequence.stream
            batch = self.decoder.decode_message(msg.data, msg.headers)
        except (DecodeError, ValueError) as exc:
            self.bad_messages += 1
            log.warning("%s: message on %s skipped: %s", self.shown, msg.subject, exc)
            return []
        return self._admit(batch, self._last_stream_seq)

    async def _read(self) -> AsyncGenerator[SubscriberItem, None]:
        if self._client is None and not self._closed:
            await self._connect()  # a failure to start is raised as it is
        consumed: list[Msg] = []  # handed over, not yet acknowledged
        unread: deque[Msg] = deque()  # fetched, not yet handed over
        backoff = self._backoff("reconnecting")
        try:
            while self._pending:
                yield self._pending.popleft()
            while not self._closed:
                try:
                    if self._psub is None or self._lost:
                        consumed.clear()  # their acks died with the old connection
                        await self._reconnect()
                    await self._ack(consumed)
                    msgs = await self._fetch()
                    self._check_liveness()
                except KVStreamError as exc:
                    if self._stopping():
                        break
                    if isinstance(exc, ConfigError) and not backoff.failures:
                        raise
                    self._lost = True
                    await backoff.wait(exc)
                    continue
                backoff.succeeded()
                if not msgs:
                    if not self.follow:
                        break
                    continue
                unread.extend(msgs)
                while unread:
                    msg = unread.popleft()
                    items = self._accept(msg)
                    if self._jumped is not None:
                        items = await self._repair(items)
                    consumed.append(msg)
                    for item in items:
                        yield item
                if not self.follow and msgs[-1].metadata.num_pending == 0:
                    break
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                if not self._lost:
                    await self._ack(consumed)
                    await self._nak(unread)
                    client = self._client
                    if client is not None and client.is_connected:
                        try:
                            await client.flush(timeout=1)
                        except Exception as exc:
                            log.debug(
                                "%s: flush failed: %s", self.shown, nats_client.describe_error(exc)
                            )
