"""The index on fleet shapes: data-parallel ranks, retired epochs, ttl, capacity, vLLM keys."""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_index import RecordingWorkload, Reference, _queries, head

from kvstream import PrefixIndex, PrefixMatch
from kvstream.errors import ConfigError
from kvstream.events import BlockRemoved, BlockStored, EventBatch
from kvstream.index._keys import vllm_extra_keys
from kvstream.sim import SimulatedEngine

B = 4
T = list(range(100, 124))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _batch(seq: int, events: list, origin: str = "a", epoch: str = "e", rank: int | None = None):  # type: ignore[no-untyped-def,type-arg]
    return EventBatch(
        seq=seq, ts=0.0, events=events, origin=origin, epoch=epoch, data_parallel_rank=rank
    )


def _stored(hashes: list[int | bytes], tokens: list[int], parent: int | None = None, **kw):  # type: ignore[no-untyped-def]
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=B if tokens else 0,
        medium=kw.pop("medium", "GPU"),
        **kw,
    )


@settings(
    max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    seed=st.integers(0, 2**16),
    rounds=st.integers(10, 40),
    restart=st.sampled_from([0.0, 0.05]),
    straggle=st.sampled_from([0.0, 0.3]),
    ttl=st.sampled_from([None, 3.0]),
    max_blocks=st.sampled_from([None, 40, 200]),
    table=st.booleans(),
)
def test_fleet_equals_reference(
    seed: int,
    rounds: int,
    restart: float,
    straggle: float,
    ttl: float | None,
    max_blocks: int | None,
    table: bool,
) -> None:
    """Two engines each run two DP ranks under one origin name; restarts leave
    stragglers of the retired epoch; some ranks go silent (ttl) or only heartbeat."""
    rng = random.Random(seed)
    clock = Clock()
    workload = RecordingWorkload(
        seed=seed,
        block_size=B,
        system_prompts=3,
        system_prompt_blocks=(1, 4),
        turn_tokens=(4, 40),
        conversations=12,
    )
    streams = [(f"engine-{e}", r) for e in range(2) for r in range(2)]

    def new_engine(i: int) -> SimulatedEngine:
        return SimulatedEngine(
            seed=seed + 31 * i + rng.randrange(1000),
            block_size=B,
            gpu_blocks=rng.choice((24, 48)),
            cpu_blocks=48,
            remote_blocks=64,
            workload=workload,
            origin=streams[i][0],
        )

    index = PrefixIndex(
        block_size=B, seed=seed, keep_removed=0, ttl=ttl, max_blocks=max_blocks, clock=clock
    )
    if table:
        index._table_min_blocks = 1  # every match through the numpy table
    reference = Reference(B, remember=False, ttl=ttl, max_blocks=max_blocks, clock=clock)
    fleet = [new_engine(i) for i in range(len(streams))]
    epochs = [f"e{i}-0" for i in range(len(streams))]
    seqs = [0] * len(streams)
    old: list[EventBatch] = []
    silent = rng.randrange(len(streams))
    for r in range(rounds):
        clock.now += 1.0
        for i, (origin, rank) in enumerate(streams):
            if ttl is not None and i == silent and r > rounds // 2:
                if r % 2 and r < rounds // 2 + 6:  # heartbeats only, then nothing
                    index.heartbeat(origin, rank)
                    reference.heartbeat((origin, rank))
                continue
            if rng.random() < restart:
                fleet[i] = new_engine(i)
                epochs[i] = f"e{i}-{rng.getrandbits(32):x}"
                seqs[i] = 0
            events = fleet[i].step_events()
            batch = _batch(seqs[i], events, origin, epochs[i], rank)
            seqs[i] += 1
            index.apply(batch)
            reference.apply(batch)
            old.append(batch)
            if straggle and old and rng.random() < straggle:
                late = rng.choice(old)  # a replay racing the live stream
                index.apply(late)
                reference.apply(late)
        for tokens, lora in _queries(workload, rng, B):
            expected = reference.match(tokens, lora)
            assert index.match(tokens, lora) == expected
    stats = index.statistics()
    assert stats.evicted == reference.evicted
    if ttl is not None and rounds >= 20:
        assert stats.expired >= 1
    if max_blocks is not None:
        assert sum(o.blocks for o in stats.origins.values()) <= max_blocks
    assert {(o.origin, o.data_parallel_rank) for o in stats.origins.values()} == set(
        reference.origins
    )


def test_data_parallel_ranks_of_one_origin_are_kept_apart() -> None:
    index = PrefixIndex(block_size=B)
    index.apply(_batch(0, [_stored([1, 2], T[:8])], rank=0))
    index.apply(_batch(0, [_stored([1, 2, 3], T[:12])], rank=1))  # its seq 0 is not a duplicate
    assert head(index.match(T)) == [
        PrefixMatch("a", 3, "GPU", data_parallel_rank=1),
        PrefixMatch("a", 2, "GPU", data_parallel_rank=0),
    ]
    assert index.statistics().duplicate_batches == 0
    assert set(index.statistics().origins) == {"a/dp0", "a/dp1"}
    assert index.streams() == [("a", 0), ("a", 1)]
    assert index.forget("a", 0)
    assert head(index.match(T)) == [PrefixMatch("a", 3, "GPU", data_parallel_rank=1)]
    assert index.forget("a")
    assert index.match(T) == []


def test_a_straggler_of_a_retired_epoch_is_dropped_and_counted() -> None:
    index = PrefixIndex(block_size=B)
    index.apply(_batch(0, [_stored([1], T[:4])], epoch="old"))
    index.apply(_batch(0, [_stored([5, 6], T[:8])], epoch="new"))
    late = _batch(1, [_stored([2], T[4:8], parent=1)], epoch="old")
    index.apply(late)  # without the rule this would wipe the new epoch's state
    assert head(index.match(T)) == [PrefixMatch("a", 2, "GPU")]
    stats = index.statistics()
    assert stats.retired_epoch_batches == 1
    assert stats.restarts == 1
    assert stats.origins["a"].epoch == "new"


def test_ttl_expires_a_silent_stream_and_a_heartbeat_keeps_it() -> None:
    clock = Clock()
    index = PrefixIndex(block_size=B, ttl=10.0, clock=clock)
    index.apply(_batch(0, [_stored([1], T[:4])], origin="quiet"))
    index.apply(_batch(0, [_stored([1], T[:4])], origin="beating"))
    for _ in range(3):
        clock.now += 6.0
        assert index.heartbeat("beating")
    assert not index.heartbeat("unknown")
    assert [m.origin for m in index.match(T)] == ["beating"]
    stats = index.statistics()
    assert stats.expired == 1
    assert set(stats.origins) == {"beating"}
    clock.now += 11.0
    assert index.expire() == [("beating", None)]


def test_capacity_evicts_the_least_recently_stored() -> None:
    index = PrefixIndex(block_size=B, max_blocks=3)
    index.apply(_batch(0, [_stored([1, 2], T[:8])], origin="x"))
    index.apply(_batch(0, [_stored([1], T[:4])], origin="y"))
    index.apply(_batch(1, [_stored([1], [], medium="CPU")], origin="x"))  # x's block 1 again
    index.apply(_batch(1, [_stored([9], T[4:8], parent=1)], origin="y"))  # 4 > 3: evict x/2
    stats = index.statistics()
    assert stats.evicted == 1
    assert stats.origins["x"].blocks == 1
    assert {m.origin: m.blocks for m in index.match(T)} == {"x": 1, "y": 2}


def test_tiers_and_scores_follow_the_weights() -> None:
    index = PrefixIndex(block_size=B, tier_weights={"GPU": 1.0, "CPU": 0.5})
    index.apply(
        _batch(
            0,
            [
                _stored([1, 2, 3], T[:12], medium="CPU"),
                _stored([2, 3], [], medium="GPU"),  # block 0 is only on CPU
            ],
            origin="cpu-first",
        )
    )
    index.apply(_batch(0, [_stored([1, 2], T[:8])], origin="gpu"))
    matches = index.match(T)
    assert [(m.origin, m.blocks, m.tiers, m.score) for m in matches] == [
        ("cpu-first", 3, {"CPU": 3}, 2.5),
        ("gpu", 2, {"GPU": 2}, 2.0),
    ]
    assert matches[0].medium == "GPU"  # the fastest tier holding the last block
    gpu_only = index.match(T, tier_weights={"GPU": 1.0, "CPU": 0.0})
    assert [(m.origin, m.score) for m in gpu_only] == [("cpu-first", 2.0), ("gpu", 2.0)]


def test_lora_name_alone_matches_vllm_lora_events() -> None:
    """vLLM repeats the adapter's name in every block's extra_keys."""
    index = PrefixIndex(block_size=B)
    keys = vllm_extra_keys(8, B, lora_name="sql")
    assert keys == [["sql"], ["sql"]]
    index.apply(_batch(0, [_stored([1, 2], T[:8], lora_name="sql", extra_keys=keys)]))
    assert head(index.match(T, lora_name="sql")) == [PrefixMatch("a", 2, "GPU")]
    assert head(index.match(T, lora_name="sql", extra_keys=keys)) == [PrefixMatch("a", 2, "GPU")]
    assert index.match(T) == []
    assert index.match(T, lora_name="other") == []


def test_cache_salt_keys_block_zero_only() -> None:
    keys = vllm_extra_keys(12, B, cache_salt="tenant-7")
    assert keys == [["tenant-7"], None, None]
    index = PrefixIndex(block_size=B)
    index.apply(_batch(0, [_stored([1, 2, 3], T[:12], extra_keys=keys)]))
    assert head(index.match(T, extra_keys=keys)) == [PrefixMatch("a", 3, "GPU")]
    assert index.match(T) == []  # an unsalted prompt shares nothing with a salted one


def test_multimodal_identifiers_with_offsets_as_vllm_computes_them() -> None:
    # An image of 6 placeholder tokens from token 2: blocks 0 and 1 overlap it.
    keys = vllm_extra_keys(12, B, mm_inputs=[("img-abc", 2, 6)], lora_name="L")
    assert keys == [["L", ["img-abc", 2]], ["L", ["img-abc", -2]], ["L"]]
    two = vllm_extra_keys(12, B, mm_inputs=[("a", 0, 2), ("b", 2, 4)])
    assert two == [[["a", 0], ["b", 2]], [["b", -2]], None]
    index = PrefixIndex(block_size=B)
    index.apply(_batch(0, [_stored([1, 2, 3], T[:12], lora_name="L", extra_keys=keys)]))
    assert head(index.match(T, "L", extra_keys=keys)) == [PrefixMatch("a", 3, "GPU")]
    moved = vllm_extra_keys(12, B, mm_inputs=[("img-abc", 1, 6)], lora_name="L")
    assert index.match(T, "L", extra_keys=moved) == []


def test_prompt_embedding_hashes_key_each_block() -> None:
    digests = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    keys = vllm_extra_keys(12, B, prompt_embeds_hashes=digests)
    assert keys == [[digests[0]], [digests[1]], [digests[2]]]
    index = PrefixIndex(block_size=B)
    index.apply(_batch(0, [_stored([1, 2, 3], T[:12], extra_keys=keys)]))
    assert head(index.match(T, extra_keys=keys)) == [PrefixMatch("a", 3, "GPU")]
    other = [digests[0], digests[1], hashlib.sha256(b"x").digest()]
    assert (
        index.match(T, extra_keys=vllm_extra_keys(12, B, prompt_embeds_hashes=other))[0].blocks == 2
    )


def test_bytes_and_engine_hash_queries_agree_with_match() -> None:
    index = PrefixIndex(block_size=B)
    index.apply(_batch(0, [_stored([1, 2, 3], T[:12])], origin="x"))
    index.apply(_batch(0, [_stored([1, 2], T[:8]), BlockRemoved(block_hashes=[2])], origin="y"))
    data = b"".join(t.to_bytes(4, "little") for t in T)
    assert index.match_bytes(data) == index.match(T)
    assert index.match_engine_hashes([1, 2, 3]) == index.match(T[:12])
    # y no longer holds 2, so it cannot translate it: the prompt ends after block 0.
    assert head(index.match_engine_hashes([1, 2], origin="y")) == [
        PrefixMatch("x", 1, "GPU"),
        PrefixMatch("y", 1, "GPU"),
    ]
    assert index.match_engine_hashes([77]) == []


def test_bad_tokens_are_refused_even_by_an_empty_index() -> None:
    index = PrefixIndex(block_size=B)
    with pytest.raises(ConfigError, match="token_ids"):
        index.match([1, 2, -3, 4])
    with pytest.raises(ConfigError, match="token_ids"):
        index.match([1, 2, 3.5, 4])  # type: ignore[list-item]
    assert index.match([1, 2, 3]) == []  # no full block


def test_tokens_of_64_bits_hash_apart_from_their_low_32_bits() -> None:
    index = PrefixIndex(block_size=B)
    wide = [1, 2, 3, (1 << 40) + 4]
    index.apply(_batch(0, [_stored([1], wide)]))
    assert head(index.match(wide)) == [PrefixMatch("a", 1, "GPU")]
    assert index.match([1, 2, 3, 4]) == []
    assert index.hashes(wide) != index.hashes([1, 2, 3, 4])


def test_a_long_prompt_that_misses_is_answered_from_its_first_block() -> None:
    index = PrefixIndex(block_size=B)
    long = list(range(1000, 1000 + 4 * 40))
    index.apply(_batch(0, [_stored(list(range(1, 41)), long)]))
    assert index.match(long)[0].blocks == 40
    other = [7, *long[1:]]  # block 0 differs: nothing else matters
    assert index.match(other) == []
    data = b"".join(t.to_bytes(4, "little") for t in other)
    assert index.match_bytes(data) == []
    with pytest.raises(ConfigError, match="token_ids"):
        index.match([*other[:-1], -1])  # still checked, though only block 0 is hashed
    salted = vllm_extra_keys(len(long), B, cache_salt="s")
    index.apply(_batch(1, [_stored(list(range(50, 90)), long, extra_keys=salted)]))
    assert index.match(long, extra_keys=salted)[0].blocks == 40


def test_a_heartbeat_for_an_origin_keeps_every_rank_of_it() -> None:
    clock = Clock()
    index = PrefixIndex(block_size=B, ttl=10.0, clock=clock)
    for rank in (0, 1):
        index.apply(_batch(0, [_stored([1], T[:4])], origin="dp", rank=rank))
    clock.now += 6.0
    assert index.heartbeat("dp", ...)
    clock.now += 6.0
    assert index.expire() == []  # both ranks were marked alive 6 s ago
    assert not index.heartbeat("nobody", ...)
