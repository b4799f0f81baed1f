"""vLLM's wire structs, field for field, and the per-event converters the msgpack codec encodes.

`kvstream.codecs.msgpack` picks a converter table by `(profile, metadata)`; the
structs here are the only place vLLM's declarations are mirrored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeAlias

import msgspec
from msgspec.structs import astuple

from kvstream.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored

# -- the structs: vLLM's declarations, field for field ---------------------------
#
# Each event's fields are declared once, in vLLM's order, and laid out twice by
# subclasses: as a tagged map ("type" first, fields at their default omitted) and
# as a tagged array (tag first, every field: msgspec never shortens arrays).
# ``locality`` and ``metadata`` come last, so each longer layout extends a shorter.


class StoredFields(msgspec.Struct, gc=False):
    """vLLM's `BlockStored` before `locality`."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class RemovedFields(msgspec.Struct, gc=False):
    """vLLM's `BlockRemoved` before `locality`."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class StoredMap(StoredFields, tag="BlockStored", tag_field="type", omit_defaults=True):
    locality: str | None = None


class StoredMapMeta(StoredMap):
    metadata: dict[str, Any] | None = None


class RemovedMap(RemovedFields, tag="BlockRemoved", tag_field="type", omit_defaults=True):
    locality: str | None = None


class RemovedMapMeta(RemovedMap):
    metadata: dict[str, Any] | None = None


class ClearedMap(
    msgspec.Struct, tag="AllBlocksCleared", tag_field="type", omit_defaults=True, gc=False
):
    pass


class ClearedMapMeta(ClearedMap):
    metadata: dict[str, Any] | None = None


class StoredPos(StoredFields, tag="BlockStored", array_like=True):
    pass


class StoredPosLocality(StoredPos):
    locality: str | None = None


class RemovedPos(RemovedFields, tag="BlockRemoved", array_like=True):
    pass


class RemovedPosLocality(RemovedPos):
    locality: str | None = None


class ClearedPos(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


class WireBatch(msgspec.Struct, array_like=True, gc=False):
    """vLLM's batch: always three elements."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None


class MapBatchIn(msgspec.Struct, array_like=True, gc=False):
    """Decoding fast path: map events straight into kvstream's own (validating) events."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# -- encoding: one function per (event type, profile), chosen by a table ------------------


def stored_map(e: BlockStored) -> Any:
    return StoredMap(
        e.block_hashes,
        e.parent_block_hash,
        e.token_ids,
        e.block_size,
        e.lora_id,
        e.medium,
        e.lora_name,
        e.extra_keys,
        e.group_idx,
        e.kv_cache_spec_kind,
        e.kv_cache_spec_sliding_window,
        e.locality,
    )


def stored_map_meta(e: BlockStored) -> Any:
    return StoredMapMeta(*astuple(e))  # the same fields in the same order (checked below)


if StoredMapMeta.__struct_fields__ != BlockStored.__struct_fields__:  # pragma: no cover
    raise ImportError("msgpack codec: StoredMapMeta's fields are not BlockStored's")


def stored_pos(e: BlockStored) -> Any:
    if e.locality is None:
        return StoredPos(
            e.block_hashes,
            e.parent_block_hash,
            e.token_ids,
            e.block_size,
            e.lora_id,
            e.medium,
            e.lora_name,
            e.extra_keys,
            e.group_idx,
            e.kv_cache_spec_kind,
            e.kv_cache_spec_sliding_window,
        )
    return StoredPosLocality(
        e.block_hashes,
        e.parent_block_hash,
        e.token_ids,
        e.block_size,
        e.lora_id,
        e.medium,
        e.lora_name,
        e.extra_keys,
        e.group_idx,
        e.kv_cache_spec_kind,
        e.kv_cache_spec_sliding_window,
        e.locality,
    )


def removed_map(e: BlockRemoved) -> Any:
    return RemovedMap(e.block_hashes, e.medium, e.group_idx, e.locality)


def removed_map_meta(e: BlockRemoved) -> Any:
    return RemovedMapMeta(e.block_hashes, e.medium, e.group_idx, e.locality, e.metadata)


def removed_pos(e: BlockRemoved) -> Any:
    if e.locality is None:
        return RemovedPos(e.block_hashes, e.medium, e.group_idx)
    return RemovedPosLocality(e.block_hashes, e.medium, e.group_idx, e.locality)


_CLEARED_MAP: Final = ClearedMap()
CLEARED_POS: Final = ClearedPos()


def cleared_map(e: AllBlocksCleared) -> Any:
    return _CLEARED_MAP


def cleared_map_meta(e: AllBlocksCleared) -> Any:
    return _CLEARED_MAP if e.metadata is None else ClearedMapMeta(e.metadata)


def cleared_pos(e: AllBlocksCleared) -> Any:
    return CLEARED_POS


ToWire: TypeAlias = Callable[[Any], Any]

#: (profile, metadata) -> {event type: converter}. Fixed at import time.
TO_WIRE: Final[dict[tuple[str, bool], dict[type, ToWire]]] = {
    ("map", False): {
        BlockStored: stored_map,
        BlockRemoved: removed_map,
        AllBlocksCleared: cleared_map,
    },
    ("map", True): {
        BlockStored: stored_map_meta,
        BlockRemoved: removed_map_meta,
        AllBlocksCleared: cleared_map_meta,
    },
    ("positional", False): {
        BlockStored: stored_pos,
        BlockRemoved: removed_pos,
        AllBlocksCleared: cleared_pos,
    },
}


MAP_TO_WIRE: Final = TO_WIRE[("map", False)]
MAP_META_TO_WIRE: Final = TO_WIRE[("map", True)]
