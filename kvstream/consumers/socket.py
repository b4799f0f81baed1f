"""SocketSubscriber: batches from a socket sink, resumed across reconnects.


    async with SocketSubscriber(port=5600, from_seq=0) as sub:
        async for item in sub:
            if isinstance(item, Gap): ...            # batches that will never come
            elif isinstance(item, SnapshotBatch): ...  # the state up to item.seq
            else: ...                                 # the next EventBatch

The subscriber says hello (`kvstream._wire.socket_protocol`), reads the
welcome, and then yields batches in order per origin. When the connection
drops it reconnects with exponential backoff and asks for the batches after
the last one it yielded, per origin and epoch, so within the sink's replay
ring nothing is lost or repeated. A producer that restarted (a new epoch) is
noticed: its batches restart at seq 0 and nothing of the old epoch is mistaken
for them. What the sink can no longer replay arrives as a `Gap` (or as
a `SnapshotBatch`, where the producer offers snapshots); a jump in seq
that nobody announced is reported as a [`Gap`][kvstream.consumers.base.Gap] too. Nothing is hidden.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import ssl
from collections import deque
from collections.abc import Callable, Mapping
from typing import ClassVar, NamedTuple, Self

import anyio
import anyio.abc
from anyio.abc import SocketAttribute
from anyio.streams.tls import TLSStream

from kvstream._backoff import Backoff
from kvstream._burst_log import BurstLog
from kvstream._checks import flag, function, seconds, text
from kvstream._one_reader import busy_error
from kvstream._wire.codec_names import CodecByName, builtin_codec
from kvstream._wire.from_seq import ANY_ORIGIN, FromSeq, check_from_seq, start_seq
from kvstream._wire.socket_protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    FATAL_ERRORS,
    BatchMessage,
    ControlMessage,
    MessageReader,
    ProtocolError,
    SnapshotPart,
    Welcome,
    codec_by_name,
    encode_hello,
    parse_heartbeat,
    parse_welcome,
)
from kvstream.consumers.base import (
    Continuity,
    Gap,
    Liveness,
    LivenessChange,
    LivenessTracker,
    SequenceTracker,
    Subscriber,
    SubscriberItem,
    report_liveness,
)
from kvstream.errors import ClosedError, ConfigError, DecodeError, TransportError
from kvstream.events import EventBatch, KVCacheEvent

__all__ = ["SnapshotBatch", "SocketSubscriber", "SocketSubscriberStatistics"]

log = logging.getLogger("kvstream.consumers.socket")

_RECEIVE_BYTES = 256 * 1024
_CLOSED_ERRORS = (
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
    ssl.SSLError,
)


class SnapshotBatch(EventBatch):
    """A producer's state, standing in for every batch of its epoch up to `seq`.

    Its events are `AllBlocksCleared` then the blocks held, parents first:
    applied like a batch, they leave a consumer in the state batches
    `0..seq` would have. The next batch of the origin is `seq + 1`.
    `first_missing` is the seq the subscriber had asked from.
    """

    __slots__ = ("first_missing",)

    is_snapshot: ClassVar[bool] = True
    first_missing: int

    @classmethod
    def of(cls, part: SnapshotPart, events: list[KVCacheEvent]) -> SnapshotBatch:
        self = cls._trusted(
            max(part.next_seq - 1, 0),
            part.batch.ts,
            events,
            part.batch.data_parallel_rank,
            part.origin,
            part.epoch,
        )
        assert isinstance(self, SnapshotBatch)
        self.first_missing = part.first_missing
        return self

    @property
    def next_seq(self) -> int:
        return self.seq + 1

    def __repr__(self) -> str:
        return (
            f"SnapshotBatch(origin={self.origin!r}, epoch={self.epoch!r}, "
            f"next_seq={self.next_seq}, events=<{len(self.events)} events>)"
        )


class SocketSubscriberStatistics(NamedTuple):
    connected: bool
    #: Connections made (the first one included).
    connections: int
    #: Times an origin was found with a new epoch (the producer restarted).
    restarts: int
    gaps: int
    missing_batches: int
    duplicates: int
    snapshots: int
    #: Messages that did not decode and were skipped.
    bad_messages: int


class SocketSubscriber(Subscriber):
    """Subscribes to a [`SocketSink`][kvstream.sinks.socket.SocketSink] (TCP or Unix).

    `from_seq`: None for live batches only, an int for every origin from
    that seq, or `{origin: seq}` (`"*"` for the others). `token` is the
    sink's shared secret; `ssl_context` turns on TLS (`tls_hostname`
    overrides the name checked, which is `host` by default). With
    `reconnect=False` the first failure raises `TransportError` and the
    sink closing ends the iteration; otherwise the subscriber retries with
    backoff (`retry_initial` doubling up to `retry_max` seconds) until
    `aclose()`. An error the sink reports as final (a wrong token, a bad
    hello, a `from_seq` ahead of the stream) raises `TransportError`.

    `snapshots` (default: when `from_seq` is None): on a cold start, when the
    sink's welcome says it offers snapshots, start whole: ask every origin from
    seq 0 (the ring replays it, or the sink sends a `SnapshotBatch`) instead of
    joining live. A resume past the ring gets a snapshot whenever the sink
    offers one. `heartbeats=True` listens to the sink's heartbeats (a sink
    with `heartbeat=`): an origin heard from neither by batch nor heartbeat for
    two intervals is reported gone (`on_liveness`, the log, `liveness()`).
    `codecs` finds the codec the sink's welcome names (default: kvstream's
    own; through a URL, the registry's, plug-ins included). One task reads it
    at a time: a second one asking while the first waits is refused with
    `ClosedError` (each item goes to one reader).
    """

    def __init__(
        self,
        *,
        host: str | None = None,
        port: int | None = None,
        path: str | os.PathLike[str] | None = None,
        from_seq: FromSeq = None,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        tls_hostname: str | None = None,
        reconnect: bool = True,
        retry_initial: float = 0.05,
        retry_max: float = 5.0,
        connect_timeout: float = 10.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        snapshots: bool | None = None,
        heartbeats: bool = False,
        on_liveness: Callable[[LivenessChange], object] | None = None,
        codecs: CodecByName = builtin_codec,
    ) -> None:
        if (path is None) == (port is None):
            raise ConfigError(
                "SocketSubscriber: give port (TCP) or path (Unix socket), exactly one"
            )
        if port is not None and (type(port) is not int or not 0 < port <= 65535):
            raise ConfigError(f"SocketSubscriber.port: expected an int in 1..65535, got {port!r}")
        check_from_seq(from_seq, "SocketSubscriber")
        seconds("SocketSubscriber.retry_initial", retry_initial)
        seconds("SocketSubscriber.retry_max", retry_max)
        seconds("SocketSubscriber.connect_timeout", connect_timeout, infinite=True)
        if host is not None and type(host) is not str:
            raise ConfigError(f"SocketSubscriber.host: expected a str, got {host!r:.80}")
        if token is not None and type(token) is not str:
            raise ConfigError("SocketSubscriber.token: expected a str")  # never its value
        text("SocketSubscriber.tls_hostname", tls_hostname)
        if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
            raise ConfigError(
                f"SocketSubscriber.ssl_context: expected an ssl.SSLContext, got {ssl_context!r:.80}"
            )
        flag("SocketSubscriber.reconnect", reconnect)
        if snapshots is not None:
            flag("SocketSubscriber.snapshots", snapshots)
        flag("SocketSubscriber.heartbeats", heartbeats)
        function("SocketSubscriber.on_liveness", on_liveness)
        function("SocketSubscriber.codecs", codecs)
        self.path = os.fspath(path) if path is not None else None
        self.host = host or "127.0.0.1"
        self.port = port
        self.from_seq = from_seq
        self.reconnect = reconnect
        self.retry_initial = float(retry_initial)
        self.retry_max = float(retry_max)
        self.connect_timeout = float(connect_timeout)
        self.max_message_bytes = max_message_bytes
        MessageReader(max_message_bytes)  # validates it now
        self._token = token
        self._codecs = codecs
        self._ssl = ssl_context
        self._tls_hostname = tls_hostname
        self.tracker = SequenceTracker()
        #: The sink's last welcome (origins, codec, ...), once connected.
        self.welcome: Welcome | None = None
        self._stream: anyio.abc.ByteStream | None = None
        self._reader = MessageReader(max_message_bytes)
        self._items: deque[SubscriberItem] = deque()
        self._snapshot_parts: dict[str, list[KVCacheEvent]] = {}
        self._joined = False
        self._closed = False
        self._reading = False  # a task is waiting in __anext__
        self._ended = False
        self._failures = 0
        self._backoff = Backoff(self.retry_initial, self.retry_max, jitter=0.5)
        self._connections = 0
        self._restarts = 0
        self._snapshots = 0
        self._bad_messages = 0
        self._bad_log = BurstLog(log, math.inf)
        self._outage_log = BurstLog(log, math.inf)
        #: Whether a cold start begins from snapshots the sink offers.
        self.snapshots = from_seq is None if snapshots is None else bool(snapshots)
        self._rejoin = False
        self.heartbeats = heartbeats
        self.on_liveness = on_liveness
        self.liveness_tracker = LivenessTracker(anyio.current_time)
        #: Liveness changes reported (gone, back, restarted).
        self.liveness_changes = 0

    @property
    def address(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def __repr__(self) -> str:
        return f"<SocketSubscriber {self.address}>"

    # -- lifetime ---------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Connect now (retrying as configured), so nothing published after this is missed."""
        if self._closed:
            raise ClosedError(f"{self!r}: the subscriber is closed")
        try:
            await self._connect()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def aclose(self) -> None:
        self._closed = True
        stream, self._stream = self._stream, None
        if stream is not None:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await stream.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    def statistics(self) -> SocketSubscriberStatistics:
        t = self.tracker
        return SocketSubscriberStatistics(
            connected=self._stream is not None,
            connections=self._connections,
            restarts=self._restarts,
            gaps=t.gaps,
            missing_batches=t.missing,
            duplicates=t.duplicates,
            snapshots=self._snapshots,
            bad_messages=self._bad_messages,
        )

    # -- iteration ---------------------------------------------------------------

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SubscriberItem:
        if self._items:  # what arrived already, handed out without a wait
            return self._items.popleft()
        if self._reading:
            raise busy_error(self.address, "SocketSubscriber")
        self._reading = True
        try:
            return await self._next()
        finally:
            self._reading = False

    async def _next(self) -> SubscriberItem:
        while True:
            if self._items:
                return self._items.popleft()
            if self._closed or self._ended:
                raise StopAsyncIteration
            stream = self._stream
            if stream is None:
                await self._connect()
                continue
            try:
                if self.heartbeats:
                    data = b""
                    with anyio.move_on_after(self._check_every()):
                        data = await stream.receive(_RECEIVE_BYTES)
                    self._report(self.liveness_tracker.check())
                    if not data:
                        continue
                else:
                    data = await stream.receive(_RECEIVE_BYTES)
            except _CLOSED_ERRORS as exc:
                if self._closed:
                    raise StopAsyncIteration from None
                await self._lost(f"connection lost ({type(exc).__name__}: {exc})", exc)
                continue
            self._reader.feed(data)
            await self._read_messages()

    async def _read_messages(self) -> None:
        """Decode every complete message buffered; queue what it yields."""
        while True:
            try:
                message = self._reader.next_message()
            except ProtocolError as exc:
                await self._lost(f"protocol error: {exc}", exc)
                return
            except DecodeError as exc:
                self._bad_messages += 1
                self._bad_log.log("%s: message skipped: %s", self.address, exc)  # all counted
                continue
            if message is None:
                return
            self._bad_log.clear()
            if isinstance(message, BatchMessage):
                self._on_batch(message.batch)
            elif isinstance(message, SnapshotPart):
                self._on_snapshot(message)
            elif message.type == "gap":
                self._on_gap(message)
            elif message.type == "heartbeat":
                self._on_heartbeat(message)
            elif message.type == "end":
                log.info("%s: the sink is closing", self.address)
                await self._lost("the sink closed", None, ended=True)
                return
            elif message.type == "error":
                error = ProtocolError(
                    f"the sink reported: {message.fields.get('message')!s:.300}",
                    str(message.fields.get("code")),
                )
                await self._lost(str(error), error)
                return
            else:
                log.debug("%s: control message %r skipped", self.address, message.type)

    def _on_batch(self, batch: EventBatch) -> None:
        state, gap = self.tracker.check(batch)
        if state is Continuity.DUPLICATE:
            return
        if state is Continuity.NEW_EPOCH:
            self._restarts += 1
            log.info("%s: origin %s restarted (epoch %s)", self.address, batch.origin, batch.epoch)
        if self.heartbeats:
            self._report(self.liveness_tracker.heard(batch.origin, batch.epoch, batch.seq))
        if gap is not None:
            log.warning(
                "%s: %s epoch %s: batches %d..%d missing",
                self.address,
                gap.origin,
                gap.epoch,
                gap.first_missing,
                gap.next_seq - 1,
            )
            self._items.append(gap)
        self._items.append(batch)

    def _on_gap(self, message: ControlMessage) -> None:
        f = message.fields
        origin, epoch, first, nxt = (
            f.get("origin"),
            f.get("epoch"),
            f.get("first_missing"),
            f.get("next_seq"),
        )
        if (
            type(origin) is not str
            or type(epoch) is not str
            or type(first) is not int
            or type(nxt) is not int
        ):
            self._bad_messages += 1
            log.warning("%s: malformed gap notice skipped: %r", self.address, f)
            return
        known = self.tracker.position(origin)
        if known is not None and known[0] == epoch:
            if nxt <= known[1]:
                return  # nothing we still expect is missing
            first = known[1]
        if nxt <= first:
            return
        tracker = self.tracker
        tracker.expect(origin, epoch, nxt)
        tracker.gaps += 1
        tracker.missing += nxt - first
        reason = f.get("reason")
        if reason == "too_large":
            log.error(
                "%s: %s epoch %s: batches %d..%d are bigger than this subscriber reads "
                "(max_message_bytes %d): the sink skipped them (a gap)",
                self.address,
                origin,
                epoch,
                first,
                nxt - 1,
                self.max_message_bytes,
            )
        self._items.append(Gap(origin, epoch, first, nxt, str(reason or "gap")))

    # -- liveness ------------------------------------------------------------------

    def liveness(self) -> dict[str, Liveness]:
        """`{origin: Liveness}`: who was heard from when, and who is gone (`heartbeats`)."""
        return self.liveness_tracker.snapshot()

    def _report(self, changes: list[LivenessChange]) -> None:
        self.liveness_changes += report_liveness(changes, self.address, self.on_liveness)

    def _check_every(self) -> float:
        """How long a read may wait before the silent origins are looked at."""
        intervals = [k.interval for k in self.liveness_tracker.snapshot().values() if k.interval]
        return min(intervals, default=2.0) / 2

    def _on_heartbeat(self, message: ControlMessage) -> None:
        if not self.heartbeats:
            return
        try:
            hb = parse_heartbeat(message.fields)
        except DecodeError as exc:
            self._bad_messages += 1
            log.warning("%s: malformed heartbeat skipped: %s", self.address, exc)
            return
        self._report(self.liveness_tracker.heard(hb.origin, hb.epoch, hb.seq, hb.interval))

    def _on_snapshot(self, part: SnapshotPart) -> None:
        if part.part == 0:
            self._snapshot_parts[part.origin] = []
        events = self._snapshot_parts.get(part.origin)
        if events is None:  # a part without its beginning (cannot happen on one connection)
            self._bad_messages += 1
            return
        events.extend(part.batch.events)
        if not part.last:
            return
        del self._snapshot_parts[part.origin]
        self._snapshots += 1
        self.tracker.expect(part.origin, part.epoch, part.next_seq)
        if self.heartbeats:
            self._report(self.liveness_tracker.heard(part.origin, part.epoch, part.next_seq - 1))
        self._items.append(SnapshotBatch.of(part, events))

    # -- connecting ----------------------------------------------------------------

    def _hello(self) -> bytes:
        if not self._joined:
            return encode_hello(
                self.from_seq, token=self._token, max_message_bytes=self.max_message_bytes
            )
        # Resume: every origin after the last batch seen; an origin not seen yet
        # appeared while we were away (the welcome named all the others): all of it.
        from_seq: dict[str, int] = {ANY_ORIGIN: 0}
        if isinstance(self.from_seq, Mapping):
            from_seq.update(self.from_seq)
        positions = self.tracker.origins()
        from_seq.update({o: n for o, (_, n) in positions.items()})
        epochs = {o: e for o, (e, _) in positions.items()}
        return encode_hello(
            from_seq,
            epoch=epochs or None,
            token=self._token,
            max_message_bytes=self.max_message_bytes,
        )

    async def _open(self) -> anyio.abc.ByteStream:
        stream: anyio.abc.ByteStream
        if self.path is not None:
            stream = await anyio.connect_unix(self.path)
        else:
            assert self.port is not None
            stream = await anyio.connect_tcp(self.host, self.port)
            raw = stream.extra(SocketAttribute.raw_socket, None)
            if raw is not None:
                with contextlib.suppress(OSError):
                    raw.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if self._ssl is not None:
            try:
                stream = await TLSStream.wrap(
                    stream,
                    server_side=False,
                    hostname=self._tls_hostname or (self.host if self.path is None else None),
                    ssl_context=self._ssl,
                    standard_compatible=False,
                )
            except BaseException:
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await stream.aclose()
                raise
        return stream

    async def _handshake(self) -> tuple[anyio.abc.ByteStream, Welcome, MessageReader]:
        stream = await self._open()
        reader = MessageReader(self.max_message_bytes)
        try:
            await stream.send(self._hello())
            while True:
                raw = reader.next_raw()
                if raw is not None:
                    break
                reader.feed(await stream.receive(_RECEIVE_BYTES))
            welcome = parse_welcome(raw[0])
            reader.use(welcome.framing, codec_by_name(welcome.codec, self._codecs))
        except BaseException:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await stream.aclose()
            raise
        return stream, welcome, reader

    async def _connect(self) -> None:
        """Connect, say hello, read the welcome; retry with backoff as configured."""
        while not self._closed:
            if self.heartbeats:  # a sink that is not there is also silent
                self._report(self.liveness_tracker.check())
            if self._failures:
                await self._backoff.wait()
                if self.closed:
                    break
            try:
                with anyio.fail_after(self.connect_timeout):
                    stream, welcome, reader = await self._handshake()
            except ProtocolError as exc:
                if exc.code in FATAL_ERRORS or not self.reconnect:
                    raise TransportError(f"{self.address}: {exc} ({exc.code})") from exc
                self._failed(exc)
                continue
            except (TimeoutError, *_CLOSED_ERRORS) as exc:
                if not self.reconnect:
                    raise TransportError(f"cannot subscribe to {self.address}: {exc}") from exc
                self._failed(exc)
                continue
            if self.closed:  # closed while connecting
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await stream.aclose()
                break
            if self._outage_log.clear():
                log.warning("%s: subscribed again", self.address)
            self._failures = 0
            self._backoff.reset()
            self._connections += 1
            self._stream = stream
            self._reader = reader
            self._on_welcome(welcome)
            if self._rejoin:
                # A cold start that begins whole: ask again, every origin from 0.
                self._rejoin = False
                self._stream = None
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await stream.aclose()
                continue
            await self._read_messages()  # what came with the welcome
            return

    def _failed(self, exc: BaseException) -> None:
        self._failures += 1
        self._outage_log.log("%s: cannot subscribe (%s); retrying", self.address, exc)

    def _on_welcome(self, welcome: Welcome) -> None:
        self.welcome = welcome
        tracker = self.tracker
        if not self._joined:
            self._joined = True
            if self.snapshots and welcome.snapshot and welcome.origins:
                for origin, info in welcome.origins.items():
                    tracker.expect(origin, info.epoch, 0)
                self._rejoin = True
                log.info("%s: starting from the sink's snapshots", self.address)
                return
            for origin, info in welcome.origins.items():
                n = start_seq(self.from_seq, origin)
                if n is None:
                    if info.newest is not None:
                        tracker.expect(origin, info.epoch, info.newest + 1)
                else:
                    tracker.expect(origin, info.epoch, n)
            return
        for origin, info in welcome.origins.items():
            known = tracker.position(origin)
            if known is not None and known[0] != info.epoch:
                # The producer restarted while we were away: the sink replays the
                # new epoch from its start.
                self._restarts += 1
                log.info("%s: origin %s restarted (epoch %s)", self.address, origin, info.epoch)
                tracker.expect(origin, info.epoch, 0)

    async def _lost(self, reason: str, exc: BaseException | None, *, ended: bool = False) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await stream.aclose()
        self._snapshot_parts.clear()
        if isinstance(exc, ProtocolError) and exc.code in FATAL_ERRORS:
            raise TransportError(f"{self.address}: {reason}") from exc
        if not self.reconnect:
            if ended:
                self._ended = True
                return
            raise TransportError(f"{self.address}: {reason}") from exc
        log.info("%s: %s; reconnecting", self.address, reason)
        self._failures = max(self._failures, 1)
