"""The KV-event dialects of the engines, read into kvstream's events and written back out.

Every engine that publishes KV events over ZMQ sends the same batch,
`[ts, events, rank]`, but its events come in several shapes (see
`docs/vllm-wire.md` for the tables). Reading is per event and detects the
shape of each event by itself, so one stream may mix them:

* **vLLM map** (v0.26+, and TensorRT-LLM's vLLM-wire publisher):
  `{"type": "BlockStored", ...}`. Keys a later vLLM adds are kept in
  `metadata["wire"]["extra"]`.
* **vLLM positional** (older vLLM): `["BlockStored", f1, f2, ...]` of every
  length a version produced, trailing elements beyond the known fields kept in
  `metadata["wire"]["extra_positional"]`.
* **SGLang map** (since #37482): the vLLM map plus `cache_salt` and
  `session_id` on `BlockStored`; the batch's third element is its
  `attn_dp_rank`, read as the rank.
* **SGLang positional** (older SGLang): element 7 of `BlockStored`, where vLLM
  has `lora_name`, is a metadata map (kept in
  `metadata["wire"]["sglang_metadata"]`).

Fields kvstream's events do not have travel in `metadata["wire"]` (the key
`WIRE_KEY`), losslessly: values a JSON reader cannot hold
(bytes) are written `{"$bytes": "<hex>"}`. The encoders of this module
(profiles `sglang`, `sglang-positional` and `llm-d-2025-12`) write them
back where their dialect has the field; the vLLM profiles (in
`kvstream.codecs.msgpack`) leave them out, as strict vLLM readers refuse
unknown fields.

`dialect="auto"` (the default) reads all of the above. `dialect="vllm"`
refuses what only SGLang sends (a map at element 7, `cache_salt`,
`session_id`), naming the field; `dialect="sglang"` reads both.
`media="normalize"` maps `medium` through `kvstream.media`'s table,
keeping the raw spelling in `metadata["wire"]["medium"]`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Literal, TypeAlias

import msgspec

from kvstream.errors import ConfigError, DecodeError, shorten
from kvstream.events import (
    WIRE_KEY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    with_wire,
)
from kvstream.media import MediaPolicy, canonical_medium

__all__ = [
    "DIALECTS",
    "ENCODERS",
    "Dialect",
    "check_dialect",
    "read_event",
]

Dialect: TypeAlias = Literal["auto", "vllm", "sglang"]
DIALECTS: Final = ("auto", "vllm", "sglang")

STORED_FIELDS: Final = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
)
REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx", "locality")
#: BlockStored fields only SGLang's map events carry.
SGLANG_STORED_FIELDS: Final = ("cache_salt", "session_id")

#: tag -> (event type, positional field order, fewest fields any version sent).
_POSITIONAL: Final[dict[str, tuple[type[KVCacheEvent], tuple[str, ...], int]]] = {
    # vLLM's first KV events (2025) had 5 BlockStored fields (through lora_id) and
    # 1 BlockRemoved field; every later field was appended with a default.
    "BlockStored": (BlockStored, STORED_FIELDS, 5),
    "BlockRemoved": (BlockRemoved, REMOVED_FIELDS, 1),
    "AllBlocksCleared": (AllBlocksCleared, (), 0),
}
_KNOWN_MAP: Final[dict[str, frozenset[str]]] = {
    "BlockStored": frozenset((*STORED_FIELDS, "metadata")),
    "BlockRemoved": frozenset((*REMOVED_FIELDS, "metadata")),
    "AllBlocksCleared": frozenset(("metadata",)),
}
_TAGS: Final = "'BlockStored', 'BlockRemoved' or 'AllBlocksCleared'"
_LORA_NAME_AT: Final = STORED_FIELDS.index("lora_name")


def check_dialect(dialect: object) -> Dialect:
    if dialect not in DIALECTS:
        raise ConfigError(f"dialect: expected one of {', '.join(DIALECTS)}, got {dialect!r}")
    return dialect


# -- JSON-safe carriage of foreign values ------------------------------------------------


def to_json_safe(value: Any, depth: int = 0) -> Any:
    """`value` with bytes as `{"$bytes": hex}` and map keys as str (for `metadata`)."""
    if depth > 30:
        raise DecodeError("foreign field nested more than 30 deep")
    t = type(value)
    if t is bytes:
        return {"$bytes": value.hex()}
    if t is list or t is tuple:
        return [to_json_safe(v, depth + 1) for v in value]
    if t is dict:
        out: dict[str, Any] = {}
        for k, v in value.items():
            if type(k) is not str:
                raise DecodeError(f"foreign map key {shorten(k)}: expected str keys")
            out[k] = to_json_safe(v, depth + 1)
        return out
    return value


def from_json_safe(value: Any) -> Any:
    """The inverse of `to_json_safe()`."""
    t = type(value)
    if t is dict:
        if len(value) == 1 and type(value.get("$bytes")) is str:
            return bytes.fromhex(value["$bytes"])
        return {k: from_json_safe(v) for k, v in value.items()}
    if t is list:
        return [from_json_safe(v) for v in value]
    return value


# -- reading ------------------------------------------------------------------------------


def read_event(raw: Any, dialect: Dialect = "auto", media: MediaPolicy = "keep") -> KVCacheEvent:
    """One event from its decoded msgpack form, in any dialect (see the module doc).

    Raises `DecodeError` or an `InvalidEventError`
    naming the field, for an event no dialect can read.
    """
    wire: dict[str, Any] = {}
    if type(raw) is dict:
        tag = raw.get("type")
        spec = _POSITIONAL.get(tag) if type(tag) is str else None
        if spec is None:
            raise DecodeError(f"type: expected {_TAGS}, got {shorten(tag)}")
        cls = spec[0]
        known = _KNOWN_MAP[cls.type_name]
        fields: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, v in raw.items():
            if k in known:
                fields[k] = v
            elif k == "type":
                continue
            elif tag == "BlockStored" and k in SGLANG_STORED_FIELDS:
                if dialect == "vllm":
                    raise DecodeError(
                        f"BlockStored.{k}: an SGLang field, refused with dialect=vllm "
                        "(use dialect=auto or sglang)"
                    )
                wire[k] = to_json_safe(v)
            else:
                if type(k) is not str:
                    raise DecodeError(f"{tag}: expected str keys, got {shorten(k)}")
                extra[k] = to_json_safe(v)
        if extra:
            wire["extra"] = extra
    elif type(raw) is list:
        if not raw:
            raise DecodeError("expected a tagged event array, got an empty array")
        tag = raw[0]
        spec = _POSITIONAL.get(tag) if type(tag) is str else None
        if spec is None:
            raise DecodeError(f"tag (element 0): expected {_TAGS}, got {shorten(tag)}")
        cls, names, fewest = spec
        n = len(raw) - 1
        if n < fewest:
            raise DecodeError(
                f"{tag}: expected at least {fewest} fields after the tag "
                f"({', '.join(names[:fewest])}), got {n}"
            )
        fields = dict(zip(names, raw[1:], strict=False))
        if n > len(names):
            wire["extra_positional"] = to_json_safe(raw[1 + len(names) :])
        if tag == "BlockStored" and type(fields.get("lora_name")) is dict:
            if dialect == "vllm":
                raise DecodeError(
                    f"BlockStored.lora_name (element {_LORA_NAME_AT + 1}): expected a str or "
                    "nil, got a map (SGLang's metadata; use dialect=auto or sglang)"
                )
            wire["sglang_metadata"] = to_json_safe(fields.pop("lora_name"))
    else:
        raise DecodeError(f"expected an event (a tagged map or array), got {shorten(raw)}")
    if media == "normalize":
        medium = fields.get("medium")
        if type(medium) is str:
            canon = canonical_medium(medium)
            if canon is not None and canon != medium:
                wire["medium"] = medium
                fields["medium"] = canon
    if wire:
        fields["metadata"] = with_wire(fields.get("metadata"), wire, cls.type_name)
    return cls(**fields)


# -- writing: the profiles this module adds --------------------------------------------------


def _wire_of(e: KVCacheEvent) -> dict[str, Any]:
    meta = getattr(e, "metadata", None)
    if not meta:
        return {}
    wire = meta.get(WIRE_KEY)
    return wire if type(wire) is dict else {}


def _medium_out(e: BlockStored | BlockRemoved, wire: dict[str, Any]) -> str | None:
    raw = wire.get("medium")
    return raw if type(raw) is str else e.medium


def _tokens_out(e: BlockStored, wire: dict[str, Any]) -> list[Any]:
    """`token_ids` as SGLang sent them: EAGLE pairs are rebuilt from `metadata`."""
    tokens = e.token_ids
    nxt = wire.get("token_pairs_next")
    if type(nxt) is int and tokens:
        return [[t, n] for t, n in zip(tokens, [*tokens[1:], nxt], strict=True)]
    second = wire.get("token_pairs_second")
    if type(second) is list and len(second) == len(tokens):
        return [[t, n] for t, n in zip(tokens, second, strict=True)]
    return tokens


def _sglang_stored(e: BlockStored) -> Any:
    wire = _wire_of(e)
    out: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": e.block_hashes,
        "parent_block_hash": e.parent_block_hash,
        "token_ids": _tokens_out(e, wire),
        "block_size": e.block_size,
        "lora_id": e.lora_id,
        "medium": _medium_out(e, wire),
        "lora_name": e.lora_name,
    }
    for key in SGLANG_STORED_FIELDS:
        if key in wire and wire[key] is not None:
            out[key] = from_json_safe(wire[key])
    return out


def _sglang_removed(e: BlockRemoved) -> Any:
    wire = _wire_of(e)
    return {"type": "BlockRemoved", "block_hashes": e.block_hashes, "medium": _medium_out(e, wire)}


def _cleared_map(e: AllBlocksCleared) -> Any:
    return {"type": "AllBlocksCleared"}


def _sglang_pos_stored(e: BlockStored) -> Any:
    wire = _wire_of(e)
    meta = wire.get("sglang_metadata")
    return [
        "BlockStored",
        e.block_hashes,
        e.parent_block_hash,
        _tokens_out(e, wire),
        e.block_size,
        e.lora_id,
        _medium_out(e, wire),
        None if meta is None else from_json_safe(meta),
    ]


def _sglang_pos_removed(e: BlockRemoved) -> Any:
    return ["BlockRemoved", e.block_hashes, _medium_out(e, _wire_of(e))]


def _cleared_pos(e: AllBlocksCleared) -> Any:
    return ["AllBlocksCleared"]


# llm-d-kv-cache v0.4.0 (its release of Nov 2025, unchanged on main through
# Dec 2025) decodes with vmihailenco/msgpack v5.4.1: an event's fields after the
# tag must be exactly as many as its Go struct has (BlockStored 6, BlockRemoved 2,
# AllBlocksCleared 0), and a hash decoded into `any` becomes a uint64 only from
# msgpack's uint 64 or int 64 (or bin) forms: a hash written in fewer bytes is
# dropped by that reader, and a short parent hash drops its event.
_UINT64: Final = b"\xcf"
_INT64: Final = b"\xd3"


def _hash_64(h: int | bytes) -> Any:
    """A hash as llm-d's Dec-2025 reader takes it: an int in its 9-byte form, bytes as they are."""
    if isinstance(h, bytes):
        return h
    if h >= 0:
        return msgspec.Raw(_UINT64 + h.to_bytes(8, "big"))
    return msgspec.Raw(_INT64 + h.to_bytes(8, "big", signed=True))


def _llm_d_stored(e: BlockStored) -> Any:
    parent = e.parent_block_hash
    return [
        "BlockStored",
        [_hash_64(h) for h in e.block_hashes],
        None if parent is None else _hash_64(parent),
        e.token_ids,
        e.block_size,
        e.lora_id,
        e.medium,
    ]


def _llm_d_removed(e: BlockRemoved) -> Any:
    return ["BlockRemoved", [_hash_64(h) for h in e.block_hashes], e.medium]


_ToWire: TypeAlias = Callable[[Any], Any]

#: Output profile -> {event type: converter to plain msgpack data}. The batch
#: around them is vLLM's `[ts, events, rank]` for every profile.
ENCODERS: Final[dict[str, dict[type, _ToWire]]] = {
    # SGLang since #37482: tagged maps, cache_salt/session_id when set.
    "sglang": {
        BlockStored: _sglang_stored,
        BlockRemoved: _sglang_removed,
        AllBlocksCleared: _cleared_map,
    },
    # Older SGLang: tagged arrays, a metadata map (or nil) at element 7.
    "sglang-positional": {
        BlockStored: _sglang_pos_stored,
        BlockRemoved: _sglang_pos_removed,
        AllBlocksCleared: _cleared_pos,
    },
    # llm-d-kv-cache's decoder of Dec 2025 (v0.4.0): tagged arrays of exactly
    # BlockStored tag + 6, BlockRemoved tag + 2, AllBlocksCleared tag; 64-bit hashes.
    "llm-d-2025-12": {
        BlockStored: _llm_d_stored,
        BlockRemoved: _llm_d_removed,
        AllBlocksCleared: _cleared_pos,
    },
}
