"""An accepted TCP connection as an asyncio `Protocol`: bytes buffered for one task,
writes straight to the transport. For `kvstream._wire.http`.

anyio's socket stream re-arms the socket's reader on every `receive()` (and disarms
it after: two `epoll_ctl` calls) and ends every `send()` with a shielded
checkpoint, an event-loop turn per response. Here reading stays on and the bytes
gather in `buffer` as they arrive; the connection's task waits only when the
buffer does not yet hold what it needs (`wait_data()`), and a write that the
kernel takes whole costs no turn at all.

Bounded: reading pauses while more than `limit` bytes wait unread and no one is
waiting for more; writing waits (`wait_drained()`) while the transport holds
more than its high-water mark. Deadlines are the loop's clock (`loop.time()`,
anyio's `current_time()` on asyncio); one timer per connection serves them all,
moved only when it fires before the current deadline.
"""

from __future__ import annotations

import asyncio
from typing import cast

__all__ = ["BufferedConnection"]

_NEVER = float("inf")


class BufferedConnection(asyncio.Protocol):
    """One connection's unread bytes (`buffer`), its end (`eof`, `lost`) and waits."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: The bytes received and not yet taken: the first piece as it came (no copy),
        #: a bytearray once more pieces join it.
        self.buffer: bytes | bytearray = b""
        #: The peer sent its last byte, or the connection is gone.
        self.eof = False
        #: The transport has closed its socket.
        self.lost = False
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[bool] | None = None
        self._wants_data = False
        self._reading_paused = False
        self._writing_paused = False
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    # -- the transport's callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        if not buffer:
            self.buffer = data
        elif type(buffer) is bytearray:
            buffer += data
        else:
            self.buffer = bytearray(buffer)
            self.buffer += data
        if self._wants_data:
            self._wake(True)
        elif len(self.buffer) > self.limit and not self._reading_paused:
            assert self.transport is not None
            self.transport.pause_reading()
            self._reading_paused = True

    def eof_received(self) -> bool:
        self.eof = True
        self._wake(True)
        return True  # keep the transport open: the answer may still go out

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = self.lost = True
        self._writing_paused = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake(True)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._wake(True)

    # -- for the connection's task ---------------------------------------------------

    @property
    def writing_paused(self) -> bool:
        """The transport holds more than its high-water mark: wait before writing on."""
        return self._writing_paused

    async def wait_data(self, deadline: float) -> bool:
        """Wait for bytes beyond those in `buffer`, or the end; False if `deadline`
        (the loop's clock) passed first."""
        if self.eof:
            return True
        if self._reading_paused:
            assert self.transport is not None
            self.transport.resume_reading()
            self._reading_paused = False
        self._wants_data = True
        try:
            return await self._wait(deadline)
        finally:
            self._wants_data = False

    async def wait_drained(self, deadline: float) -> bool:
        """Wait until the transport takes writes again; False if `deadline` passed first."""
        while self._writing_paused:
            if not await self._wait(deadline):
                return False
        return True

    def take(self, start: int, end: int) -> bytes:
        """The bytes of `buffer[start:end]` (one copy), dropping `buffer[:end]`."""
        buffer = self.buffer
        if isinstance(buffer, bytearray):
            with memoryview(buffer) as view:
                piece = bytes(view[start:end])
            del buffer[:end]
        else:
            piece = buffer[start:end]
            self.buffer = buffer[end:] if end < len(buffer) else b""
        return piece

    def take_all(self) -> bytes | bytearray:
        """Everything buffered, which the caller now owns."""
        buffer, self.buffer = self.buffer, b""
        return buffer

    def put_back(self, data: bytes | bytearray) -> None:
        """Bytes taken and not used, back before those buffered since."""
        if data:
            self.buffer = bytes(data) + self.buffer if self.buffer else bytes(data)

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(data)

    async def aclose(self, grace: float) -> None:
        """Close once what was written has gone out, dropping it after `grace` seconds
        (at once for 0); returns when the socket is closed. Run it shielded from
        cancellation."""
        transport = self.transport
        if transport is None:
            return
        if grace > 0:
            transport.close()
        else:
            transport.abort()
        deadline = self._loop.time() + grace
        while not self.lost:
            if not await self._wait(deadline):
                transport.abort()  # connection_lost() follows in the next turn
                deadline = _NEVER

    # -- waits and the deadline -------------------------------------------------------

    async def _wait(self, deadline: float) -> bool:
        """Until a callback wakes it (True) or `deadline` passes (False)."""
        waiter: asyncio.Future[bool] = self._loop.create_future()
        self._waiter = waiter
        self._deadline = deadline
        if deadline != _NEVER:
            self._arm(deadline)
        try:
            return await waiter
        finally:
            self._waiter = None

    def _wake(self, result: bool) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(result)

    def _arm(self, deadline: float) -> None:
        # One timer: moved earlier at once, later only when it fires (in _expire).
        if self._timer is None or self._timer_at > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(deadline, self._expire)
            self._timer_at = deadline

    def _expire(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done() or self._deadline == _NEVER:
            return
        if self._deadline <= self._timer_at:
            waiter.set_result(False)
        else:
            self._timer = self._loop.call_at(self._deadline, self._expire)
            self._timer_at = self._deadline
