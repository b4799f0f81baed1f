"""NatsSink: one JetStream message per batch, acknowledged and de-duplicated.

`nats://HOST:PORT/SUBJECT?stream=NAME&create=true` (nats-py, extra `nats`).
Each batch is published to `SUBJECT` (default `kv.events.<origin>`, see
`kvstream._wire.broker`) with its name in headers and
`Nats-Msg-Id: <origin>:<epoch>:<seq>`; the sink waits for JetStream's ack
before the next batch, so batches are stored in order. When the server goes
away the connection closes, `write` fails, and the base class retries the
same batch with backoff after `NatsSink.recover()` has reconnected; the
retry carries the same message id, so a batch that was stored but whose ack
was lost is dropped by the server as a duplicate (and, should the outage
outlast the stream's duplicate window, the sink first asks the stream for the
subject's last message and skips a batch it finds there).

One batch is one message, never split: a batch whose message would exceed the
server's `max_payload` (or the stream's `max_msg_size`) is refused with a
logged error and counted as dropped, which consumers see as a gap.

Snapshots (opt-in: `snapshot_every=N` batches and/or `snapshot_interval=T`
seconds): the sink keeps the state of the batches JetStream acknowledged
(`SinkSnapshots`) and, when one is due, publishes
the origin's snapshot to the stream `snapshot_stream` (default
`KV_SNAPSHOTS`, created when missing), which keeps the latest per origin
(see `kvstream._wire.broker` and `docs/recovery.md`). Heartbeats
(opt-in: `heartbeat=T` seconds): every origin that delivered nothing for
`T` seconds announces its epoch and last seq on `kv.heartbeat.<origin>`
(core NATS, not stored).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Final, Literal

import anyio
import anyio.abc
import anyio.lowlevel
import orjson

from kvstream._checks import count, flag, seconds, text
from kvstream._wire import nats_client
from kvstream._wire.broker import (
    DEFAULT_NATS_STREAM,
    DEFAULT_SNAPSHOT_STREAM,
    DEFAULT_SUBJECT_FILTER,
    SNAPSHOT_SUBJECT_PREFIX,
    Heartbeat,
    check_subject,
    default_subject,
    heartbeat_subject,
    key_from_headers,
    nats_headers,
    nats_headers_size,
    snapshot_subjects,
)
from kvstream._wire.broker_client import closed_on_error, shown_url
from kvstream.codecs.json import JsonCodec
from kvstream.errors import ConfigError, TransportError
from kvstream.events import EventBatch
from kvstream.sinks._broker import BrokerSink
from kvstream.state import DEFAULT_MAX_BYTES

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.client import JetStreamContext

__all__ = ["NatsSink"]

log = logging.getLogger("kvstream.sinks")

StorageKind = Literal["file", "memory"]
_STREAM_EXISTS: Final = 10058  # JetStream: "stream name already in use"


class NatsSink(BrokerSink):
    """Publish every batch to NATS JetStream and wait for its ack.

    `subject`: where every batch goes; None publishes each batch to
    `kv.events.<origin>`. `stream`: the JetStream stream that must cover
    the subject (None: whichever does). With `create=True` a missing stream
    is created (name `stream` or `KV_EVENTS`, covering `subject` or
    `kv.events.>`) with `storage`, `max_age` (seconds), `max_msgs` and
    `duplicate_window` (seconds); when it exists, any of those given must
    match it, since kvstream never changes an existing stream.
    """

    max_coalesce = 1  # one message in flight keeps the stream in order across a reconnect

    def __init__(
        self,
        url: str = "nats://127.0.0.1:4222",
        *,
        subject: str | None = None,
        stream: str | None = None,
        create: bool = False,
        storage: StorageKind | None = None,
        max_age: float | None = None,
        max_msgs: int | None = None,
        duplicate_window: float | None = None,
        ack_timeout: float = 5.0,
        connect_timeout: float = 5.0,
        snapshot_every: int | None = None,
        snapshot_interval: float | None = None,
        snapshot_max_bytes: int = DEFAULT_MAX_BYTES,
        snapshot_stream: str = DEFAULT_SNAPSHOT_STREAM,
        heartbeat: float | None = None,
        **options: Any,
    ) -> None:
        self._nats = nats_client.require_nats()  # a missing extra fails here, not at the first send
        self.url = text("NatsSink.url", url)
        self.shown = shown_url(url)
        text(f"{self.shown}: subject", subject)
        text(f"{self.shown}: stream", stream)
        flag(f"{self.shown}: create", create)
        # 0 is NATS's own "no limit" / "the server's default": passed on as given.
        seconds(f"{self.shown}: max_age", max_age, zero=True)
        count(f"{self.shown}: max_msgs", max_msgs)
        seconds(f"{self.shown}: duplicate_window", duplicate_window, zero=True)
        seconds(f"{self.shown}: ack_timeout", ack_timeout)
        seconds(f"{self.shown}: connect_timeout", connect_timeout)
        if subject is not None:
            check_subject(subject, wildcards=False, where=self.shown)
        if storage not in (None, "file", "memory"):
            raise ConfigError(f"{self.shown}: storage: expected file or memory, got {storage!r}")
        options.setdefault("codec", JsonCodec())
        options.setdefault("name", f"{self.shown}/{subject or 'kv.events.<origin>'}")
        super().__init__(
            snapshot_every=snapshot_every,
            snapshot_interval=snapshot_interval,
            snapshot_max_bytes=snapshot_max_bytes,
            heartbeat=heartbeat,
            **options,
        )
        if self.codec is None:
            raise ConfigError("NatsSink: codec: expected a codec, got None")
        self.subject = subject
        self.stream = stream
        self.create = create
        self._wanted: dict[str, Any] = {
            key: value
            for key, value in (
                ("storage", storage),
                ("max_age", max_age),
                ("max_msgs", max_msgs),
                ("duplicate_window", duplicate_window),
            )
            if value is not None
        }
        self.ack_timeout = ack_timeout
        self.connect_timeout = connect_timeout
        self._client: Client | None = None
        self._js: JetStreamContext | None = None
        self._stream_name: str | None = None
        self._max_message = 0
        self._ack_scope: anyio.CancelScope | None = None
        # True from the start of an attempt until it is acked: the next attempt
        # of the same batch first checks whether the stream already holds it.
        self._uncertain = False
        #: Batches the server reported as duplicates (a retry of a stored batch).
        self.duplicates = 0
        #: Batches refused because their message exceeds the size limit.
        self.oversized = 0
        if (
            type(snapshot_stream) is not str
            or not snapshot_stream
            or any(c in snapshot_stream for c in " .*>")
        ):
            raise ConfigError(
                f"{self.shown}: snapshot_stream: expected a stream name without spaces, "
                f"dots, * or >, got {snapshot_stream!r}"
            )
        self.snapshot_stream = snapshot_stream

    # -- connection ---------------------------------------------------------------

    @property
    def stream_name(self) -> str | None:
        """The stream the sink publishes into (known once open)."""
        return self._stream_name

    @property
    def max_message_size(self) -> int:
        """The largest message (headers + payload) the server and stream accept."""
        return self._max_message

    async def open(self) -> None:
        await self._connect()

    async def _connect(self) -> None:
        client = await nats_client.connect(
            self.url,
            name=f"kvstream sink {self.name}",
            connect_timeout=self.connect_timeout,
            on_lost=self._on_lost,
        )
        async with closed_on_error(lambda: nats_client.close_quietly(client)):
            info = await self._ensure_stream(client)
            if self.snapshots is not None:
                await self._ensure_snapshot_stream(client)
        self._client = client
        self._js = client.jetstream(timeout=self.ack_timeout)
        self._stream_name = info.config.name
        limit = client.max_payload
        stream_limit = info.config.max_msg_size
        if stream_limit is not None and 0 < stream_limit < limit:
            limit = stream_limit
        self._max_message = limit

    def _on_lost(self) -> None:
        scope = self._ack_scope
        if scope is not None:
            scope.cancel()

    async def _ensure_stream(self, client: Client) -> Any:
        target = self.subject or DEFAULT_SUBJECT_FILTER
        info = await nats_client.find_stream(client, target, self.stream, self.shown)
        if info is None:
            if not self.create:
                raise nats_client.no_stream_error(
                    self.shown, self.stream, target, "add ?create=true to the sink URL"
                )
            info = await self._create_stream(client, self.stream or DEFAULT_NATS_STREAM, target)
        self._check_config(info)
        return info

    async def _create_stream(self, client: Client, name: str, subject: str) -> Any:
        nats = nats_client.require_nats()
        from nats.js.api import StorageType, StreamConfig

        params: dict[str, Any] = dict(self._wanted)
        if "storage" in params:
            params["storage"] = StorageType(params["storage"])
        config = StreamConfig(name=name, subjects=[subject], **params)
        with nats_client.jetstream_errors(self.shown, f"create stream {name!r} for {subject!r}"):
            try:
                info = await client.jsm().add_stream(config)
            except nats.js.errors.APIError as exc:
                if exc.err_code != _STREAM_EXISTS:
                    raise
                # Created meanwhile by someone else: use it if it covers the subject.
                found = await nats_client.find_stream(client, subject, name, self.shown)
                if found is None:
                    raise
                return found
        log.info("%s: created stream %s for %s", self.shown, name, subject)
        return info

    async def _ensure_snapshot_stream(self, client: Client) -> None:
        nats = nats_client.require_nats()
        from nats.js.api import StorageType, StreamConfig

        name = self.snapshot_stream
        jsm = client.jsm()
        with nats_client.jetstream_errors(self.shown, f"use snapshot stream {name!r}"):
            try:
                info = await jsm.stream_info(name)
            except nats.js.errors.NotFoundError:
                storage = StorageType(self._wanted.get("storage", "file"))
                config = StreamConfig(
                    name=name,
                    subjects=[SNAPSHOT_SUBJECT_PREFIX + ">"],
                    allow_rollup_hdrs=True,
                    allow_direct=True,  # readers get parts as raw bytes (3x faster)
                    storage=storage,
                )
                try:
                    info = await jsm.add_stream(config)
                    log.info("%s: created snapshot stream %s", self.shown, name)
                except nats.js.errors.APIError as exc:
                    if exc.err_code != _STREAM_EXISTS:
                        raise
                    info = await jsm.stream_info(name)
        if not info.config.allow_rollup_hdrs:
            raise ConfigError(
                f"{self.shown}: snapshot stream {name!r} does not allow rollup headers; "
                f"kvstream keeps one snapshot per origin with them: set allow_rollup_hdrs "
                f"or name another snapshot_stream"
            )

    def _check_config(self, info: Any) -> None:
        config = info.config
        for key, wanted in self._wanted.items():
            have = getattr(config, key)
            have = getattr(have, "value", have)  # enums (storage)
            if have != wanted:
                raise ConfigError(
                    f"{self.shown}: stream {config.name!r} has {key}={have!r}, the sink asks for "
                    f"{wanted!r}; kvstream never changes an existing stream: change it yourself "
                    f"or drop the option"
                )

    async def recover(self, exc: Exception) -> None:
        client = self._client
        if client is not None and client.is_connected:
            return
        self._client = self._js = None
        await nats_client.close_quietly(client)
        await self._connecting(self._connect)

    def _unreachable(self, exc: TransportError) -> bool:
        # No answer (refused, reset, timed out, no such host); a refusal by the server
        # (authorization) is a nats error and stays fatal.
        nats = self._nats
        silent = (OSError, TimeoutError, nats.errors.NoServersError, nats.errors.TimeoutError)
        return isinstance(exc.__cause__, silent)

    # -- sending ------------------------------------------------------------------

    async def write(self, data: bytes, batch: EventBatch) -> None:
        js = self._js
        if js is None:  # before the size check: the limit is known once connected
            raise self._not_connected()
        codec = self.codec
        assert codec is not None
        subject = self.subject or default_subject(batch.origin)
        headers = nats_headers(batch, codec.name)
        size = len(data) + nats_headers_size(headers)
        if size > self._max_message:
            self.oversized += 1
            log.error(
                "%s: batch %s/%s seq %d is %d bytes, above the %d-byte message limit "
                "(server max_payload / stream max_msg_size); refused, not split",
                self.name,
                batch.origin,
                batch.epoch,
                batch.seq,
                size,
                self._max_message,
            )
            self.discard(batch, f"message of {size} bytes above the {self._max_message}-byte limit")
            return
        nats = self._nats
        try:
            if self._uncertain:
                stored_at = await self._stored(subject, batch)
                if stored_at is not None:
                    self._uncertain = False
                    self.duplicates += 1
                    await self._delivered(batch, subject, stored_at)
                    return
            self._uncertain = True
            with anyio.CancelScope() as scope:
                self._ack_scope = scope
                try:
                    ack = await js.publish(subject, data, headers=headers)
                finally:
                    self._ack_scope = None
        except (nats.errors.Error, OSError) as exc:
            raise TransportError(
                f"{self.shown}: publish to {subject} failed: {nats_client.describe_error(exc)}"
            ) from exc
        if scope.cancelled_caught:
            raise TransportError(f"{self.shown}: connection lost before the ack")
        self._uncertain = False
        if ack.duplicate:
            self.duplicates += 1
        await self._delivered(batch, subject, ack.seq)

    async def _stored(self, subject: str, batch: EventBatch) -> int | None:
        """The stream sequence of the subject's last message when it is `batch` or a
        later one of its producer, else None."""
        nats = nats_client.require_nats()
        client = self._client
        if client is None or self._stream_name is None:
            return None
        try:
            msg = await client.jsm().get_last_msg(self._stream_name, subject)
        except nats.js.errors.NotFoundError:
            return None
        try:
            origin, epoch, seq = key_from_headers(msg.headers)
        except ValueError:
            return None
        if origin == batch.origin and epoch == batch.epoch and seq >= batch.seq:
            return int(msg.seq or 0)
        return None

    # -- snapshots and heartbeats ----------------------------------------------------

    async def _delivered(self, batch: EventBatch, subject: str, stream_seq: int) -> None:
        if self._keep_delivered(batch, str(stream_seq)):
            await self.publish_snapshot(batch.origin, subject)

    async def publish_snapshot(self, origin: str, subject: str | None = None) -> bool:
        """Publish `origin`'s snapshot now; False when there is none to publish or it failed.

        A failure is logged and counted (`snapshots.failed`) and does not fail
        the batch that made it due; the next snapshot is tried when it is due again.
        """
        nats = nats_client.require_nats()
        snapshots = self.snapshots
        client = self._client
        js = self._js
        if snapshots is None or client is None or js is None:
            return False
        made = await self._snapshot_envelope(
            origin, subject or self.subject or default_subject(origin)
        )
        if made is None:
            return False
        snap, info, envelope = made
        head_subject, part_subject = snapshot_subjects(origin)
        chunk = max(self._max_message - 256, 1024)
        try:
            first = last = 0
            view = memoryview(envelope)
            for start in range(0, len(envelope), chunk):
                ack = await js.publish(part_subject, bytes(view[start : start + chunk]))
                last = ack.seq
                first = first or last
            head = orjson.dumps(
                {
                    "info": info._replace(parts=())._asdict(),
                    "first": first,
                    "last": last,
                    "bytes": len(envelope),
                }
            )
            await js.publish(head_subject, head, headers={"Nats-Rollup": "sub"})
            # The older snapshot's parts: everything on the part subject before this one.
            # (The server reads seq <= 1 as "no bound": the whole subject would go.)
            if first > 1:
                await client.jsm().purge_stream(
                    self.snapshot_stream, seq=first, subject=part_subject
                )
        except (nats.errors.Error, OSError) as exc:
            return snapshots.stored(origin, snap.epoch, nats_client.describe_error(exc))
        return snapshots.stored(origin, snap.epoch)

    async def _beat(self, heartbeat: Heartbeat) -> None:
        client = self._client
        if client is None or not client.is_connected:
            return
        await client.publish(heartbeat_subject(heartbeat.origin), heartbeat.to_json())

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            client, self._client, self._js = self._client, None, None
            with anyio.CancelScope(shield=True):
                await nats_client.close_quietly(client)
