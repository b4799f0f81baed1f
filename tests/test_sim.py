"""The simulated engine: a real prefix cache whose event stream is consistent."""

from __future__ import annotations

import pytest

from kvstream import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, MemorySink, Scheduler
from kvstream.sim import (
    ConsistencyError,
    SimulatedEngine,
    Workload,
    block_hash,
    check_consistency,
)


def _batches(engine: SimulatedEngine, steps: int, origin: str = "sim") -> list[EventBatch]:
    out: list[EventBatch] = []
    for events in engine.iter_steps(steps):
        if events:
            out.append(EventBatch(seq=len(out), ts=0.0, events=events, origin=origin, epoch="e"))
    return out


def test_workload_is_reproducible_and_shares_prefixes() -> None:
    a = [r.token_ids for r in Workload(seed=3).next_requests(50)]
    b = [r.token_ids for r in Workload(seed=3).next_requests(50)]
    c = [r.token_ids for r in Workload(seed=4).next_requests(50)]
    assert a == b
    assert a != c
    # System prompts are shared: some pair of requests starts with the same block.
    firsts = [tuple(t[:16]) for t in a]
    assert len(set(firsts)) < len(firsts)


def test_hash_chains_on_parent_and_adapter() -> None:
    tokens = list(range(16))
    root = block_hash(None, tokens, None)
    assert 0 <= root < 2**64
    assert block_hash(root, tokens, None) != root
    assert block_hash(None, tokens, "lora") != root
    assert block_hash(None, tokens, None) == root


@pytest.mark.parametrize("reset_every", [None, 50])
def test_stream_is_consistent_per_tier(reset_every: int | None) -> None:
    engine = SimulatedEngine(
        seed=7, gpu_blocks=128, cpu_blocks=256, remote_blocks=512, reset_every=reset_every
    )
    batches = _batches(engine, 300)
    report = check_consistency(batches)
    kinds = set(report.by_type)
    # Every tier stores and evicts; the pool's pressure is real.
    for medium in ("GPU", "CPU", "EXTERNAL"):
        assert ("BlockStored", medium) in kinds
        assert ("BlockRemoved", medium) in kinds
    assert (("AllBlocksCleared", None) in kinds) == (reset_every is not None)
    assert report.held["sim"].get("GPU", 0) <= 128
    assert report.held["sim"].get("CPU", 0) <= 256
    # Token ids are those of the blocks: block_size per block.
    for b in batches:
        for e in b.events:
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == 16 * len(e.block_hashes)


def test_prefix_reuse_happens() -> None:
    engine = SimulatedEngine(seed=1, gpu_blocks=2048)
    for _ in range(100):
        engine.step_events()
    assert engine.hit_rate > 0.2


def test_snapshot_rebuilds_the_state() -> None:
    engine = SimulatedEngine(seed=2, gpu_blocks=64, cpu_blocks=128, remote_blocks=256)
    batches = _batches(engine, 80)
    live = check_consistency(batches).held["sim"]
    snap = engine.snapshot()
    assert isinstance(snap[0], AllBlocksCleared)
    rebuilt = check_consistency(
        [EventBatch(seq=0, ts=0.0, events=snap, origin="snap", epoch="s")]
    ).held["snap"]
    assert rebuilt == live
    # And the stream continues consistently after the snapshot.
    later = [
        b.replace(seq=i + 1, epoch="s") for i, b in enumerate(_batches(engine, 20, origin="snap"))
    ]
    check_consistency([EventBatch(seq=0, ts=0.0, events=snap, origin="snap", epoch="s"), *later])


def test_checker_refuses_inconsistent_streams() -> None:
    stored = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[], block_size=0)
    orphan = BlockStored(block_hashes=[2], parent_block_hash=9, token_ids=[], block_size=0)
    removed = BlockRemoved(block_hashes=[5])

    def one(*events: object, seq: int = 0) -> list[EventBatch]:
        return [EventBatch(seq=seq, ts=0.0, events=list(events), origin="o", epoch="e")]  # type: ignore[arg-type]

    with pytest.raises(ConsistencyError, match="parent 9 is not held"):
        check_consistency(one(orphan))
    with pytest.raises(ConsistencyError, match="block 5 is not held"):
        check_consistency(one(removed))
    with pytest.raises(ConsistencyError, match="already held"):
        check_consistency(one(stored, stored))
    with pytest.raises(ConsistencyError, match="expected seq 0"):
        check_consistency(one(stored, seq=3))
    gap = one(stored) + one(BlockRemoved(block_hashes=[1]), seq=2)
    with pytest.raises(ConsistencyError, match="expected seq 1"):
        check_consistency(gap)


async def test_engine_feeds_a_scheduler_with_all_three_inputs() -> None:
    sink = MemorySink()
    engine = SimulatedEngine(seed=5, gpu_blocks=96, cpu_blocks=192, remote_blocks=384)
    async with Scheduler(sinks=[sink], origin="sim-a") as scheduler:
        for source, name in engine.inputs():
            scheduler.add_source(source, name=name)
        for _ in range(120):
            scheduler.emit(engine.run_step())
            await engine.handed_over()
            await scheduler.tick()
        engine.close()
    report = check_consistency(sink.batches)
    assert [b.seq for b in sink.batches] == list(range(len(sink.batches)))
    kinds = {medium for (_, medium) in report.by_type}
    assert {"GPU", "CPU", "EXTERNAL"} <= kinds
    # Within a batch, the cache manager's events come first, then the connectors'.
    order = {"GPU": 0, "CPU": 1, "EXTERNAL": 2}
    for b in sink.batches:
        ranks = [order[e.medium] for e in b.events if isinstance(e, BlockStored | BlockRemoved)]  # type: ignore[index]
        assert ranks == sorted(ranks)
