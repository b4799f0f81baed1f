"""SocketSink: serve batches to any number of subscribers over TCP or a Unix socket.

The sink listens for as long as it lives. Every batch it is given is encoded
once (by the sink's codec), framed once (:mod:`kvstream.wire.socket_protocol`)
and appended to a **replay ring** bounded in bytes. Subscribers read the ring:

* each subscriber has a cursor into the ring and a writer task of its own;
  what lies between its cursor and the ring's head is its **outbox**, bounded
  by ``subscriber_bytes`` (the bytes that arrived since it connected and are not
  yet written to its socket). A frame is never copied per subscriber until its
  socket is ready to take it;
* :meth:`SocketSink.send` appends to the ring and wakes idle writers. It never
  awaits a subscriber, so a slow subscriber never slows the others, the sink's
  outbox or the scheduler's tick;
* a subscriber that falls behind is handled by ``slow``: ``disconnect`` (the
  default) closes its connection while its position is still in the ring, so
  it reconnects and resumes where it was; ``drop`` skips the oldest batches it
  has not been sent and tells it with a gap notice. Both are counted;
* a subscriber that asks for a seq older than the ring gets a gap notice, or,
  where the producer offers a snapshot (:attr:`SocketSink.snapshot_provider`),
  the producer's current state instead (see *Snapshots*).

Snapshots: the snapshot must describe exactly the batches before the seq it
claims to precede. The sink therefore never calls the provider at an arbitrary
moment: it asks its scheduler to call back at the next **tick barrier**
(``Scheduler.call_at_barrier``), right after a tick has sealed its batches and
before any further event is accepted. At that moment the host has reported
every change it made as events in batches ``< next_seq``, so the provider's
state is the state those batches describe, and the snapshot is sent as
preceding ``next_seq``; the subscriber then gets the origin's batches from
``next_seq`` on. A provider must therefore return its state as of its last
``tick()`` (the simulated engine does, when driven ``astep()`` then
``tick()``). Without a scheduler, or when no tick comes within
``snapshot_timeout``, the subscriber gets a gap notice instead.

Secure by default: TCP binds ``127.0.0.1`` unless told otherwise, refuses a
non-loopback address without a token, compares tokens in constant time and
never logs them; TLS is optional; a Unix socket is created with mode 0600 (set
before ``bind``, so it is never reachable with looser permissions). A bad hello
gets one error line and a close; nothing a peer sends can crash the sink.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import socket
import ssl
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    Final,
    Generic,
    Literal,
    NamedTuple,
    Self,
    TypeVar,
    cast,
    get_args,
)

import anyio
import anyio.abc
from anyio.abc import SocketAttribute, TaskGroup
from anyio.streams.tls import TLSStream

from kvstream.codecs.json import JsonCodec
from kvstream.errors import ConfigError, TransportError
from kvstream.events import EventBatch, KVCacheEvent
from kvstream.sinks.base import Sink
from kvstream.wire.socket_protocol import (
    MAX_HELLO_BYTES,
    Hello,
    OriginInfo,
    ProtocolError,
    batch_message,
    control_message,
    error_line,
    framing_of,
    parse_hello,
    snapshot_messages,
    token_matches,
    welcome_line,
)
from kvstream.wire.socket_security import (
    is_loopback,
    read_token,
    server_ssl_context,
)

if TYPE_CHECKING:
    from kvstream.config import Options, ParsedURL

__all__ = [
    "DEFAULT_RING_BYTES",
    "SlowPolicy",
    "SnapshotProvider",
    "SocketSink",
    "SocketSinkStatistics",
    "SubscriberStatistics",
]

log = logging.getLogger("kvstream.sinks.socket")

SlowPolicy = Literal["disconnect", "drop"]
SLOW_POLICIES: Final[tuple[str, ...]] = get_args(SlowPolicy)
#: A zero-argument callable returning the events that rebuild the producer's
#: current state: ``AllBlocksCleared`` then ``BlockStored`` events, parents first.
SnapshotProvider = Callable[[], Iterable[KVCacheEvent]]
#: ``call_at_barrier(callback)``: the scheduler calls ``callback(origin, epoch,
#: next_seq)`` once, inside its next tick, right after sealing.
BarrierRequest = Callable[[Callable[[str, str, int], None]], None]

DEFAULT_RING_BYTES: Final = 64 * 1024 * 1024
DEFAULT_SUBSCRIBER_BYTES: Final = 16 * 1024 * 1024
#: What a ring entry costs beyond its frame (tuple, list slot, position index).
_ENTRY_OVERHEAD: Final = 128
#: A writer sends up to this many bytes of frames per write.
_CHUNK_BYTES: Final = 256 * 1024
_ERROR_SEND_TIMEOUT: Final = 1.0

#: What a connection ending (the peer leaving, a reset, a TLS failure) raises.
_GONE: Final = (
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
    ssl.SSLError,
)

T = TypeVar("T")
#: (origin, epoch, seq, frame, start offset in the ring's byte count)
_Entry = tuple[str, str, int, bytes, int]


class SubscriberStatistics(NamedTuple):
    peer: str
    batches_sent: int
    bytes_sent: int
    batches_dropped: int
    #: Bytes that arrived since it connected and are not yet written to it.
    lag_bytes: int


class SocketSinkStatistics(NamedTuple):
    address: str
    subscribers: int
    connections_accepted: int
    #: Connections closed without a welcome: bad hello, wrong token, busy, timeout.
    connections_refused: int
    #: Subscribers disconnected for falling behind (``slow=disconnect``).
    slow_disconnects: int
    #: Batches skipped for slow subscribers (``slow=drop``), summed over subscribers.
    subscriber_batches_dropped: int
    gap_notices: int
    snapshots_sent: int
    ring_batches: int
    ring_bytes: int
    ring_max_bytes: int


class _Fifo(Generic[T]):
    """A list with O(1) ``append``, ``popleft`` and random access by index."""

    __slots__ = ("_head", "_items")

    def __init__(self) -> None:
        self._items: list[T] = []
        self._head = 0

    def __len__(self) -> int:
        return len(self._items) - self._head

    def __getitem__(self, i: int) -> T:
        return self._items[self._head + i]

    def append(self, item: T) -> None:
        self._items.append(item)

    def popleft(self) -> T:
        item = self._items[self._head]
        self._head += 1
        if self._head >= 1024 and self._head * 2 >= len(self._items):
            del self._items[: self._head]
            self._head = 0
        return item


class _Ring:
    """Encoded frames, oldest first, bounded in bytes; every entry has a position.

    Positions count entries ever appended, so a cursor stays valid while the
    ring moves; ``offset`` counts their bytes, so a cursor's lag is a subtraction.
    """

    __slots__ = ("_entries", "_first", "bytes", "end_offset", "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: _Fifo[_Entry] = _Fifo()
        self._first = 0  # position of the oldest entry held
        self.bytes = 0
        self.end_offset = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def first_pos(self) -> int:
        return self._first

    @property
    def end_pos(self) -> int:
        return self._first + len(self._entries)

    def get(self, pos: int) -> _Entry:
        return self._entries[pos - self._first]

    def offset(self, pos: int) -> int:
        """Bytes appended before position ``pos`` (held, or the end)."""
        if pos >= self.end_pos:
            return self.end_offset
        return self._entries[max(pos - self._first, 0)][4]

    def append(self, origin: str, epoch: str, seq: int, frame: bytes) -> list[tuple[int, _Entry]]:
        """Add a frame; return the entries evicted to stay within ``max_bytes``.

        The entry just added is never evicted by its own append.
        """
        cost = len(frame) + _ENTRY_OVERHEAD
        self._entries.append((origin, epoch, seq, frame, self.end_offset))
        self.end_offset += cost
        self.bytes += cost
        evicted: list[tuple[int, _Entry]] = []
        entries = self._entries
        while self.bytes > self.max_bytes and len(entries) > 1:
            entry = entries.popleft()
            evicted.append((self._first, entry))
            self._first += 1
            self.bytes -= len(entry[3]) + _ENTRY_OVERHEAD
        return evicted


class _OriginState:
    """What the sink knows of one origin's current epoch."""

    __slots__ = ("data_parallel_rank", "epoch", "newest", "positions")

    def __init__(self, epoch: str) -> None:
        self.epoch = epoch
        self.newest = -1
        self.data_parallel_rank: int | None = None
        #: ring positions of this epoch's entries, oldest first
        self.positions: _Fifo[int] = _Fifo()


class _Await(NamedTuple):
    """A snapshot a subscriber waits for, and the gap it gets if none comes."""

    epoch: str
    first_missing: int
    #: the oldest seq of the origin the ring held when the subscriber connected
    oldest: int


class _Snapshot:
    """One provider call, shared by every subscriber it serves; encoded lazily."""

    __slots__ = ("_encoded", "data_parallel_rank", "epoch", "events", "next_seq", "origin", "ts")

    def __init__(
        self,
        origin: str,
        epoch: str,
        next_seq: int,
        data_parallel_rank: int | None,
        events: list[KVCacheEvent],
    ) -> None:
        self.origin = origin
        self.epoch = epoch
        self.next_seq = next_seq
        self.ts = time.time()
        self.data_parallel_rank = data_parallel_rank
        self.events = events
        self._encoded: dict[int, bytes] = {}

    def encoded(self, sink: SocketSink, first_missing: int) -> bytes:
        data = self._encoded.get(first_missing)
        if data is None:
            assert sink.codec is not None
            data = self._encoded[first_missing] = b"".join(
                snapshot_messages(
                    sink.codec,
                    origin=self.origin,
                    epoch=self.epoch,
                    next_seq=self.next_seq,
                    first_missing=first_missing,
                    ts=self.ts,
                    data_parallel_rank=self.data_parallel_rank,
                    events=self.events,
                )
            )
        return data


class _Subscriber:
    """One connected subscriber: its cursor, its filter and its pending messages."""

    __slots__ = (
        "awaiting",
        "batches_dropped",
        "batches_sent",
        "bytes_sent",
        "control",
        "cursor",
        "drop_gaps",
        "gone",
        "min_seq",
        "peer",
        "replay_end",
        "scope",
        "snapshot_deadline",
        "snapshots",
        "starts",
        "stream",
        "wakeup",
    )

    def __init__(self, peer: str, stream: anyio.abc.ByteStream, scope: anyio.CancelScope) -> None:
        self.peer = peer
        self.stream = stream
        self.scope = scope
        self.cursor = 0
        self.replay_end = 0
        #: origin -> first ring position to replay (positions < replay_end only)
        self.starts: dict[str, int] = {}
        #: origin -> (epoch, seq): nothing of that epoch below seq (after a snapshot)
        self.min_seq: dict[str, tuple[str, int]] = {}
        self.control: list[bytes] = []
        self.awaiting: dict[str, _Await] = {}
        self.snapshots: list[tuple[_Snapshot, int]] = []
        self.snapshot_deadline = math.inf
        #: origin -> [epoch, first, next] of batches skipped, not yet announced
        self.drop_gaps: dict[str, list[Any]] = {}
        self.wakeup: anyio.Event | None = None
        self.gone = False
        self.batches_sent = 0
        self.bytes_sent = 0
        self.batches_dropped = 0

    def wants(self, pos: int, entry: _Entry) -> bool:
        origin = entry[0]
        if pos < self.replay_end:
            start = self.starts.get(origin)
            if start is None or pos < start:
                return False
        if self.min_seq:
            floor = self.min_seq.get(origin)
            if floor is not None and floor[0] == entry[1] and entry[2] < floor[1]:
                return False
        return True

    def wake(self) -> None:
        w = self.wakeup
        if w is not None:
            self.wakeup = None
            w.set()


class _Burst:
    """Logs the first of a burst of similar events at WARNING, the rest at DEBUG."""

    __slots__ = ("_last", "_suppressed", "window")

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self._last = -math.inf
        self._suppressed = 0

    def log(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last >= self.window:
            if self._suppressed:
                msg += f" ({self._suppressed} more like it in the last burst)"
            log.warning(msg, *args)
            self._last = now
            self._suppressed = 0
        else:
            self._suppressed += 1
            log.debug(msg, *args)


class SocketSink(Sink):
    """Serves batches over TCP (``host``, ``port``) or a Unix socket (``path``).

    ::

        async with Scheduler(sinks=[SocketSink(port=5600)]) as s:
            ...   # subscribers connect to tcp://127.0.0.1:5600

    ``token`` (a shared secret the subscriber's hello must carry) is required to
    listen anywhere but loopback. ``ssl_context`` turns TLS on. See the module
    doc for ``ring_bytes``, ``subscriber_bytes``, ``slow`` and snapshots; the
    other options (``codec``, ``policy``, ...) are :class:`Sink`'s.
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
        hello_timeout: float = 10.0,
        snapshot_timeout: float = 5.0,
        snapshot_provider: SnapshotProvider | None = None,
        **options: Any,
    ) -> None:
        if (path is None) == (port is None):
            raise ConfigError("SocketSink: give port (TCP) or path (Unix socket), exactly one")
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
        for what, value in (
            ("hello_timeout", hello_timeout),
            ("snapshot_timeout", snapshot_timeout),
        ):
            if not (isinstance(value, int | float) and value > 0):
                raise ConfigError(f"SocketSink.{what}: expected seconds > 0, got {value!r}")
        if token is not None and (type(token) is not str or not token):
            raise ConfigError("SocketSink.token: expected a non-empty string")
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
            options.setdefault("name", f"tcp://{_join(self.host or '', port or 0)}")
        super().__init__(**options)
        if self.codec is None:
            raise ConfigError("SocketSink: codec: expected a codec, got None")
        self.port = port
        self.ring_bytes = ring_bytes
        self.subscriber_bytes = subscriber_bytes
        self.slow: SlowPolicy = slow
        self.max_subscribers = max_subscribers
        self.hello_timeout = float(hello_timeout)
        self.snapshot_timeout = float(snapshot_timeout)
        #: The producer's snapshot hook; settable until subscribers need it.
        self.snapshot_provider: SnapshotProvider | None = snapshot_provider
        self._token = token.encode("utf-8", "surrogatepass") if token is not None else None
        self._ssl = ssl_context
        self._framing = framing_of(self.codec)
        self._ring = _Ring(ring_bytes)
        self._origins: dict[str, _OriginState] = {}
        self._subscribers: list[_Subscriber] = []
        self._barrier: BarrierRequest | None = None
        self._barrier_pending = False
        self._listeners: list[anyio.abc.SocketListener] = []
        self._server_tg: TaskGroup | None = None
        self._connections = 0
        #: cancel scopes of connections still in their hello
        self._greeting: set[anyio.CancelScope] = set()
        self._all_gone = anyio.Event()
        self._all_gone.set()
        self._stopping = False
        self._stopped = False
        self._unix_inode: int | None = None
        self._bound = ""
        self._refusals = _Burst()
        self._slowness = _Burst()
        # counters
        self._accepted = 0
        self._refused = 0
        self._slow_disconnects = 0
        self._sub_dropped = 0
        self._gap_notices = 0
        self._snapshots_sent = 0

    # -- wiring ------------------------------------------------------------------

    def bind_barrier(self, request: BarrierRequest) -> None:
        """Called by the scheduler this sink is added to: how to reach its tick barrier."""
        self._barrier = request

    @property
    def address(self) -> str:
        """The address subscribers connect to (with the real port once listening)."""
        if self.path is not None:
            return f"unix:{self.path}"
        return self._bound or f"tcp://{_join(self.host or '', self.port or 0)}"

    # -- lifetime ------------------------------------------------------------------

    async def open(self) -> None:
        if self.path is not None:
            sock = _bind_unix(self.path)
            self._unix_inode = os.stat(self.path).st_ino
            self._listeners = [await anyio.abc.SocketListener.from_socket(sock)]
            return
        host = None if self.host in ("*", "") else self.host
        try:
            multi = await anyio.create_tcp_listener(local_host=host, local_port=self.port or 0)
        except OSError as exc:
            raise TransportError(
                f"{self.name}: cannot listen on {_join(self.host or '*', self.port or 0)}: "
                f"{exc.strerror or exc}"
            ) from exc
        self._listeners = [
            lst for lst in multi.listeners if isinstance(lst, anyio.abc.SocketListener)
        ]
        bound = self._listeners[0].extra(SocketAttribute.local_address)
        assert isinstance(bound, tuple)
        self._bound = f"tcp://{_join(str(bound[0]), int(bound[1]))}"
        if self._auto_name:
            self.name = self._bound

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._server_tg = tg
        for listener in self._listeners:
            tg.start_soon(self._accept, listener, name=f"kvstream socket accept {self.address}")
        log.info("%s: listening on %s", self.name, self.address)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        # Task groups end in the reverse order they began: the server's, then
        # the base class's (the writer).
        try:
            with anyio.CancelScope(shield=True):
                await self.aclose()
        finally:
            tg, self._server_tg = self._server_tg, None
            try:
                if tg is not None:
                    tg.cancel_scope.cancel()
                    await tg.__aexit__(None, None, None)
            finally:
                await super().__aexit__(exc_type, exc, tb)
        return None

    async def aclose(self) -> None:
        """Deliver what is queued into the ring, let subscribers take it (within
        ``close_timeout``), tell them the sink is closing, and stop listening."""
        if self._stopped:
            return
        self._stopped = True
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
        for sub in self._subscribers:
            sub.wake()
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

    async def send(self, data: bytes, batch: EventBatch) -> None:
        self._publish(data, batch)

    async def send_many(self, items: Sequence[tuple[bytes, EventBatch]]) -> None:
        for data, batch in items:
            self._publish(data, batch)

    def _publish(self, data: bytes, batch: EventBatch) -> None:
        """Append one batch to the ring and wake the subscribers. Never waits."""
        frame = batch_message(data, batch, self._framing)
        origin = batch.origin
        state = self._origins.get(origin)
        if state is None or state.epoch != batch.epoch:
            state = self._origins[origin] = _OriginState(batch.epoch)
        ring = self._ring
        pos = ring.end_pos
        evicted = ring.append(origin, batch.epoch, batch.seq, frame)
        state.positions.append(pos)
        state.newest = batch.seq
        state.data_parallel_rank = batch.data_parallel_rank
        for old_pos, entry in evicted:
            old = self._origins.get(entry[0])
            if (
                old is not None
                and old.epoch == entry[1]
                and old.positions
                and old.positions[0] == old_pos
            ):
                old.positions.popleft()
        if not self._subscribers:
            return
        first = ring.first_pos
        limit = self.subscriber_bytes
        end_offset = ring.end_offset
        for sub in self._subscribers:
            if sub.cursor < first:
                self._fell_behind(sub, evicted)
            if not sub.gone:
                start = sub.cursor if sub.cursor > sub.replay_end else sub.replay_end
                if end_offset - ring.offset(start) > limit:
                    self._too_slow(sub)
            sub.wake()
        if any(s.gone for s in self._subscribers):
            self._subscribers = [s for s in self._subscribers if not s.gone]

    def _fell_behind(self, sub: _Subscriber, evicted: list[tuple[int, _Entry]]) -> None:
        """Entries ``sub`` had not taken were evicted (a replay the ring outran, or a
        batch bigger than the ring's room). Only those it would have been sent count."""
        lost = [
            entry
            for pos, entry in evicted
            if pos >= sub.cursor and entry[0] not in sub.awaiting and sub.wants(pos, entry)
        ]
        sub.cursor = self._ring.first_pos
        if not lost:
            return
        if self.slow == "disconnect":
            self._disconnect_slow(sub)
            return
        for entry in lost:
            self._note_drop(sub, entry)
        self._announce_drops(sub)

    def _too_slow(self, sub: _Subscriber) -> None:
        if self.slow == "disconnect":
            self._disconnect_slow(sub)
            return
        ring = self._ring
        target = ring.end_offset - self.subscriber_bytes
        pos = sub.cursor
        end = ring.end_pos
        while pos < end and ring.offset(max(pos, sub.replay_end)) < target:
            entry = ring.get(pos)
            if sub.wants(pos, entry):
                self._note_drop(sub, entry)
            pos += 1
        sub.cursor = pos
        self._announce_drops(sub)

    def _disconnect_slow(self, sub: _Subscriber) -> None:
        sub.gone = True
        sub.scope.cancel()
        self._slow_disconnects += 1
        self._slowness.log(
            "%s: subscriber %s fell more than %d bytes behind; disconnected "
            "(it can resume from the ring)",
            self.name,
            sub.peer,
            self.subscriber_bytes,
        )

    def _note_drop(self, sub: _Subscriber, entry: _Entry) -> None:
        origin, epoch, seq = entry[0], entry[1], entry[2]
        if origin in sub.awaiting:  # the snapshot it waits for replaces these
            return
        sub.batches_dropped += 1
        self._sub_dropped += 1
        gap = sub.drop_gaps.get(origin)
        if gap is not None and gap[0] == epoch and gap[2] == seq:
            gap[2] = seq + 1
            return
        if gap is not None:
            self._queue_gap(sub, origin, gap[0], gap[1], gap[2], "dropped")
        sub.drop_gaps[origin] = [epoch, seq, seq + 1]

    def _announce_drops(self, sub: _Subscriber) -> None:
        if not sub.drop_gaps:
            return
        n = sum(g[2] - g[1] for g in sub.drop_gaps.values())
        for origin, (epoch, first, nxt) in sub.drop_gaps.items():
            self._queue_gap(sub, origin, epoch, first, nxt, "dropped")
        sub.drop_gaps.clear()
        self._slowness.log(
            "%s: subscriber %s fell more than %d bytes behind; %d batches skipped for it",
            self.name,
            sub.peer,
            self.subscriber_bytes,
            n,
        )

    def _queue_gap(
        self, sub: _Subscriber, origin: str, epoch: str, first: int, nxt: int, reason: str
    ) -> None:
        self._gap_notices += 1
        sub.control.append(
            control_message(
                {
                    "type": "gap",
                    "origin": origin,
                    "epoch": epoch,
                    "first_missing": first,
                    "next_seq": nxt,
                    "reason": reason,
                },
                self._framing,
            )
        )

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
        peer = _peer(stream)
        sub: _Subscriber | None = None
        scope = anyio.CancelScope()
        try:
            with scope:
                self._greeting.add(scope)
                if self._connections > self.max_subscribers:
                    await self._refuse(stream, peer, "busy", "too many subscribers; retry later")
                    return
                try:
                    with anyio.fail_after(self.hello_timeout):
                        if self._ssl is not None:
                            stream = await TLSStream.wrap(
                                stream,
                                server_side=True,
                                ssl_context=self._ssl,
                                standard_compatible=False,
                            )
                        line = await _read_hello(stream)
                except TimeoutError:
                    await self._refuse(stream, peer, "bad_hello", "no hello line in time")
                    return
                except ProtocolError as exc:
                    await self._refuse(stream, peer, exc.code, str(exc))
                    return
                try:
                    hello = parse_hello(line)
                    if self._token is not None and not token_matches(self._token, hello.token):
                        raise ProtocolError("token missing or wrong", "unauthorized")
                    if self._stopping:
                        raise ProtocolError("the sink is closing", "closing")
                    sub = self._subscribe(hello, peer, stream, scope)
                except ProtocolError as exc:
                    await self._refuse(stream, peer, exc.code, str(exc))
                    return
                self._greeting.discard(scope)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._watch_peer, sub)
                    try:
                        await self._write(sub)
                    except _GONE as exc:
                        log.debug("%s: subscriber %s went away: %r", self.name, peer, exc)
                    tg.cancel_scope.cancel()
        except _GONE as exc:
            log.debug("%s: subscriber %s went away: %r", self.name, peer, exc)
        except Exception as exc:  # a bug must not take the sink down with it
            log.exception("%s: subscriber %s: unexpected error: %r", self.name, peer, exc)
        finally:
            self._greeting.discard(scope)
            if sub is not None:
                sub.gone = True
                if sub in self._subscribers:
                    self._subscribers.remove(sub)
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await stream.aclose()
            self._connections -= 1
            if self._connections == 0:
                self._all_gone.set()

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

    async def _watch_peer(self, sub: _Subscriber) -> None:
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

    # -- one subscriber ---------------------------------------------------------------

    def _subscribe(
        self, hello: Hello, peer: str, stream: anyio.abc.ByteStream, scope: anyio.CancelScope
    ) -> _Subscriber:
        """Plan the replay and register, in one step: nothing published can fall between."""
        ring = self._ring
        head = ring.end_pos
        sub = _Subscriber(peer, stream, scope)
        infos: dict[str, OriginInfo] = {}
        gaps: list[tuple[str, str, int, int]] = []
        can_snapshot = self.snapshot_provider is not None and self._barrier is not None
        for origin, state in self._origins.items():
            held = len(state.positions) > 0
            oldest = ring.get(state.positions[0])[2] if held else state.newest + 1
            infos[origin] = OriginInfo(state.epoch, oldest if held else None, state.newest)
            n = hello.start_for(origin)
            if n is None:
                continue
            asked_epoch = hello.epoch_for(origin)
            if asked_epoch is not None and asked_epoch != state.epoch:
                n = 0  # the producer restarted since: all of the new epoch
            elif n > state.newest + 1:
                raise ProtocolError(
                    f"from_seq {n} of origin {origin!r} is ahead of the newest batch "
                    f"{state.newest} of epoch {state.epoch}",
                    "from_seq_ahead",
                )
            if n >= oldest:
                sub.starts[origin] = _position_of(ring, state, n, head)
                continue
            sub.starts[origin] = state.positions[0] if held else head
            if can_snapshot:
                sub.awaiting[origin] = _Await(state.epoch, n, oldest)
            else:
                gaps.append((origin, state.epoch, n, oldest))
        sub.replay_end = head
        sub.cursor = min(sub.starts.values(), default=head)
        sub.control.append(welcome_line(self.codec, infos, snapshot=can_snapshot))  # type: ignore[arg-type]
        for origin, epoch, first, nxt in gaps:
            self._queue_gap(sub, origin, epoch, first, nxt, "evicted")
        if sub.awaiting:
            sub.snapshot_deadline = anyio.current_time() + self.snapshot_timeout
            if not self._barrier_pending and self._barrier is not None:
                self._barrier_pending = True
                self._barrier(self._at_barrier)
        self._subscribers.append(sub)
        self._accepted += 1
        log.debug("%s: subscriber %s joined (from_seq %r)", self.name, peer, hello.from_seq)
        return sub

    async def _write(self, sub: _Subscriber) -> None:
        """The subscriber's writer: control first, then snapshots, then the ring."""
        ring = self._ring
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
                chunk = snapshot.encoded(self, first_missing)
                self._snapshots_sent += 1
                await stream.send(chunk)
                sub.bytes_sent += len(chunk)
                continue
            if sub.awaiting:
                remaining = sub.snapshot_deadline - anyio.current_time()
                if remaining <= 0 or self._stopping:
                    self._no_snapshot(
                        sub, "no tick came to take it" if remaining <= 0 else "closing"
                    )
                    continue
                event = sub.wakeup = anyio.Event()
                with anyio.move_on_after(remaining):
                    await event.wait()
                continue
            if sub.cursor < ring.end_pos:
                frames, n = self._gather(sub)
                if frames:
                    # anyio's socket and TLS streams take any bytes-like object;
                    # copying a 256 KiB chunk just to satisfy the annotation is waste.
                    await stream.send(cast(bytes, frames))
                    sub.batches_sent += n
                    sub.bytes_sent += len(frames)
                continue
            if self._stopping:
                await stream.send(
                    control_message({"type": "end", "reason": "sink closed"}, self._framing)
                )
                return
            event = sub.wakeup = anyio.Event()
            await event.wait()

    def _gather(self, sub: _Subscriber) -> tuple[bytearray, int]:
        """Frames for ``sub`` from its cursor, up to :data:`_CHUNK_BYTES`; advances it."""
        ring = self._ring
        pos = max(sub.cursor, ring.first_pos)
        end = ring.end_pos
        out = bytearray()
        n = 0
        wants = sub.wants
        get = ring.get
        while pos < end and len(out) < _CHUNK_BYTES:
            entry = get(pos)
            if wants(pos, entry):
                out += entry[3]
                n += 1
            pos += 1
        sub.cursor = pos
        return out, n

    # -- snapshots ------------------------------------------------------------------

    def _at_barrier(self, origin: str, epoch: str, next_seq: int) -> None:
        """Inside the scheduler's tick, right after it sealed: take the snapshot now."""
        self._barrier_pending = False
        waiting = [s for s in self._subscribers if s.awaiting]
        if not waiting:
            return
        serve = [s for s in waiting if origin in s.awaiting]
        snapshot: _Snapshot | None = None
        provider = self.snapshot_provider
        if serve and provider is not None:
            try:
                events = list(provider())
                for i, e in enumerate(events):
                    if not isinstance(e, KVCacheEvent):
                        raise TypeError(f"item {i} is {type(e).__name__}, not a KV cache event")
            except Exception as exc:
                log.error("%s: snapshot provider failed: %r; sending gap notices", self.name, exc)
            else:
                state = self._origins.get(origin)
                rank = state.data_parallel_rank if state is not None else None
                snapshot = _Snapshot(origin, epoch, next_seq, rank, events)
        for sub in waiting:
            if snapshot is not None and origin in sub.awaiting:
                wait = sub.awaiting.pop(origin)
                sub.snapshots.append((snapshot, wait.first_missing))
                sub.min_seq[origin] = (epoch, next_seq)
            # Only the scheduler's own origin has a snapshot: the others get gaps.
            for other in list(sub.awaiting):
                self._no_snapshot(sub, "no snapshot for this origin", other)
            sub.wake()

    def _no_snapshot(self, sub: _Subscriber, why: str, origin: str | None = None) -> None:
        for name in [origin] if origin is not None else list(sub.awaiting):
            wait = sub.awaiting.pop(name)
            log.info(
                "%s: subscriber %s gets a gap for %s instead of a snapshot: %s",
                self.name,
                sub.peer,
                name,
                why,
            )
            self._queue_gap(sub, name, wait.epoch, wait.first_missing, wait.oldest, "evicted")

    # -- introspection ---------------------------------------------------------------

    def server_statistics(self) -> SocketSinkStatistics:
        return SocketSinkStatistics(
            address=self.address,
            subscribers=len(self._subscribers),
            connections_accepted=self._accepted,
            connections_refused=self._refused,
            slow_disconnects=self._slow_disconnects,
            subscriber_batches_dropped=self._sub_dropped,
            gap_notices=self._gap_notices,
            snapshots_sent=self._snapshots_sent,
            ring_batches=len(self._ring),
            ring_bytes=self._ring.bytes,
            ring_max_bytes=self.ring_bytes,
        )

    def subscriber_statistics(self) -> tuple[SubscriberStatistics, ...]:
        ring = self._ring
        out = []
        for s in self._subscribers:
            start = max(s.cursor, s.replay_end, ring.first_pos)
            out.append(
                SubscriberStatistics(
                    s.peer,
                    s.batches_sent,
                    s.bytes_sent,
                    s.batches_dropped,
                    ring.end_offset - ring.offset(start),
                )
            )
        return tuple(out)


# -- helpers ---------------------------------------------------------------------------


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _peer(stream: anyio.abc.ByteStream) -> str:
    addr = stream.extra(SocketAttribute.remote_address, None)
    if isinstance(addr, tuple) and len(addr) >= 2:
        return _join(str(addr[0]), int(addr[1]))
    return "unix peer" if addr is not None else "peer"


async def _read_hello(stream: anyio.abc.ByteStream) -> bytes:
    buf = bytearray()
    while True:
        buf += await stream.receive(MAX_HELLO_BYTES)
        end = buf.find(b"\n")
        if end >= 0:
            if end + 1 != len(buf):
                raise ProtocolError("hello: nothing may follow the hello line", "bad_hello")
            return bytes(buf[:end])
        if len(buf) >= MAX_HELLO_BYTES:
            raise ProtocolError(f"hello: no newline within {MAX_HELLO_BYTES} bytes", "bad_hello")


def _position_of(ring: _Ring, state: _OriginState, seq: int, head: int) -> int:
    """Ring position of the origin's first held batch with a seq >= ``seq`` (or ``head``)."""
    positions = state.positions
    lo, hi = 0, len(positions)
    if hi == 0:
        return head
    guess = seq - ring.get(positions[0])[2]  # exact when no seq is missing
    if 0 <= guess < hi and ring.get(positions[guess])[2] == seq:
        return positions[guess]
    while lo < hi:
        mid = (lo + hi) // 2
        if ring.get(positions[mid])[2] < seq:
            lo = mid + 1
        else:
            hi = mid
    return positions[lo] if lo < len(positions) else head


def _bind_unix(path: str) -> socket.socket:
    """A listening Unix socket at ``path``, mode 0600 from the start.

    A stale socket file (nobody listening) is replaced; a live one, or any other
    kind of file, is an error.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise TransportError(f"unix:{path}: {exc.strerror}") from exc
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise TransportError(f"unix:{path}: the path exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        except OSError as exc:
            raise TransportError(f"unix:{path}: {exc.strerror}") from exc
        else:
            raise TransportError(f"unix:{path}: another process is listening there")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.fchmod(sock.fileno(), 0o600)  # Linux creates the file with the socket's mode
        sock.bind(path)
        os.chmod(path, 0o600)  # elsewhere: tighten right after bind
        sock.listen(1024)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise TransportError(f"unix:{path}: address in use") from exc
        raise TransportError(f"unix:{path}: cannot listen: {exc.strerror or exc}") from exc
    return sock


def sink_from_url(parsed: ParsedURL, opts: Options, common: dict[str, Any]) -> SocketSink:
    """``tcp://HOST:PORT`` / ``unix:PATH`` -> a :class:`SocketSink` (used by kvstream.config)."""
    where = parsed.raw.partition("?")[0]
    if "token" in opts:
        raise ConfigError(
            f"{where}: option token: a secret in a URL is visible to other users "
            "(ps, shell history, logs); use token_env=NAME or token_file=PATH"
        )
    token = read_token(env=opts.pop_str("token_env"), file=opts.pop_str("token_file"), where=where)
    cert = opts.pop_str("tls_cert")
    key = opts.pop_str("tls_key")
    if key is not None and cert is None:
        raise ConfigError(f"{where}: option tls_key needs tls_cert")
    ssl_context = server_ssl_context(cert, key, where=where) if cert is not None else None
    ring_bytes = opts.pop_size("ring_bytes", DEFAULT_RING_BYTES)
    subscriber_bytes = (
        opts.pop_size("subscriber_bytes", DEFAULT_SUBSCRIBER_BYTES)
        if "subscriber_bytes" in opts
        else None
    )
    kwargs: dict[str, Any] = {
        "token": token,
        "ssl_context": ssl_context,
        "ring_bytes": ring_bytes,
        "subscriber_bytes": subscriber_bytes,
        "slow": opts.pop_choice("slow", SLOW_POLICIES, "disconnect"),
        "max_subscribers": opts.pop_int("max_subscribers", 64, minimum=1),
        "hello_timeout": opts.pop_float("hello_timeout", 10.0),
        "snapshot_timeout": opts.pop_float("snapshot_timeout", 5.0),
    }
    if parsed.scheme == "unix":
        if not parsed.path:
            raise ConfigError(f"{where}: expected unix:PATH (or unix:///absolute/path)")
        return SocketSink(path=parsed.path, **kwargs, **common)
    if parsed.port is None or parsed.path:
        raise ConfigError(f"{where}: expected tcp://HOST:PORT (port 0 picks a free port)")
    return SocketSink(host=parsed.host or None, port=parsed.port, **kwargs, **common)
