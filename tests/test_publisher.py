"""The drop-in EventPublisher (kvstream.publisher): conversion, one batch per step, exit."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import strategies
import vllm_wire as vllm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream import AllBlocksCleared, BlockRemoved, BlockStored, MemorySink
from kvstream._wire.vllm_zmq import KVEventsConfig
from kvstream.errors import ClosedError, ConfigError, InvalidEventError, InvalidEventTypeError
from kvstream.publisher import EventPublisher, from_vllm_event, to_kvstream_event

# vLLM's current BlockStored (Aug 2026) adds fields kvstream's events do not have.


class BlockStoredAug2026(
    msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False, kw_only=False
):
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
    storage_tier: str | None = None
    source_node: str | None = None
    estimated_bandwidth_bps: float | None = None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's batch as its scheduler builds it: ``ts``, ``events``, rank default None."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def vllm_stored(i: int, **changes: Any) -> vllm.BlockStored:
    fields: dict[str, Any] = {
        "block_hashes": [i * 16 + b for b in range(4)],
        "parent_block_hash": None if i == 0 else i * 16 - 1,
        "token_ids": list(range(i, i + 16)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * 4,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    fields.update(changes)
    return vllm.BlockStored(**fields)


def kv_of(e: vllm.BlockStored) -> BlockStored:
    return BlockStored(**msgspec.structs.asdict(e))


# -- conversion -------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(event=strategies.events)
def test_a_vllm_struct_converts_to_the_event_it_was_made_from(event: Any) -> None:
    """Trusted or field by field, the result is the event kvstream itself would build."""
    plain = msgspec.structs.replace(event, metadata=None)
    struct = vllm.to_vllm(plain)
    assert from_vllm_event(struct) == plain
    assert to_kvstream_event(struct) == plain
    assert type(from_vllm_event(struct)) is type(plain)


def test_the_trusted_path_agrees_with_full_validation_on_a_run_of_steps() -> None:
    rng = random.Random(7)
    for i in range(2000):
        changes: dict[str, Any] = {}
        if rng.random() < 0.2:
            changes["medium"] = rng.choice(["CPU", "GPU", None, "STORAGE"])
        if rng.random() < 0.1:
            changes["kv_cache_spec_sliding_window"] = rng.randrange(1, 4096)
        if rng.random() < 0.1:
            changes["lora_name"] = rng.choice(["a", "adapter-7"])
        if rng.random() < 0.1:
            changes["extra_keys"] = None
        e = vllm_stored(i, **changes)
        assert from_vllm_event(e) == kv_of(e)


def test_fields_kvstream_lacks_travel_in_metadata() -> None:
    e = BlockStoredAug2026(
        [1, 2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "CPU", None, storage_tier="SSD"
    )
    converted = from_vllm_event(e)
    assert isinstance(converted, BlockStored)
    assert converted.metadata == {"storage_tier": "SSD"}
    plain = BlockStoredAug2026([1, 2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "CPU", None)
    assert from_vllm_event(plain).metadata is None  # type: ignore[attr-defined]


def test_extra_keys_tuples_become_lists() -> None:
    e = BlockStoredAug2026([1], None, [1, 2], 2, None, "GPU", None, extra_keys=[("salt", 3)])
    converted = from_vllm_event(e)
    assert isinstance(converted, BlockStored)
    assert converted.extra_keys == [["salt", 3]]


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"block_hashes": "abc"}, "block_hashes"),
        ({"block_hashes": [1, "2", 3, 4]}, "block_hashes[1]"),
        ({"block_hashes": [1, 2, 3, True]}, "block_hashes[3]"),
        ({"block_hashes": [1, 2, 3, 2**64]}, "block_hashes[3]"),
        ({"token_ids": None}, "token_ids"),
        ({"token_ids": ["a", *range(15)]}, "token_ids"),
        ({"token_ids": [*range(15), 1.5]}, "token_ids"),
        ({"token_ids": list(range(15))}, "token_ids"),
        ({"block_size": "4"}, "block_size"),
        ({"parent_block_hash": "p"}, "parent_block_hash"),
        ({"medium": 7}, "medium"),
        ({"medium": "\udcff"}, "medium"),
        ({"group_idx": -1}, "group_idx"),
        ({"kv_cache_spec_kind": 3}, "kv_cache_spec_kind"),
        ({"kv_cache_spec_sliding_window": "w"}, "kv_cache_spec_sliding_window"),
        ({"lora_id": "x"}, "lora_id"),
        ({"extra_keys": [None, None]}, "extra_keys"),
        ({"extra_keys": "abcd"}, "extra_keys"),
        ({"locality": 1}, "locality"),
    ],
)
def test_a_wrong_field_is_refused_by_name(changes: dict[str, Any], named: str) -> None:
    good = vllm_stored(3)
    from_vllm_event(good)  # the class's converter is warm: the bad one takes the trusted path
    with pytest.raises(InvalidEventError, match=re.escape(f"BlockStored.{named}")):
        from_vllm_event(vllm_stored(3, **changes))


def test_other_objects_are_refused_by_type() -> None:
    class Sample(msgspec.Struct, tag=True):
        id: int

    with pytest.raises(InvalidEventTypeError, match="expected a BlockStored"):
        from_vllm_event(Sample(1))
    with pytest.raises(InvalidEventTypeError, match="got str"):
        from_vllm_event("BlockStored")
    with pytest.raises(InvalidEventError, match=r"BlockRemoved\.block_hashes"):
        from_vllm_event(vllm.BlockRemoved(block_hashes="x", medium="GPU"))  # type: ignore[arg-type]
    assert from_vllm_event(vllm.AllBlocksCleared()) == AllBlocksCleared()
    assert from_vllm_event(vllm.BlockRemoved([5, b"\x01"], "CPU", 2)) == BlockRemoved(
        block_hashes=[5, b"\x01"], medium="CPU", group_idx=2
    )


# -- one batch per publish -------------------------------------------------------------


def test_each_publish_is_one_batch_with_the_callers_ts_and_rank() -> None:
    sink = MemorySink()
    with EventPublisher([sink], origin="engine", data_parallel_rank=2) as pub:
        pub.publish(KVEventBatch(ts=10.5, events=[vllm_stored(0)]))
        pub.publish(KVEventBatch(ts=11.5, events=[], data_parallel_rank=5))  # empty: a batch
        pub.publish(KVEventBatch(ts=12.5, events=[vllm_stored(1), vllm.AllBlocksCleared()]))
        pub.publish([kv_of(vllm_stored(2))])  # a list: the scheduler's clock
        pub.publish(())
    got = [(b.seq, b.ts, b.data_parallel_rank, len(b.events)) for b in sink.batches]
    assert got[:3] == [(0, 10.5, 2, 1), (1, 11.5, 5, 0), (2, 12.5, 2, 2)]
    assert [(s, r, n) for s, _, r, n in got[3:]] == [(3, 2, 1), (4, 2, 0)]
    assert sink.batches[2].events == [kv_of(vllm_stored(1)), AllBlocksCleared()]
    assert pub.statistics() == (5, 4, 0)


def test_the_default_rank_is_zero_not_none() -> None:
    sink = MemorySink()
    with EventPublisher([sink], origin="engine") as pub:
        pub.publish(KVEventBatch(ts=1.0, events=[]))
    assert sink.batches[0].data_parallel_rank == 0


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_10000_unpaused_publishes_from_a_thread_are_10000_batches(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice((0, 1, 2, 5)) for _ in range(10_000)]
    sink = MemorySink(max_batches=20_000)
    steps: list[list[Any]] = []
    n = 0
    for size in sizes:
        steps.append([vllm_stored(n + j) for j in range(size)])
        n += size
    pub = EventPublisher([sink], origin="engine")

    def engine() -> None:
        for i, events in enumerate(steps):
            pub.publish(KVEventBatch(ts=float(i), events=events))

    thread = threading.Thread(target=engine)
    thread.start()
    thread.join()
    pub.shutdown()
    assert len(sink.batches) == len(steps)
    for i, (batch, events) in enumerate(zip(sink.batches, steps, strict=True)):
        assert (batch.seq, batch.ts) == (i, float(i))
        assert batch.events == [kv_of(e) for e in events]


def test_a_bad_event_is_dropped_and_counted_the_rest_published(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = MemorySink()
    with EventPublisher([sink], origin="engine") as pub:
        pub.publish([vllm_stored(1), "not an event", vllm_stored(2, block_size="4")])
    assert sink.batches[0].events == [kv_of(vllm_stored(1))]
    assert pub.statistics() == (1, 1, 2)
    assert "event 1 of a step dropped" in caplog.text


def test_bad_batches_raise_in_the_callers_thread() -> None:
    with EventPublisher([MemorySink()], origin="engine") as pub:
        with pytest.raises(InvalidEventTypeError, match="ts"):
            pub.publish(KVEventBatch(ts="now", events=[]))  # type: ignore[arg-type]
        with pytest.raises(InvalidEventTypeError, match="data_parallel_rank"):
            pub.publish(KVEventBatch(ts=1.0, events=[], data_parallel_rank=-1))
        with pytest.raises(InvalidEventTypeError, match="expected a batch"):
            pub.publish(42)
    with pytest.raises(ConfigError, match="data_parallel_rank"):
        EventPublisher([MemorySink()], data_parallel_rank=-1)


def test_publish_after_shutdown_raises_a_runtime_error() -> None:
    pub = EventPublisher([MemorySink()], origin="engine")
    pub.shutdown()
    pub.shutdown()  # idempotent
    assert pub.closed
    with pytest.raises(ClosedError) as info:
        pub.publish([])
    assert isinstance(info.value, RuntimeError)  # as vLLM's publisher raises


# -- configuration --------------------------------------------------------------------------


@dataclasses.dataclass
class VllmKVEventsConfig:
    """vLLM's ``KVEventsConfig`` as vLLM declares it (a dataclass; publisher resolved after)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"


def test_get_publisher_config_resolves_the_endpoints_of_the_rank(tmp_path: Path) -> None:
    base = f"ipc://{tmp_path}/kv"
    config = VllmKVEventsConfig(
        enable_kv_cache_events=True, endpoint=base, replay_endpoint=base + "-replay"
    )
    pub = EventPublisher.from_kv_events_config(config, data_parallel_rank=1)
    try:
        resolved = pub.get_publisher_config()
        assert isinstance(resolved, VllmKVEventsConfig)
        assert (resolved.endpoint, resolved.replay_endpoint) == (
            base + "_dp1",
            base + "-replay_dp1",
        )
        assert config.endpoint == base  # the caller's object is left alone
    finally:
        pub.shutdown()
    pub = EventPublisher.from_kv_events_config(json.dumps({"endpoint": base}))
    try:
        resolved = pub.get_publisher_config()
        assert isinstance(resolved, KVEventsConfig)
        assert resolved.endpoint == base
    finally:
        pub.shutdown()
    with EventPublisher([MemorySink()]) as plain:
        assert plain.get_publisher_config() is None


def test_a_config_that_turns_publishing_off_is_refused() -> None:
    with pytest.raises(ConfigError, match="publishing is off"):
        EventPublisher.from_kv_events_config(VllmKVEventsConfig(enable_kv_cache_events=False))
    with pytest.raises(ConfigError, match="KVEventsConfig"):
        EventPublisher.from_kv_events_config(42)


@pytest.mark.parametrize(
    ("sinks", "named"),
    [
        ({"enable_kv_cache_events": True}, "got dict (vLLM's --kv-events-config? use"),
        (KVEventsConfig(endpoint="tcp://127.0.0.1:5557"), "from_kv_events_config(config)"),
        ("file:kv.jsonl", "got the str 'file:kv.jsonl' (a single URL goes in a list: [url])"),
        (7, "expected a list of sinks or sink URLs, got int"),
        (["file:kv.jsonl", None], "sinks[1]: expected a Sink or a sink URL, got NoneType None"),
    ],
)
def test_sinks_that_are_not_a_list_of_sinks_are_refused_and_nothing_is_made(
    sinks: Any, named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Iterated, a URL's characters or a config's keys each became a file sink here.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        EventPublisher(sinks)
    assert named in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_vllms_publisher_arguments_make_one(tmp_path: Path) -> None:
    pub = EventPublisher.zmq(
        data_parallel_rank=2, endpoint=f"ipc://{tmp_path}/e", buffer_steps=5, topic="t"
    )
    try:
        resolved = pub.get_publisher_config()
        assert (resolved.endpoint, resolved.buffer_steps, resolved.topic) == (
            f"ipc://{tmp_path}/e_dp2",
            5,
            "t",
        )
    finally:
        pub.shutdown()


# -- exit -------------------------------------------------------------------------------------


def test_flush_returns_once_every_published_step_reached_the_sinks() -> None:
    sink = MemorySink()
    pub = EventPublisher([sink], origin="engine")
    try:
        for i in range(200):
            pub.publish([vllm_stored(i)])
        pub.flush(10.0)
        assert [b.seq for b in sink.batches] == list(range(200))
    finally:
        pub.shutdown()
