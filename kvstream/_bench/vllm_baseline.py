"""A publisher that behaves as vLLM's `ZmqEventPublisher` does: the comparison's baseline.

Written from the behaviour of vLLM's `vllm/distributed/kv_events.py` (Aug
2026) and WIRE.md, not from its code:

* `publish(batch)`, called on the engine's (scheduler's) thread, stamps the
  publisher's data-parallel rank on a batch that has none and does a blocking
  `queue.put` on a bounded `queue.Queue` (`max_queue_size`);
* one thread owns the sockets, made in the process's shared ZMQ context
  (`zmq.Context.instance()`): each turn it polls the replay ROUTER without
  waiting (and serves a request: every buffered batch from the asked `seq`,
  then the end marker), takes a batch off the queue (`get` with a 0.1 s
  timeout), encodes it with a reused msgspec msgpack encoder, sends
  `[topic, seq (8 bytes), payload]` on a synchronous PUB and appends
  `(seq, payload)` to a ring of `buffer_steps` batches. An encode or send
  error drops the batch with its sequence number used;
* the PUB binds (`bind=None`: vLLM's rule, bind for `*`, `::`,
  `ipc://` and `inproc://`, else connect; the benchmarks bind on loopback), has a high-water
  mark of `hwm` messages and drops silently beyond it; shutdown waits up to a
  second, then closes with linger 0.

Events are vLLM's msgspec Structs, declared with vLLM's names, fields (those
WIRE.md lists; vLLM's Aug 2026 `storage_tier`, `source_node` and
`estimated_bandwidth_bps` are left out, so the payload is byte for byte the
msgpack codec's) and options (tagged maps, fields with a default omitted when
at it), unvalidated, as vLLM builds them. The benchmark converts kvstream's events to these before
timing (`to_vllm_batch()`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

from kvstream import events as kv
from kvstream.errors import MissingDependencyError

try:
    import zmq
except ImportError as exc:  # pragma: no cover - the zmq extra is missing
    raise MissingDependencyError.for_extra("pyzmq", "zmq", exc) from exc

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "VllmAllBlocksCleared",
    "VllmBlockRemoved",
    "VllmBlockStored",
    "VllmEventBatch",
    "VllmStylePublisher",
    "to_vllm_batch",
    "to_vllm_event",
]

log = logging.getLogger("kvstream.bench")

_END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base event: tagged with the class name, defaults omitted."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """`[ts, events, data_parallel_rank]` (array_like never shortens: always 3)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# The names earlier versions of this module used.
VllmBlockStored = BlockStored
VllmBlockRemoved = BlockRemoved
VllmAllBlocksCleared = AllBlocksCleared
VllmEventBatch = KVEventBatch


def to_vllm_event(event: kv.KVCacheEvent) -> Any:
    """The vLLM struct of a kvstream event (metadata is not on vLLM's wire)."""
    if type(event) is kv.BlockStored:
        return BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,  # type: ignore[arg-type]
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            locality=event.locality,
        )
    if type(event) is kv.BlockRemoved:
        return BlockRemoved(
            block_hashes=event.block_hashes,
            medium=event.medium,
            group_idx=event.group_idx,
            locality=event.locality,
        )
    if type(event) is kv.AllBlocksCleared:
        return AllBlocksCleared()
    raise TypeError(f"to_vllm_event: expected a KV cache event, got {event!r:.80}")


def to_vllm_batch(
    batch: kv.EventBatch, cache: dict[int, Any] | None = None, *, rank: bool = True
) -> KVEventBatch:
    """The vLLM batch of `batch`; `cache` shares structs of repeated events.

    `rank=False` leaves `data_parallel_rank` None, as vLLM's scheduler
    builds its batches (the publisher stamps its own).
    """
    events = []
    for e in batch.events:
        if cache is None:
            events.append(to_vllm_event(e))
            continue
        converted = cache.get(id(e))
        if converted is None:
            converted = cache[id(e)] = to_vllm_event(e)
        events.append(converted)
    return KVEventBatch(
        ts=batch.ts, events=events, data_parallel_rank=batch.data_parallel_rank if rank else None
    )


class VllmStylePublisher:
    """vLLM's publisher, as it behaves (see the module doc): a queue, a thread, PUB + ROUTER."""

    SHUTDOWN_TIMEOUT = 1.0

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        data_parallel_rank: int = 0,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        buffer_steps: int = 10_000,
        bind: bool | None = True,
    ) -> None:
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        if bind is None:
            bind = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc:", "inproc:"))
        if bind:
            # The last run's socket, closed in the shared context, frees its port
            # a moment later (the context's reaper closes it): retry briefly.
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    self._pub.bind(endpoint)
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                        self._pub.close(linger=0)
                        raise
                    time.sleep(0.01)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._running = True
        self.sent_batches = 0
        self.sent_events = 0
        self.errors = 0
        self._target = 0
        self._reached = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-style publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """On the engine's thread: stamp the rank if the batch has none, blocking put."""
        if not self._running:
            raise RuntimeError("Publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        self._queue.put(batch)

    def expect(self, events: int) -> None:
        """Arm `wait_sent()` for `events` more events (the benchmark's end marker)."""
        self._reached.clear()
        self._target = self.sent_events + events

    def wait_sent(self, timeout: float | None = None) -> bool:
        """Block until the events armed with `expect()` have been sent."""
        return self._reached.wait(timeout)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        pub = self._pub
        replay = self._replay
        topic = self._topic
        ring = self._ring
        q = self._queue
        while self._running or q.qsize() > 0:
            if replay is not None and replay.poll(0):
                try:
                    self._serve_replay(replay)
                except Exception:
                    log.exception("vllm-style publisher: replay failed")
            try:
                batch = q.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                break
            seq = self._seq
            self._seq += 1
            try:
                payload = encoder.encode(batch)
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                ring.append((seq, payload))
                q.task_done()
            except Exception as exc:  # vLLM drops the batch, its seq used
                self.errors += 1
                log.error("vllm-style publisher: batch %d dropped: %s", seq, exc)
                time.sleep(0.1)
            else:
                self.sent_batches += 1
                self.sent_events += len(batch.events)
                if self._target and self.sent_events >= self._target:
                    self._reached.set()

    def _serve_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._ring):
            if seq >= first:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", _END_SEQ, b""))

    def close(self) -> None:
        """Stop: wait up to a second for the queue and the thread, then close with linger 0."""
        self._running = False
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        deadline = time.monotonic() + self.SHUTDOWN_TIMEOUT
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        # The context is the process's: other sockets may use it (as vLLM leaves it).
