"""A drop-in for vLLM's ``EventPublisher``, backed by a kvstream pipeline.

For engines that cannot change their code path: vLLM's scheduler calls
``publisher.publish(batch)`` once per step from its own thread and
``publisher.shutdown()`` at exit. :class:`EventPublisher` has that shape. Behind
it a :class:`~kvstream.scheduler.Scheduler` runs on an event loop in a thread
of its own (an anyio blocking portal), so every kvstream sink
is available, and vLLM's wire is one of them::

    publisher = EventPublisher.from_kv_events_config(
        '{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}',
        data_parallel_rank=0,
    )
    publisher.publish(KVEventBatch(ts=time.time(), events=events))   # engine thread
    publisher.shutdown()

``publish`` validates and converts the events in the caller's thread (vLLM's
event structs, or kvstream's own events, are accepted), hands them to the loop
and schedules one tick, so one ``publish`` is one batch with the next ``seq``.
It never waits, except when more than 64 steps are still in flight, which
only a full sink with policy ``block`` causes: that is the backpressure that
policy asks for. An event that fails validation is dropped,
counted and logged; ``publish`` does not raise for it (vLLM drops a batch it
cannot encode), so a bad event never stops the engine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Final, NamedTuple

from anyio.from_thread import BlockingPortal, start_blocking_portal

from kvstream.errors import ClosedError, InvalidEventError, InvalidEventTypeError
from kvstream.events import EVENT_TYPES, KVCacheEvent
from kvstream.scheduler import Scheduler
from kvstream.sinks.base import Sink

__all__ = ["EventPublisher", "PublisherStatistics", "to_kvstream_event"]

log = logging.getLogger("kvstream.publisher")

#: Steps whose batch may still be on its way to the sinks before publish() waits.
MAX_PENDING_STEPS: Final = 64


class PublisherStatistics(NamedTuple):
    batches_published: int
    events_published: int
    #: Events dropped in ``publish`` because they failed validation.
    events_refused: int


def to_kvstream_event(event: object) -> KVCacheEvent:
    """A kvstream event from a vLLM-style event object (matched by class name and fields).

    kvstream events pass through unchanged. Raises
    :class:`~kvstream.errors.InvalidEventError` for anything else or an
    invalid field.
    """
    if isinstance(event, KVCacheEvent):
        return event
    name = type(event).__name__
    cls = EVENT_TYPES.get(name)
    if cls is None:
        raise InvalidEventTypeError(
            f"publish: expected a BlockStored, BlockRemoved or AllBlocksCleared event, got {name}"
        )
    fields = {
        field: getattr(event, field) for field in cls.__struct_fields__ if hasattr(event, field)
    }
    return cls(**fields)


class EventPublisher:
    """vLLM's ``EventPublisher`` shape (``publish``, ``shutdown``) over kvstream sinks.

    ``sinks``: sink objects or URLs (``zmq+tcp://*:5557?replay=tcp://*:5558``,
    ``file:kv.jsonl``, ...). ``origin`` names the engine (default: the host
    name), ``data_parallel_rank`` is stamped on every batch.
    """

    def __init__(
        self,
        sinks: Sequence[Sink | str],
        *,
        origin: str | None = None,
        data_parallel_rank: int | None = None,
        close_timeout: float = 5.0,
    ) -> None:
        from kvstream.config import open_sink

        codecs: dict[str, Any] = {}
        built = [open_sink(s, codecs=codecs) if isinstance(s, str) else s for s in sinks]
        self.scheduler = Scheduler(
            sinks=built,
            origin=origin,
            data_parallel_rank=data_parallel_rank,
            close_timeout=close_timeout,
        )
        self._stack = contextlib.ExitStack()
        try:
            portal = self._stack.enter_context(start_blocking_portal(backend="asyncio"))
            self._stack.enter_context(portal.wrap_async_context_manager(self.scheduler))
        except BaseException:
            self._stack.close()
            raise
        self._portal: BlockingPortal = portal
        self._pending: deque[concurrent.futures.Future[None]] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._batches = 0
        self._events = 0
        self._refused = 0
        self._refuse_burst = False

    @classmethod
    def from_kv_events_config(
        cls,
        config: str | dict[str, Any],
        *,
        data_parallel_rank: int | None = None,
        origin: str | None = None,
        sinks: Sequence[Sink | str] = (),
        **options: Any,
    ) -> EventPublisher:
        """A publisher on vLLM's ZMQ wire, configured as vLLM's ``--kv-events-config``.

        Endpoints are offset by ``data_parallel_rank`` as vLLM does; ``sinks``
        adds more destinations beside the ZMQ sink.
        """
        from kvstream.sinks.zmq import ZmqSink

        zmq_sink = ZmqSink.from_kv_events_config(config, data_parallel_rank=data_parallel_rank)
        return cls(
            [zmq_sink, *sinks], origin=origin, data_parallel_rank=data_parallel_rank, **options
        )

    def publish(self, events: object) -> None:
        """Publish one step's events as one batch (from the engine's thread).

        ``events``: a vLLM ``KVEventBatch`` (anything with ``.events``), or an
        iterable of events.
        """
        if self._closed:
            raise ClosedError("publish: the publisher is shut down")
        raw = getattr(events, "events", events)
        if not isinstance(raw, Iterable):
            raise InvalidEventTypeError(
                f"publish: expected a batch with .events or a list of events, "
                f"got {type(events).__name__}"
            )
        converted: list[KVCacheEvent] = []
        for i, event in enumerate(raw):
            try:
                converted.append(to_kvstream_event(event))
            except InvalidEventError as exc:
                self._refuse(i, exc)
        if not converted:
            return  # as vLLM: a step without events publishes no batch
        with self._lock:
            pending = self._pending
            while pending and pending[0].done():
                pending.popleft().result()  # surfaces a step that failed
            while len(pending) >= MAX_PENDING_STEPS:  # only a full `block` sink gets here
                pending.popleft().result()
            pending.append(self._portal.start_task_soon(self._step, converted))
            self._batches += 1
            self._events += len(converted)

    async def _step(self, events: list[KVCacheEvent]) -> None:
        # emit and tick in one task: this step's events, and only they, make its batch.
        self.scheduler.emit(events)
        await self.scheduler.tick()

    def _refuse(self, index: int, exc: InvalidEventError) -> None:
        self._refused += 1
        if not self._refuse_burst:
            self._refuse_burst = True
            log.error("publish: event %d dropped: %s", index, exc)

    def shutdown(self) -> None:
        """Deliver what is pending (within ``close_timeout``), close the sinks, stop the loop.

        Idempotent.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, deque()
        try:
            for future in pending:
                future.result()
        finally:
            self._stack.close()

    def statistics(self) -> PublisherStatistics:
        return PublisherStatistics(self._batches, self._events, self._refused)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
