"""The bulk paths of `apply` (a batch's stores and removals gathered, entered in a few
vectorized passes) leave the index exactly as applying each event on its own does.

The oracle is the same index with a `max_blocks` bound it never reaches: with an LRU
to keep in order, every event takes the one-at-a-time path.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream import PrefixIndex
from kvstream.events import BlockHash, BlockRemoved, BlockStored, EventBatch, KVCacheEvent
from kvstream.sim import SimulatedEngine, Workload

B = 4


def _placeholder(hashes: list[BlockHash], medium: str) -> BlockStored:
    """A store without tokens: blocks the stream holds, now on `medium` too."""
    return BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=0, medium=medium
    )


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


def _store_batches(rng: random.Random, batches: int) -> list[list[KVCacheEvent]]:
    """Batches of stores as the whole-batch path sees them, with what makes it step aside
    mixed in (more in some batches than in others).

    Stores chain on the previous store, on a block of an earlier batch, on a removed block
    (`recent`), on a block in the middle of this batch, on an unknown one, or on the
    previous store's last block named with other high bits. Placeholders name the store
    before (on its tier too), earlier blocks or unknown ones. Also: a block stored again,
    a new tier, an adapter, a store of twice the block size, one with more token blocks
    than hashes, empty stores; now and then a batch of removals."""
    out: list[list[KVCacheEvent]] = []
    known: list[BlockHash] = []
    next_hash = 1
    for _ in range(batches):
        events: list[KVCacheEvent] = []
        if known and rng.random() < 0.2:
            gone = rng.sample(known, min(len(known), rng.randint(1, 6)))
            events.append(BlockRemoved(block_hashes=gone, medium="GPU"))
            out.append(events)
            continue
        mess = rng.choice([0.0, 0.0, 0.3, 1.0])  # how often the unusual comes
        last: list[BlockHash] | None = None
        this_batch: list[BlockHash] = []
        for _ in range(rng.randint(1, 8)):
            roll = rng.random()
            if last and roll < 0.2:  # the store just before, on another tier
                medium = rng.choice(["CPU", "CPU", "DISK", "GPU"])
                events.append(_placeholder(last if rng.random() < 0.5 else list(last), medium))
                continue
            if known and roll < 0.2 + 0.1 * mess:  # blocks of earlier batches (some gone)
                held = rng.sample(known, min(len(known), rng.randint(1, 3)))
                if rng.random() < 0.2:
                    held.append(10**12 + rng.randint(0, 9))
                events.append(_placeholder(held, "CPU"))
                continue
            pick = rng.random()
            parent: BlockHash | None
            if last and (pick < 0.55 or not mess):
                parent = last[-1]
                if rng.random() < 0.05:
                    parent = int(parent) + (1 << 60)  # the same block to the index (60 bits)
            elif known and pick < 0.8:
                parent = rng.choice(known)
            elif pick < 0.88:
                parent = None
            elif this_batch and pick < 0.94:
                parent = rng.choice(this_batch)
            else:
                parent = 10**13 + rng.randint(0, 9)
            m = rng.choice([1, 2, 3, 3, 0 if rng.random() < mess else 3])
            hashes: list[BlockHash] = list(range(next_hash, next_hash + m))
            next_hash += m
            if known and hashes and rng.random() < 0.08 * mess + 0.04:
                hashes[0] = rng.choice(known)  # a block stored again (or gone before)
            size = 2 * B if rng.random() < 0.05 * mess else B
            tokens = [rng.randrange(40) for _ in range(m * size)]
            if tokens and rng.random() < 0.04 * mess:
                tokens += tokens[:size]  # a block more than hashes (skipped null blocks)
            events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=size,
                    medium=rng.choice(["GPU"] * 8 + ["CPU", "NVME"])
                    if rng.random() < mess
                    else "GPU",
                    lora_name="L" if rng.random() < 0.1 * mess else None,
                )
            )
            if hashes:
                last = hashes
                this_batch += hashes
                known += hashes
        out.append(events)
    return out


@settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(seed=st.integers(0, 2**16), keep_removed=st.sampled_from([0, 4, 4096]))
def test_a_batch_of_stores_at_once_equals_one_event_at_a_time(seed: int, keep_removed: int) -> None:
    rng = random.Random(seed)
    bulk = PrefixIndex(block_size=B, keep_removed=keep_removed)
    one = PrefixIndex(block_size=B, keep_removed=keep_removed, max_blocks=10**9)
    for seq, events in enumerate(_store_batches(rng, rng.randint(3, 14))):
        batch = EventBatch(seq=seq, ts=0.0, events=events, origin="e", epoch="x")
        bulk.apply(batch)
        one.apply(batch)
        assert _state(bulk) == _state(one)
        prompt = [t for e in events if isinstance(e, BlockStored) for t in e.token_ids]
        assert bulk.match(prompt) == one.match(prompt)


class _Counted(PrefixIndex):
    """A `PrefixIndex` that records what each whole-batch attempt returned."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.taken: list[bool] = []

    def _defer_batch(self, *args: Any) -> bool:
        self.taken.append(super()._defer_batch(*args))
        return self.taken[-1]


def test_the_usual_batch_takes_the_whole_batch_path() -> None:
    """A batch of chained stores with a placeholder after one goes through
    `_defer_batch` whole, and ends as one event at a time would."""
    bulk = _Counted(block_size=B)
    one = PrefixIndex(block_size=B, max_blocks=10**9)
    rng = random.Random(7)
    parent: BlockHash | None = None
    for seq in range(3):
        events: list[KVCacheEvent] = []
        for k in range(4):
            hashes: list[BlockHash] = list(range(100 * seq + 10 * k + 1, 100 * seq + 10 * k + 4))
            events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=[rng.randrange(1000) for _ in range(3 * B)],
                    block_size=B,
                )
            )
            if k == 1:
                events.append(_placeholder(hashes, "CPU"))
            parent = hashes[-1]
        batch = EventBatch(seq=seq, ts=0.0, events=events, origin="e", epoch="x")
        bulk.apply(batch)
        one.apply(batch)
        assert _state(bulk) == _state(one)
    # the first batch's CPU placeholder names a tier not known yet: one at a time
    assert bulk.taken == [False, True, True]


def test_a_batch_the_whole_batch_path_leaves_to_one_event_at_a_time() -> None:
    """Tokens of 32 bits or more, and a block stored again after its removal (held in
    `recent`), send the batch the one-at-a-time way, with the same end."""
    bulk = _Counted(block_size=B, keep_removed=8)
    one = PrefixIndex(block_size=B, keep_removed=8, max_blocks=10**9)
    tokens = list(range(3 * B))

    def store(hashes: list[BlockHash], parent: BlockHash | None, toks: list[int]) -> BlockStored:
        return BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=toks, block_size=B
        )

    batches: list[list[KVCacheEvent]] = [
        [store([1, 2, 3], None, tokens)],  # a tier the index does not know yet
        [store([4, 5, 6], 3, tokens)],  # the usual batch: taken whole
        [store([7, 8, 9], 6, [2**32 + t for t in tokens])],  # wide tokens
        [BlockRemoved(block_hashes=[9], medium="GPU")],
        [store([9], 8, tokens[:B])],  # block 9 again, after its removal
    ]
    for seq, events in enumerate(batches):
        batch = EventBatch(seq=seq, ts=0.0, events=events, origin="e", epoch="x")
        bulk.apply(batch)
        one.apply(batch)
        assert _state(bulk) == _state(one)
    assert bulk.taken == [False, True, False, False, False]


def test_removals_naming_one_block_twice_end_as_one_at_a_time() -> None:
    """A removal naming one engine block twice, or naming two engine blocks of the same
    own block (the same tokens stored on two tiers under other hashes), leaves the index
    as the one taking every event alone leaves it."""
    bulk = PrefixIndex(block_size=B, keep_removed=8)
    one = PrefixIndex(block_size=B, keep_removed=8, max_blocks=10**9)
    tokens = list(range(2 * B))

    def store(hashes: list[BlockHash], medium: str = "GPU") -> BlockStored:
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=tokens,
            block_size=B,
            medium=medium,
        )

    batches: list[list[KVCacheEvent]] = [
        [store([1, 2])],
        [store([3, 4], "CPU")],  # the same blocks, on CPU, under other hashes
        [BlockRemoved(block_hashes=[2, 2], medium="GPU")],
        [BlockRemoved(block_hashes=[1, 3], medium="GPU")],
        [BlockRemoved(block_hashes=[3, 4], medium="CPU")],
    ]
    for seq, events in enumerate(batches):
        batch = EventBatch(seq=seq, ts=0.0, events=events, origin="e", epoch="x")
        bulk.apply(batch)
        one.apply(batch)
        assert _state(bulk) == _state(one)
