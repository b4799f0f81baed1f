"""vLLM's replay server: a ROUTER that answers `(identity, start_seq)` from the sink's ring.

Each client's reply is a cursor over the ring, never a copy; payloads are lent
to ZMQ (zero-copy). Replies take turns, a budget of frames each; a client
whose pipe stays full past `timeout` is abandoned, and one that stopped
reading gives its slot to a new request when all `max_clients` are taken
(otherwise the request gets the end marker at once). Everything is counted and
logged once per burst.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final

import anyio
import anyio.lowlevel

from kvstream._burst_log import BurstLog
from kvstream._wire.vllm_zmq import ReplayLayout, parse_replay_request, replay_end, replay_reply
from kvstream.errors import DecodeError, MissingDependencyError
from kvstream.sinks._replay_ring import ReplayRing
from kvstream.sinks.zmq._frames import pipe_backoff, send_now
from kvstream.sinks.zmq._snapshots import next_request

try:
    import zmq
except ImportError as exc:  # pragma: no cover - the extra is installed in tests
    raise MissingDependencyError.for_extra("pyzmq", "zmq", exc) from exc

if TYPE_CHECKING:
    import logging

__all__ = ["DEFAULT_MAX_REPLAY_CLIENTS", "Entry", "ReplayServer"]

#: A ring entry: `(seq, topic, seq_frame, payload)`, a plain tuple (made per batch:
#: a NamedTuple costs six times as much to make).
Entry = tuple[int, bytes, bytes, bytes]

#: How many replies are served at once; further requests wait for their client's retry.
DEFAULT_MAX_REPLAY_CLIENTS: Final = 64
#: Frames sent to one reply client before the others get a turn.
_REPLY_BUDGET: Final = 64
#: How often the request reader looks at the socket without a signal: often
#: while replies go out on it (a reply's send can take a request's signal),
#: rarely when idle (each look takes the GIL from the engine's thread).
_REQUEST_INTERVAL_BUSY: Final = 0.02
_REQUEST_INTERVAL_IDLE: Final = 1.0


class _Reply:
    """One client's replay in progress: a cursor over the ring, not a copy of it."""

    __slots__ = ("end", "identity", "next", "stalled_since", "start_seq")

    def __init__(self, identity: bytes, start_seq: int, first: int, end: int) -> None:
        self.identity = identity
        self.start_seq = start_seq
        #: Ring position (counting every batch ever stored) of the next candidate.
        self.next = first
        #: Position one past the last batch stored when the request came.
        self.end = end
        self.stalled_since: float | None = None


class ReplayServer:
    """Serves replay requests on `router` from `ring` (see the module doc)."""

    def __init__(
        self,
        name: str,
        ring: ReplayRing[Entry],
        log: logging.Logger,
        *,
        layout: ReplayLayout,
        timeout: float,
        max_clients: int,
    ) -> None:
        self.name = name
        self.ring = ring
        self.layout: ReplayLayout = layout
        self.timeout = timeout
        self.max_clients = max_clients
        #: Set by the sink once the socket is bound.
        self.router: zmq.Socket[bytes] | None = None
        self._replies: dict[bytes, _Reply] = {}
        self._wakeup = anyio.Event()
        #: When a reply last sent something (the request reader looks often then).
        self._last_reply = -math.inf
        self._malformed_log = BurstLog(log)
        self._busy_log = BurstLog(log)
        self._abandon_log = BurstLog(log)
        # counters (read by the sink's statistics)
        self.requests = 0
        self.malformed = 0
        #: Valid requests refused because `max_clients` replies were running.
        self.busy = 0
        self.completed = 0
        self.abandoned = 0
        self.sent = 0
        self.waits = 0

    def _request_interval(self) -> float:
        if self._replies or anyio.current_time() - self._last_reply < _REQUEST_INTERVAL_IDLE:
            return _REQUEST_INTERVAL_BUSY
        return _REQUEST_INTERVAL_IDLE

    @property
    def active(self) -> int:
        """Replies in progress."""
        return len(self._replies)

    async def serve_requests(self) -> None:
        router = self.router
        assert router is not None
        while True:
            frames = await next_request(
                router, f"{self.name}: replay server", interval=self._request_interval
            )
            if frames is None:
                return
            try:
                identity, start_seq = parse_replay_request(frames)
            except DecodeError as exc:
                self.malformed += 1
                self._malformed_log.log("%s: malformed replay request ignored: %s", self.name, exc)
                continue
            self.requests += 1
            replies = self._replies
            if identity not in replies and len(replies) >= self.max_clients:
                # A client whose pipe is full (it is not reading now) gives way, the
                # one stalled longest first: clients that never read cannot hold
                # every slot against one that does.
                stalled = [r for r in replies.values() if r.stalled_since is not None]
                if stalled:
                    oldest = min(stalled, key=lambda r: r.stalled_since or 0.0)
                    self._abandon(oldest, "stalled, displaced by a new replay request")
                else:
                    self._refuse(identity, len(replies))
                    continue
            # A new request from a client being served restarts its reply.
            ring = self.ring
            replies[identity] = _Reply(identity, start_seq, ring.first_pos, ring.end_pos)
            wakeup, self._wakeup = self._wakeup, anyio.Event()
            wakeup.set()

    async def pump_replies(self) -> None:
        """Serve every reply in turn, a few frames each, backing off while all are stalled."""
        backoff = pipe_backoff()
        while True:
            if not self._replies:
                await self._wakeup.wait()
                continue
            progressed = False
            for reply in list(self._replies.values()):
                if await self._pump(reply):
                    progressed = True
            if progressed:
                backoff.reset()
                await anyio.lowlevel.checkpoint()  # live publishing goes on between turns
            else:
                await backoff.wait()

    async def _pump(self, reply: _Reply) -> bool:
        """Send up to a budget of frames to one client; True if anything was sent."""
        router = self.router
        assert router is not None
        layout = self.layout
        sent = 0
        ring = self.ring
        while sent < _REPLY_BUDGET:
            first = ring.first_pos
            if reply.next < first:  # the ring moved on: those batches are gone
                reply.next = first
            if reply.next >= reply.end:
                frames = replay_end(reply.identity, layout)
                entry = None
            else:
                entry = ring.get(reply.next)
                seq, topic, seq_frame, payload = entry
                if seq < reply.start_seq:
                    reply.next += 1
                    continue
                frames = replay_reply(reply.identity, topic, seq_frame, payload, layout)
            try:
                # Zero-copy: ZMQ's queue refers to the ring's payload instead of
                # holding a copy per client.
                send_now(router, frames, copy=False)
            except zmq.Again:
                self.waits += 1
                now = anyio.current_time()
                if reply.stalled_since is None:
                    reply.stalled_since = now
                elif now - reply.stalled_since > self.timeout:
                    self._abandon(reply, f"its pipe stayed full for {self.timeout:g} s")
                return sent > 0
            except zmq.ZMQError as exc:
                # ROUTER_MANDATORY: EHOSTUNREACH once the client is gone.
                self._abandon(reply, str(exc))
                return sent > 0
            reply.stalled_since = None
            self._last_reply = anyio.current_time()
            sent += 1
            if entry is None:
                self.completed += 1
                self._replies.pop(reply.identity, None)
                return True
            reply.next += 1
            self.sent += 1
        return True

    def _refuse(self, identity: bytes, running: int) -> None:
        """Every reply slot serves a client that reads: end this one's replay at once.

        vLLM's wire has no refusal message; the end marker is the clear answer
        (nothing replayed), so the client does not wait out its timeout and sees
        the batches it asked for as a gap against the live stream.
        """
        self.busy += 1
        self._busy_log.log(
            "%s: replay request from %s refused (answered with the end marker): "
            "%d replies already running",
            self.name,
            identity.hex(),
            running,
        )
        router = self.router
        if router is None:
            return
        try:
            send_now(router, replay_end(identity, self.layout))
        except zmq.ZMQError:  # gone, or its pipe is full: it times out as before
            pass

    def _abandon(self, reply: _Reply, reason: str) -> None:
        if self._replies.get(reply.identity) is reply:
            del self._replies[reply.identity]
        self.abandoned += 1
        self._abandon_log.log(
            "%s: replay to %s abandoned at ring position %d: %s",
            self.name,
            reply.identity.hex(),
            reply.next,
            reason,
        )
