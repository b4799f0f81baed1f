"""ZMQ sockets as the sink uses them: sends that never wait, paced ROUTERs, bind or connect."""

from __future__ import annotations

from typing import Final

from kvstream._backoff import Backoff
from kvstream.errors import MissingDependencyError, TransportError

try:
    import zmq
except ImportError as exc:  # pragma: no cover - the extra is installed in tests
    raise MissingDependencyError.for_extra("pyzmq", "zmq", exc) from exc

__all__ = ["MORE_NOW", "NOW", "SEND_FRAME", "attach", "paced_router", "pipe_backoff", "send_now"]

#: pyzmq's frame send without its Python wrapper (`send_multipart` spends most of
#: its time in Python: flag arithmetic on enums, keyword handling, a loop).
SEND_FRAME: Final = zmq.backend.Socket.send
MORE_NOW: Final = int(zmq.SNDMORE | zmq.NOBLOCK)
NOW: Final = int(zmq.NOBLOCK)
#: Frames at least this big are lent to ZMQ rather than copied (pyzmq's own threshold).
ZERO_COPY_MIN: Final = 65536


def send_now(sock: zmq.Socket[bytes], frames: list[bytes], *, copy: bool = True) -> None:
    """Send one multipart message without blocking; `zmq.Again` when it cannot go now.

    A ZMQ message is atomic: when its first frame is refused (EAGAIN), nothing of
    it was queued; once the first frame is taken, the others are taken too.
    `copy=False` lends large frames to ZMQ instead of copying them (pyzmq
    keeps them alive until ZMQ is done with them).
    """
    send = SEND_FRAME
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        flags = NOW if i == last else MORE_NOW
        if copy or len(frame) < ZERO_COPY_MIN:
            send(sock, frame, flags)
        else:
            send(sock, frame, flags, False)


def paced_router(ctx: zmq.Context[zmq.Socket[bytes]], hwm: int) -> zmq.Socket[bytes]:
    """A ROUTER whose sends to a full pipe answer EAGAIN (never dropped), `hwm` per client."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, hwm)
    return router


def attach(sock: zmq.Socket[bytes], endpoint: str, bind: bool, what: str) -> str:
    """Bind or connect `sock`; returns the endpoint actually bound (ports resolved)."""
    try:
        if bind:
            sock.bind(endpoint)
            last = sock.getsockopt(zmq.LAST_ENDPOINT)
            return last.decode() if isinstance(last, bytes) and last else endpoint
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        verb = "bind" if bind else "connect"
        raise TransportError(f"ZmqSink: {what}: cannot {verb} {endpoint}: {exc}") from exc
    return endpoint


def pipe_backoff() -> Backoff:
    """How long to wait for a full ZMQ pipe: 1 ms, doubling, at most 50 ms (a poll, not a retry)."""
    return Backoff(0.001, 0.05, where="ZMQ pipe")
