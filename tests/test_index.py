"""The prefix index against a brute-force reference, edge cases, and its HTTP endpoint."""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import tempfile
import threading
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import RedisServer, free_port, redis_servers

import kvstream
from kvstream import PrefixIndex, PrefixMatch
from kvstream.codecs.json import JsonCodec
from kvstream.consumers.base import Gap
from kvstream.errors import ConfigError
from kvstream.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)
from kvstream.index._hashing import BlockHasher
from kvstream.index._http import QueryServer
from kvstream.index._prefix import DEFAULT_TIER_WEIGHTS, TIER_PREFERENCE
from kvstream.sim import Request, SimulatedEngine, Workload
from kvstream.sinks.redis import RedisSink

__all__ = ["redis_servers"]  # a fixture, imported for pytest

B = 4  # block size of the hand-built tests

# -- the reference model -----------------------------------------------------------------------

#: one block of a prefix: (lora_name, extra key of the block, tokens)
Block = tuple[Any, Any, tuple[int, ...]]
Prefix = tuple[Block, ...]


def _freeze(value: Any) -> Any:
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


class _RefOrigin:
    def __init__(self, now: float = 0.0) -> None:
        self.epoch: str | None = None
        self.retired: list[str] = []
        self.next_seq = 0
        self.stale = False
        self.last_seen = now
        #: tier -> prefixes held, with multiplicity (the same block stored twice)
        self.held: dict[str, Counter[Prefix]] = {}
        #: engine hash -> the whole token prefix it stands for
        self.prefix_of: dict[Any, Prefix] = {}
        #: engine hash -> [parent engine hash, block, tiers]
        self.orphans: dict[Any, list[Any]] = {}

    def holds(self, prefix: Prefix) -> list[str]:
        return [t for t, c in self.held.items() if c[prefix] > 0]


RefKey = tuple[str, int | None]


class Reference:
    """The set of token prefixes each stream holds per tier, by brute force.

    Nothing hashed: a block is named by its whole token prefix. Mirrors the
    index's documented rules (streams per (origin, rank), refcounts, orphans,
    placeholders, stale streams, retired epochs, ttl, the max_blocks LRU);
    ``remember=True`` models an index whose ``keep_removed`` exceeds every block
    of the run (an engine hash once seen stays resolvable until a clear).
    """

    def __init__(
        self,
        block_size: int,
        *,
        remember: bool,
        ttl: float | None = None,
        max_blocks: int | None = None,
        clock: Any = None,
    ) -> None:
        self.block_size = block_size
        self.remember = remember
        self.ttl = ttl
        self.max_blocks = max_blocks
        self.clock = clock or (lambda: 0.0)
        self.next_expiry = self.clock() + (ttl or 0.0)
        self.origins: dict[RefKey, _RefOrigin] = {}
        self.tier_seen: list[str] = []
        #: (stream, engine hash) held on some tier, least recently stored first
        self.lru: dict[tuple[RefKey, Any], None] = {}
        self.evicted = 0

    def _origin(self, key: RefKey) -> _RefOrigin:
        if key not in self.origins:
            self.origins[key] = _RefOrigin(self.clock())
        return self.origins[key]

    def _tier(self, medium: str | None) -> str:
        name = medium or "GPU"
        if name not in self.tier_seen:
            self.tier_seen.append(name)
        return name

    def _clear(self, key: RefKey, o: _RefOrigin) -> None:
        o.held.clear()
        o.prefix_of.clear()
        o.orphans.clear()
        o.stale = False
        for k in [k for k in self.lru if k[0] == key]:
            del self.lru[k]

    def _touch(self, key: RefKey, h: Any) -> None:
        if self.max_blocks is not None:
            self.lru.pop((key, h), None)
            self.lru[(key, h)] = None

    def _evict(self) -> None:
        if self.max_blocks is None:
            return
        while len(self.lru) > self.max_blocks:
            key, h = next(iter(self.lru))
            del self.lru[(key, h)]
            o = self.origins[key]
            prefix = o.prefix_of.pop(h)
            for counter in o.held.values():
                counter[prefix] = 0
            self.evicted += 1

    def expire_due(self) -> None:
        if self.ttl is None:
            return
        now = self.clock()
        if now < self.next_expiry:
            return
        self.next_expiry = now + min(self.ttl, 1.0)
        for key in [k for k, o in self.origins.items() if o.last_seen < now - self.ttl]:
            self._clear(key, self.origins[key])
            del self.origins[key]

    def heartbeat(self, key: RefKey) -> None:
        if key in self.origins:
            self.origins[key].last_seen = self.clock()

    def apply(self, item: EventBatch | Gap) -> None:
        self.expire_due()
        if isinstance(item, Gap):
            keys = [k for k in self.origins if k[0] == item.origin] or [(item.origin, None)]
            for key in keys:
                o = self._origin(key)
                if o.epoch != item.epoch and item.epoch in o.retired:
                    continue
                if o.epoch != item.epoch:
                    if o.epoch is not None:
                        o.retired.append(o.epoch)
                    self._clear(key, o)
                    o.epoch = item.epoch
                    o.next_seq = item.next_seq
                else:
                    o.next_seq = max(o.next_seq, item.next_seq)
                o.stale = True
            return
        key = (item.origin, item.data_parallel_rank)
        o = self._origin(key)
        if o.epoch != item.epoch:
            if item.epoch in o.retired:
                return
            if o.epoch is not None:
                o.retired.append(o.epoch)
            self._clear(key, o)
            o.epoch = item.epoch
            o.stale = item.seq != 0
        elif item.seq < o.next_seq:
            return
        elif item.seq > o.next_seq:
            o.stale = True
        o.next_seq = item.seq + 1
        o.last_seen = self.clock()
        for event in item.events:
            if isinstance(event, BlockStored):
                self._store(key, o, event)
                self._evict()
            elif isinstance(event, BlockRemoved):
                self._remove(key, o, event)
            else:
                self._clear(key, o)

    def _store(self, key: RefKey, o: _RefOrigin, event: BlockStored) -> None:
        if not event.block_hashes:
            return
        tier = self._tier(event.medium)
        if not event.token_ids:
            for h in event.block_hashes:
                prefix = o.prefix_of.get(h)
                if prefix is not None:
                    o.held.setdefault(tier, Counter())[prefix] += 1
                    self._touch(key, h)
                elif h in o.orphans:
                    o.orphans[h][2].append(tier)
            return
        if event.block_size != self.block_size:
            return
        size = self.block_size
        parent = event.parent_block_hash
        prev: Prefix | None = () if parent is None else o.prefix_of.get(parent)
        prev_h = parent
        for i, h in enumerate(event.block_hashes):
            extra = _freeze(event.extra_keys[i]) if event.extra_keys is not None else None
            if (
                extra is not None
                and event.lora_name is not None
                and extra[:1] == (event.lora_name,)
            ):
                extra = extra[1:] or None
            block: Block = (
                event.lora_name,
                extra or None,
                tuple(event.token_ids[i * size : (i + 1) * size]),
            )
            prefix = o.prefix_of.get(h)
            fresh = False
            if prefix is None and prev is not None:
                prefix = (*prev, block)
                o.prefix_of[h] = prefix
                self._touch(key, h)
                self._resolve(key, o, h, prefix)
                fresh = True
            if prefix is None:
                if h in o.orphans:
                    o.orphans[h][2].append(tier)
                else:
                    o.orphans[h] = [prev_h, block, [tier]]
            else:
                if not fresh:
                    self._touch(key, h)
                o.held.setdefault(tier, Counter())[prefix] += 1
            prev, prev_h = prefix, h

    def _resolve(self, key: RefKey, o: _RefOrigin, h: Any, prefix: Prefix) -> None:
        record = o.orphans.pop(h, None)
        if record is not None:
            for tier in record[2]:
                o.held.setdefault(tier, Counter())[prefix] += 1
        for child, (parent, block, tiers) in list(o.orphans.items()):
            if parent == h and child in o.orphans:
                del o.orphans[child]
                child_prefix = (*prefix, block)
                o.prefix_of[child] = child_prefix
                self._touch(key, child)
                for tier in tiers:
                    o.held.setdefault(tier, Counter())[child_prefix] += 1
                self._resolve(key, o, child, child_prefix)

    def _remove(self, key: RefKey, o: _RefOrigin, event: BlockRemoved) -> None:
        if not event.block_hashes:
            return
        tier = self._tier(event.medium)
        for h in event.block_hashes:
            prefix = o.prefix_of.get(h)
            counter = o.held.get(tier)
            if prefix is not None and o.holds(prefix):
                if counter is not None and counter[prefix] > 0:
                    counter[prefix] -= 1
                    if not o.holds(prefix):
                        self.lru.pop((key, h), None)
                        if not self.remember:
                            del o.prefix_of[h]
                continue
            record = o.orphans.get(h)
            if record is not None and tier in record[2]:
                record[2].remove(tier)
                if not record[2]:
                    del o.orphans[h]

    def match(
        self,
        tokens: Sequence[int],
        lora_name: str | None = None,
        weights: Any = None,
        include_stale: bool = True,
    ) -> list[PrefixMatch]:
        self.expire_due()
        weights = DEFAULT_TIER_WEIGHTS if weights is None else weights
        size = self.block_size
        n = len(tokens) // size
        prefixes: list[Prefix] = []
        prefix: Prefix = ()
        for k in range(n):
            prefix = (*prefix, (lora_name, None, tuple(tokens[k * size : (k + 1) * size])))
            prefixes.append(prefix)
        order: list[str] = [m for m in TIER_PREFERENCE if m in self.tier_seen]
        order += [m for m in self.tier_seen if m not in order]
        out = []
        for (name, rank), o in self.origins.items():
            if o.stale and not include_stale:
                continue
            k = 0
            score = 0.0
            while k < n and o.holds(prefixes[k]):
                score += max(weights.get(t, 0.5) for t in o.holds(prefixes[k]))
                k += 1
            if k:
                tiers = o.holds(prefixes[k - 1])
                medium = min(tiers, key=order.index)
                per_tier = {}
                for t in self.tier_seen:
                    j = 0
                    while j < n and o.held.get(t, Counter())[prefixes[j]] > 0:
                        j += 1
                    if j:
                        per_tier[t] = j
                out.append(PrefixMatch(name, k, medium, o.stale, rank, per_tier, round(score, 6)))
        out.sort(
            key=lambda m: (
                -m.score,
                -m.blocks,
                m.stale,
                order.index(m.medium),
                m.origin,
                -1 if m.data_parallel_rank is None else m.data_parallel_rank,
            )
        )
        return out


# -- driving simulated engines -------------------------------------------------------------------


class RecordingWorkload(Workload):
    """A shared workload that remembers every prompt it handed out."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.served: list[Request] = []

    def next_request(self) -> Request:
        request = super().next_request()
        self.served.append(request)
        return request


def _placeholders(events: list[KVCacheEvent], tiers: set[str]) -> list[KVCacheEvent]:
    """Stores on ``tiers`` rewritten the way vLLM's offloading connector sends them."""
    out: list[KVCacheEvent] = []
    for e in events:
        if isinstance(e, BlockStored) and e.medium in tiers:
            e = BlockStored(
                block_hashes=e.block_hashes,
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                medium=e.medium,
            )
        out.append(e)
    return out


def _queries(
    workload: RecordingWorkload, rng: random.Random, block_size: int
) -> Iterator[tuple[list[int], str | None]]:
    recent = workload.served[-12:]
    for request in recent:
        yield request.token_ids, request.lora_name
        cut = rng.randrange(len(request.token_ids) + 1)
        yield request.token_ids[:cut], request.lora_name
        other = None if request.lora_name else "sql-adapter"
        yield request.token_ids, other
        tweaked = list(request.token_ids)
        if tweaked:
            tweaked[rng.randrange(len(tweaked))] ^= 1
        yield tweaked, request.lora_name
    yield [rng.randrange(32000) for _ in range(5 * block_size)], None


def _run_workload(
    *,
    seed: int,
    engines: int,
    rounds: int,
    drop: float,
    duplicate: float,
    redeliver: float,
    restart: float,
    snapshot: float,
    reset_every: int | None,
    placeholder_tiers: set[str],
    remember: bool,
) -> tuple[PrefixIndex, Reference, int, list[SimulatedEngine]]:
    """Simulated engines -> (lossy) stream -> index and reference; compared on every query."""
    block_size = 4
    rng = random.Random(seed)
    workload = RecordingWorkload(
        seed=seed,
        block_size=block_size,
        system_prompts=3,
        system_prompt_blocks=(1, 4),
        turn_tokens=(4, 40),
        conversations=12,
    )

    def new_engine(i: int) -> SimulatedEngine:
        return SimulatedEngine(
            seed=seed + i,
            block_size=block_size,
            gpu_blocks=rng.choice((24, 48, 96)),
            cpu_blocks=rng.choice((48, 128)),
            remote_blocks=rng.choice((64, 256)),
            requests_per_step=rng.randint(1, 3),
            reset_every=reset_every,
            workload=workload,
            origin=f"engine-{i}",
        )

    index = PrefixIndex(block_size=block_size, seed=seed, keep_removed=10**9 if remember else 0)
    index._table_min_blocks = 1 + seed % 2  # half the runs through the numpy table
    reference = Reference(block_size, remember=remember)
    fleet = [new_engine(i) for i in range(engines)]
    epochs = [f"e{i}-0" for i in range(engines)]
    seqs = [0] * engines
    queries = 0

    def deliver(batch: EventBatch) -> None:
        index.apply(batch)
        reference.apply(batch)

    for _ in range(rounds):
        for i in range(engines):
            if rng.random() < restart:
                fleet[i] = new_engine(i)
                epochs[i] = f"e{i}-{rng.getrandbits(32):x}"
                seqs[i] = 0
            engine = fleet[i]
            events = _placeholders(engine.step_events(), placeholder_tiers)
            if duplicate and rng.random() < duplicate:
                stores = [k for k, e in enumerate(events) if isinstance(e, BlockStored)]
                if stores:
                    k = rng.choice(stores)
                    events.insert(k + 1, events[k])
            batch = EventBatch(
                seq=seqs[i], ts=0.0, events=events, origin=engine.origin, epoch=epochs[i]
            )
            seqs[i] += 1
            if rng.random() < drop:
                if rng.random() < 0.5:  # a subscriber that noticed reports it
                    gap = Gap(engine.origin, epochs[i], batch.seq, batch.seq + 1)
                    index.apply(gap)
                    reference.apply(gap)
                if rng.random() < snapshot:
                    events = engine.snapshot()
                    batch = EventBatch(
                        seq=seqs[i], ts=0.0, events=events, origin=engine.origin, epoch=epochs[i]
                    )
                    seqs[i] += 1
                    deliver(batch)
                continue
            deliver(batch)
            if rng.random() < redeliver:
                deliver(batch)  # the same (origin, epoch, seq) again: skipped by both
        for tokens, lora in _queries(workload, rng, block_size):
            queries += 1
            expected = reference.match(tokens, lora)
            got = index.match(tokens, lora)
            assert got == expected, (tokens, lora)
            assert index.match_bytes(array("I", tokens).tobytes(), lora) == expected
            fresh = [m for m in expected if not m.stale]
            assert index.match(tokens, lora, include_stale=False) == fresh
    return index, reference, queries, fleet


@settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**16),
    engines=st.integers(1, 3),
    rounds=st.integers(10, 45),
    lossy=st.booleans(),
    duplicate=st.sampled_from([0.0, 0.2]),
    restart=st.sampled_from([0.0, 0.03]),
    reset_every=st.sampled_from([None, 9]),
    placeholder_tiers=st.sampled_from([set(), {"CPU"}, {"CPU", "EXTERNAL"}]),
    remember=st.booleans(),
)
def test_index_equals_reference_on_simulated_engines(
    seed: int,
    engines: int,
    rounds: int,
    lossy: bool,
    duplicate: float,
    restart: float,
    reset_every: int | None,
    placeholder_tiers: set[str],
    remember: bool,
) -> None:
    if placeholder_tiers and not remember:
        # The CPU tier stores ancestors the GPU evicted long ago: a placeholder can
        # only name them if the index remembers removed blocks.
        remember = True
    index, reference, queries, _ = _run_workload(
        seed=seed,
        engines=engines,
        rounds=rounds,
        drop=0.1 if lossy else 0.0,
        duplicate=duplicate,
        redeliver=0.05,
        restart=restart,
        snapshot=0.5,
        reset_every=reset_every,
        placeholder_tiers=placeholder_tiers,
        remember=remember,
    )
    assert queries > 0
    stats = index.statistics()
    for (name, _), o in reference.origins.items():
        by_medium = {t: sum(1 for c in held.values() if c > 0) for t, held in o.held.items()}
        assert stats.origins[name].by_medium == {t: n for t, n in by_medium.items() if n}
        assert stats.origins[name].stale == o.stale
        assert stats.origins[name].orphans == len(o.orphans)


def test_lossless_workload_matches_the_engines_own_state() -> None:
    """Without loss, the reference (and so the index) agrees with the engines' tiers."""
    index, _, queries, fleet = _run_workload(
        seed=7,
        engines=3,
        rounds=80,
        drop=0.0,
        duplicate=0.0,
        redeliver=0.0,
        restart=0.0,
        snapshot=0.0,
        reset_every=None,
        placeholder_tiers=set(),
        remember=False,
    )
    stats = index.statistics()
    assert queries > 500
    assert stats.unknown_removals == 0
    assert stats.orphans_stored == 0
    assert stats.gaps == 0
    assert not any(o.stale for o in stats.origins.values())
    assert sum(o.blocks for o in stats.origins.values()) > 100
    assert stats.distinct_blocks > 50
    for engine in fleet:
        held = stats.origins[engine.origin].by_medium
        assert held.get("GPU", 0) == len(engine.gpu)
        assert held.get("CPU", 0) == len(engine.cpu.tier)
        assert held.get("EXTERNAL", 0) == len(engine.remote.tier)


def head(matches: list[PrefixMatch]) -> list[PrefixMatch]:
    """Matches without their per-tier lengths and scores (tested on their own)."""
    return [
        PrefixMatch(m.origin, m.blocks, m.medium, m.stale, m.data_parallel_rank) for m in matches
    ]


def test_the_reference_is_not_the_index() -> None:
    """The test can fail: a broken index (refcounts ignored) disagrees with the reference."""
    index = PrefixIndex(block_size=B)
    reference = Reference(B, remember=False)
    stored = _stored([1, 2], list(range(8)))
    batch = _batch(0, [stored, stored, BlockRemoved(block_hashes=[1, 2], medium="GPU")])
    index.apply(batch)
    reference.apply(batch)
    assert index.match(list(range(8))) == reference.match(list(range(8)))
    assert head(reference.match(list(range(8)))) == [PrefixMatch("a", 2, "GPU")]
    reference.origins[("a", None)].held["GPU"].clear()
    assert index.match(list(range(8))) != reference.match(list(range(8)))


# -- hand-built edge cases -------------------------------------------------------------------------


def _stored(
    hashes: list[Any],
    tokens: list[int],
    parent: Any = None,
    medium: str | None = "GPU",
    **kwargs: Any,
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=B if tokens else 0,
        medium=medium,
        **kwargs,
    )


def _batch(seq: int, events: list[KVCacheEvent], origin: str = "a", epoch: str = "e") -> EventBatch:
    return EventBatch(seq=seq, ts=0.0, events=events, origin=origin, epoch=epoch)


class Feed:
    """Applies events as consecutive batches of one origin."""

    def __init__(self, index: PrefixIndex, origin: str = "a", epoch: str = "e") -> None:
        self.index = index
        self.origin = origin
        self.epoch = epoch
        self.seq = 0

    def __call__(self, *events: KVCacheEvent) -> None:
        self.index.apply(_batch(self.seq, list(events), self.origin, self.epoch))
        self.seq += 1


T = list(range(100, 124))  # six blocks of four tokens


def test_match_counts_leading_full_blocks_and_reports_the_tier() -> None:
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(_stored([1, 2, 3], T[:12]))
    assert head(index.match(T)) == [PrefixMatch("a", 3, "GPU")]
    assert head(index.match(T[:11])) == [PrefixMatch("a", 2, "GPU")]  # only full blocks
    assert head(index.match(T[:3])) == []
    assert head(index.match(T[4:])) == []  # not a leading block
    assert head(index.match([])) == []
    # The first block held but the second evicted: one leading block.
    feed(BlockRemoved(block_hashes=[2], medium="GPU"))
    assert head(index.match(T)) == [PrefixMatch("a", 1, "GPU")]


def test_any_tier_counts_and_the_fastest_tier_is_reported() -> None:
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(_stored([1, 2], T[:8], medium="EXTERNAL"))
    feed(_stored([1], T[:4], medium="CPU"))
    feed(_stored([3], T[8:12], parent=2, medium="CPU"))
    assert head(index.match(T)) == [PrefixMatch("a", 3, "CPU")]
    assert head(index.match(T[:8])) == [PrefixMatch("a", 2, "EXTERNAL")]
    feed(_stored([1, 2], T[:8], medium="GPU"))
    assert head(index.match(T[:8])) == [PrefixMatch("a", 2, "GPU")]
    assert index.statistics().origins["a"].by_medium == {"EXTERNAL": 2, "CPU": 2, "GPU": 2}


def test_results_are_best_first_across_origins() -> None:
    index = PrefixIndex(block_size=B)
    Feed(index, "short")(_stored([1], T[:4]))
    Feed(index, "long")(_stored([7, 8, 9], T[:12], medium="CPU"))
    Feed(index, "mid-cpu")(_stored([4, 5], T[:8], medium="CPU"))
    Feed(index, "mid-gpu")(_stored([4, 5], T[:8]))
    assert head(index.match(T)) == [
        PrefixMatch("long", 3, "CPU"),
        PrefixMatch("mid-gpu", 2, "GPU"),
        PrefixMatch("mid-cpu", 2, "CPU"),
        PrefixMatch("short", 1, "GPU"),
    ]


def test_the_same_block_stored_twice_is_reference_counted() -> None:
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(_stored([1, 2], T[:8]))
    feed(_stored([1, 2], T[:8]))
    feed(BlockRemoved(block_hashes=[1, 2], medium="GPU"))
    assert head(index.match(T)) == [PrefixMatch("a", 2, "GPU")]
    feed(BlockRemoved(block_hashes=[1, 2], medium="GPU"))
    assert head(index.match(T)) == []
    stats = index.statistics()
    assert stats.unknown_removals == 0
    assert stats.distinct_blocks == 0


def test_repeats_within_one_batch_are_reference_counted() -> None:
    """The stores of one batch are merged into the nodes together: a block named twice
    on one tier there (again as a placeholder, or under a second engine hash) still
    needs two removals, and a placeholder of a block stored earlier in the batch counts."""
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(
        _stored([1, 2], T[:8]),
        _stored([1], [], medium="GPU"),  # block 1 again on GPU: one more reference
        _stored([7, 8], T[:8]),  # the same tokens under other engine hashes
        _stored([2], [], medium="CPU"),
    )
    stats = index.statistics()
    assert stats.origins["a"].by_medium == {"GPU": 2, "CPU": 1}
    assert stats.distinct_blocks == 2
    feed(BlockRemoved(block_hashes=[1, 2], medium="GPU"))
    feed(BlockRemoved(block_hashes=[1], medium="GPU"))
    assert head(index.match(T)) == [PrefixMatch("a", 2, "GPU")]  # 7, 8 hold them still
    feed(BlockRemoved(block_hashes=[7, 8], medium="GPU"))
    assert head(index.match(T)) == []  # block 2 left GPU; block 1 is on no tier
    feed(BlockRemoved(block_hashes=[1], medium="GPU"))  # one reference too many
    assert index.statistics().unknown_removals == 1
    assert index.statistics().origins["a"].by_medium == {"CPU": 1}


def test_a_store_naming_one_hash_twice_leaves_the_bulk_path_intact() -> None:
    """Its first block is entered, then taken out again (the hash was held by then), and
    the store goes block by block, as the reference has it: the second name is the first
    block stored again. (The per-event bulk path before entered both blocks.)"""
    index = PrefixIndex(block_size=B)
    reference = Reference(B, remember=False)
    batch = _batch(0, [_stored([1, 1], T[:8]), _stored([3], T[8:12], parent=1)])
    index.apply(batch)
    reference.apply(batch)
    for tokens in (T[:4], T[:8], T[:12]):
        assert index.match(tokens) == reference.match(tokens)
    assert index.statistics().origins["a"].blocks == 2


def test_a_block_held_before_the_batch_stored_again_under_a_new_hash_is_counted_once() -> None:
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(_stored([1, 2], T[:8]), _stored([3], T[:4], medium="CPU"))
    feed(_stored([5, 6], T[:8]), _stored([4], T[:4], medium="CPU"))  # held on both tiers
    assert index.statistics().origins["a"].by_medium == {"GPU": 2, "CPU": 1}
    feed(
        BlockRemoved(block_hashes=[1, 2], medium="GPU"),
        BlockRemoved(block_hashes=[3], medium="CPU"),
    )
    assert index.statistics().origins["a"].by_medium == {"GPU": 2, "CPU": 1}
    feed(BlockRemoved(block_hashes=[5, 6], medium="GPU"))
    assert head(index.match(T)) == [PrefixMatch("a", 1, "CPU")]
    assert index.statistics().unknown_removals == 0


def test_removals_of_unknown_blocks_are_counted_and_ignored() -> None:
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(_stored([1], T[:4]))
    feed(BlockRemoved(block_hashes=[99], medium="GPU"))
    feed(BlockRemoved(block_hashes=[1], medium="CPU"))  # known block, tier it is not on
    assert head(index.match(T)) == [PrefixMatch("a", 1, "GPU")]
    assert index.statistics().unknown_removals == 2


def test_all_blocks_cleared_clears_every_tier_of_one_origin_only() -> None:
    index = PrefixIndex(block_size=B)
    a, b = Feed(index, "a"), Feed(index, "b")
    a(_stored([1, 2], T[:8]), _stored([1, 2], T[:8], medium="CPU"))
    b(_stored([1], T[:4]))
    a(AllBlocksCleared())
    assert head(index.match(T)) == [PrefixMatch("b", 1, "GPU")]
    assert index.statistics().origins["a"].blocks == 0
    # After the clear the origin's old hashes mean nothing: a removal is unknown.
    a(BlockRemoved(block_hashes=[1], medium="GPU"))
    assert index.statistics().unknown_removals == 1


def test_a_new_epoch_drops_the_old_state() -> None:
    index = PrefixIndex(block_size=B)
    old = Feed(index, "a", "first")
    old(_stored([1, 2], T[:8]))
    old(_stored([3], T[8:12], parent=2))
    new = Feed(index, "a", "second")
    new(_stored([5], T[:4]))
    assert head(index.match(T)) == [PrefixMatch("a", 1, "GPU")]
    stats = index.statistics()
    assert stats.restarts == 1
    assert stats.origins["a"].epoch == "second"
    assert not stats.origins["a"].stale


def test_an_orphan_is_kept_and_matchable_once_its_chain_is_known() -> None:
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(_stored([3, 4], T[8:16], parent=2))  # parent 2 never seen
    assert head(index.match(T)) == []
    assert index.statistics().origins["a"].orphans == 2
    assert index.statistics().orphans_stored == 2
    feed(_stored([1], T[:4]))
    assert head(index.match(T)) == [PrefixMatch("a", 1, "GPU")]  # 2 still missing
    feed(_stored([2], T[4:8], parent=1, medium="CPU"))
    assert head(index.match(T)) == [PrefixMatch("a", 4, "GPU")]
    assert head(index.match(T[:8])) == [PrefixMatch("a", 2, "CPU")]
    assert index.statistics().origins["a"].orphans == 0


def test_an_orphan_can_be_removed_or_gain_tiers_before_its_chain_is_known() -> None:
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(_stored([2, 3], T[4:12], parent=1))
    feed(_stored([3], [], medium="CPU"))  # placeholder: orphan 3 also on CPU
    feed(BlockRemoved(block_hashes=[3], medium="GPU"))
    feed(BlockRemoved(block_hashes=[2], medium="GPU"))  # orphan 2 gone entirely
    assert index.statistics().origins["a"].orphans == 1
    feed(_stored([1, 2], T[:8]))
    assert head(index.match(T)) == [PrefixMatch("a", 3, "CPU")]


def test_orphans_are_bounded_oldest_first() -> None:
    index = PrefixIndex(block_size=B, max_orphans=2)
    feed = Feed(index)
    feed(_stored([2], T[4:8], parent=1))
    feed(_stored([12], T[8:12], parent=11))
    feed(_stored([22], T[12:16], parent=21))
    stats = index.statistics()
    assert stats.origins["a"].orphans == 2
    assert stats.orphans_dropped == 1
    feed(_stored([1], T[:4]))
    assert head(index.match(T)) == [PrefixMatch("a", 1, "GPU")]  # orphan 2 was dropped


def test_placeholders_update_tiers_of_known_blocks() -> None:
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(_stored([1, 2], T[:8]))
    feed(_stored([1, 2], [], medium="CPU"))
    feed(BlockRemoved(block_hashes=[1, 2], medium="GPU"))
    assert head(index.match(T)) == [PrefixMatch("a", 2, "CPU")]
    feed(_stored([77], [], medium="CPU"))
    assert index.statistics().unknown_placeholders == 1


def test_placeholders_just_after_eviction_resolve_from_removed_memory() -> None:
    # The GPU evicts and the offloading connector reports the CPU copy in the
    # same step: GPU events come first in the batch.
    for keep, expected in ((16, [PrefixMatch("a", 2, "CPU")]), (0, [])):
        index = PrefixIndex(block_size=B, keep_removed=keep)
        feed = Feed(index)
        feed(_stored([1, 2], T[:8]))
        feed(BlockRemoved(block_hashes=[2, 1], medium="GPU"), _stored([1, 2], [], medium="CPU"))
        assert head(index.match(T)) == expected


def test_removed_memory_is_bounded() -> None:
    index = PrefixIndex(block_size=B, keep_removed=1)
    feed = Feed(index)
    feed(_stored([1, 2], T[:8]))
    feed(BlockRemoved(block_hashes=[2, 1], medium="GPU"))  # only 1 remembered
    feed(_stored([1, 2], [], medium="CPU"))
    assert head(index.match(T)) == [PrefixMatch("a", 1, "CPU")]
    assert index.statistics().unknown_placeholders == 1


def test_a_gap_marks_the_origin_stale_until_a_snapshot() -> None:
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(_stored([1], T[:4]))
    index.apply(Gap("a", "e", 1, 3))
    feed.seq = 3
    feed(_stored([2], T[4:8], parent=1))
    assert head(index.match(T)) == [PrefixMatch("a", 2, "GPU", stale=True)]
    assert head(index.match(T, include_stale=False)) == []
    stats = index.statistics()
    assert stats.gaps == 1
    assert stats.origins["a"].stale_reason is not None
    # A snapshot (AllBlocksCleared, then the content) makes it exact again.
    feed(AllBlocksCleared(), _stored([1, 2], T[:8]))
    assert head(index.match(T)) == [PrefixMatch("a", 2, "GPU")]


def test_a_seq_jump_marks_stale_and_a_new_epoch_clears_it() -> None:
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(_stored([1], T[:4]))
    feed.seq = 5
    feed(_stored([2], T[4:8], parent=1))
    assert index.statistics().origins["a"].stale
    assert index.statistics().gaps == 1
    Feed(index, "a", "restarted")(_stored([1], T[:4]))
    assert head(index.match(T)) == [PrefixMatch("a", 1, "GPU")]


def test_joining_late_marks_stale_and_duplicates_are_skipped() -> None:
    index = PrefixIndex(block_size=B)
    batch = _batch(4, [_stored([1], T[:4])])
    index.apply(batch)
    index.apply(batch)
    assert head(index.match(T)) == [PrefixMatch("a", 1, "GPU", stale=True)]
    stats = index.statistics()
    assert stats.duplicate_batches == 1
    assert stats.batches == 1


def test_mark_stale_and_origin_override() -> None:
    index = PrefixIndex(block_size=B)
    index.apply(_batch(0, [_stored([1], T[:4])], origin="ignored"), origin="engine-7")
    assert index.origins() == ["engine-7"]
    index.mark_stale("engine-7", "subscriber reconnected")
    assert head(index.match(T)) == [PrefixMatch("engine-7", 1, "GPU", stale=True)]
    assert index.statistics().origins["engine-7"].stale_reason == "subscriber reconnected"


def test_lora_and_extra_keys_are_part_of_a_block() -> None:
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(_stored([1, 2], T[:8], lora_name="sql"))
    feed(_stored([3], T[:4], extra_keys=[["img-hash", 7]]))
    assert head(index.match(T)) == []
    assert head(index.match(T, lora_name="sql")) == [PrefixMatch("a", 2, "GPU")]
    assert head(index.match(T, lora_name="other")) == []
    assert head(index.match(T, extra_keys=[["img-hash", 7]])) == [PrefixMatch("a", 1, "GPU")]
    assert head(index.match(T, extra_keys=[("img-hash", 7)])) == [PrefixMatch("a", 1, "GPU")]
    assert head(index.match(T, extra_keys=[["img-hash", 8]])) == []


def test_events_with_a_block_size_not_a_multiple_are_counted_and_ignored() -> None:
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=T[:6], block_size=6))
    assert head(index.match(T)) == []
    assert index.statistics().wrong_block_size == 1


def test_engine_blocks_of_a_multiple_size_are_split_into_index_blocks() -> None:
    """An engine block of 2 * B tokens is two index blocks, matchable like any others."""
    small = PrefixIndex(block_size=B)
    big = PrefixIndex(block_size=B)
    Feed(small)(_stored([1, 2, 3], T[:12]))
    feed = Feed(big)
    feed(BlockStored(block_hashes=[10], parent_block_hash=None, token_ids=T[:8], block_size=8))
    feed(BlockStored(block_hashes=[11], parent_block_hash=10, token_ids=T[8:16], block_size=8))
    assert big.hashes(T[:16]) == small.hashes(T[:16])
    assert head(big.match(T)) == [PrefixMatch("a", 4, "GPU")]
    assert head(big.match(T[:6])) == [PrefixMatch("a", 1, "GPU")]
    stats = big.statistics()
    assert stats.remapped_blocks == 2
    assert stats.wrong_block_size == 0
    assert stats.origins["a"].by_medium == {"GPU": 4}
    assert stats.origins["a"].block_size == 8
    feed(_stored([11], [], medium="CPU"))  # a placeholder covers both halves
    assert big.match(T)[0].tiers == {"GPU": 4}
    assert big.statistics().origins["a"].by_medium == {"GPU": 4, "CPU": 2}
    feed(BlockRemoved(block_hashes=[11], medium="GPU"))
    assert big.match(T)[0].tiers == {"GPU": 2}
    assert big.statistics().origins["a"].by_medium == {"GPU": 2, "CPU": 2}
    feed(BlockRemoved(block_hashes=[11], medium="CPU"), BlockRemoved(block_hashes=[10]))
    assert big.match(T) == []
    assert big.statistics().distinct_blocks == 0


def test_hashes_as_bytes_and_signed_integers() -> None:
    index = PrefixIndex(block_size=B)
    Feed(index, "bytes")(_stored([b"\x01" * 32, b"\x02" * 32], T[:8]))
    Feed(index, "signed")(_stored([-5, -(2**63)], T[:8]))
    feed = Feed(index, "bytes")
    feed.seq = 1
    feed(BlockRemoved(block_hashes=[b"\x02" * 32], medium="GPU"))
    assert head(index.match(T)) == [PrefixMatch("signed", 2, "GPU"), PrefixMatch("bytes", 1, "GPU")]


def test_tokens_beyond_32_bits_hash_distinctly() -> None:
    wide = [2**40 + 1, 2, 3, 4]
    index = PrefixIndex(block_size=B)
    Feed(index)(_stored([1, 2], [*wide, *T[:4]]))
    assert head(index.match([*wide, *T[:4]])) == [PrefixMatch("a", 2, "GPU")]
    assert head(index.match([1, 2, 3, 4, *T[:4]])) == []


def test_own_hashes_are_the_documented_chain_and_depend_on_the_seed() -> None:
    hasher = BlockHasher(B, seed=1)
    chain = hasher.chain(None, T[:12])
    assert len(chain) == 3
    assert chain[:2] == hasher.chain(None, T[:8])
    assert hasher.chain(chain[0], T[4:12]) == chain[1:]
    assert BlockHasher(B, seed=2).chain(None, T[:4]) != chain[:1]
    assert hasher.chain(None, T[:4], lora_name="x") != chain[:1]
    assert BlockHasher(B, seed=1).chain(None, T[:12]) == chain  # deterministic
    with pytest.raises(ConfigError, match="block_size"):
        BlockHasher(0)
    # The index keys its nodes by exactly this chain (white box: the node table).
    for lora in (None, "x"):
        index = PrefixIndex(block_size=B, seed=1)
        Feed(index)(_stored([1, 2, 3], T[:12], lora_name=lora))
        assert set(index._nodes) == set(hasher.chain(None, T[:12], lora_name=lora))


def test_many_origins_and_forget() -> None:
    index = PrefixIndex(block_size=B)
    for i in range(40):  # more origins than the first slot width: nodes are re-laid
        feed = Feed(index, f"o{i:02}")
        feed(_stored([1, 2], T[:8], medium="CPU" if i % 2 else "GPU"))
        if i % 3 == 0:
            feed(BlockRemoved(block_hashes=[2], medium="CPU" if i % 2 else "GPU"))
    matches = index.match(T)
    assert len(matches) == 40
    assert {m.origin for m in matches if m.blocks == 1} == {f"o{i:02}" for i in range(0, 40, 3)}
    assert head(matches)[0] == PrefixMatch("o01", 2, "GPU") or matches[0].medium == "GPU"
    assert index.forget("o05")
    assert not index.forget("o05")
    assert "o05" not in {m.origin for m in index.match(T)}
    Feed(index, "new")(_stored([9], T[:4]))  # takes the freed slot
    assert PrefixMatch("new", 1, "GPU") in head(index.match(T))
    assert len(index.match(T)) == 40


def test_statistics_and_memory_estimate() -> None:
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(_stored([1, 2, 3], T[:12]), _stored([1], [], medium="CPU"))
    stats = index.statistics()
    assert stats.origins["a"].blocks == 3
    assert stats.origins["a"].by_medium == {"GPU": 3, "CPU": 1}
    assert stats.distinct_blocks == 3
    assert stats.blocks_stored == 4
    assert stats.memory_bytes > 0
    assert not gc.is_tracked(index._nodes)  # integers only: the GC never walks them


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        PrefixIndex(block_size=0)
    with pytest.raises(ConfigError, match="keep_removed"):
        PrefixIndex(block_size=4, keep_removed=-1)


def test_exported_from_the_package() -> None:
    assert kvstream.PrefixIndex is PrefixIndex
    assert "PrefixIndex" in kvstream.__all__
    assert "PrefixMatch" in kvstream.__all__
    assert kvstream.__all__ == sorted(kvstream.__all__)


# -- the HTTP endpoint -----------------------------------------------------------------------------


async def _http(port: int, raw: bytes) -> tuple[int, dict[str, str], Any]:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(raw)
        data = b""
        while True:
            try:
                data += await stream.receive()
            except anyio.EndOfStream:
                break
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep:
                lines = head.decode().split("\r\n")
                headers = dict(line.split(": ", 1) for line in lines[1:])
                if len(body) >= int(headers["Content-Length"]):
                    return int(lines[0].split()[1]), headers, orjson.loads(body)
    raise AssertionError(f"incomplete response {data!r}")


def _post(body: bytes, path: str = "/match", extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}"
        "Connection: close\r\n\r\n"
    ).encode() + body


async def test_http_endpoint_over_a_real_socket(no_leaked_tasks: None) -> None:
    index = PrefixIndex(block_size=B)
    Feed(index, "engine-0")(_stored([1, 2], T[:8]))
    async with QueryServer(index, port=0, max_request_bytes=4096) as server:
        port = server.port
        assert port > 0
        status, _, body = await _http(port, _post(orjson.dumps({"token_ids": T})))
        assert status == 200
        assert body == {
            "block_size": B,
            "blocks": 6,
            "matches": [
                {
                    "origin": "engine-0",
                    "data_parallel_rank": None,
                    "blocks": 2,
                    "medium": "GPU",
                    "stale": False,
                    "tiers": {"GPU": 2},
                    "score": 2.0,
                }
            ],
        }
        status, _, body = await _http(
            port, _post(orjson.dumps({"token_ids": T, "lora_name": "x", "include_stale": False}))
        )
        assert (status, body["matches"]) == (200, [])
        status, _, body = await _http(
            port, b"GET /stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert status == 200
        assert body["origins"]["engine-0"]["by_medium"] == {"GPU": 2}
        assert body["distinct_blocks"] == 2

        for payload, fragment in (
            (b"{not json", "expected JSON"),
            (b"[1, 2]", "expected a JSON object"),
            (b'{"token_ids": "abc"}', "token_ids"),
            (b'{"token_ids": [1, -2]}', "token_ids"),
            (b'{"token_ids": [1.5]}', "token_ids"),
            (b'{"token_ids": [1], "lora_name": 3}', "lora_name"),
            (b'{"token_ids": [1], "colour": 3}', "colour"),
            (b'{"token_ids": [1], "extra_keys": 3}', "extra_keys"),
        ):
            status, _, body = await _http(port, _post(payload))
            assert status == 400, payload
            assert fragment in body["error"], (payload, body)
        status, _, body = await _http(port, _post(b"x" * 5000))
        assert status == 413
        status, _, _ = await _http(port, b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 404
        status, headers, _ = await _http(port, b"GET /match HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (status, headers["Allow"]) == (405, "POST")
        status, headers, _ = await _http(port, _post(b"{}", "/stats"))
        assert (status, headers["Allow"]) == (405, "GET, HEAD")
        # HEAD where GET goes: the head of the answer, without its body.
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(b"HEAD /stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head = b""
            with anyio.fail_after(10):
                while True:
                    try:
                        head += await stream.receive()
                    except anyio.EndOfStream:
                        break
        assert head.startswith(b"HTTP/1.1 200 OK\r\n"), head
        assert head.endswith(b"\r\n\r\n")
        assert b"Content-Length: " in head
        # A JSON body carries its own options: a query string is refused, not ignored.
        status, _, body = await _http(
            port, _post(orjson.dumps({"token_ids": T}), "/match?lora_name=x")
        )
        assert status == 400
        assert "'lora_name=x'" in body["error"], body
        status, _, body = await _http(
            port, b"PRI * HTTP/2.0\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert status == 505
        assert "HTTP/2.0" in body["error"], body
        status, _, _ = await _http(port, b"NONSENSE\r\n\r\n")
        assert status == 400
        # A chunked body is read like any other (h11 decodes it), within the same bound.
        chunked = orjson.dumps({"token_ids": T[:4]})
        status, _, body = await _http(
            port,
            b"POST /match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunked), chunked),
        )
        assert status == 200, body

        # Keep-alive: two requests on one connection.
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            body = orjson.dumps({"token_ids": T[:4]})
            request = (
                f"POST /match HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await stream.send(request + request)
            data = b""
            with anyio.fail_after(10):
                while data.count(b"HTTP/1.1 200 OK") < 2 or not data.endswith(b"}]}"):
                    data += await stream.receive()
        assert server.requests >= 15
    with pytest.raises(OSError, match="connection attempts failed"):  # the port is closed
        await anyio.connect_tcp("127.0.0.1", port)


async def test_http_json_tokens_are_checked_in_one_pass_bools_refused_zeros_kept(
    no_leaked_tasks: None,
) -> None:
    # The JSON path converts the tokens once (refusing anything but integers in
    # [0, 2**64), the partial last block too) and looks for bools only among the
    # tokens converted to 0 or 1: real zeros and ones must still match.
    index = PrefixIndex(block_size=B)
    zeros = [0, 1, 1, 0, 1, 0, 0, 1]
    wide = [2**40 + 7, 5, 2**33, 1, 9, 8, 7, 6]
    Feed(index, "a")(_stored([1, 2], zeros), _stored([3, 4], wide))
    async with QueryServer(index, port=0) as server:
        for tokens in (zeros, wide, [*zeros, 0, 1]):
            status, _, body = await _http(server.port, _post(orjson.dumps({"token_ids": tokens})))
            assert status == 200, body
            assert [(m["origin"], m["blocks"]) for m in body["matches"]] == [("a", 2)]
            assert body["matches"][0]["blocks"] == index.match(tokens)[0].blocks
        for payload, shown in (
            (b'{"token_ids": [false, 1, 1, 0, 1, 0, 0, 1]}', "false"),
            (b'{"token_ids": [0, 1, 1, 0, 1, 0, 0, 1, true]}', "true"),  # partial block
            (b'{"token_ids": [0, 1, 1, 0, 1, 0, 0, 1, 1.5]}', "1.5"),
            (b'{"token_ids": [0, 1, 1, 0, 1, 0, 0, 1, -1]}', "-1"),
            # 2**64: orjson reads it as a float
            (b'{"token_ids": [0, 1, 1, 0, 1, 0, 0, 18446744073709551616]}', "e+19"),
            (b'{"token_ids": [0, 1, 1, 0, 1, 0, 0, null]}', "None"),
        ):
            status, _, body = await _http(server.port, _post(payload))
            assert status == 400, payload
            assert "token_ids" in body["error"], body
            assert shown in body["error"], body


class _BrokenIndex(PrefixIndex):
    def match(self, *args: Any, **kwargs: Any) -> list[PrefixMatch]:
        raise RuntimeError("a bug")

    match_bytes = match  # the server's path for JSON token lists of 32-bit tokens


async def test_http_a_failing_query_is_a_500_and_the_server_goes_on(
    no_leaked_tasks: None, caplog: pytest.LogCaptureFixture
) -> None:
    async with QueryServer(_BrokenIndex(block_size=B), port=0) as server:
        status, _, body = await _http(server.port, _post(orjson.dumps({"token_ids": T})))
        assert status == 500
        assert "a bug" in body["error"]
        status, _, _ = await _http(
            server.port, b"GET /stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert status == 200
    assert "request failed" in caplog.text


# -- the command line ------------------------------------------------------------------------------


def _start_cli_index(paths: str | list[str], *options: str) -> tuple[subprocess.Popen[bytes], int]:
    """`kvstream index PATH...` on a free port, and that port (from the line it prints)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    streams = [paths] if isinstance(paths, str) else paths
    command = [sys.executable, "-m", "kvstream", "index", *streams, "--block-size", str(B)]
    proc = subprocess.Popen(
        [*command, "--port", "0", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if "http://127.0.0.1:" not in line:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"kvstream index did not start: {line!r} {err.decode()}")
    return proc, int(line.rsplit(":", 1)[1].split()[0].strip("/"))


def _one_batch_file(origin: str = "engine-0", blocks: int = 3) -> str:
    path = os.path.join(tempfile.mkdtemp(dir="/tmp"), "kv.jsonl")
    stored = _stored(list(range(1, blocks + 1)), T[: blocks * B])
    with open(path, "wb") as f:
        f.write(JsonCodec().encode(_batch(0, [stored], origin=origin)))
        f.write(b"\n")
    return path


def _matches_once(port: int, ready: Callable[[list[Any]], bool]) -> list[Any]:
    """`POST /match` of `T` until the answer's matches are `ready` (30 s at most)."""

    async def query() -> list[Any]:
        with anyio.fail_after(30):
            while True:
                status, _, body = await _http(port, _post(orjson.dumps({"token_ids": T})))
                assert status == 200
                if ready(body["matches"]):
                    return body["matches"]  # type: ignore[no-any-return]
                await anyio.sleep(0.05)

    return anyio.run(query)


def _stats_until(port: int, ready: Callable[[Any], bool]) -> Any:
    """`GET /stats` until the answer is `ready` (30 s at most)."""

    async def query() -> Any:
        with anyio.fail_after(30):
            while True:
                status, _, body = await _http(port, _STATS)
                assert status == 200
                if ready(body):
                    return body
                await anyio.sleep(0.05)

    return anyio.run(query)


def test_cli_index_follows_a_file_and_answers_queries() -> None:
    path = _one_batch_file()
    codec = JsonCodec()
    proc, port = _start_cli_index(path)
    try:
        assert _matches_once(port, bool) == [
            {
                "origin": "engine-0",
                "data_parallel_rank": None,
                "blocks": 3,
                "medium": "GPU",
                "stale": False,
                "tiers": {"GPU": 3},
                "score": 3.0,
            }
        ]
        # The file grows: the index follows it.
        with open(path, "ab") as f:
            f.write(
                codec.encode(
                    _batch(1, [BlockRemoved(block_hashes=[3], medium="GPU")], origin="engine-0")
                )
                + b"\n"
            )

        _matches_once(port, lambda matches: matches[0]["blocks"] == 2)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()


def test_cli_index_follows_several_streams_into_one_index() -> None:
    streams = [_one_batch_file("engine-0", 3), _one_batch_file("engine-1", 2)]
    proc, port = _start_cli_index(streams)
    try:
        matches = _matches_once(port, lambda matches: len(matches) == 2)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    assert [(m["origin"], m["blocks"]) for m in matches] == [("engine-0", 3), ("engine-1", 2)]
    assert "2 origin(s)" in err.decode()
    twice = subprocess.run(
        [sys.executable, "-m", "kvstream", "index", streams[0], streams[0]],
        capture_output=True,
        timeout=60,
    )
    assert twice.returncode == 2
    assert "given twice" in twice.stderr.decode()
    same = subprocess.run(
        [
            *(sys.executable, "-m", "kvstream", "index"),
            "zmq+tcp://127.0.0.1:5557?origin=engine-0",
            "zmq+tcp://127.0.0.1:5567?origin=engine-0",
        ],
        capture_output=True,
        timeout=60,
    )
    assert same.returncode == 2
    assert "origin='engine-0' given to" in same.stderr.decode()


def _read_stderr(
    proc: subprocess.Popen[bytes],
) -> tuple[list[str], threading.Thread, Callable[[str], None]]:
    """The lines `proc` writes to stderr (read by a thread as they come), the thread,
    and a function that waits (30 s at most) until a line says something."""
    lines: list[str] = []
    stderr = proc.stderr
    assert stderr is not None
    reader = threading.Thread(
        target=lambda: lines.extend(line.decode() for line in iter(stderr.readline, b"")),
        daemon=True,
    )
    reader.start()

    async def wait_for(said: str) -> None:
        with anyio.fail_after(30):
            # Lines come from a thread: polled, there is no event to wait on.
            while not any(said in line for line in lines):  # noqa: ASYNC110
                await anyio.sleep(0.05)

    return lines, reader, lambda said: anyio.run(wait_for, said)


def test_cli_index_serves_on_when_one_of_its_streams_fails() -> None:
    streams = [_one_batch_file("engine-0", 3), _one_batch_file("engine-1", 2)]
    proc, port = _start_cli_index(streams)
    lines, reader, until = _read_stderr(proc)
    stderr = proc.stderr
    try:
        _matches_once(port, lambda matches: len(matches) == 2)
        # The first stream's path becomes unreadable: that stream fails, the rest goes on.
        os.rename(streams[0], streams[0] + ".old")
        os.mkdir(streams[0])
        until(f"the stream {streams[0]} failed: cannot read")
        assert proc.poll() is None, "the index stopped with one stream left"
        # Still answering, from both streams' blocks, the failed one's as stale hints.
        answer = [(m["origin"], m["stale"]) for m in _matches_once(port, bool)]
        assert answer == [("engine-0", True), ("engine-1", False)]  # by score, then freshness
        # The second fails too: nothing is left to follow, and the command says so.
        os.rename(streams[1], streams[1] + ".old")
        os.mkdir(streams[1])
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        reader.join(timeout=30)
        for pipe in (proc.stdout, stderr):
            if pipe is not None:
                pipe.close()
    text = "".join(lines)
    assert proc.returncode == 1, text
    assert "still serving, 1 stream(s) followed" in text
    assert f"failed: {streams[0]}, {streams[1]}" in text
    assert "Traceback" not in text


@pytest.mark.server
def test_cli_index_waits_for_a_server_not_up_yet(
    redis_servers: Callable[..., RedisServer],
) -> None:
    """A router may start before its broker: the index serves what it has and tries the
    stream again with backoff, then follows it from the start it was given."""
    port, socket_port = free_port(), free_port()
    url = f"redis://127.0.0.1:{port}/kv?start=0"
    local = _one_batch_file("engine-0", 3)
    # A socket sink's subscriber is entered without retrying inside (it would block the
    # start, the banner and the other streams), then resumes after drops on its own.
    socket_url = f"tcp://127.0.0.1:{socket_port}"
    proc, http_port = _start_cli_index([local, url, socket_url])
    lines, reader, until = _read_stderr(proc)
    try:
        until(f"cannot reach redis://127.0.0.1:{port}")
        until(f"cannot subscribe to {socket_url}")
        assert proc.poll() is None, "the index stopped for a server not up yet"
        assert [m["origin"] for m in _matches_once(http_port, bool)] == ["engine-0"]
        server = redis_servers(port=port, appendonly=False)

        async def publish() -> None:
            async with RedisSink(server.url, stream="kv") as sink:
                sink.offer(_batch(0, [_stored([1, 2], T[: 2 * B])], origin="engine-1"))

        anyio.run(publish)
        until(f"following redis://127.0.0.1:{port}/kv")
        matches = _matches_once(http_port, lambda matches: len(matches) == 2)
        assert [(m["origin"], m["blocks"]) for m in matches] == [("engine-0", 3), ("engine-1", 2)]
        demo = [sys.executable, "-m", "kvstream", "demo", "--steps", "0", "--rate", "50"]
        for seed in (1, 2):  # the second run: the sink came back after a drop
            engine = subprocess.Popen(
                [*demo, "--seed", str(seed), "--block-size", str(B), "--sink", socket_url],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                until(f"following {socket_url}")
                restarts = seed - 1

                def restarted(stats: Any, n: int = restarts) -> bool:
                    return bool(stats["restarts"] == n)

                _stats_until(http_port, restarted)
                _stats_until(http_port, lambda stats: "sim-0" in stats["origins"])
            finally:
                engine.terminate()
                engine.wait(timeout=30)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=30)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    text = "".join(lines)
    assert proc.returncode == 0, text
    assert "retrying with backoff" in text
    assert "Traceback" not in text
    # A bad option is not a server down: it stops at once; so does --no-retry.
    bad = subprocess.run(
        [sys.executable, "-m", "kvstream", "index", f"redis://127.0.0.1:{port}/kv?count=x"],
        capture_output=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "count" in bad.stderr.decode()
    server.stop()
    down = subprocess.run(
        [*(sys.executable, "-m", "kvstream", "index", url), "--no-retry", "--port", "0"],
        capture_output=True,
        timeout=60,
    )
    assert down.returncode == 2
    assert f"cannot reach redis://127.0.0.1:{port}" in down.stderr.decode()


_STATS = b"GET /stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def test_cli_index_max_connections_bounds_the_connections_served() -> None:
    # With room for one connection, a silent client is closed to make room for a
    # query; with the default (64) it would stay open until its idle timeout (30 s).
    path = _one_batch_file()
    proc, port = _start_cli_index(path, "--max-connections", "1")
    try:

        async def check() -> None:
            with anyio.fail_after(60):
                async with await anyio.connect_tcp("127.0.0.1", port) as silent:
                    while True:
                        # A query that arrives before the silent client is taken in
                        # may be the one closed instead: it is asked again.
                        try:
                            status, _, body = await _http(port, _STATS)
                        except (OSError, anyio.BrokenResourceError, AssertionError):
                            await anyio.sleep(0.05)
                            continue
                        assert status == 200
                        assert body["http"]["requests"] >= 1
                        break
                    # Closed when the query came in (an idle timeout would take 30 s).
                    with (
                        anyio.fail_after(10),
                        pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)),
                    ):
                        await silent.receive()

        anyio.run(check)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    bad = subprocess.run(
        [sys.executable, "-m", "kvstream", "index", path, "--max-connections", "0"],
        capture_output=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "argument --max-connections: expected an integer >= 1, got '0'" in bad.stderr.decode()


def test_cli_index_demo_routes_better_than_random(capsys: pytest.CaptureFixture[str]) -> None:
    from kvstream._cli.main import main

    assert main(["index", "--demo", "--engines", "3", "--requests", "300"]) == 0
    out = capsys.readouterr().out
    assert "index routing" in out
    assert "index-gpu routing" in out
    assert "random routing" in out
    rates = {
        line.split(":")[0].strip(): float(line.split("hit rate")[1].split("%")[0])
        for line in out.splitlines()
        if "hit rate" in line
    }
    assert rates["index routing"] > rates["random routing"]
    assert "late batches of retired epochs dropped" in out


def test_demo_tier_weights_reuse_more_than_gpu_only_when_gpus_are_small() -> None:
    from kvstream.index._demo import compare_routing

    weighted, gpu_only, randomly = compare_routing(
        engines=3, requests=600, gpu_blocks=128, ranks=2, seed=0
    )
    assert (weighted.policy, gpu_only.policy, randomly.policy) == ("index", "index-gpu", "random")
    assert weighted.reusable_rate > gpu_only.reusable_rate > randomly.reusable_rate
    assert weighted.misrouted > 0  # the lost engine was still indexed until its ttl ran out
    stats = weighted.index
    assert stats is not None
    assert stats.expired == 2  # both ranks of the lost engine
    assert stats.retired_epoch_batches > 0
    assert {o.data_parallel_rank for o in stats.origins.values()} == {0, 1}


def test_cli_index_needs_a_url_or_demo(capsys: pytest.CaptureFixture[str]) -> None:
    from kvstream._cli.main import main

    assert main(["index"]) == 2
    assert "URL" in capsys.readouterr().err


# -- in process, as docs/prefix-index.md shows it -----------------------------------------------


async def test_fed_in_process_through_a_queue_sink(no_leaked_tasks: None) -> None:
    from kvstream import QueueSink, Scheduler

    workload = Workload(seed=1)
    engine = SimulatedEngine(workload=workload, origin="engine-0")
    index = PrefixIndex(block_size=16)
    sink = QueueSink()

    async def consume() -> None:
        async for batch in sink:
            index.apply(batch)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        async with Scheduler(sinks=[sink], origin="engine-0") as scheduler:
            for source, name in engine.inputs():
                scheduler.add_source(source, name=name)
            for _ in range(30):
                scheduler.emit(engine.run_step())
                await engine.handed_over()
                await scheduler.tick()
            engine.close()
        # The scheduler closed its sinks: the queue ends once everything is applied.

    stats = index.statistics()
    assert stats.batches == 30
    assert stats.unknown_removals == 0
    assert stats.orphans_stored == 0
    assert stats.origins["engine-0"].by_medium == {
        "GPU": len(engine.gpu),
        "CPU": len(engine.cpu.tier),
        "EXTERNAL": len(engine.remote.tier),
    }
    hits = [index.match(r.token_ids, r.lora_name) for r in workload.next_requests(20)]
    assert any(m and m[0].blocks > 2 for m in hits)


def test_a_store_with_skipped_blocks_is_counted_never_chained_to_the_wrong_tokens() -> None:
    # vLLM's sliding-window and Mamba groups skip null blocks: the tokens of every
    # block, the hashes of the last ones only. The index cannot tell which index
    # blocks those hashes name for a prefix from the root, so it counts and skips
    # them, and a later full store of the same prompt still indexes normally.
    index = PrefixIndex(block_size=B)
    feed = Feed(index)
    feed(_stored([5, 6], T[:16]))  # four blocks of tokens, two hashes
    assert head(index.match(T)) == []
    assert index.statistics().skipped_blocks == 2
    feed(_stored([1, 2, 3, 4], T[:16]))
    assert head(index.match(T)) == [PrefixMatch("a", 4, "GPU")]


# -- bad queries, in process ----------------------------------------------------------------------


@pytest.mark.parametrize("populated", [False, True])
@pytest.mark.parametrize(
    ("query", "named"),
    [
        (lambda i: i.match(T, lora_name=5), "lora_name: expected a str or None, got 5"),
        (lambda i: i.match(T, extra_keys="x"), "extra_keys: expected a list with one entry"),
        (lambda i: i.match(T, extra_keys=[None, 3]), "extra_keys: expected a list with one"),
        (lambda i: i.match(T, include_stale="no"), "include_stale: expected True or False"),
        (lambda i: i.match_bytes("abcd"), "token bytes: expected bytes (uint32 little-endian)"),
        (lambda i: i.match_bytes(b"abcd", lora_name=1), "lora_name: expected a str or None"),
        (lambda i: i.match_engine_hashes("abc"), "block_hashes: expected a list of engine"),
        (lambda i: i.match_engine_hashes([1, None]), "expected engine hashes (int or bytes)"),
        (lambda i: i.match_engine_hashes([1], origin=5), "origin: expected a str or None"),
        (lambda i: i.apply({"seq": 0}), "PrefixIndex.apply: expected an EventBatch or a Gap"),
    ],
)
def test_a_bad_query_is_refused_whatever_the_index_holds(
    query: Callable[[PrefixIndex], object], named: str, populated: bool
) -> None:
    # A wrong option used to give [] (or be read as true) without a word.
    index = PrefixIndex(block_size=B)
    if populated:
        Feed(index, "engine-0")(_stored([1, 2], T[: 2 * B]))
    with pytest.raises(ConfigError) as caught:
        query(index)
    assert named in str(caught.value)
