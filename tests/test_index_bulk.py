"""The bulk paths of `apply` (a batch's stores and removals gathered, entered in a few
vectorized passes) leave the index exactly as applying each event on its own does.

The oracle is the same index with a `max_blocks` bound it never reaches: with an LRU
to keep in order, every event takes the one-at-a-time path.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream import PrefixIndex
from kvstream.events import BlockRemoved, BlockStored, EventBatch, KVCacheEvent
from kvstream.sim import SimulatedEngine, Workload

B = 4


def _stirred(events: list[KVCacheEvent], rng: random.Random) -> list[KVCacheEvent]:
    """The engine's events, with the unusual ones a batch may hold mixed in: a store
    again (same or other tier), a placeholder, a removal repeated or of an unknown block,
    a block moved to another tier (stored there, removed here)."""
    out: list[KVCacheEvent] = []
    for e in events:
        out.append(e)
        roll = rng.random()
        if isinstance(e, BlockStored) and e.block_hashes:
            if roll < 0.1:
                out.append(e)  # stored again on the same tier: extra references
            elif roll < 0.2:
                out.append(
                    BlockStored(
                        block_hashes=e.block_hashes,
                        parent_block_hash=e.parent_block_hash,
                        token_ids=e.token_ids,
                        block_size=e.block_size,
                        medium="DISK",
                    )
                )
            elif roll < 0.3:
                out.append(
                    BlockStored(
                        block_hashes=e.block_hashes[: rng.randint(1, len(e.block_hashes))],
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=0,
                        medium="CPU",
                    )
                )
            elif roll < 0.35:
                moved = e.block_hashes[-rng.randint(1, len(e.block_hashes)) :]
                out.append(
                    BlockStored(
                        block_hashes=moved,
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=0,
                        medium="CPU",
                    )
                )
                out.append(BlockRemoved(block_hashes=moved, medium=e.medium))
        elif isinstance(e, BlockRemoved) and e.block_hashes:
            if roll < 0.1:
                out.append(e)  # removed twice: the second is unknown
            elif roll < 0.15:
                out.append(BlockRemoved(block_hashes=[*e.block_hashes, 10**15], medium="GPU"))
    if out and rng.random() < 0.1:
        rng.shuffle(out)  # parents after children: orphans
    return out


def _state(index: PrefixIndex) -> tuple[object, ...]:
    stats = index.statistics()._asdict()
    for volatile in ("memory_bytes", "evicted"):
        stats.pop(volatile)
    origins = {k: v._replace(idle_seconds=0.0) for k, v in stats.pop("origins").items()}
    streams = {
        key: (
            sorted(s.blocks.items()),
            sorted(s.dups.items()),
            list(s.recent.items()),
            sorted(s.orphans),
            s.held,
        )
        for key, s in index._streams.items()
    }
    return stats, origins, streams, sorted(index._nodes.items())


@settings(
    max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    seed=st.integers(0, 2**16),
    keep_removed=st.sampled_from([0, 3, 4096]),
    steps=st.integers(5, 40),
)
def test_bulk_apply_equals_one_event_at_a_time(seed: int, keep_removed: int, steps: int) -> None:
    rng = random.Random(seed)
    bulk = PrefixIndex(block_size=B, keep_removed=keep_removed)
    one = PrefixIndex(block_size=B, keep_removed=keep_removed, max_blocks=10**9)
    engines = [
        SimulatedEngine(
            seed=seed + i,
            block_size=B,
            gpu_blocks=rng.choice((16, 48)),
            cpu_blocks=rng.choice((32, 96)),
            remote_blocks=64,
            workload=Workload(seed=seed, block_size=B),
            origin=f"e{i}",
        )
        for i in range(2)
    ]
    for step in range(steps):
        for engine in engines:
            events = _stirred(engine.step_events(), rng)
            batch = EventBatch(seq=step, ts=0.0, events=events, origin=engine.origin, epoch="x")
            bulk.apply(batch)
            one.apply(batch)
            assert _state(bulk) == _state(one)
