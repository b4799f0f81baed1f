"""A publisher built the way vLLM builds its KV-event publisher: the comparison's baseline.

Written from the description in WIRE.md ("vLLM's publisher, for comparison"),
not from vLLM's code:

* ``publish(batch)``, called on the engine's (scheduler's) thread, stamps the
  data-parallel rank and does a blocking ``queue.put`` on a bounded
  :class:`queue.Queue` (``max_queue_size``);
* one thread owns the PUB socket: it takes batches off the queue, encodes them
  with a reused msgspec msgpack encoder, sends ``[topic, seq (8 bytes), payload]``
  and appends ``(seq, payload)`` to a ring of ``buffer_steps`` batches. An encode
  or send error drops the batch with its sequence number used;
* the PUB socket has a high-water mark of ``hwm`` messages and drops silently
  beyond it; shutdown waits up to a second, then closes with linger 0.

Events are vLLM-style msgspec Structs (map profile: tagged maps, fields with a
default omitted when at it), unvalidated, as vLLM builds them. The benchmark
converts kvstream's events to these before timing (:func:`to_vllm_batch`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any

import msgspec

from kvstream.errors import MissingDependencyError
from kvstream.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVCacheEvent

try:
    import zmq
except ImportError as exc:  # pragma: no cover - the zmq extra is missing
    raise MissingDependencyError.for_extra("pyzmq", "zmq", exc) from exc

__all__ = [
    "VllmAllBlocksCleared",
    "VllmBlockRemoved",
    "VllmBlockStored",
    "VllmEventBatch",
    "VllmStylePublisher",
    "to_vllm_batch",
    "to_vllm_event",
]

log = logging.getLogger("kvstream.bench")


class VllmBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class VllmBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class VllmAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``[ts, events, data_parallel_rank]`` (array_like never shortens: always 3)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def to_vllm_event(event: KVCacheEvent) -> Any:
    """The vLLM-style struct of a kvstream event (metadata is not on vLLM's wire)."""
    if type(event) is BlockStored:
        return VllmBlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            locality=event.locality,
        )
    if type(event) is BlockRemoved:
        return VllmBlockRemoved(
            block_hashes=event.block_hashes,
            medium=event.medium,
            group_idx=event.group_idx,
            locality=event.locality,
        )
    if type(event) is AllBlocksCleared:
        return VllmAllBlocksCleared()
    raise TypeError(f"to_vllm_event: expected a KV cache event, got {event!r:.80}")


def to_vllm_batch(batch: EventBatch, cache: dict[int, Any] | None = None) -> VllmEventBatch:
    """The vLLM-style batch of ``batch``; ``cache`` shares structs of repeated events."""
    events = []
    for e in batch.events:
        if cache is None:
            events.append(to_vllm_event(e))
            continue
        converted = cache.get(id(e))
        if converted is None:
            converted = cache[id(e)] = to_vllm_event(e)
        events.append(converted)
    return VllmEventBatch(ts=batch.ts, events=events, data_parallel_rank=batch.data_parallel_rank)


class VllmStylePublisher:
    """vLLM's publisher design (see the module doc): a thread, a queue, a PUB socket."""

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        data_parallel_rank: int | None = 0,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        buffer_steps: int = 10_000,
    ) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.bind(endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._queue: queue.Queue[VllmEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._running = True
        self.sent_batches = 0
        self.sent_events = 0
        self.errors = 0
        self._target = 0
        self._reached = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-style publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: VllmEventBatch) -> None:
        """On the engine's thread: stamp the rank, blocking put."""
        if self._rank is not None:
            batch.data_parallel_rank = self._rank
        self._queue.put(batch)

    def expect(self, events: int) -> None:
        """Arm :meth:`wait_sent` for ``events`` more events (the benchmark's end marker)."""
        self._reached.clear()
        self._target = self.sent_events + events

    def wait_sent(self, timeout: float | None = None) -> bool:
        """Block until the events armed with :meth:`expect` have been sent."""
        return self._reached.wait(timeout)

    def _run(self) -> None:
        encode = self._encoder.encode
        send = self._pub.send_multipart
        topic = self._topic
        ring = self._ring
        while self._running or not self._queue.empty():
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                self._queue.task_done()
                break
            seq = self._seq
            self._seq += 1
            try:
                payload = encode(batch)
                send((topic, seq.to_bytes(8, "big"), payload))
                ring.append((seq, payload))
            except Exception as exc:  # vLLM drops the batch, its seq used
                self.errors += 1
                log.error("vllm-style publisher: batch %d dropped: %s", seq, exc)
            else:
                self.sent_batches += 1
                self.sent_events += len(batch.events)
                if self._target and self.sent_events >= self._target:
                    self._reached.set()
            self._queue.task_done()

    def close(self) -> None:
        """Stop: wait up to a second for the thread, then close with linger 0."""
        self._running = False
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=1.0)
        self._pub.close(linger=0)
        self._ctx.term()
