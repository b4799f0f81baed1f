"""The benchmarks' workloads: realistic events, pre-built before anything is timed.

Two shapes (`event_pool()`'s `shape`):

* `"vllm"`, the main case: every event a `BlockStored` shaped as vLLM emits
  it from its block pool: 16 block hashes (the low 64 bits of chained sha256
  digests, as vLLM's default hashing gives), 256 token ids drawn uniformly from
  a 151,936-token vocabulary (Qwen's), `block_size` 16, `medium="GPU"`,
  `extra_keys=[None] * 16`, `group_idx=0` and
  `kv_cache_spec_kind="full_attention"`. Chains run for a few events, then a
  new request starts one at the root.
* `"mixed"`, the second case: events from the simulated engine
  (`kvstream.sim`): real chained block hashes, GPU evictions spilling to a
  CPU tier and a remote store. Every `BlockStored` run the engine makes is cut
  into events of exactly `blocks_per_event` blocks (shorter tails are left
  out) and every `BlockRemoved` is kept as the engine made it: stores and
  removals. Cutting runs breaks parent links, so it is a *shape* workload, not a
  stream a consistency checker would accept.

Benchmarks cycle through the pool (`chunks()`, `batches()`): the lists
are built up front and hold references to the pool's events, so generating the
workload is never timed and cycling it does not grow memory.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

from kvstream.errors import ConfigError
from kvstream.events import BlockRemoved, BlockStored, EventBatch, KVCacheEvent
from kvstream.sim import SimulatedEngine, Workload

__all__ = [
    "EPOCH",
    "ORIGIN",
    "VOCAB_SIZE",
    "PoolStats",
    "Shape",
    "batches",
    "chunks",
    "event_pool",
    "pool_stats",
    "sample_stored",
]

#: The origin and epoch every benchmark batch carries.
ORIGIN = "bench-0"
EPOCH = "0123456789abcdef"

#: The vocabulary token ids are drawn from (Qwen2's, 151,936 tokens).
VOCAB_SIZE: Final = 151_936
_U64: Final = (1 << 64) - 1

Shape: TypeAlias = Literal["vllm", "mixed"]

_POOLS: dict[tuple[str, int, int, int, int], list[KVCacheEvent]] = {}


def _vllm_pool(n_events: int, seed: int, blocks: int, block_size: int) -> list[KVCacheEvent]:
    rnd = random.Random(seed)
    vocab = range(VOCAB_SIZE)
    pool: list[KVCacheEvent] = []
    parent: int | None = None
    while len(pool) < n_events:
        if rnd.random() < 0.25:  # a new request: its chain starts at the root
            parent = None
        tokens = rnd.choices(vocab, k=blocks * block_size)
        hashes: list[int | bytes] = []
        prev = parent
        for b in range(blocks):
            block = tokens[b * block_size : (b + 1) * block_size]
            digest = hashlib.sha256(repr((prev, block)).encode()).digest()
            prev = int.from_bytes(digest, "big") & _U64
            hashes.append(prev)
        pool.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=block_size,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None] * blocks,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )
        parent = prev
    return pool


def _cut(event: BlockStored, blocks: int) -> Iterator[BlockStored]:
    hashes = event.block_hashes
    tokens = event.token_ids
    size = event.block_size
    parent = event.parent_block_hash
    for start in range(0, len(hashes) - blocks + 1, blocks):
        piece = hashes[start : start + blocks]
        yield BlockStored(
            block_hashes=list(piece),
            parent_block_hash=parent,
            token_ids=list(tokens[start * size : (start + blocks) * size]),
            block_size=size,
            medium=event.medium,
            lora_name=event.lora_name,
        )
        parent = piece[-1]


def event_pool(
    n_events: int = 8192,
    *,
    seed: int = 0,
    blocks_per_event: int = 16,
    block_size: int = 16,
    shape: Shape = "vllm",
) -> list[KVCacheEvent]:
    """`n_events` realistic events of `shape` (see the module doc); cached per arguments.

    Builds take about a second per 10k events (every block is hashed).
    """
    if n_events <= 0 or blocks_per_event <= 0 or block_size <= 0:
        raise ConfigError(
            f"event_pool: expected positive sizes, got n_events={n_events}, "
            f"blocks_per_event={blocks_per_event}, block_size={block_size}"
        )
    if shape not in ("vllm", "mixed"):
        raise ConfigError(f"event_pool: shape: expected 'vllm' or 'mixed', got {shape!r}")
    key = (shape, n_events, seed, blocks_per_event, block_size)
    pool = _POOLS.get(key)
    if pool is not None:
        return pool
    if shape == "vllm":
        pool = _POOLS[key] = _vllm_pool(n_events, seed, blocks_per_event, block_size)
        return pool
    # Long turns, so most runs of new blocks are at least one 16-block event long.
    workload = Workload(seed=seed, block_size=block_size, turn_tokens=(128, 512))
    engine = SimulatedEngine(
        seed=seed,
        block_size=block_size,
        workload=workload,
        gpu_blocks=2048,
        cpu_blocks=8192,
        remote_blocks=16384,
    )
    pool = []
    while len(pool) < n_events:
        for event in engine.step_events():
            if type(event) is BlockStored:
                pool.extend(_cut(event, blocks_per_event))
            elif type(event) is BlockRemoved:
                pool.append(event)
    del pool[n_events:]
    _POOLS[key] = pool
    return pool


def chunks(pool: list[KVCacheEvent], size: int, count: int, *, offset: int = 0) -> list[list[Any]]:
    """`count` lists of `size` events each, cycling through `pool` from `offset`."""
    if size <= 0 or count < 0:
        raise ConfigError(f"chunks: expected size > 0 and count >= 0, got {size}, {count}")
    cycle = itertools.cycle(pool)
    for _ in range(offset % len(pool)):
        next(cycle)
    return [list(itertools.islice(cycle, size)) for _ in range(count)]


def batches(
    pool: list[KVCacheEvent], size: int, count: int, *, ts: float = 1767225600.0
) -> list[EventBatch]:
    """`count` numbered batches of `size` events (what a tick would seal)."""
    return [
        EventBatch(seq=i, ts=ts + i * 0.001, events=events, origin=ORIGIN, epoch=EPOCH)
        for i, events in enumerate(chunks(pool, size, count))
    ]


def sample_stored(pool: list[KVCacheEvent]) -> BlockStored:
    """The first 16-block `BlockStored` of the pool (the single-event benchmarks' event)."""
    for event in pool:
        if type(event) is BlockStored:
            return event
    raise ConfigError("sample_stored: the pool holds no BlockStored event")


@dataclass(frozen=True)
class PoolStats:
    """What the pool is made of, for the report."""

    events: int
    stored: int
    removed: int
    blocks_per_stored: float
    tokens_per_stored: float
    hashes_per_removed: float

    def as_dict(self) -> dict[str, float]:
        return {
            "events": self.events,
            "stored": self.stored,
            "removed": self.removed,
            "blocks_per_stored": self.blocks_per_stored,
            "tokens_per_stored": self.tokens_per_stored,
            "hashes_per_removed": self.hashes_per_removed,
        }


def pool_stats(pool: list[KVCacheEvent]) -> PoolStats:
    stored = [e for e in pool if type(e) is BlockStored]
    removed = [e for e in pool if type(e) is BlockRemoved]
    return PoolStats(
        events=len(pool),
        stored=len(stored),
        removed=len(removed),
        blocks_per_stored=sum(len(e.block_hashes) for e in stored) / max(len(stored), 1),
        tokens_per_stored=sum(len(e.token_ids) for e in stored) / max(len(stored), 1),
        hashes_per_removed=sum(len(e.block_hashes) for e in removed) / max(len(removed), 1),
    )
