"""The sink contract and the machinery every sink shares.

A sink author writes one coroutine, `Sink.write()`, that writes one encoded
batch to the transport, plus `Sink.open()` / `Sink.aclose()` when the
transport has a lifetime. Everything else lives here:

* the **outbox**: bounded in batches and in bytes, filled by `Sink.offer()`
  (synchronous, called from the scheduler's tick) and emptied by the writer task;
* the **overflow policy** when the outbox is full: `block` (the tick waits:
  backpressure), `drop_oldest` or `drop_newest` (the tick never waits; every
  dropped batch and event is counted, and since sinks never renumber, a drop is a
  visible gap in `seq` downstream);
* **encoding**, when the batch is offered (on the scheduler's tick): once per
  codec per batch, shared by every sink of the scheduler that uses an equal codec
  (`kvstream.sinks._encoding`), so the outbox holds encoded bytes and is
  bounded by what they cost;
* the **inline write**: a sink whose transport can take a batch without waiting
  (`Sink.write_nowait()`: a ZMQ socket with room, an in-process queue) is
  written from the tick when nothing is queued or in flight ahead of the batch,
  without waking the writer task;
* **faults**: a failing `write` is retried with exponential backoff (after
  `Sink.recover()`), logged once per burst, and never slows the other sinks;
  a failure after which nothing can ever be delivered (`Sink.final_error()`: a
  pipe whose reader went away) ends the writer instead, and `Sink.ended` says why;
* **shutdown**: `Sink.drain()` delivers what is queued within a deadline and
  reports what it could not; [`Sink.aclose()`][kvstream.sinks.base.Sink.aclose] is idempotent;
* [`Sink.statistics()`][kvstream.sinks.base.Sink.statistics], an immutable record.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple, TypeAlias, get_args

import anyio
from anyio.abc import TaskGroup

from kvstream._backoff import Backoff
from kvstream._burst_log import BurstLog
from kvstream.codecs.base import Codec, Refusal
from kvstream.codecs.json import JsonCodec
from kvstream.errors import ClosedError, ConfigError, TransportError
from kvstream.events import EventBatch
from kvstream.lifetime import LifetimeState, TaskOwner, open_task_group
from kvstream.sinks._encoding import SharedEncoding
from kvstream.sinks._outbox import Outbox

__all__ = [
    "DEFAULT_MAX_BATCHES",
    "DEFAULT_MAX_BYTES",
    "DeliveryReport",
    "OverflowPolicy",
    "Sink",
    "SinkStatistics",
]

log = logging.getLogger("kvstream.sinks")

OverflowPolicy: TypeAlias = Literal["block", "drop_oldest", "drop_newest"]
POLICIES: Final[tuple[str, ...]] = get_args(OverflowPolicy)

DEFAULT_MAX_BYTES: Final = 64 * 1024 * 1024
DEFAULT_MAX_BATCHES: Final = 100_000
#: What a queued batch costs beyond its encoded bytes (the outbox entry, the batch).
_ENTRY_OVERHEAD: Final = 160


@dataclass(frozen=True, slots=True, kw_only=True)
class SinkStatistics:
    """A snapshot of one sink's counters.

    A transport's record extends it (`SocketSinkStatistics`,
    `ZmqSinkStatistics`): every field here, then the transport's own.
    """

    name: str
    policy: str
    #: Batches handed to the sink (offered), including those later dropped.
    batches_in: int
    batches_out: int
    events_out: int
    bytes_out: int
    batches_dropped: int
    events_dropped: int
    queued_batches: int
    #: What the queued and in-flight batches hold: their encoded bytes as
    #: allocated, plus a fixed cost per batch. The outbox is bounded by this.
    queued_bytes: int
    send_errors: int
    #: False while `write` is failing and being retried.
    healthy: bool
    #: Batches still queued or in flight when the sink was closed.
    undelivered_batches: int
    undelivered_events: int
    #: Events a strict codec left out of the batches it wrote for this sink
    #: (e.g. bytes hashes for Dynamo); logged once per burst.
    events_refused: int = 0


class DeliveryReport(NamedTuple):
    """What a sink could not deliver when it was drained."""

    name: str
    undelivered_batches: int
    undelivered_events: int
    #: The `(origin, epoch, seq)` of the first batch not delivered, if any.
    first_undelivered: tuple[str, str, int] | None

    @property
    def complete(self) -> bool:
        return self.undelivered_batches == 0


_NEW: Final = LifetimeState.NEW
_RUNNING: Final = LifetimeState.RUNNING
_CLOSING: Final = LifetimeState.CLOSING
_CLOSED: Final = LifetimeState.CLOSED


class Sink(TaskOwner, ABC):
    """Base class of every sink. Subclasses implement `write()`.

    `write()` (with `write_nowait()` and `write_many()`) is the transport hook:
    the sink's writer calls it. Batches enter the sink through its queue,
    `offer()` and `put()` (the scheduler calls these); calling `write()`
    yourself would bypass the outbox, its bounds and its counters.

    Use a sink as an async context manager (the scheduler does this for you): it
    opens the transport, runs the writer task, and on exit drains and closes.
    A sink takes batches only while it is entered: before, or after it closed,
    `offer()` and `put()` raise [`ClosedError`][kvstream.errors.ClosedError].
    """

    #: How many queued batches `write_many()` may receive at once. Sinks that
    #: can write several batches in one operation (a file) raise it. A hop also
    #: stops at 16 MiB of encoded bytes.
    max_coalesce: int = 1

    def __init__(
        self,
        *,
        codec: Codec | None = None,
        policy: OverflowPolicy = "block",
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_batches: int = DEFAULT_MAX_BATCHES,
        name: str | None = None,
        close_timeout: float = 5.0,
        retry_initial: float = 0.05,
        retry_max: float = 5.0,
    ) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
        if type(max_bytes) is not int or max_bytes <= 0:
            raise ConfigError(f"max_bytes: expected a positive int, got {max_bytes!r}")
        if type(max_batches) is not int or max_batches <= 0:
            raise ConfigError(f"max_batches: expected a positive int, got {max_batches!r}")
        if close_timeout < 0 or math.isnan(close_timeout):
            raise ConfigError(f"close_timeout: expected seconds >= 0, got {close_timeout!r}")
        if codec is not None and not isinstance(codec, Codec):
            raise ConfigError(
                f"codec: expected a Codec (encode, encode_screened, decode, decode_keyed), "
                f"got {type(codec).__name__}"
            )
        self.codec: Codec | None = codec
        self.policy: OverflowPolicy = policy
        if name is not None and type(name) is not str:
            raise ConfigError(f"{type(self).__name__}.name: expected a str, got {name!r:.80}")
        TaskOwner.__init__(self)
        self.name = name or type(self).__name__
        self.close_timeout = close_timeout
        self._backoff = Backoff(retry_initial, retry_max, where=f"{self.name}: retry")
        # A private encoding until a scheduler joins the sink to its group.
        self._encoding = SharedEncoding(codec)
        self._encoding.users = 1
        #: The queue the writer works through (`kvstream.sinks._outbox`).
        self._outbox = Outbox(max_batches, max_bytes)
        self._inline = type(self).write_nowait is not Sink.write_nowait
        self._writer_waiting: anyio.Event | None = None
        #: The sink's tasks (the writer; subclasses may start more). Closing cancels
        #: its scope, which the owner's `async with` body is not in (`open_task_group`).
        self._tg: TaskGroup | None = None
        #: The state's view the tick reads: True while RUNNING (offers are taken).
        self._accepting = False
        self._drain_report: DeliveryReport | None = None
        self._writer_started = False
        self._writer_done = anyio.Event()
        # counters
        self._batches_in = 0
        self._batches_out = 0
        self._batches_inline = 0
        self._events_out = 0
        self._bytes_out = 0
        self._batches_dropped = 0
        self._events_dropped = 0
        self._send_errors = 0
        self._healthy = True
        self._burst_errors = 0
        self._ended: str | None = None
        self._discarded: set[int] = set()
        self._events_refused = 0
        # Logged once per burst (kvstream._burst_log): drops end when the outbox
        # drains, refusals with the first batch the codec took whole, write
        # failures when a write succeeds again.
        self._drop_log = BurstLog(log, math.inf)
        self._refuse_log = BurstLog(log, math.inf)
        self._write_log = BurstLog(log, math.inf)

    # -- what a sink author writes ------------------------------------------------

    async def open(self) -> None:
        """Acquire the transport (connect, open a file, bind). Called on enter."""

    @abstractmethod
    async def write(self, data: bytes, batch: EventBatch) -> None:
        """Write one encoded batch to the transport.

        `data` is `batch` encoded by `codec` (`b""` when the sink has no
        codec and hands over objects). Raise to signal failure: the same batch is
        retried after a backoff and `recover()`.
        """

    def write_nowait(self, data: bytes, batch: EventBatch) -> bool:
        """Write one encoded batch now if the transport takes it without waiting.

        Optional. Called on the scheduler's tick, only when nothing is queued or
        in flight ahead of `batch`, so order is kept. Return True when the batch
        was written (or given up with `discard()`), False when writing it
        would have to wait: the batch then goes to the outbox and `write()`
        writes it. Write all of it or none of it; raising counts as a failed
        attempt and leaves the batch to `write()`. Keep it short and never
        block: it runs on the host's tick.
        """
        return False

    async def write_many(self, items: Sequence[tuple[bytes, EventBatch]]) -> None:
        """Write several batches at once (up to `max_coalesce`).

        Overrides must write all of `items` or raise having written none of
        them, so that a retry neither loses nor repeats a batch.
        """
        for data, batch in items:
            await self.write(data, batch)

    async def recover(self, exc: Exception) -> None:
        """Called after `write` raised `exc`, before the retry: reconnect here."""

    def final_error(self, exc: Exception) -> str | None:
        """Why nothing can ever be delivered after `write` raised `exc`, or None (optional hook).

        None (the default): the write is retried. A reason (a pipe whose reader
        went away): the writer stops, `ended` holds the reason, and what is
        queued, and what is offered after, is reported undelivered at close
        (the tick still waits for room under the `block` policy).
        """
        return None

    @property
    def ended(self) -> str | None:
        """Why the sink can deliver nothing more (see `final_error()`); None while it can."""
        return self._ended

    def opens_later(self, exc: TransportError) -> bool:
        """Whether the sink enters although `open()` raised `exc` (optional hook).

        True for a server that could not be reached (not up yet, say): the sink
        enters unhealthy, its batches wait in the outbox under its policy, and
        the writer's retries (backoff, then `recover()`, which must then open the
        transport) connect it once the server is there. The other sinks of the
        scheduler are not held up. Default: False, every failure fails the entry.
        """
        return False

    async def aclose(self) -> None:
        """Drain what is queued (within `close_timeout`), stop the writer.

        Idempotent. Subclasses that hold a transport override it and call
        `await super().aclose()` first, then release the transport (in a
        `finally`, so it is released even when draining fails).
        """
        if self._state is _CLOSED:
            return
        if self._state is not _NEW:  # a sink closed unentered stays NEW: "never entered"
            self._set_state(_CLOSED)
        try:
            if self._drain_report is None:
                await self.drain(self.close_timeout)
        finally:
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
                if self._writer_started:
                    # A send running in a worker thread is not interrupted by the
                    # cancellation: wait for it before subclasses release the transport.
                    with anyio.CancelScope(shield=True):
                        await self._writer_done.wait()

    # -- lifetime ---------------------------------------------------------------

    def _set_state(self, state: LifetimeState) -> None:
        self._state = state
        self._accepting = state is _RUNNING

    def reentry_error(self) -> ClosedError:
        return ClosedError(f"{self.name}: a sink can be entered only once")

    async def open_lifetime(self, stack: AsyncExitStack) -> None:
        """Open the transport, start the writer and the sink's own tasks.

        Subclasses write `open()`, `enter_contexts()` and `start_tasks()`
        instead. On exit the stack runs `aclose()` (shielded), then exits what
        `enter_contexts()` entered, then ends the sink's tasks.
        """
        if self._drain_report is not None:
            raise ClosedError(f"{self.name}: the sink was closed before it was entered")
        try:
            await self.open()
        except TransportError as exc:
            if not self.opens_later(exc):
                raise
            # Faults stay local: this sink waits for its server, the others go on.
            self._count_failed_attempt()
            log.warning(
                "%s: %s; entered without it: batches wait in the outbox (policy %s) "
                "while it tries again with backoff",
                self.name,
                exc,
                self.policy,
            )
        try:
            tg = self._tg = await open_task_group(stack, f"kvstream sink {self.name}")
            await self.enter_contexts(stack)
            tg.start_soon(self._writer, name=f"kvstream sink writer {self.name}")
            self.start_tasks(tg)
        except BaseException:
            await _shielded_aclose(self)
            raise
        stack.push_async_callback(_shielded_aclose, self)

    async def enter_contexts(self, stack: AsyncExitStack) -> None:
        """Enter what the sink holds until it closes, on `stack` (optional hook).

        Called once as the sink is entered, after `open()`, before the writer
        starts: a task group of the sink's own that must outlive the writer
        (`kvstream.lifetime.open_task_group(stack, name)`), a connection, a
        cleanup (`stack.push_async_callback(...)`). All of it is exited, in
        reverse order, after `aclose()` returned.
        """

    def start_tasks(self, tg: TaskGroup) -> None:
        """Start the sink's own background tasks in `tg` (optional hook).

        Called once as the sink is entered, after `open()` and the writer. `tg` is
        the sink's task group: it is cancelled when the sink closes, after what
        was queued has been delivered. A sink with tasks of its own overrides
        this (or `enter_contexts()`), never `__aenter__` or `__aexit__`.
        """

    # -- encoding -----------------------------------------------------------------

    @property
    def encoding(self) -> SharedEncoding:
        """Where this sink's batches are encoded (shared within a scheduler's group)."""
        return self._encoding

    def use_encoding(self, encoding: SharedEncoding) -> None:
        """Take batches' bytes from `encoding` (a scheduler's group calls this).

        Only before the sink is entered, and only for an encoding of an equal codec.
        """
        if self._state is not _NEW:
            raise ClosedError(
                f"{self.name}: the sink is already running (entered on its own, or by "
                "another scheduler); a sink serves one scheduler, from before it starts"
            )
        if encoding.codec != self.codec:
            raise ConfigError(
                f"{self.name}: use_encoding: expected an encoding of {self.codec!r}, "
                f"got one of {encoding.codec!r}"
            )
        if encoding is not self._encoding:
            self._encoding.users -= 1
            self._encoding = encoding
            encoding.users += 1

    # -- the tick's side ----------------------------------------------------------

    def _refusal(self, what: str) -> ClosedError:
        if self._state is _NEW:
            return ClosedError(
                f"{self.name}: {what}: the sink was never entered; use it as "
                "`async with sink:` or give it to a Scheduler (which enters it)"
            )
        if self._state is _CLOSING or self._state is _CLOSED:
            return ClosedError(f"{self.name}: {what}: the sink is closed")
        return ClosedError(f"{self.name}: {what}: the sink is still opening")

    def offer(self, batch: EventBatch, *, force: bool = False) -> bool:
        """Take `batch` without waiting: write it now, or queue it for the writer.

        The batch is encoded here (once per codec within a scheduler). Returns
        False only when the outbox is full and the policy is `block`: the
        caller then awaits `put()`. With a `drop_*` policy it always
        returns True (dropping and counting what the policy says). `force=True`
        queues a batch past the bounds of a full `block` outbox: the scheduler
        does this for the last batches it seals when closing, which
        `drain()` then delivers or reports.
        """
        if not self._accepting:
            raise self._refusal("offer")
        try:
            data, refused, cost = self._encoding.encode(batch)
        except Exception as exc:
            # Deterministic: retrying cannot help. Count it as a drop, loudly.
            log.error(
                "%s: cannot encode batch %s/%s seq %d (%s); dropped",
                self.name,
                batch.origin,
                batch.epoch,
                batch.seq,
                exc,
            )
            self._batches_in += 1
            self._batches_dropped += 1
            self._events_dropped += len(batch.events)
            return True
        outbox = self._outbox
        if self._inline and not outbox.entries and not outbox.inflight and self._healthy:
            try:
                written = self.write_nowait(data, batch)
            except Exception as exc:
                # Left to write(), which retries with backoff and recover().
                log.debug("%s: write_nowait failed (%s); queued", self.name, exc)
                written = False
            if written:
                self._batches_in += 1
                if refused or self._refuse_log.on:
                    self._note_refused(batch, refused)
                if self._discarded and id(batch) in self._discarded:
                    self._discarded.discard(id(batch))
                else:
                    self._batches_inline += 1
                    self._batches_out += 1
                    self._events_out += len(batch.events)
                    self._bytes_out += len(data)
                return True
        cost += _ENTRY_OVERHEAD
        if outbox.full_for(cost):
            policy = self.policy
            if policy == "block" and not force:
                return False
            self._batches_in += 1
            self._note_refused(batch, refused)
            if policy == "drop_newest":
                self._drop(batch)
                return True
            while policy == "drop_oldest" and outbox.entries and outbox.over(cost):
                self._drop(outbox.pop_oldest())
        else:
            self._batches_in += 1
            self._note_refused(batch, refused)
        outbox.push(batch, data, cost)
        waiting = self._writer_waiting
        if waiting is not None:
            self._writer_waiting = None
            waiting.set()
        return True

    def _note_refused(self, batch: EventBatch, refused: tuple[Refusal, ...]) -> None:
        if refused:
            self._count_refused(batch, refused)
        elif self._refuse_log.on:
            self._refuse_log.clear()

    async def put(self, batch: EventBatch) -> None:
        """Take `batch`, waiting for room when the policy is `block`.

        Cancelled while waiting, the batch was not taken (the scheduler keeps it
        and offers it again).
        """
        while not self.offer(batch):
            await self._outbox.wait_for_room()

    def _drop(self, batch: EventBatch) -> None:
        self._count_drop(
            batch,
            f"outbox full ({len(self._outbox.entries)} batches, "
            f"{self._outbox.queued_bytes} bytes), "
            f"policy {self.policy}",
        )

    def discard(self, batch: EventBatch, reason: str) -> None:
        """Count `batch` as dropped (never silently): logged once per burst.

        For sinks whose `write` finds a batch undeliverable for good (the
        consumer went away); the writer then moves on to the next batch and does
        not count this one as sent.
        """
        self._count_drop(batch, reason)
        self._discarded.add(id(batch))

    def count_missed(self, batch: EventBatch, reason: str) -> None:
        """Count a batch this sink was meant to get but never took, as dropped.

        The scheduler calls it for batches sealed after the sink was closed by its
        owner, so that every accepted event is delivered or counted by every sink.
        """
        self._batches_in += 1
        self._count_drop(batch, reason)

    def _count_drop(self, batch: EventBatch, reason: str) -> None:
        self._drop_log.log(
            "%s: dropping batches: %s (first: %s/%s seq %d)",
            self.name,
            reason,
            batch.origin,
            batch.epoch,
            batch.seq,
        )
        self._batches_dropped += 1
        self._events_dropped += len(batch.events)

    # -- the writer ---------------------------------------------------------------

    def _count_refused(self, batch: EventBatch, refused: tuple[Refusal, ...]) -> None:
        """The codec left events out of this batch: count them, log once per burst.

        (A strict profile's refusals, or events the codec cannot write.)
        """
        self._events_refused += len(refused)
        self._refuse_log.log(
            "%s: the codec refused %d event(s) of %s/%s seq %d "
            "(first: %s); the batch is sent without them",
            self.name,
            len(refused),
            batch.origin,
            batch.epoch,
            batch.seq,
            refused[0].reason,
        )

    def _take(self) -> list[tuple[bytes, EventBatch]]:
        """Pop the next hop: up to `max_coalesce` batches, 16 MiB at most (or one batch)."""
        items = self._outbox.take(self.max_coalesce)
        if not self._outbox.entries and self._drop_log.on:
            self._drop_log.clear()
            log.warning(
                "%s: outbox drained; %d batches (%d events) dropped so far",
                self.name,
                self._batches_dropped,
                self._events_dropped,
            )
        return items

    async def _writer(self) -> None:
        self._writer_started = True
        try:
            while self._drain_report is None:  # once reported, nothing more is sent
                if not self._outbox.entries:
                    if self._state is _CLOSING or self._state is _CLOSED:
                        return
                    event = self._writer_waiting = anyio.Event()
                    await event.wait()
                    continue
                items = self._take()
                try:
                    await self._deliver(items)
                except _Ended:
                    return  # what is in flight and queued stays pending, for drain()
                self._outbox.landed()
                # Free the encoded bytes before the next hop: the allocator then
                # reuses that memory instead of faulting in fresh pages.
                del items
        finally:
            self._writer_done.set()

    async def _deliver(self, items: list[tuple[bytes, EventBatch]]) -> None:
        backoff = self._backoff
        while True:
            if self._discarded:
                self._discarded.clear()
            try:
                if len(items) == 1:
                    await self.write(*items[0])
                else:
                    await self.write_many(items)
            except Exception as exc:
                self._count_failed_attempt()
                why = self.final_error(exc)
                if why is not None:
                    self._ended = why
                    log.warning(
                        "%s: %s; nothing more can be delivered (what is queued is reported "
                        "at close)",
                        self.name,
                        why,
                    )
                    raise _Ended from exc
                self._write_log.log(
                    "%s: send failed (%s: %s); retrying with backoff",
                    self.name,
                    type(exc).__name__,
                    exc,
                )
                await backoff.wait()
                try:
                    await self.recover(exc)
                except Exception as rexc:
                    log.debug("%s: recover failed: %s", self.name, rexc)
                continue
            if not self._healthy:
                self._healthy = True
                backoff.reset()
                self._write_log.clear()
                log.warning(
                    "%s: send recovered after %d failed attempts", self.name, self._burst_errors
                )
            discarded = self._discarded
            for data, batch in items:
                if discarded and id(batch) in discarded:
                    discarded.discard(id(batch))
                    continue
                self._batches_out += 1
                self._events_out += len(batch.events)
                self._bytes_out += len(data)
            return

    def _count_failed_attempt(self) -> None:
        """A send (or the opening) failed: unhealthy until one works again."""
        self._send_errors += 1
        if self._healthy:
            self._healthy = False
            self._burst_errors = 0
        self._burst_errors += 1

    # -- shutdown -----------------------------------------------------------------

    async def drain(self, timeout: float | None) -> DeliveryReport:
        """Stop accepting batches and deliver what is queued within `timeout`.

        Returns (and remembers) what could not be delivered. A sink that was never
        started delivers nothing and reports everything queued.
        """
        if self._drain_report is not None:
            return self._drain_report
        if self._state is LifetimeState.OPENING or self._state is _RUNNING:
            self._set_state(_CLOSING)
        waiting = self._writer_waiting
        if waiting is not None:
            self._writer_waiting = None
            waiting.set()
        if self._tg is not None:
            with anyio.move_on_after(timeout):
                await self._writer_done.wait()
            self._tg.cancel_scope.cancel()
        # The writer lands a hop only after its delivery succeeded: whatever is
        # still in flight (the writer was cancelled mid-send) was not delivered.
        pending = self._outbox.pending()
        n_events = sum(len(b.events) for b in pending)
        report = DeliveryReport(
            self.name, len(pending), n_events, pending[0].key if pending else None
        )
        if pending and self._ended is None:  # an ended sink said so when it ended
            log.error(
                "%s: %d batches (%d events) not delivered at close, first %s",
                self.name,
                len(pending),
                n_events,
                report.first_undelivered,
            )
        self._drain_report = report
        # Wake anyone blocked in put(): the sink is closed now.
        self._outbox.wake()
        return report

    # -- introspection --------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once the sink stopped taking batches (draining or closed)."""
        return self._state is _CLOSING or self._state is _CLOSED or self._drain_report is not None

    @property
    def batches_inline(self) -> int:
        """Batches written straight from the tick (`write_nowait()`), without
        waking the writer task; `statistics().batches_out` counts them too."""
        return self._batches_inline

    @property
    def max_batches(self) -> int:
        """The outbox's bound in batches."""
        return self._outbox.max_batches

    @property
    def max_bytes(self) -> int:
        """The outbox's bound in bytes (encoded, as allocated, plus a fixed cost per batch)."""
        return self._outbox.max_bytes

    @property
    def accepting(self) -> bool:
        """True while the sink takes batches (entered and not closing)."""
        return self._accepting

    def statistics(self) -> SinkStatistics:
        """The sink's counters; a transport returns a record that extends this one."""
        return SinkStatistics(**self._sink_fields())

    def _sink_fields(self) -> dict[str, Any]:
        """The `SinkStatistics` fields, for a transport's record to extend."""
        report = self._drain_report
        return {
            "name": self.name,
            "policy": self.policy,
            "batches_in": self._batches_in,
            "batches_out": self._batches_out,
            "events_out": self._events_out,
            "bytes_out": self._bytes_out,
            "batches_dropped": self._batches_dropped,
            "events_dropped": self._events_dropped,
            "queued_batches": len(self._outbox.entries),
            "queued_bytes": max(self._outbox.queued_bytes, 0),
            "send_errors": self._send_errors,
            "healthy": self._healthy,
            "undelivered_batches": report.undelivered_batches if report else 0,
            "undelivered_events": report.undelivered_events if report else 0,
            "events_refused": self._events_refused,
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} policy={self.policy}>"


class _Ended(Exception):
    """The writer's way out when `Sink.final_error()` gave a reason."""


async def _shielded_aclose(sink: Sink) -> None:
    with anyio.CancelScope(shield=True):
        await sink.aclose()


#: Convenience for sinks whose default is kvstream's own JSON lines.
def default_codec() -> Codec:
    return JsonCodec()
