"""ZmqSink: vLLM's KV-event publisher, on the event loop, with replay.

`zmq+tcp://HOST:PORT?replay=tcp://HOST:PORT2&topic=...` or
`zmq+ipc:///run/kv.sock` (pyzmq, extra `zmq`). A consumer written for
vLLM's publisher (llm-d's KV cache manager, Dynamo's ZMQ listener) cannot tell
this sink from it: the frames, the sequence numbers, the msgpack payload
([`MsgpackCodec`][kvstream.codecs.msgpack.MsgpackCodec]) and the replay protocol are
vLLM's (see `kvstream._wire.vllm_zmq`). What differs is what vLLM leaves to
chance:

* **No silent drops.** vLLM's PUB drops at its high-water mark while `send`
  succeeds. This sink publishes on an XPUB with `XPUB_NODROP`: a full
  subscriber pipe answers EAGAIN, and the sink's policy decides: `block`
  waits (paced) until the pipe has room, `drop_*` drops the batch and counts
  it. Either way the batch enters the replay ring, so a consumer that sees the
  gap can repair it.
* **Sequence numbers are the scheduler's** for each origin (sinks never
  renumber). With several origins (a relay) each origin is its own stream with
  its own topic: `topic` may contain `{origin}`, or give `model` for
  llm-d's `kv@<origin>@<model>`. A fixed topic serves one origin; batches of
  a second origin are refused (counted, logged), since two sequences on one
  topic would look like restarts to every consumer.
* **Replay that loses nothing.** The ROUTER (always bound, on its own endpoint)
  is `ROUTER_MANDATORY` and paced: a reply that meets a full pipe waits and
  resumes instead of being dropped at the ROUTER's high-water mark, every
  reply ends with its end marker, replies run beside live publishing without
  stalling it, and a reply stuck longer than `replay_timeout` (or whose
  client went away) is abandoned and counted. The ring is bounded in bytes
  (`replay_max_bytes`) and in batches (`buffer_steps`) and stores the exact
  bytes published. A malformed request is ignored and counted.
* **Strict consumers.** With a strict codec (`strict=refuse|convert`) the
  events strict consumers would reject are left out of the batch where they
  enter this sink, each counted and logged with its reason; the batch itself
  (and its `seq`) is always sent.
* **Recovery (opt-in, kvstream's extension).** With `snapshot_endpoint`
  the sink keeps the state of what it published and serves snapshots of it
  on a ROUTER of its own (`kvstream.sinks.zmq._snapshots`); with
  `heartbeat` every origin silent for that long is announced (epoch, last
  seq) under the topic `\x00kvstream.heartbeat`. The live frames are the same
  with and without them (`kvstream._wire.zmq_recovery`, `docs/vllm-wire.md`).

Bind or connect follows vLLM's rule (bind for `*`, `::`, ipc and inproc;
otherwise connect, so a central consumer can bind); `bind=` overrides it.
Everything runs on the event loop; there is no publisher thread. Publishing
uses plain (synchronous) sockets with `NOBLOCK`: a send either goes at once
or answers EAGAIN, so it never blocks the loop, and it costs a third of a
`zmq.asyncio` send. When nothing is queued ahead, the scheduler's tick
publishes the batch itself (`ZmqSink.write_nowait()`); the writer task only
runs when a pipe is full or the sink is retrying. Subscriptions and replay
requests are read by tasks that wait for the socket's descriptor.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Final, Self

import anyio
from anyio.abc import TaskGroup

from kvstream._wire.broker import Heartbeat, Heartbeats
from kvstream._wire.vllm_zmq import (
    DEFAULT_BUFFER_STEPS,
    DEFAULT_HWM,
    REPLAY_LAYOUTS,
    KVEventsConfig,
    ReplayLayout,
    live_frames,
    llm_d_topic,
    normalize_endpoint,
    pack_seq,
    parse_kv_events_config,
    should_bind,
)
from kvstream._wire.zmq_recovery import heartbeat_frames
from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.errors import ConfigError, MissingDependencyError, TransportError
from kvstream.events import EventBatch
from kvstream.sinks._encoding import held_bytes
from kvstream.sinks._replay_ring import ReplayRing
from kvstream.sinks.base import Sink, SinkStatistics
from kvstream.sinks.zmq._frames import (
    MORE_NOW,
    NOW,
    SEND_FRAME,
    attach,
    paced_router,
    pipe_backoff,
    send_now,
)
from kvstream.sinks.zmq._replay import DEFAULT_MAX_REPLAY_CLIENTS, Entry, ReplayServer
from kvstream.sinks.zmq._snapshots import SnapshotServer, SnapshotServerStatistics
from kvstream.state import DEFAULT_MAX_BYTES

try:
    import zmq
except ImportError as exc:  # pragma: no cover - the extra is installed in tests
    raise MissingDependencyError.for_extra("pyzmq", "zmq", exc) from exc

__all__ = ["DEFAULT_REPLAY_HWM", "DEFAULT_REPLAY_MAX_BYTES", "ZmqSink", "ZmqSinkStatistics"]

log = logging.getLogger("kvstream.sinks")

DEFAULT_REPLAY_MAX_BYTES: Final = 256 * 1024 * 1024
#: Bookkeeping charged per ring entry on top of its payload as allocated (the
#: entry, its seq and seq frame, the ring's list slots and offset), measured.
_ENTRY_OVERHEAD: Final = 256
#: Replies queued in ZMQ per replay client. Small: what a client that stops
#: reading (or never reads) can pin is this many messages, and their payloads
#: are the ring's own bytes (sent without copying), not copies.
DEFAULT_REPLAY_HWM: Final = 16
#: Sequence numbers below this are packed inline (the end marker's value and above raise).
_SEQ_END: Final = (1 << 64) - 1
#: How often the subscription watcher looks at the socket when the descriptor
#: stays quiet (a send on the tick can consume its signal); `wait_subscribed()`
#: looks every `_WAIT_INTERVAL` itself.
_WATCH_INTERVAL: Final = 1.0
_WAIT_INTERVAL: Final = 0.02


@dataclass(frozen=True, slots=True, kw_only=True)
class ZmqSinkStatistics(SinkStatistics):
    """A ZMQ sink's counters: the sink's (`SinkStatistics`), then the ZMQ side's."""

    endpoint: str
    replay_endpoint: str | None
    #: Subscriptions the XPUB has seen minus unsubscriptions.
    subscriptions: int
    #: Sends a full subscriber pipe answered with EAGAIN (each waited or dropped).
    pipe_full: int
    #: Batches of an origin this sink has no topic for (several origins, fixed topic).
    batches_unroutable: int
    ring_batches: int
    ring_bytes: int
    replay_requests: int
    replay_malformed: int
    #: Valid requests refused because `max_replay_clients` replies were running.
    replay_busy: int
    replays_completed: int
    #: Replies given up: the client went away or its pipe stayed full too long.
    replays_abandoned: int
    replay_batches_sent: int
    #: Times a reply met a full pipe and waited (paced) instead of losing a frame.
    replay_waits: int
    replays_active: int
    #: The snapshot endpoint's counters (None when it is off).
    snapshots: SnapshotServerStatistics | None = None


LOOPBACK_ENDPOINT: Final = "tcp://127.0.0.1:5557"


class ZmqSink(Sink):
    """Publish batches on vLLM's ZMQ wire, with a replay ROUTER.

    `endpoint`: a ZMQ endpoint (`tcp://*:5557`, `tcp://10.0.0.5:5557`,
    `ipc:///run/kv.sock`); `bind` overrides vLLM's bind-or-connect rule. With
    no endpoint the sink binds `tcp://127.0.0.1:5557` (loopback only; ZMQ has no
    token vLLM's consumers could send, so exposing the stream is an explicit choice).
    `replay_endpoint`: where replay requests are served (always bound); None
    disables replay (no ring is kept). `topic`: the topic frame, `{origin}`
    replaced by the batch's origin; `model`: llm-d's `kv@<origin>@<model>`
    instead. `hwm`: per-subscriber high-water mark in messages (0: none).
    `buffer_steps` / `replay_max_bytes`: the ring's bounds. `replay_hwm`:
    the ROUTER's per-client high-water mark (replies are paced at it, never
    dropped); `replay_timeout`: how long a reply may stay stalled before it is
    abandoned; `replay_layout`: `"topic"` (vLLM v0.26+) or `"legacy"` (no
    topic frame). `linger`: seconds queued messages get to leave at close.
    `snapshot_endpoint`: where snapshots are served (always bound; None: no
    state is kept); `snapshot_max_bytes`: the state keeper's bound.
    `heartbeat`: seconds between heartbeats of idle origins (None: none).
    The codec defaults to `MsgpackCodec` (map profile); `policy`,
    `max_bytes` and the other options are the base class's.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        model: str | None = None,
        bind: bool | None = None,
        hwm: int = DEFAULT_HWM,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        replay_max_bytes: int = DEFAULT_REPLAY_MAX_BYTES,
        replay_layout: ReplayLayout = "topic",
        replay_timeout: float = 30.0,
        replay_hwm: int = DEFAULT_REPLAY_HWM,
        max_replay_clients: int = DEFAULT_MAX_REPLAY_CLIENTS,
        linger: float = 1.0,
        snapshot_endpoint: str | None = None,
        snapshot_max_bytes: int = DEFAULT_MAX_BYTES,
        heartbeat: float | None = None,
        context: zmq.Context[Any] | None = None,
        **options: Any,
    ) -> None:
        #: The ZMQ context the sockets are made in (not terminated by the sink). By
        #: default, for `inproc://` endpoints (which reach only sockets of one
        #: context), the process's shared `zmq.Context.instance()`, as vLLM uses;
        #: otherwise a context of the sink's own, terminated at close so that the
        #: endpoint is free again when `aclose` returns.
        self.context: zmq.Context[Any] | None = context
        if endpoint is None:
            # Secure by default: bound on loopback only. vLLM's own default
            # (tcp://*:5557, every interface) must be asked for by name.
            endpoint = LOOPBACK_ENDPOINT
            if bind is None:
                bind = True
        endpoint = normalize_endpoint(endpoint, "ZmqSink: endpoint")
        if replay_endpoint is not None:
            replay_endpoint = normalize_endpoint(replay_endpoint, "ZmqSink: replay_endpoint")
        if snapshot_endpoint is not None:
            snapshot_endpoint = normalize_endpoint(snapshot_endpoint, "ZmqSink: snapshot_endpoint")
        options.setdefault("codec", MsgpackCodec())
        options.setdefault("name", f"zmq:{endpoint}")
        super().__init__(**options)
        if self.codec is None:
            raise ConfigError("ZmqSink: codec: expected a codec, got None")
        if type(topic) is not str:
            raise ConfigError(f"ZmqSink: topic: expected a str, got {topic!r}")
        if model is not None:
            if topic:
                raise ConfigError(
                    "ZmqSink: give topic or model, not both (model makes the topic "
                    "kv@<origin>@<model>)"
                )
            llm_d_topic("origin", model)  # checks the model part
        for key, value, minimum in (
            ("hwm", hwm, 0),
            ("buffer_steps", buffer_steps, 1),
            ("replay_max_bytes", replay_max_bytes, 1),
            ("max_replay_clients", max_replay_clients, 1),
            ("replay_hwm", replay_hwm, 0),
            ("snapshot_max_bytes", snapshot_max_bytes, 1),
        ):
            if type(value) is not int or value < minimum:
                raise ConfigError(f"ZmqSink: {key}: expected an int >= {minimum}, got {value!r}")
        if replay_layout not in REPLAY_LAYOUTS:
            raise ConfigError(
                f"ZmqSink: replay_layout: expected one of {', '.join(REPLAY_LAYOUTS)}, "
                f"got {replay_layout!r}"
            )
        for key, seconds in (("replay_timeout", replay_timeout), ("linger", linger)):
            if not (
                isinstance(seconds, int | float)
                and not isinstance(seconds, bool)
                and seconds >= 0
                and math.isfinite(seconds)
            ):
                raise ConfigError(f"ZmqSink: {key}: expected seconds >= 0, got {seconds!r}")
        if heartbeat is not None and not (
            isinstance(heartbeat, int | float)
            and not isinstance(heartbeat, bool)
            and heartbeat > 0
            and math.isfinite(heartbeat)
        ):
            raise ConfigError(f"ZmqSink: heartbeat: expected seconds > 0, got {heartbeat!r}")
        if bind is not None and type(bind) is not bool:
            raise ConfigError(f"ZmqSink: bind: expected True, False or None, got {bind!r:.80}")
        if context is not None and not isinstance(context, zmq.Context):
            raise ConfigError(f"ZmqSink: context: expected a zmq.Context, got {context!r:.80}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.model = model
        self.bind = should_bind(endpoint) if bind is None else bind
        self.hwm = hwm
        self.buffer_steps = buffer_steps
        self.replay_max_bytes = replay_max_bytes
        self.replay_layout: ReplayLayout = replay_layout
        self.replay_timeout = float(replay_timeout)
        self.max_replay_clients = max_replay_clients
        self.replay_hwm = replay_hwm
        self.linger = float(linger)
        self._per_origin = model is not None or "{origin}" in topic
        self._topics: dict[str, bytes | None] = {}
        # The topic of the origin of the last batch sent (the hot path's cache).
        self._last_origin: str | None = None
        self._last_topic = b""
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._own_ctx = True
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        # The replay ring: exact frames, bounded in bytes and batches.
        self._ring: ReplayRing[Entry] = ReplayRing(replay_max_bytes, buffer_steps)
        self._replay: ReplayServer | None = None
        if replay_endpoint is not None:
            self._replay = ReplayServer(
                self.name,
                self._ring,
                log,
                layout=replay_layout,
                timeout=self.replay_timeout,
                max_clients=max_replay_clients,
            )
        self._subscriptions = 0
        self._subscription_changed = anyio.Event()
        # counters
        self._pipe_full = 0
        self._unroutable = 0
        # recovery (opt-in): None when off, so the tick pays one `is None` test
        self.snapshot_endpoint = snapshot_endpoint
        self._snap_router: zmq.Socket[bytes] | None = None
        self._snapshots: SnapshotServer | None = None
        if snapshot_endpoint is not None:
            self._snapshots = SnapshotServer(
                self.name,
                codec=self.codec,
                origin_of=self._origin_of,
                max_bytes=snapshot_max_bytes,
                timeout=self.replay_timeout,
            )
        self.heartbeat = None if heartbeat is None else float(heartbeat)
        self._heartbeats: Heartbeats | None = None
        if heartbeat is not None:
            self._heartbeats = Heartbeats(
                float(heartbeat), self.name, self._beat, clock=anyio.current_time
            )
        self._heartbeats_skipped = 0

    @property
    def per_origin_topics(self) -> bool:
        """True when each origin gets its own topic (`{origin}` in it, or `model`)."""
        return self._per_origin

    @classmethod
    def from_kv_events_config(
        cls,
        config: str | KVEventsConfig | dict[str, Any],
        *,
        data_parallel_rank: int | None = None,
        **options: Any,
    ) -> Self:
        """A sink configured as vLLM's `--kv-events-config` would configure its publisher.

        Endpoints are offset by `data_parallel_rank` as vLLM does. The policy
        defaults to `drop_newest` (vLLM drops when its queue is full; here the
        drops are counted). Raises `ConfigError` when the config turns
        publishing off.
        """
        parsed = config if isinstance(config, KVEventsConfig) else parse_kv_events_config(config)
        if not parsed.enabled:
            raise ConfigError(
                "--kv-events-config: publishing is off (enable_kv_cache_events false or "
                "publisher 'null')"
            )
        settings = parsed.sink_settings(data_parallel_rank)
        settings.setdefault("policy", "drop_newest")
        settings.update(options)
        return cls(**settings)

    # -- lifetime -----------------------------------------------------------------------

    async def open(self) -> None:
        shared = self.context
        if shared is None and "inproc://" in f"{self.endpoint} {self.replay_endpoint}":
            shared = zmq.Context.instance()
        # Synchronous sockets (sends are NOBLOCK, from the tick); a shared context
        # is used as it is, so inproc:// endpoints reach the other sockets in it.
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if shared is None else shared
        self._own_ctx = shared is None
        try:
            pub = ctx.socket(zmq.XPUB)
            pub.setsockopt(zmq.XPUB_NODROP, 1)
            pub.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscription, for the count
            pub.setsockopt(zmq.SNDHWM, self.hwm)
            pub.setsockopt(zmq.LINGER, int(self.linger * 1000))
            self._pub = pub
            self.endpoint = attach(pub, self.endpoint, self.bind, "endpoint")
            if self.replay_endpoint is not None:
                router = self._router = paced_router(ctx, self.replay_hwm)
                self.replay_endpoint = attach(router, self.replay_endpoint, True, "replay")
                assert self._replay is not None
                self._replay.router = router
            if self._snapshots is not None:
                assert self.snapshot_endpoint is not None
                snap = self._snap_router = paced_router(ctx, self.replay_hwm)
                self.snapshot_endpoint = attach(snap, self.snapshot_endpoint, True, "snapshot")
                self._snapshots.endpoint = self.snapshot_endpoint
        except BaseException:
            self._close_sockets()
            if self._own_ctx:
                ctx.term()
            raise
        self._ctx = ctx

    def start_tasks(self, tg: TaskGroup) -> None:
        tg.start_soon(self._watch_subscriptions, name=f"kvstream {self.name} subscriptions")
        replay = self._replay
        if replay is not None and self._router is not None:
            tg.start_soon(replay.serve_requests, name=f"kvstream {self.name} replay requests")
            tg.start_soon(replay.pump_replies, name=f"kvstream {self.name} replay replies")
        if self._snapshots is not None and self._snap_router is not None:
            tg.start_soon(
                self._snapshots.serve, self._snap_router, name=f"kvstream {self.name} snapshots"
            )
        if self._heartbeats is not None:
            tg.start_soon(self._heartbeats.run, name=f"kvstream {self.name} heartbeats")

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            self._close_sockets()
            ctx, self._ctx = self._ctx, None
            if ctx is not None and self._own_ctx:
                # term() waits up to the linger for queued messages to leave. (A
                # shared context is left running: its I/O thread sends them.)
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(ctx.term)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router, self._snap_router):
            if sock is not None and not sock.closed:
                sock.close()
        self._pub = self._router = self._snap_router = None
        if self._replay is not None:
            self._replay.router = None

    # -- publishing ---------------------------------------------------------------------

    def _topic_for(self, origin: str) -> bytes | None:
        topics = self._topics
        if origin in topics:
            return topics[origin]
        topic: bytes | None
        if self.model is not None:
            try:
                topic = llm_d_topic(origin, self.model).encode()
            except ConfigError as exc:
                log.error("%s: no topic for origin %r: %s", self.name, origin, exc)
                topic = None
        elif self._per_origin:
            topic = self.topic.replace("{origin}", origin).encode()
        elif any(t is not None for t in topics.values()):
            log.error(
                "%s: batches of a second origin %r refused: topic %r serves one origin "
                "(give topic=...{origin}... or model=... for several)",
                self.name,
                origin,
                self.topic,
            )
            topic = None
        else:
            topic = self.topic.encode()
        topics[origin] = topic
        return topic

    def write_nowait(self, data: bytes, batch: EventBatch) -> bool:
        """Publish now if every subscriber's pipe has room (on the tick; see Sink).

        The hot path of every batch, written out: `write()` is the same steps
        with waiting, through the helpers.
        """
        pub = self._pub
        if pub is None:
            return False  # write() reports it
        origin = batch.origin
        topic: bytes | None
        if origin is self._last_origin:  # the common case: one origin, its topic known
            topic = self._last_topic
        else:
            topic = self._topic_for(origin)
            if topic is None:
                self._unroutable += 1
                self.discard(batch, f"no topic for origin {origin!r}")
                return True
            self._last_origin, self._last_topic = origin, topic
        seq = batch.seq
        seq_frame = seq.to_bytes(8, "big") if seq < _SEQ_END else pack_seq(seq)  # raises
        send = SEND_FRAME
        try:
            # A ZMQ message is atomic: once its first frame is taken, so are the others.
            send(pub, topic, MORE_NOW)
        except zmq.Again:
            # XPUB_NODROP: some subscriber's pipe is at its high-water mark.
            self._pipe_full += 1
            if self.policy == "block":
                return False  # the writer waits for room, paced
            self.discard(batch, "a subscriber's pipe is full (XPUB high-water mark)")
        except zmq.ZMQError as exc:
            raise TransportError(f"{self.name}: cannot publish: {exc}") from exc
        else:
            send(pub, seq_frame, MORE_NOW)
            send(pub, data, NOW)
        # Sent or discarded, the batch enters the ring: a consumer that sees the gap replays it.
        self._keep(batch, topic, seq_frame, data)
        return True

    async def write(self, data: bytes, batch: EventBatch) -> None:
        pub = self._pub
        if pub is None:
            raise TransportError(f"{self.name}: the socket is not open")
        topic = self._topic_for(batch.origin)
        if topic is None:
            self._unroutable += 1
            self.discard(batch, f"no topic for origin {batch.origin!r}")
            return
        seq_frame = pack_seq(batch.seq)
        frames = live_frames(topic, seq_frame, data)
        backoff = pipe_backoff()
        while True:
            try:
                send_now(pub, frames)
            except zmq.Again:
                # XPUB_NODROP: some subscriber's pipe is at its high-water mark.
                self._pipe_full += 1
                if self.policy != "block":
                    self.discard(batch, "a subscriber's pipe is full (XPUB high-water mark)")
                    break
                await backoff.wait()
                continue
            except zmq.ZMQError as exc:
                raise TransportError(f"{self.name}: cannot publish: {exc}") from exc
            break
        self._keep(batch, topic, seq_frame, data)

    def _keep(self, batch: EventBatch, topic: bytes, seq_frame: bytes, data: bytes) -> None:
        """Keep a published batch in the replay ring and for snapshots and heartbeats
        (each when it is on)."""
        if self._router is not None:
            cost = held_bytes(len(data)) + _ENTRY_OVERHEAD
            self._ring.push((batch.seq, topic, seq_frame, data), cost)
        if self._snapshots is not None:
            self._snapshots.pending.append(batch)
        if self._heartbeats is not None:
            self._heartbeats.delivered(batch)

    # -- recovery (snapshots, heartbeats) -----------------------------------------------

    def _origin_of(self, topic: bytes) -> str | None:
        """The origin whose stream has `topic` (the last one, should two share it)."""
        found = None
        for origin, known in self._topics.items():
            if known == topic:
                found = origin
        return found

    async def _beat(self, heartbeat: Heartbeat) -> None:
        pub = self._pub
        topic = self._topics.get(heartbeat.origin)
        if pub is None or topic is None:
            return
        try:
            send_now(pub, heartbeat_frames(topic, heartbeat))
        except zmq.Again:  # a full pipe: batches are waiting there, signs of life enough
            self._heartbeats_skipped += 1

    @property
    def heartbeats_sent(self) -> int:
        return 0 if self._heartbeats is None else self._heartbeats.sent

    # -- subscriptions ------------------------------------------------------------------

    async def _watch_subscriptions(self) -> None:
        pub = self._pub
        assert pub is not None
        while True:
            try:
                self._read_subscriptions(pub)
            except zmq.ZMQError as exc:
                log.debug("%s: subscription watcher stopped: %s", self.name, exc)
                return
            # The descriptor signals pending work; a send on the tick may have
            # taken that signal already, hence the timeout. It is long: each
            # wake-up takes the GIL from a busy engine thread (the drop-in runs
            # beside one), and the count is only needed promptly by someone in
            # wait_subscribed(), which reads the socket itself.
            with anyio.move_on_after(_WATCH_INTERVAL):
                await anyio.wait_readable(pub.FD)

    def _read_subscriptions(self, pub: zmq.Socket[bytes]) -> None:
        """Count every (un)subscription the XPUB has queued; returns when none is left."""
        changed = False
        while True:
            try:
                message = pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if message[:1] == b"\x01":
                self._subscriptions += 1
                changed = True
            elif message[:1] == b"\x00":
                self._subscriptions -= 1
                changed = True
        if changed:
            event, self._subscription_changed = self._subscription_changed, anyio.Event()
            event.set()

    async def wait_subscribed(self, count: int = 1) -> None:
        """Return once at least `count` subscriptions are in place (tests, demos)."""
        while self._subscriptions < count:
            pub = self._pub
            if pub is not None and not pub.closed:
                self._read_subscriptions(pub)
                if self._subscriptions >= count:
                    return
            with anyio.move_on_after(_WAIT_INTERVAL):
                await self._subscription_changed.wait()

    # -- introspection --------------------------------------------------------------------

    def statistics(self) -> ZmqSinkStatistics:
        replay = self._replay
        return ZmqSinkStatistics(
            **self._sink_fields(),
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            subscriptions=self._subscriptions,
            pipe_full=self._pipe_full,
            batches_unroutable=self._unroutable,
            ring_batches=len(self._ring),
            ring_bytes=self._ring.bytes,
            replay_requests=replay.requests if replay else 0,
            replay_malformed=replay.malformed if replay else 0,
            replay_busy=replay.busy if replay else 0,
            replays_completed=replay.completed if replay else 0,
            replays_abandoned=replay.abandoned if replay else 0,
            replay_batches_sent=replay.sent if replay else 0,
            replay_waits=replay.waits if replay else 0,
            replays_active=replay.active if replay else 0,
            snapshots=None if self._snapshots is None else self._snapshots.statistics(),
        )
