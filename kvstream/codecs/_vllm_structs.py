"""vLLM's wire structs, field for field, and the per-event converters the msgpack codec encodes.

`kvstream.codecs.msgpack` picks a converter table by `(profile, metadata)`. The
map profile needs no struct of its own: kvstream's events are laid out as vLLM's
map events (`kvstream.events`), so they are written as they are (without their
`metadata` unless it is asked for). The positional profile's structs here are the
only place vLLM's declarations are mirrored.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Final, TypeAlias

import msgspec
from msgspec.structs import astuple, force_setattr

from kvstream.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored

# -- the structs: vLLM's declarations, field for field ---------------------------
#
# Each event's fields are declared once, in vLLM's order, and laid out by subclasses
# as a tagged array (tag first, every field: msgspec never shortens arrays).
# ``locality`` comes last, so the longer layout extends the shorter.


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


def without_metadata(e: BlockStored | BlockRemoved | AllBlocksCleared) -> Any:
    """vLLM's map event: the event itself, its `metadata` (not vLLM's) left out."""
    if e.metadata is None:
        return e
    out = copy.copy(e)  # checked already: a copy (msgspec's __copy__), not a new event
    force_setattr(out, "metadata", None)
    return out


def as_is(e: BlockStored | BlockRemoved | AllBlocksCleared) -> Any:
    """vLLM's map event with kvstream's `metadata` as one more key (when set)."""
    return e


def stored_pos(e: BlockStored) -> Any:
    fields = astuple(e)  # BlockStored's fields in vLLM's order, locality and metadata last
    if e.locality is None:
        return StoredPos(*fields[:_POS_FIELDS])
    return StoredPosLocality(*fields[: _POS_FIELDS + 1])


_POS_FIELDS: Final = len(StoredPos.__struct_fields__)
if BlockStored.__struct_fields__[: _POS_FIELDS + 1] != StoredPosLocality.__struct_fields__:
    raise ImportError(  # pragma: no cover
        "msgpack codec: StoredPosLocality's fields are not BlockStored's first ones"
    )


def removed_pos(e: BlockRemoved) -> Any:
    if e.locality is None:
        return RemovedPos(e.block_hashes, e.medium, e.group_idx)
    return RemovedPosLocality(e.block_hashes, e.medium, e.group_idx, e.locality)


CLEARED_POS: Final = ClearedPos()


def cleared_pos(e: AllBlocksCleared) -> Any:
    return CLEARED_POS


ToWire: TypeAlias = Callable[[Any], Any]

#: (profile, metadata) -> {event type: converter}. Fixed at import time.
TO_WIRE: Final[dict[tuple[str, bool], dict[type, ToWire]]] = {
    ("map", False): dict.fromkeys((BlockStored, BlockRemoved, AllBlocksCleared), without_metadata),
    ("map", True): dict.fromkeys((BlockStored, BlockRemoved, AllBlocksCleared), as_is),
    ("positional", False): {
        BlockStored: stored_pos,
        BlockRemoved: removed_pos,
        AllBlocksCleared: cleared_pos,
    },
}


MAP_TO_WIRE: Final = TO_WIRE[("map", False)]
MAP_META_TO_WIRE: Final = TO_WIRE[("map", True)]
