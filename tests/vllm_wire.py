"""vLLM's KV-event structs, declared from WIRE.md, independent of kvstream's codec.

The ZMQ and relay tests use them on the far side of the wire: to decode what
kvstream's sink publishes as a vLLM consumer would (unknown fields refused, so a
leaked ``metadata`` fails), and to publish as a vLLM engine would (map profile:
fields at their default left out).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvstream.events import AllBlocksCleared as KvCleared
from kvstream.events import BlockRemoved as KvRemoved
from kvstream.events import BlockStored as KvStored
from kvstream.events import KVCacheEvent

_OPTIONS: dict[str, Any] = {
    "tag_field": "type",
    "omit_defaults": True,
    "forbid_unknown_fields": True,
}


class BlockStored(msgspec.Struct, tag="BlockStored", **_OPTIONS):
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


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", **_OPTIONS):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", **_OPTIONS):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None


decoder = msgspec.msgpack.Decoder(KVEventBatch)


def to_vllm(event: KVCacheEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """The vLLM struct a vLLM consumer should read for a kvstream event."""
    if isinstance(event, KvStored):
        fields = msgspec.structs.asdict(event)
        del fields["metadata"]
        return BlockStored(**fields)
    if isinstance(event, KvRemoved):
        return BlockRemoved(event.block_hashes, event.medium, event.group_idx, event.locality)
    assert isinstance(event, KvCleared)
    return AllBlocksCleared()
