"""SocketSink: serve batches to any number of subscribers over TCP or a Unix socket.

The sink listens for as long as it lives. Every batch it is given is encoded
once (by the sink's codec), framed once (`kvstream._wire.socket_protocol`)
and appended to a **replay ring** bounded in bytes. Subscribers read the ring:

* each subscriber has a cursor into the ring and a writer task of its own;
  what lies between its cursor and the ring's head is its **outbox**, bounded
  by `subscriber_bytes` (the bytes that arrived since it connected and are not
  yet written to its socket). A frame is never copied per subscriber until its
  socket is ready to take it;
* `SocketSink.write()` (and `write_nowait`, from the tick) appends to the
  ring and wakes idle writers. It never awaits a subscriber, so a slow
  subscriber never slows the others, the sink's outbox or the scheduler's tick;
* a subscriber that falls behind is handled by `slow`: `disconnect` (the
  default) closes its connection while its position is still in the ring, so
  it reconnects and resumes where it was; `drop` skips the oldest batches it
  has not been sent and tells it with a gap notice. Both are counted;
* a subscriber that asks for a seq older than the ring gets a gap notice, or,
  where the producer offers a snapshot (`SocketSink.snapshot_provider`),
  the producer's current state instead (see *Snapshots*).

Snapshots: the snapshot must describe exactly the batches before the seq it
claims to precede. The sink therefore never calls the provider at an arbitrary
moment: it asks its scheduler to call back at the next **tick barrier**
(`Scheduler.call_at_barrier`), right after a tick has sealed its batches and
before any further event is accepted. At that moment the host has reported
every change it made as events in batches `< next_seq`, so the provider's
state is the state those batches describe, and the snapshot is sent as
preceding `next_seq`; the subscriber then gets the origin's batches from
`next_seq` on. A provider must therefore return its state as of its last
`tick()` (the simulated engine does: its `run_step()` hands the step's
events to the scheduler before the tick that seals them). Without a
scheduler, or when no tick comes within `snapshot_timeout`, the subscriber
gets a gap notice instead.

Secure by default: TCP binds `127.0.0.1` unless told otherwise, refuses a
non-loopback address without a token, compares tokens in constant time and
never logs them; TLS is optional; a Unix socket is created with mode 0600 (set
before `bind`, so it is never reachable with looser permissions). A bad hello
gets one error line and a close; nothing a peer sends can crash the sink.

This module is the network side (listening, hellos, one writer per
subscriber). The rest lives beside it: the ring in
`kvstream.sinks._replay_ring`, publishing, slow subscribers, replay plans
and snapshots in `kvstream.sinks.socket._fanout`, each subscriber's record
in `kvstream.sinks.socket._subscription`, and the Unix socket and hello
helpers in `kvstream.sinks.socket._listen`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, cast

import anyio
import anyio.abc
from anyio.abc import SocketAttribute, TaskGroup
from anyio.streams.tls import TLSStream

from kvstream._burst_log import BurstLog
from kvstream._checks import function, seconds
from kvstream._wire.broker import Heartbeat, Heartbeats
from kvstream._wire.socket_protocol import (
    MAX_HELLO_BYTES,
    ProtocolError,
    control_message,
    error_line,
    heartbeat_message,
    parse_hello,
    token_matches,
)
from kvstream._wire.socket_security import is_loopback
from kvstream.codecs.json import JsonCodec
from kvstream.errors import ConfigError, TransportError
from kvstream.events import EventBatch
from kvstream.lifetime import LifetimeState, open_task_group
from kvstream.sinks.base import Sink, SinkStatistics
from kvstream.sinks.socket._fanout import (
    SLOW_POLICIES,
    BarrierRequest,
    Fanout,
    SlowPolicy,
    SnapshotProvider,
)
from kvstream.sinks.socket._listen import bind_unix, host_port, peer_name, read_hello
from kvstream.sinks.socket._subscription import Subscription

__all__ = [
    "DEFAULT_RING_BYTES",
    "SlowPolicy",
    "SnapshotProvider",
    "SocketSink",
    "SocketSinkStatistics",
    "SubscriberStatistics",
]

log = logging.getLogger("kvstream.sinks.socket")

DEFAULT_RING_BYTES: Final = 64 * 1024 * 1024
DEFAULT_SUBSCRIBER_BYTES: Final = 16 * 1024 * 1024
DEFAULT_MAX_PENDING_HELLOS: Final = 16
_ERROR_SEND_TIMEOUT: Final = 1.0

#: What a connection ending (the peer leaving, a reset, a TLS failure) raises.
_GONE: Final = (
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
    ssl.SSLError,
)


class SubscriberStatistics(NamedTuple):
    peer: str
    batches_sent: int
    bytes_sent: int
    batches_dropped: int
    #: Bytes that arrived since it connected and are not yet written to it.
    lag_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SocketSinkStatistics(SinkStatistics):
    """A socket sink's counters: the sink's (`SinkStatistics`), then the server's."""

    address: str
    subscribers: int
    connections_accepted: int
    #: Connections closed without a welcome: bad hello, wrong token, busy, timeout.
    connections_refused: int
    #: Subscribers disconnected for falling behind (`slow=disconnect`).
    slow_disconnects: int
    #: Batches skipped for slow subscribers (`slow=drop`), summed over subscribers.
    subscriber_batches_dropped: int
    gap_notices: int
    snapshots_sent: int
    ring_batches: int
    ring_bytes: int
    ring_max_bytes: int
    #: Batches and snapshots not sent because they exceeded their subscriber's
    #: `max_message_bytes` (each sent as a gap notice, reason `too_large`).
    too_large: int = 0
    #: Connections still without a hello closed to make room for a newer one
    #: (`max_pending_hellos`); counted in `connections_refused` too.
    hellos_evicted: int = 0
    #: One record per connected subscriber (not exported as metrics: one label
    #: value per peer would grow without bound).
    peers: tuple[SubscriberStatistics, ...] = ()


class SocketSink(Sink):
    """Serves batches over TCP (`host`, `port`) or a Unix socket (`path`).


        async with Scheduler(sinks=[SocketSink(port=5600)]) as s:
            ...   # subscribers connect to tcp://127.0.0.1:5600

    `token` (a shared secret the subscriber's hello must carry) is required to
    listen anywhere but loopback. `ssl_context` turns TLS on. See the module
    doc for `ring_bytes`, `subscriber_bytes`, `slow` and snapshots; the
    other options (`codec`, `policy`, ...) are [`Sink`][kvstream.sinks.base.Sink]'s.

    Connections are limited twice: at most `max_subscribers` subscribers (a
    hello beyond that gets `busy`), and at most `max_pending_hellos`
    connections that have not said hello yet, each for at most
    `hello_timeout` seconds. A connection beyond that budget closes the
    oldest one still waiting for its hello (refused with `busy`, counted in
    `hellos_evicted`), so idle or slow connections can never keep a
    subscriber that says its hello at once from getting in.
    """

    max_coalesce = 256

    def __init__(
        self,
        *,
        host: str | None = None,
        port: int | None = None,
        path: str | os.PathLike[str] | None = None,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        ring_bytes: int = DEFAULT_RING_BYTES,
        subscriber_bytes: int | None = None,
        slow: SlowPolicy = "disconnect",
        max_subscribers: int = 64,
        max_pending_hellos: int = DEFAULT_MAX_PENDING_HELLOS,
        hello_timeout: float = 10.0,
        snapshot_timeout: float = 5.0,
        snapshot_provider: SnapshotProvider | None = None,
        heartbeat: float | None = None,
        **options: Any,
    ) -> None:
        if (path is None) == (port is None):
            raise ConfigError("SocketSink: give port (TCP) or path (Unix socket), exactly one")
        seconds("SocketSink.heartbeat", heartbeat)
        if path is not None and host is not None:
            raise ConfigError("SocketSink: host is for TCP; a Unix socket takes only path")
        if port is not None and (type(port) is not int or not 0 <= port <= 65535):
            raise ConfigError(f"SocketSink.port: expected an int in 0..65535, got {port!r}")
        if type(ring_bytes) is not int or ring_bytes < 1024:
            raise ConfigError(f"SocketSink.ring_bytes: expected an int >= 1024, got {ring_bytes!r}")
        if subscriber_bytes is None:
            subscriber_bytes = min(DEFAULT_SUBSCRIBER_BYTES, ring_bytes // 2)
        if type(subscriber_bytes) is not int or not 0 < subscriber_bytes <= ring_bytes:
            raise ConfigError(
                f"SocketSink.subscriber_bytes: expected an int in 1..ring_bytes ({ring_bytes}), "
                f"got {subscriber_bytes!r}"
            )
        if slow not in SLOW_POLICIES:
            raise ConfigError(
                f"SocketSink.slow: expected one of {', '.join(SLOW_POLICIES)}, got {slow!r}"
            )
        if type(max_subscribers) is not int or max_subscribers < 1:
            raise ConfigError(
                f"SocketSink.max_subscribers: expected an int >= 1, got {max_subscribers!r}"
            )
        if type(max_pending_hellos) is not int or max_pending_hellos < 1:
            raise ConfigError(
                f"SocketSink.max_pending_hellos: expected an int >= 1, got {max_pending_hellos!r}"
            )
        seconds("SocketSink.hello_timeout", hello_timeout, infinite=True)
        seconds("SocketSink.snapshot_timeout", snapshot_timeout, infinite=True)
        if token is not None and (type(token) is not str or not token):
            raise ConfigError("SocketSink.token: expected a non-empty string")
        if host is not None and type(host) is not str:
            raise ConfigError(f"SocketSink.host: expected a str, got {host!r:.80}")
        if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
            raise ConfigError(
                f"SocketSink.ssl_context: expected an ssl.SSLContext, got {ssl_context!r:.80}"
            )
        function("SocketSink.snapshot_provider", snapshot_provider)
        self.path = os.fspath(path) if path is not None else None
        self.host = None if self.path is not None else (host or "127.0.0.1")
        if self.host is not None and self.host != "*" and not self.host.strip():
            raise ConfigError(f"SocketSink.host: expected a host, got {host!r}")
        if self.host is not None and token is None and not is_loopback(self.host):
            shown = "all interfaces" if self.host in ("*", "0.0.0.0", "::") else self.host
            raise ConfigError(
                f"refusing to listen on {shown} (not loopback) without a token: "
                "give one with token_env=NAME or token_file=PATH, or bind 127.0.0.1"
            )
        options.setdefault("codec", JsonCodec())
        self._auto_name = "name" not in options
        if self.path is not None:
            options.setdefault("name", f"unix:{self.path}")
        else:
            options.setdefault("name", f"tcp://{host_port(self.host or '', port or 0)}")
        super().__init__(**options)
        if self.codec is None:
            raise ConfigError("SocketSink: codec: expected a codec, got None")
        self.port = port
        self.ring_bytes = ring_bytes
        self.max_subscribers = max_subscribers
        self.max_pending_hellos = max_pending_hellos
        self.hello_timeout = float(hello_timeout)
        self._token = token.encode("utf-8", "surrogatepass") if token is not None else None
        self._ssl = ssl_context
        self._fanout = Fanout(
            name=self.name,
            codec=self.codec,
            ring_bytes=ring_bytes,
            subscriber_bytes=subscriber_bytes,
            slow=slow,
            snapshot_timeout=float(snapshot_timeout),
            snapshot_provider=snapshot_provider,
        )
        self._listeners: list[anyio.abc.SocketListener] = []
        self._server_tg: TaskGroup | None = None
        self._connections = 0
        #: cancel scopes of connections still in their hello, oldest first
        self._greeting: dict[anyio.CancelScope, None] = {}
        #: those closed to make room for newer ones (refused once out of their scope)
        self._evicted: set[anyio.CancelScope] = set()
        self._all_gone = anyio.Event()
        self._all_gone.set()
        self._stopping = False
        self._unix_inode: int | None = None
        self._bound = ""
        self._refusals = BurstLog(log)
        # counters
        self._accepted = 0
        self._refused = 0
        self._snapshots_sent = 0
        self._hellos_evicted = 0
        #: Heartbeats of idle origins to every subscriber (opt-in), see `heartbeat_message`.
        self.heartbeat = None if heartbeat is None else float(heartbeat)
        self._heartbeats: Heartbeats | None = None
        if heartbeat is not None:
            self._heartbeats = Heartbeats(
                float(heartbeat), self.name, self._beat, clock=anyio.current_time
            )

    # -- wiring ------------------------------------------------------------------

    def bind_barrier(self, request: BarrierRequest) -> None:
        """Called by the scheduler this sink is added to: how to reach its tick barrier."""
        self._fanout.barrier = request

    @property
    def subscriber_bytes(self) -> int:
        """How far (in bytes) a subscriber may fall behind before `slow` applies."""
        return self._fanout.subscriber_bytes

    @property
    def slow(self) -> SlowPolicy:
        """What happens to a subscriber that falls behind: `disconnect` or `drop`."""
        return self._fanout.slow

    @property
    def snapshot_timeout(self) -> float:
        """How long a subscriber waits for a snapshot before it gets a gap notice."""
        return self._fanout.snapshot_timeout

    @property
    def snapshot_provider(self) -> SnapshotProvider | None:
        """The producer's snapshot hook; settable until subscribers need it."""
        return self._fanout.snapshot_provider

    @snapshot_provider.setter
    def snapshot_provider(self, provider: SnapshotProvider | None) -> None:
        self._fanout.snapshot_provider = provider

    @property
    def address(self) -> str:
        """The address subscribers connect to (with the real port once listening)."""
        if self.path is not None:
            return f"unix:{self.path}"
        return self._bound or f"tcp://{host_port(self.host or '', self.port or 0)}"

    # -- lifetime ------------------------------------------------------------------

    async def open(self) -> None:
        if self.path is not None:
            sock = bind_unix(self.path)
            self._unix_inode = os.stat(self.path).st_ino
            self._listeners = [await anyio.abc.SocketListener.from_socket(sock)]
            return
        host = None if self.host in ("*", "") else self.host
        try:
            multi = await anyio.create_tcp_listener(local_host=host, local_port=self.port or 0)
        except OSError as exc:
            raise TransportError(
                f"{self.name}: cannot listen on {host_port(self.host or '*', self.port or 0)}: "
                f"{exc.strerror or exc}"
            ) from exc
        self._listeners = [
            lst for lst in multi.listeners if isinstance(lst, anyio.abc.SocketListener)
        ]
        bound = self._listeners[0].extra(SocketAttribute.local_address)
        assert isinstance(bound, tuple)
        self._bound = f"tcp://{host_port(str(bound[0]), int(bound[1]))}"
        if self._auto_name:
            self.name = self._fanout.name = self._bound

    async def enter_contexts(self, stack: AsyncExitStack) -> None:
        # The server's tasks (accept, one per subscriber) outlive the writer: on
        # close, subscribers take what the writer delivered into the ring first.
        tg = self._server_tg = await open_task_group(stack, f"kvstream socket server {self.name}")
        for listener in self._listeners:
            tg.start_soon(self._accept, listener, name=f"kvstream socket accept {self.address}")
        log.info("%s: listening on %s", self.name, self.address)

    async def aclose(self) -> None:
        """Deliver what is queued into the ring, let subscribers take it (within
        `close_timeout`), tell them the sink is closing, and stop listening."""
        if self.state is LifetimeState.CLOSED:
            return
        try:
            await super().aclose()
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop_serving()

    async def _stop_serving(self) -> None:
        self._stopping = True
        for listener in self._listeners:
            with contextlib.suppress(Exception):
                await listener.aclose()
        self._listeners = []
        for scope in self._greeting:  # not subscribers yet: nothing to deliver to them
            scope.cancel()
        self._fanout.wake_all()
        with anyio.move_on_after(self.close_timeout):
            await self._all_gone.wait()
        if self._server_tg is not None:
            self._server_tg.cancel_scope.cancel()
        if self.path is not None and self._unix_inode is not None:
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == self._unix_inode:
                    os.unlink(self.path)
            self._unix_inode = None

    # -- the writer's side: publishing ---------------------------------------------------

    async def write(self, data: bytes, batch: EventBatch) -> None:
        self._fanout.publish(data, batch)
        if self._heartbeats is not None:
            self._heartbeats.delivered(batch)

    def write_nowait(self, data: bytes, batch: EventBatch) -> bool:
        # Publishing appends to the ring and wakes subscribers' writers: it never
        # waits, so the tick does it and the sink's own writer task stays asleep.
        self._fanout.publish(data, batch)
        if self._heartbeats is not None:
            self._heartbeats.delivered(batch)
        return True

    async def write_many(self, items: Sequence[tuple[bytes, EventBatch]]) -> None:
        publish = self._fanout.publish
        for data, batch in items:
            publish(data, batch)
            if self._heartbeats is not None:
                self._heartbeats.delivered(batch)

    # -- heartbeats ----------------------------------------------------------------------

    def start_tasks(self, tg: TaskGroup) -> None:
        if self._heartbeats is not None:
            tg.start_soon(self._heartbeats.run, name=f"kvstream {self.name} heartbeats")

    async def _beat(self, heartbeat: Heartbeat) -> None:
        """Queue the heartbeat to every subscriber, ahead of batches (a control message)."""
        fanout = self._fanout
        if not fanout.subscriptions:
            return
        message = control_message(heartbeat_message(heartbeat), fanout.framing)
        for sub in fanout.subscriptions:
            if not sub.gone:
                sub.control.append(message)
                sub.wake()

    @property
    def heartbeats_sent(self) -> int:
        return 0 if self._heartbeats is None else self._heartbeats.sent

    # -- the listener's side -----------------------------------------------------------

    async def _accept(self, listener: anyio.abc.SocketListener) -> None:
        while True:
            try:
                stream = await listener.accept()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:  # out of file descriptors, ...: keep serving the others
                self._refusals.log("%s: accept failed: %s", self.name, exc)
                await anyio.sleep(0.1)
                continue
            tg = self._server_tg
            if tg is None or self._stopping:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                continue
            self._connections += 1
            self._all_gone = anyio.Event() if self._all_gone.is_set() else self._all_gone
            tg.start_soon(self._serve, stream, name=f"kvstream socket subscriber {self.name}")

    async def _serve(self, stream: anyio.abc.ByteStream) -> None:
        """One connection: TLS, hello, then the subscriber's writer; never raises."""
        peer = peer_name(stream)
        sub: Subscription | None = None
        scope = anyio.CancelScope()
        try:
            with scope:
                self._wait_for_hello(scope)
                try:
                    with anyio.fail_after(self.hello_timeout):
                        if self._ssl is not None:
                            stream = await TLSStream.wrap(
                                stream,
                                server_side=True,
                                ssl_context=self._ssl,
                                standard_compatible=False,
                            )
                        line = await read_hello(stream)
                except TimeoutError:
                    self._greeting.pop(scope, None)
                    await self._refuse(stream, peer, "bad_hello", "no hello line in time")
                    return
                except ProtocolError as exc:
                    self._greeting.pop(scope, None)
                    await self._refuse(stream, peer, exc.code, str(exc))
                    return
                self._greeting.pop(scope, None)  # no longer waiting: it cannot be evicted
                try:
                    hello = parse_hello(line)
                    if self._token is not None and not token_matches(self._token, hello.token):
                        raise ProtocolError("token missing or wrong", "unauthorized")
                    if self._stopping:
                        raise ProtocolError("the sink is closing", "closing")
                    if len(self._fanout.subscriptions) >= self.max_subscribers:
                        raise ProtocolError(
                            f"{self.max_subscribers} subscribers already (max_subscribers); "
                            "retry later",
                            "busy",
                        )
                    sub = self._fanout.join(hello, peer, stream, scope)
                    self._accepted += 1
                except ProtocolError as exc:
                    await self._refuse(stream, peer, exc.code, str(exc))
                    return
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._watch_peer, sub)
                    try:
                        await self._write(sub)
                    except _GONE as exc:
                        log.debug("%s: subscriber %s went away: %r", self.name, peer, exc)
                    tg.cancel_scope.cancel()
            if scope in self._evicted:
                self._evicted.discard(scope)
                await self._refuse(
                    stream,
                    peer,
                    "busy",
                    f"no hello yet while {self.max_pending_hellos} newer connections waited for "
                    "theirs (max_pending_hellos); retry",
                )
        except _GONE as exc:
            log.debug("%s: subscriber %s went away: %r", self.name, peer, exc)
        except Exception as exc:  # a bug must not take the sink down with it
            log.exception("%s: subscriber %s: unexpected error: %r", self.name, peer, exc)
        finally:
            self._greeting.pop(scope, None)
            self._evicted.discard(scope)
            if sub is not None:
                self._fanout.leave(sub)
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await stream.aclose()
            self._connections -= 1
            if self._connections == 0:
                self._all_gone.set()

    def _wait_for_hello(self, scope: anyio.CancelScope) -> None:
        """Count a new connection against `max_pending_hellos`, closing the
        oldest connection still without a hello when the budget is spent."""
        greeting = self._greeting
        while len(greeting) >= self.max_pending_hellos:
            oldest = next(iter(greeting))
            del greeting[oldest]
            self._evicted.add(oldest)
            self._hellos_evicted += 1
            oldest.cancel()
        greeting[scope] = None

    async def _refuse(
        self, stream: anyio.abc.ByteStream, peer: str, code: str, message: str
    ) -> None:
        self._refused += 1
        self._refusals.log("%s: refused %s: %s (%s)", self.name, peer, message, code)
        with anyio.move_on_after(_ERROR_SEND_TIMEOUT), contextlib.suppress(Exception):
            await stream.send(error_line(code, message))
            with contextlib.suppress(Exception):
                await stream.send_eof()
            # Read (and drop) what the peer is still sending before closing, so that
            # the close is not a reset that could destroy the error line in flight.
            discarded = 0
            while discarded < 4 * MAX_HELLO_BYTES:
                discarded += len(await stream.receive())

    async def _watch_peer(self, sub: Subscription) -> None:
        """After its hello a subscriber sends nothing: data or EOF end the connection."""
        try:
            await sub.stream.receive()
        except _GONE:
            log.debug("%s: subscriber %s closed the connection", self.name, sub.peer)
        else:
            self._refusals.log(
                "%s: subscriber %s sent data after its hello; closed", self.name, sub.peer
            )
        sub.gone = True
        sub.scope.cancel()

    # -- one subscriber's writer ------------------------------------------------------

    async def _write(self, sub: Subscription) -> None:
        """The subscriber's writer: control first, then snapshots, then the ring."""
        fanout = self._fanout
        ring = fanout.ring
        stream = sub.stream
        while not sub.gone:
            if sub.control:
                chunk = b"".join(sub.control)
                sub.control.clear()
                await stream.send(chunk)
                sub.bytes_sent += len(chunk)
                continue
            if sub.snapshots:
                snapshot, first_missing = sub.snapshots.pop(0)
                size = snapshot.largest_message(fanout.codec, first_missing)
                if size > sub.max_message:
                    fanout.too_large_for(
                        sub,
                        snapshot.origin,
                        snapshot.epoch,
                        first_missing,
                        snapshot.next_seq,
                        size,
                    )
                    continue
                chunk = snapshot.encoded(fanout.codec, first_missing)
                self._snapshots_sent += 1
                await stream.send(chunk)
                sub.bytes_sent += len(chunk)
                continue
            if sub.awaiting:
                remaining = sub.snapshot_deadline - anyio.current_time()
                if remaining <= 0 or self._stopping:
                    fanout.no_snapshot(
                        sub, "no tick came to take it" if remaining <= 0 else "closing"
                    )
                    continue
                event = sub.wakeup = anyio.Event()
                with anyio.move_on_after(remaining):
                    await event.wait()
                continue
            if sub.cursor < ring.end_pos:
                frames, n = fanout.gather(sub)
                if frames:
                    # anyio's socket and TLS streams take any bytes-like object;
                    # copying a 256 KiB chunk just to satisfy the annotation is waste.
                    await stream.send(cast(bytes, frames))
                    sub.batches_sent += n
                    sub.bytes_sent += len(frames)
                continue
            if self._stopping:
                await stream.send(
                    control_message({"type": "end", "reason": "sink closed"}, fanout.framing)
                )
                return
            event = sub.wakeup = anyio.Event()
            await event.wait()

    # -- introspection ---------------------------------------------------------------

    def statistics(self) -> SocketSinkStatistics:
        fanout = self._fanout
        return SocketSinkStatistics(
            **self._sink_fields(),
            address=self.address,
            subscribers=len(fanout.subscriptions),
            connections_accepted=self._accepted,
            connections_refused=self._refused,
            slow_disconnects=fanout.slow_disconnects,
            subscriber_batches_dropped=fanout.batches_dropped,
            gap_notices=fanout.gap_notices,
            snapshots_sent=self._snapshots_sent,
            ring_batches=len(fanout.ring),
            ring_bytes=fanout.ring.bytes,
            ring_max_bytes=self.ring_bytes,
            too_large=fanout.too_large,
            hellos_evicted=self._hellos_evicted,
            peers=tuple(
                SubscriberStatistics(
                    s.peer, s.batches_sent, s.bytes_sent, s.batches_dropped, fanout.lag_bytes(s)
                )
                for s in fanout.subscriptions
            ),
        )
