"""Test doubles and fault injection for pipelines built on kvstream.

* `SeededEvents`: a deterministic event stream. Event `i` is a pure
  function of `(seed, i)`, so a consumer checks millions of events against
  the stream by *regenerating* them, never holding them in memory.
* `StreamVerifier`: the consumer's side of that check: every batch in
  order, every sequence number once, every event equal to the regenerated one,
  and the gaps (what a `drop_*` policy dropped) counted.
* [`FaultySink`][kvstream.testing.FaultySink]: a sink whose faults the test controls: it fails on
  send or close, stalls until released, or never answers.
* `raising_source()`, `hanging_source()`, `garbage_source()`:
  async sources that misbehave in the ways a real connector can.

Nothing here is used by kvstream itself; it is public so that applications can
test their own pipelines the way kvstream's reliability suite tests its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, Final

import anyio
import anyio.lowlevel

from kvstream.errors import TransportError
from kvstream.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVCacheEvent
from kvstream.sinks.base import Sink

__all__ = [
    "FaultySink",
    "SeededEvents",
    "StreamVerifier",
    "VerificationError",
    "garbage_source",
    "hanging_source",
    "raising_source",
]

_MASK: Final = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash of `x`."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class SeededEvents:
    """A reproducible stream of events: `event(i)` depends only on the seed and `i`.

    Mostly `BlockStored` (1 to `max_blocks` chained blocks of `block_size`
    tokens, now and then with a LoRA name, a raw-bytes hash or metadata), some
    `BlockRemoved` and, rarely, `AllBlocksCleared`: every field kind the
    codecs carry, at a cost low enough to make millions of them.
    """

    __slots__ = ("block_size", "max_blocks", "seed")

    def __init__(self, seed: int = 0, *, block_size: int = 4, max_blocks: int = 4) -> None:
        if block_size <= 0 or max_blocks <= 0:
            raise ValueError("SeededEvents: block_size and max_blocks must be positive")
        self.seed = seed
        self.block_size = block_size
        self.max_blocks = max_blocks

    def event(self, index: int) -> KVCacheEvent:
        """The event at position `index` of the stream."""
        x = _mix(self.seed * 0x100000001B3 + index)
        kind = x & 0xFF
        n = 1 + (x >> 8) % self.max_blocks
        hashes: list[int | bytes] = [(x + k * 0x9E3779B97F4A7C15) & _MASK for k in range(n)]
        if kind == 0:
            return AllBlocksCleared()
        if kind < 36:
            return BlockRemoved(block_hashes=hashes, medium="GPU" if kind & 1 else "CPU")
        size = self.block_size
        first = (x >> 16) % 30_000
        parent = None if kind & 8 else x ^ 0x5555_5555_5555_5555
        lora = "sql-adapter" if kind & 0x30 == 0x30 else None
        metadata = {"i": index, "tag": "seeded"} if kind > 250 else None
        if kind == 37:
            hashes[0] = x.to_bytes(8, "big") * 4  # a raw 32-byte digest
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=list(range(first, first + n * size)),
            block_size=size,
            lora_name=lora,
            medium="GPU",
            metadata=metadata,
        )

    def events(self, start: int, stop: int) -> list[KVCacheEvent]:
        """Events `start` to `stop - 1`."""
        event = self.event
        return [event(i) for i in range(start, stop)]

    def chunks(self, total: int, size: int, start: int = 0) -> Iterator[list[KVCacheEvent]]:
        """`total` events from `start`, in lists of `size` (the last may be shorter)."""
        for first in range(start, start + total, size):
            yield self.events(first, min(first + size, start + total))


class VerificationError(AssertionError):
    """What a consumer received differs from the stream it was made from."""


class StreamVerifier:
    """Checks received batches of one origin against a `SeededEvents` stream.

    With `events_per_batch` set (the producer sealed exactly that many events
    per tick), batch `seq` holds events `[seq * n, (seq + 1) * n)`, so a
    gap left by a drop policy is counted and checking resumes after it.
    Without it the events must arrive contiguously (policy `block`), and a
    gap is an error. Either way a duplicate or reordered batch, or any event
    that differs from the regenerated one, raises `VerificationError`.
    """

    def __init__(
        self,
        stream: SeededEvents,
        *,
        origin: str | None = None,
        events_per_batch: int | None = None,
    ) -> None:
        self.stream = stream
        self.origin = origin
        self.events_per_batch = events_per_batch
        self.epoch: str | None = None
        self.next_seq = 0
        self.next_event = 0
        self.batches = 0
        self.events = 0
        #: Gaps seen, and the batches and events missing in them.
        self.gaps = 0
        self.missing_batches = 0
        self.missing_events = 0

    def check(self, batch: EventBatch) -> None:
        """Verify the next batch received."""
        if self.origin is not None and batch.origin != self.origin:
            raise VerificationError(f"origin: expected {self.origin!r}, got {batch.origin!r}")
        if self.epoch is None:
            self.epoch = batch.epoch
        elif batch.epoch != self.epoch:
            raise VerificationError(f"epoch changed from {self.epoch!r} to {batch.epoch!r}")
        seq = batch.seq
        if seq < self.next_seq:
            raise VerificationError(f"seq {seq}: duplicate or reordered (expected {self.next_seq})")
        per = self.events_per_batch
        if seq > self.next_seq:
            if per is None:
                raise VerificationError(f"seq {seq}: batches {self.next_seq}..{seq - 1} missing")
            self.gaps += 1
            self.missing_batches += seq - self.next_seq
            self.missing_events += (seq - self.next_seq) * per
            self.next_event = seq * per
        if per is not None and len(batch.events) != per:
            raise VerificationError(f"seq {seq}: expected {per} events, got {len(batch.events)}")
        event = self.stream.event
        start = self.next_event
        for k, got in enumerate(batch.events):
            expected = event(start + k)
            if got != expected:
                raise VerificationError(
                    f"seq {seq} event {k} (stream index {start + k}): "
                    f"expected {expected!r:.200}, got {got!r:.200}"
                )
        self.next_event = start + len(batch.events)
        self.next_seq = seq + 1
        self.batches += 1
        self.events += len(batch.events)

    def check_all(self, batches: Iterable[EventBatch]) -> None:
        for batch in batches:
            self.check(batch)


class FaultySink(Sink):
    """A sink whose faults the test controls.

    * `fail_sends=n`: the next `n` sends raise `TransportError`
      (the base class retries them with backoff); `fail_next()` adds more.
    * `stall()` / `release()`: sends wait at a gate; `wait_stalled()`
      returns once a send is provably waiting there.
    * `hang=True`: sends never return (until cancelled by a close deadline).
    * `fail_close=True`: `aclose()` raises after the base class closed.

    Delivered batches are passed to `on_batch` when given, else kept in
    `batches` (`keep=False` keeps none).
    """

    def __init__(
        self,
        *,
        fail_sends: int = 0,
        hang: bool = False,
        fail_close: bool = False,
        keep: bool = True,
        on_batch: Callable[[EventBatch], object] | None = None,
        **options: Any,
    ) -> None:
        options.setdefault("codec", None)
        super().__init__(**options)
        self.batches: list[EventBatch] = []
        self.attempts = 0
        self.recovered = 0
        self._fail = fail_sends
        self._hang = hang
        self._fail_close = fail_close
        self._keep = keep
        self._on_batch = on_batch
        self._gate: anyio.Event | None = None
        self._stalled = anyio.Event()

    def fail_next(self, n: int) -> None:
        """Make the next `n` sends raise."""
        self._fail += n

    def stall(self) -> None:
        """Hold every send at a gate until `release()`."""
        if self._gate is None:
            self._gate = anyio.Event()
            self._stalled = anyio.Event()

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.set()

    async def wait_stalled(self) -> None:
        """Return once a send is waiting at the gate (the writer is stuck)."""
        await self._stalled.wait()

    async def write(self, data: bytes, batch: EventBatch) -> None:
        self.attempts += 1
        gate = self._gate
        if gate is not None:
            self._stalled.set()
            await gate.wait()
        if self._hang:
            self._stalled.set()
            await anyio.sleep_forever()
        if self._fail > 0:
            self._fail -= 1
            raise TransportError(f"{self.name}: injected send failure")
        if self._on_batch is not None:
            self._on_batch(batch)
        elif self._keep:
            self.batches.append(batch)

    async def recover(self, exc: Exception) -> None:
        self.recovered += 1

    async def aclose(self) -> None:
        await super().aclose()
        if self._fail_close:
            raise TransportError(f"{self.name}: injected close failure")


async def raising_source(
    chunks: Iterable[list[KVCacheEvent]], exc: BaseException
) -> AsyncIterator[list[KVCacheEvent]]:
    """Yield `chunks`, then raise `exc`: a connector that crashes."""
    for chunk in chunks:
        yield chunk
        await anyio.lowlevel.checkpoint()
    raise exc


async def hanging_source(
    chunks: Iterable[list[KVCacheEvent]], hung: anyio.Event | None = None
) -> AsyncIterator[list[KVCacheEvent]]:
    """Yield `chunks`, then never yield again (set `hung` when it gets there)."""
    for chunk in chunks:
        yield chunk
    if hung is not None:
        hung.set()
    await anyio.sleep_forever()


async def garbage_source(
    chunks: Iterable[list[KVCacheEvent]], garbage: object
) -> AsyncIterator[Any]:
    """Yield `chunks`, then `garbage` (not an event): a connector returning junk."""
    for chunk in chunks:
        yield chunk
    yield garbage
