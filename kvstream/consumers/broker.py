"""What the NATS and Redis subscribers share: lifetime, backoff, where to start, continuity.

Both read a broker that keeps history, one message per batch with the batch's
name beside its payload (:mod:`kvstream.wire.broker`). They differ in how they
connect, fetch and acknowledge; the rest is written here once:

* **where to start**: ``from_seq`` (an int, or ``{origin: seq}`` with ``"*"``
  for the others) skips, in the first epoch seen of each origin, the batches
  below it; then the :class:`~kvstream.consumers.base.SequenceTracker` drops
  repeats and reports gaps (:meth:`BrokerSubscriber._admit`);
* **backoff**: a failed read waits ``retry_initial`` seconds, doubling up to
  ``retry_max``, and an outage is logged twice: when it starts and when
  reading works again (:class:`Backoff`);
* **lifetime**: ``async with`` connects (a failure to start is raised as it
  is), iteration runs one reading generator, and :meth:`BrokerSubscriber.aclose`
  ends that generator (so it can acknowledge what was handed over) and closes
  the connection, even when the graceful part fails;
* the URL options every broker subscriber takes (:func:`reader_options`).
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, Generic, Self, TypedDict, TypeVar

import anyio

from kvstream.codecs.base import Codec
from kvstream.consumers.base import Continuity, SequenceTracker, Subscriber, SubscriberItem
from kvstream.consumers.socket import SnapshotBatch
from kvstream.errors import ClosedError
from kvstream.events import EventBatch
from kvstream.wire.broker import FromSeq, PayloadDecoder, check_from_seq, start_seq

if TYPE_CHECKING:
    from kvstream.config import Options

__all__ = ["Backoff", "BrokerSubscriber", "ReaderOptions", "as_snapshot_batch", "reader_options"]

log = logging.getLogger("kvstream.consumers")

ClientT = TypeVar("ClientT")


class ReaderOptions(TypedDict, total=False):
    """The keyword arguments every broker subscriber takes (see :class:`BrokerSubscriber`)."""

    follow: bool
    from_seq: FromSeq
    codec: Codec | None
    connect_timeout: float
    retry_initial: float
    retry_max: float


class Backoff:
    """Waits between failed attempts: ``initial`` seconds, doubling up to ``maximum``.

    The first failure of an outage is logged at WARNING (``<where>: <error>;
    <retrying> with backoff``), the ones after it are only counted, and the
    first success after them logs how many attempts failed.
    """

    __slots__ = ("delay", "failures", "initial", "maximum", "retrying", "where")

    def __init__(self, initial: float, maximum: float, where: str, retrying: str) -> None:
        self.initial = initial
        self.maximum = maximum
        self.where = where
        self.retrying = retrying
        self.delay = initial
        #: Failed attempts since the last success.
        self.failures = 0

    async def wait(self, exc: Exception) -> None:
        """Count the failure ``exc`` and sleep before the next attempt."""
        if self.failures == 0:
            log.warning("%s: %s; %s with backoff", self.where, exc, self.retrying)
        self.failures += 1
        await anyio.sleep(self.delay)
        self.delay = min(self.delay * 2, self.maximum)

    def succeeded(self) -> None:
        """An attempt worked: the next failure starts a new outage."""
        if self.failures:
            log.warning("%s: reading again after %d failed attempts", self.where, self.failures)
            self.failures = 0
            self.delay = self.initial


class BrokerSubscriber(Subscriber, Generic[ClientT]):
    """The broker-independent part of :class:`~kvstream.consumers.nats.NatsSubscriber`
    and :class:`~kvstream.consumers.redis.RedisSubscriber`.

    ``url`` is what the client connects to, ``shown`` the same without
    credentials (for messages). ``follow=False`` stops once the subscriber has
    caught up. ``codec`` decodes messages that do not name their codec
    (default JSON). See the module doc for ``from_seq``, ``retry_initial`` and
    ``retry_max``.

    A subclass connects in :meth:`_connect` (setting ``_client``), closes in
    :meth:`_disconnect`, and reads in :meth:`_read`, an async generator that
    turns each decoded batch into items with :meth:`_admit`.
    """

    def __init__(
        self,
        url: str,
        shown: str,
        *,
        follow: bool = True,
        from_seq: FromSeq = None,
        codec: Codec | None = None,
        connect_timeout: float = 5.0,
        retry_initial: float = 0.05,
        retry_max: float = 5.0,
    ) -> None:
        self.url = url
        self.shown = shown
        self.follow = follow
        self.from_seq = check_from_seq(from_seq, shown)
        self.decoder = PayloadDecoder(codec)
        self.connect_timeout = connect_timeout
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self.tracker = SequenceTracker()
        self._client: ClientT | None = None
        self._gen: AsyncGenerator[SubscriberItem, None] | None = None
        self._closed = False

    # -- what a broker provides ---------------------------------------------------------

    @abstractmethod
    async def _connect(self) -> None:
        """Connect and set ``_client``; raise a :class:`KVStreamError` on failure."""

    @abstractmethod
    async def _disconnect(self) -> None:
        """Forget ``_client`` (and what hangs on it) and close it, without raising."""

    @abstractmethod
    def _read(self) -> AsyncGenerator[SubscriberItem, None]:
        """The items, in stream order; the generator :meth:`__aiter__` returns."""

    def _interrupt(self) -> None:
        """Stop a wait another task may be in, at :meth:`aclose` (by default nothing)."""

    # -- lifetime -----------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._closed:
            raise ClosedError(f"{self!r}: the subscriber is closed")
        if self._client is None:
            await self._connect()
        return self

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._interrupt()
        gen, self._gen = self._gen, None
        with anyio.CancelScope(shield=True):
            try:
                if gen is not None:
                    try:
                        await gen.aclose()
                    except RuntimeError:  # being iterated in another task: it sees _closed
                        pass
            finally:
                await self._disconnect()

    def __aiter__(self) -> AsyncIterator[SubscriberItem]:
        if self._closed:
            raise ClosedError(f"{self!r}: the subscriber is closed")
        if self._gen is None:
            self._gen = self._read()
        return self._gen

    def _stopping(self) -> bool:
        return self._closed  # a call, so that type checkers do not assume it unchanged

    def _backoff(self, retrying: str) -> Backoff:
        """A fresh :class:`Backoff` for one reading loop."""
        return Backoff(self._retry_initial, self._retry_max, self.shown, retrying)

    # -- from a decoded batch to items --------------------------------------------------

    def _admit(self, batch: EventBatch) -> list[SubscriberItem]:
        """``batch`` and the gap before it, if any; [] when it is skipped or a repeat."""
        if self.from_seq is not None and self.tracker.position(batch.origin) is None:
            first = start_seq(self.from_seq, batch.origin)
            if first is not None and batch.seq < first:
                return []
        state, gap = self.tracker.check(batch)
        if state is Continuity.DUPLICATE:
            return []
        return [gap, batch] if gap is not None else [batch]


def as_snapshot_batch(batch: EventBatch, first_missing: int) -> SnapshotBatch:
    """``batch`` (a snapshot encoded as the batch ``resume_seq - 1``) as a :class:`SnapshotBatch`.

    One snapshot type for every transport: the socket subscriber's.
    """
    snap = SnapshotBatch._trusted(
        batch.seq, batch.ts, batch.events, batch.data_parallel_rank, batch.origin, batch.epoch
    )
    assert isinstance(snap, SnapshotBatch)
    snap.first_missing = first_missing
    return snap


def reader_options(opts: Options, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the URL options every broker subscriber takes.

    ``codec`` (and that codec's own options), ``follow``, ``from_seq`` and
    ``connect_timeout``; a URL's value wins over the caller's.
    """
    from kvstream.config import make_codec

    codec_name = opts.pop_str("codec")
    if codec_name is not None:
        kwargs["codec"] = make_codec(codec_name, opts)
    kwargs["follow"] = opts.pop_bool("follow", kwargs.pop("follow", True))
    kwargs["from_seq"] = opts.pop_int("from_seq", kwargs.pop("from_seq", None))
    timeout = opts.pop_float("connect_timeout", kwargs.pop("connect_timeout", 5.0))
    kwargs["connect_timeout"] = timeout or 5.0
    return kwargs
