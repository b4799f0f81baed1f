"""The state keeper: its rules, its bound, and snapshot + stream == whole stream."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvstream.consumers._broker import as_snapshot_batch
from kvstream.errors import ConfigError
from kvstream.events import KVCacheEvent
from kvstream.sim import SimulatedEngine, check_consistency
from kvstream.state import (
    SNAPSHOT_EVENT_BLOCKS,
    Snapshot,
    StateError,
    StateKeeper,
    StateLimitError,
)


def _batch(seq: int, events: list[KVCacheEvent], origin: str = "o", epoch: str = "e") -> EventBatch:
    return EventBatch(seq=seq, ts=float(seq), events=events, origin=origin, epoch=epoch)


def _stored(hashes: list[Any], parent: Any = None, size: int = 2, **kw: Any) -> BlockStored:
    tokens = [t for h in hashes for t in ([7] * size)] if size else []
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size, **kw
    )


def _restored(snap: Snapshot) -> StateKeeper:
    keeper = StateKeeper()
    keeper.apply(as_snapshot_batch(snap.to_batch(), 0))
    return keeper


# -- the rules -----------------------------------------------------------------------


def test_stores_removes_and_clears_per_tier() -> None:
    k = StateKeeper()
    k.apply(_batch(0, [_stored([1, 2], medium="GPU"), _stored([1], medium="CPU")]))
    k.apply(_batch(1, [BlockRemoved(block_hashes=[2], medium="GPU")]))
    held = k.held("o")
    assert set(held) == {"GPU", "CPU"}
    assert list(held["GPU"]) == [1]
    assert held["CPU"][1].parent is None
    k.apply(_batch(2, [AllBlocksCleared()]))
    assert k.held("o") == {}
    assert k.position("o") == ("e", 3)


def test_block_i_has_the_block_before_it_as_parent() -> None:
    k = StateKeeper()
    k.apply(_batch(0, [_stored([1, 2, 3], parent=9)]))
    tier = k.held("o")[None]
    assert [tier[h].parent for h in (1, 2, 3)] == [9, 1, 2]


def test_unknown_removals_are_ignored_and_counted() -> None:
    k = StateKeeper()
    k.apply(_batch(0, [_stored([1]), BlockRemoved(block_hashes=[5, 1, 1])]))
    assert k.held("o") == {}
    assert k.statistics().unknown_removals == 2
    assert k.statistics().bytes == 0


def test_a_placeholder_never_replaces_a_block_held_with_tokens() -> None:
    k = StateKeeper()
    k.apply(_batch(0, [_stored([1, 2], size=2, lora_name="a")]))
    k.apply(_batch(1, [_stored([1, 3], size=0)]))
    tier = k.held("o")[None]
    assert tier[1].tokens is not None
    assert tier[1].shape.lora_name == "a"
    assert tier[3].tokens is None
    assert tier[3].parent == 1
    snap = k.snapshot("o")
    placeholders = [e for e in snap.events if isinstance(e, BlockStored) and e.block_size == 0]
    assert [e.block_hashes for e in placeholders] == [[3]]
    assert placeholders[0].token_ids == []
    assert _restored(snap).held("o") == k.held("o")


def test_a_store_with_tokens_replaces_a_placeholder_and_a_restore_replaces_fields() -> None:
    k = StateKeeper()
    k.apply(_batch(0, [_stored([1], size=0), _stored([2], size=1, lora_id=4)]))
    k.apply(_batch(1, [_stored([1], size=3), _stored([2], size=1, lora_id=5)]))
    tier = k.held("o")[None]
    assert tier[1].tokens is not None
    assert len(tier[1].tokens) == 3
    assert tier[2].shape.lora_id == 5


def test_repeats_are_ignored_and_new_epochs_start_empty() -> None:
    k = StateKeeper()
    k.apply(_batch(0, [_stored([1])]))
    k.apply(_batch(0, [_stored([2])]))  # a repeat
    assert list(k.held("o")[None]) == [1]
    k.apply(_batch(0, [_stored([3])], epoch="f"))
    assert list(k.held("o")[None]) == [3]
    assert k.position("o") == ("f", 1)


def test_after_a_gap_the_state_is_unknown_until_a_clear() -> None:
    k = StateKeeper()
    k.apply(_batch(0, [_stored([1])]))
    k.apply(_batch(2, [_stored([2])]))
    assert not k.known("o")
    assert k.held("o") == {}
    with pytest.raises(StateError, match=r"batches 1\.\.1 are missing"):
        k.snapshot("o")
    k.apply(_batch(3, [_stored([4]), AllBlocksCleared(), _stored([5])]))
    assert k.known("o")
    assert list(k.held("o")[None]) == [5]
    assert k.snapshot("o").resume_seq == 4


def test_a_late_first_batch_makes_the_state_unknown() -> None:
    k = StateKeeper()
    k.apply(_batch(7, [_stored([1])]))
    with pytest.raises(StateError, match="first batch seen of epoch e is seq 7"):
        k.snapshot("o")
    with pytest.raises(StateError, match="never seen"):
        k.snapshot("other")


def test_the_byte_bound_is_a_clear_error_and_memory_stays_bounded() -> None:
    k = StateKeeper(max_bytes=10_000)
    k.apply(_batch(0, [_stored([1, 2, 3], size=4)]))
    with pytest.raises(StateLimitError, match=r"origin 'o'.*max_bytes=10000"):
        k.apply(_batch(1, [_stored(list(range(10, 100)), size=4)]))
    stats = k.statistics()
    assert stats.bytes == 0
    assert stats.over_limit == 1
    with pytest.raises(StateError, match="bound of 10000 bytes"):
        k.snapshot("o")
    k.apply(_batch(2, [_stored([5])]))  # ignored: still unknown
    assert k.statistics().bytes == 0
    k.apply(_batch(3, [AllBlocksCleared(), _stored([6])]))
    assert k.known("o")
    assert 0 < k.statistics().bytes <= 10_000


def test_max_bytes_is_checked() -> None:
    with pytest.raises(ConfigError, match="max_bytes: expected an int >= 1, got 0"):
        StateKeeper(max_bytes=0)


def test_snapshot_is_clear_then_stores_in_parent_order_and_tagged() -> None:
    k = StateKeeper()
    # 3's parent 2 is stored after it; the snapshot must announce 2 first.
    k.apply(_batch(0, [_stored([3], parent=2), _stored([1]), _stored([2], parent=1)]))
    snap = k.snapshot("o")
    assert (snap.origin, snap.epoch, snap.resume_seq, snap.blocks) == ("o", "e", 1, 3)
    assert isinstance(snap.events[0], AllBlocksCleared)
    order = [h for e in snap.events[1:] if isinstance(e, BlockStored) for h in e.block_hashes]
    assert order == [1, 2, 3]
    assert len(snap.events) == 2  # one chain, one event
    batch = snap.to_batch()
    assert batch.seq == 0
    assert batch.events == snap.events


def test_long_chains_are_cut_and_cycles_do_not_hang() -> None:
    k = StateKeeper()
    n = SNAPSHOT_EVENT_BLOCKS * 2 + 3
    k.apply(_batch(0, [_stored(list(range(n)), size=1)]))
    # A parent cycle (only a contradictory stream makes one): 10**6 <-> 10**6 + 1.
    k.apply(_batch(1, [_stored([10**6], parent=10**6 + 1), _stored([10**6 + 1], parent=10**6)]))
    snap = k.snapshot("o")
    sizes = [len(e.block_hashes) for e in snap.events[1:] if isinstance(e, BlockStored)]
    assert sizes[:3] == [SNAPSHOT_EVENT_BLOCKS, SNAPSHOT_EVENT_BLOCKS, 3]
    assert snap.blocks == n + 2
    assert _restored(snap).held("o") == k.held("o")


def test_every_field_survives_a_snapshot() -> None:
    k = StateKeeper()
    k.apply(
        _batch(
            0,
            [
                _stored(
                    [b"\x01" * 32, -5],
                    parent=b"\x02",
                    size=2,
                    lora_id=3,
                    lora_name="x",
                    medium="DISK",
                    extra_keys=[["a", 1], None],
                    group_idx=2,
                    kv_cache_spec_kind="full",
                    kv_cache_spec_sliding_window=128,
                    locality="rack-1",
                )
            ],
        )
    )
    snap = k.snapshot("o")
    (stored,) = snap.events[1:]
    assert isinstance(stored, BlockStored)
    assert stored.extra_keys == [["a", 1], None]
    assert (stored.group_idx, stored.locality, stored.kv_cache_spec_sliding_window) == (
        2,
        "rack-1",
        128,
    )
    assert _restored(snap).held("o") == k.held("o")


def test_a_snapshot_batch_replaces_the_state_and_sets_the_position() -> None:
    source = StateKeeper()
    source.apply(_batch(0, [_stored([1])]))
    source.apply(_batch(1, [_stored([2], parent=1)]))
    consumer = StateKeeper()
    consumer.apply(_batch(0, [_stored([99])], epoch="old"))
    consumer.apply(as_snapshot_batch(source.snapshot("o").to_batch(), 0))
    assert consumer.position("o") == ("e", 2)
    assert consumer.held("o") == source.held("o")
    consumer.apply(_batch(1, [_stored([3])]))  # a repeat of what the snapshot holds
    assert consumer.held("o") == source.held("o")


# -- snapshot + the stream after it == the whole stream ------------------------------------

_POOL: st.SearchStrategy[int | bytes] = st.sampled_from([0, 1, 2, 3, 4, 5, b"\x07", -1])
_MEDIA = st.sampled_from([None, "GPU", "CPU"])


@st.composite
def _random_event(draw: st.DrawFn) -> KVCacheEvent:
    kind = draw(st.integers(0, 9))
    if kind < 6:
        n = draw(st.integers(1, 3))
        size = draw(st.sampled_from([0, 1, 2]))
        return BlockStored(
            block_hashes=draw(st.lists(_POOL, min_size=n, max_size=n)),
            parent_block_hash=draw(st.none() | _POOL),
            token_ids=draw(
                st.lists(st.integers(0, 2**64 - 1), min_size=n * size, max_size=n * size)
            ),
            block_size=size,
            medium=draw(_MEDIA),
            lora_name=draw(st.none() | st.just("l")),
            extra_keys=draw(st.none() | st.just([["k"]] * n)),  # type: ignore[arg-type]
            group_idx=draw(st.none() | st.integers(0, 1)),
            locality=draw(st.none() | st.just("here")),
        )
    if kind < 9:
        return BlockRemoved(block_hashes=draw(st.lists(_POOL, max_size=3)), medium=draw(_MEDIA))
    return AllBlocksCleared()


@st.composite
def _streams(draw: st.DrawFn) -> list[EventBatch]:
    """One or two origins, each over one or more epochs (restarts), interleaved."""
    per_origin: list[list[EventBatch]] = []
    for origin in ("a", "b")[: draw(st.integers(1, 2))]:
        out: list[EventBatch] = []
        for epoch in range(draw(st.integers(1, 3))):
            name = f"{origin}-{epoch}"
            if draw(st.booleans()):  # the simulated engine: evictions, offload, resets
                engine = SimulatedEngine(
                    seed=draw(st.integers(0, 2**16)),
                    block_size=4,
                    gpu_blocks=draw(st.integers(4, 24)),
                    cpu_blocks=draw(st.integers(8, 48)),
                    remote_blocks=draw(st.integers(8, 64)),
                    requests_per_step=2,
                    reset_every=draw(st.none() | st.integers(3, 12)),
                    origin=origin,
                )
                steps = [e for e in engine.iter_steps(draw(st.integers(1, 30))) if e]
            else:  # contradictory streams: placeholders, unknown removals, replaced blocks
                steps = draw(
                    st.lists(st.lists(_random_event(), max_size=4), min_size=1, max_size=12)
                )
            out.extend(
                EventBatch(seq=i, ts=float(i), events=ev, origin=origin, epoch=name)
                for i, ev in enumerate(steps)
            )
        per_origin.append(out)
    merged: list[EventBatch] = []
    while any(per_origin):
        choices = [q for q in per_origin if q]
        merged.append(draw(st.sampled_from(choices)).pop(0))
    return merged


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=_streams(), data=st.data())
def test_snapshot_then_the_rest_equals_the_whole_stream(
    stream: list[EventBatch], data: st.DataObject
) -> None:
    reference = StateKeeper()
    reference.apply_all(stream)
    cut = data.draw(st.integers(1, len(stream)), label="cut")
    producer = StateKeeper()
    producer.apply_all(stream[:cut])
    # A consumer joins after the cut: each origin's snapshot, then the stream from there.
    consumer = StateKeeper()
    snapshots = [producer.snapshot(o) for o in producer.origins()]
    for snap in snapshots:
        consumer.apply(as_snapshot_batch(snap.to_batch(), 0))
    for batch in stream[cut:]:
        consumer.apply(batch)
    assert sorted(consumer.origins()) == sorted(reference.origins())
    for origin in reference.origins():
        assert consumer.position(origin) == reference.position(origin)
        assert consumer.held(origin) == reference.held(origin)
    assert consumer.statistics().blocks == reference.statistics().blocks


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), steps=st.integers(1, 80), cut=st.integers(1, 80))
def test_a_snapshot_of_the_simulated_engine_is_a_consistent_stream(
    seed: int, steps: int, cut: int
) -> None:
    engine = SimulatedEngine(
        seed=seed, block_size=4, gpu_blocks=16, cpu_blocks=32, remote_blocks=48, reset_every=25
    )
    stream = [
        EventBatch(seq=i, ts=0.0, events=ev, origin="sim", epoch="e")
        for i, ev in enumerate(e for e in engine.iter_steps(steps) if e)
    ]
    if not stream:
        return
    cut = min(cut, len(stream))
    k = StateKeeper()
    k.apply_all(stream[:cut])
    snap = k.snapshot("sim")
    # Parents first: every store names a held parent; the rest of the stream follows on.
    check_consistency([snap.to_batch(), *stream[cut:]], start_seq=None)
    assert snap.blocks == sum(len(t) for t in k.held("sim").values())
