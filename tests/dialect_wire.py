"""The other engines' KV-event structs, declared from their documented shapes (WIRE.md).

Like tests/vllm_wire.py, these are independent of kvstream's codec: the dialect
tests publish with them (as SGLang, an older vLLM or TensorRT-LLM would) and
read kvstream's output with them (as those consumers would: unknown fields
refused). Running this file writes tests/golden/dialects.json from them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import vllm_wire as vllm

_MAP: dict[str, Any] = {"tag_field": "type", "omit_defaults": True, "forbid_unknown_fields": True}

# -- vLLM positional: every layout length a version sent ------------------------------------


class VllmStoredV1(msgspec.Struct, tag="BlockStored", array_like=True):
    """vLLM's first KV events: 5 fields."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class VllmStoredPos(VllmStoredV1, tag="BlockStored", array_like=True):
    """vLLM before ``locality`` (tag + 11)."""

    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmStoredPosLocality(VllmStoredPos, tag="BlockStored", array_like=True):
    locality: str | None = None


class VllmRemovedPos(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VllmClearedPos(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


# -- SGLang: map events (since #37482) and positional with a metadata map at index 7 ---------


class SglangStored(msgspec.Struct, tag="BlockStored", **_MAP):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int | tuple[int, int]]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    cache_salt: str | None = None
    session_id: str | None = None


class SglangRemoved(msgspec.Struct, tag="BlockRemoved", **_MAP):
    block_hashes: list[int]
    medium: str | None


class SglangCleared(msgspec.Struct, tag="AllBlocksCleared", **_MAP):
    pass


class SglangStoredPos(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int | tuple[int, int]]
    block_size: int
    lora_id: int | None
    medium: str | None
    metadata: dict[str, Any] | None


class SglangRemovedPos(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[int]
    medium: str | None


class SglangStoredPosNoMeta(msgspec.Struct, tag="BlockStored", array_like=True):
    """SGLang's positional BlockStored without the metadata map (tag + 6, medium optional)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int | tuple[int, int]]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SglangBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None


SGLANG_MAP = SglangStored | SglangRemoved | SglangCleared
sglang_map_decoder = msgspec.msgpack.Decoder(
    msgspec.defstruct(
        "SglangMapBatch",
        [("ts", float), ("events", list[SGLANG_MAP]), ("attn_dp_rank", int | None)],
        array_like=True,
    )
)
sglang_pos_decoder = msgspec.msgpack.Decoder(
    msgspec.defstruct(
        "SglangPosBatch",
        [
            ("ts", float),
            ("events", list[SglangStoredPos | SglangRemovedPos | VllmClearedPos]),
            ("attn_dp_rank", int | None),
        ],
        array_like=True,
    )
)


sglang_pos_no_meta_decoder = msgspec.msgpack.Decoder(
    msgspec.defstruct(
        "SglangPosNoMetaBatch",
        [
            ("ts", float),
            ("events", list[SglangStoredPosNoMeta | SglangRemovedPos | VllmClearedPos]),
            ("attn_dp_rank", int | None),
        ],
        array_like=True,
    )
)


# -- llm-d-kv-cache's reader of Dec 2025 ----------------------------------------------------------
#
# llm-d-kv-cache v0.4.0 (tag of 2025-11-21; pkg/kvcache/kvevents unchanged on main
# through 2025-12-28) reads a payload in pool.go's processEvent/digestEvents with
# vmihailenco/msgpack v5.4.1. Modelled here from that source, not from kvstream:
#
# * the batch is a Go struct decoded from an array: exactly 3 elements
#   (TS float64, Events []RawMessage, DataParallelRank *int), else the batch is dropped;
# * each event is an array, tag first; the rest is re-encoded as an array and decoded
#   into the tag's struct, which must have exactly that many fields (the library's
#   "number of fields in array-encoded struct has changed"), except that an empty
#   rest gives the zero struct; otherwise the event is skipped;
# * BlockStored: BlockHashes []any, ParentBlockHash any, TokenIds []uint32,
#   BlockSize int, LoraID *int, Medium *string (6); BlockRemoved: BlockHashes []any,
#   Medium *string (2); AllBlocksCleared: none;
# * a hash decoded into `any` is uint64 or int64 only from msgpack's 9-byte int forms
#   (smaller ones become uint8..int32, which getHashAsUint64 refuses); bin gives its
#   last 8 bytes big-endian (left-padded when shorter, refused when empty). A refused
#   block hash is skipped; a refused parent hash skips the event.

LLM_D_2025_12_FIELDS = {"BlockStored": 6, "BlockRemoved": 2, "AllBlocksCleared": 0}
_RAWS = msgspec.msgpack.Decoder(list[msgspec.Raw])
_STR = msgspec.msgpack.Decoder(str)
_LLM_D_FIELD_TYPES: dict[str, tuple[Any, ...]] = {
    "BlockStored": (
        list[msgspec.Raw] | None,
        msgspec.Raw,
        list[int] | None,
        int,
        int | None,
        str | None,
    ),
    "BlockRemoved": (list[msgspec.Raw] | None, str | None),
}


class LlmdEvent(msgspec.Struct, frozen=True):
    """What llm-d's Dec-2025 reader takes from one event: the uint64 keys it indexes."""

    tag: str
    keys: list[int]
    parent: int | None = None
    token_ids: list[int] | None = None
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None


def _llm_d_hash(raw: msgspec.Raw) -> int | None:
    data = bytes(raw)
    code = data[0]
    if code == 0xCF:  # uint 64
        return int.from_bytes(data[1:9], "big")
    if code == 0xD3:  # int 64, taken as its two's complement
        return int.from_bytes(data[1:9], "big")
    if code in (0xC4, 0xC5, 0xC6):
        digest = msgspec.msgpack.decode(data)
        return int.from_bytes(digest[-8:], "big") if digest else None
    return None


def llm_d_2025_12_read(payload: bytes) -> tuple[list[LlmdEvent], list[str]]:
    """The events llm-d-kv-cache's Dec-2025 reader keeps, and why it skipped the others.

    Raises `ValueError` when it drops the whole batch.
    """
    batch = _RAWS.decode(payload)
    if len(batch) != 3:
        raise ValueError(f"batch: 3 elements expected, got {len(batch)}")
    msgspec.msgpack.decode(batch[0], type=float)
    msgspec.msgpack.decode(batch[2], type=int | None)
    kept: list[LlmdEvent] = []
    skipped: list[str] = []
    for i, raw in enumerate(_RAWS.decode(batch[1])):
        try:
            parts = _RAWS.decode(raw)
            tag = _STR.decode(parts[0])
        except (msgspec.DecodeError, IndexError):
            skipped.append(f"event {i}: not a tagged array")
            continue
        n = LLM_D_2025_12_FIELDS.get(tag)
        if n is None:
            skipped.append(f"event {i}: unknown tag {tag!r}")
            continue
        rest = parts[1:]
        if rest and len(rest) != n:
            skipped.append(f"event {i}: {tag} has {n} fields, got {len(rest)}")
            continue
        if not rest or tag == "AllBlocksCleared":
            kept.append(LlmdEvent(tag, []))
            continue
        try:
            fields = [
                msgspec.msgpack.decode(part, type=t)
                for part, t in zip(rest, _LLM_D_FIELD_TYPES[tag], strict=True)
            ]
        except msgspec.ValidationError as exc:
            skipped.append(f"event {i}: {tag}: {exc}")
            continue
        keys = []
        for j, h in enumerate(fields[0] or []):
            key = _llm_d_hash(h)
            if key is None:
                skipped.append(f"event {i}: {tag} hash {j}: unsupported form {bytes(h).hex()}")
            else:
                keys.append(key)
        if tag == "BlockRemoved":
            kept.append(LlmdEvent(tag, keys, medium=fields[1]))
            continue
        parent_raw: msgspec.Raw = fields[1]
        parent = None
        if bytes(parent_raw) != b"\xc0":
            parent = _llm_d_hash(parent_raw)
            if parent is None:
                skipped.append(f"event {i}: {tag} parent hash: unsupported form")
                continue
        tokens = fields[2]
        if tokens is not None and not all(0 <= t < 2**32 for t in tokens):
            skipped.append(f"event {i}: {tag} token ids: not uint32")
            continue
        kept.append(LlmdEvent(tag, keys, parent, tokens, fields[3], fields[4], fields[5]))
    return kept, skipped


# -- one message per dialect ------------------------------------------------------------------

SLIDING = list(range(100, 112))  # three blocks of 4 tokens; the first two skipped (null)


def cases() -> list[dict[str, Any]]:
    """(name, dialect, batch struct) of every golden message."""
    digest = bytes(range(32))
    return [
        {
            "name": "vllm-map-sliding-window-and-digest",
            "dialect": "vllm map (v0.26+)",
            "batch": vllm.KVEventBatch(
                1767225600.5,
                [
                    # A sliding-window group: 3 blocks of tokens, 1 hash (2 null blocks skipped).
                    vllm.BlockStored(
                        [0xDAB89BAA7B585700],
                        None,
                        SLIDING,
                        4,
                        None,
                        "GPU",
                        None,
                        group_idx=1,
                        kv_cache_spec_kind="sliding_window",
                        kv_cache_spec_sliding_window=4,
                    ),
                    vllm.BlockStored([digest], None, [1, 2, 3, 4], 4, None, "STORAGE", None),
                    vllm.BlockRemoved([0xDAB89BAA7B585700], "GPU", group_idx=1),
                    vllm.AllBlocksCleared(),
                ],
                0,
            ),
        },
        {
            "name": "vllm-positional-every-length",
            "dialect": "vllm positional (older vLLM)",
            "batch": vllm.KVEventBatch(
                1767225601.0,
                [
                    VllmStoredV1([7], None, [1, 2], 2, None),  # type: ignore[list-item]
                    VllmStoredPos([8], 7, [3, 4], 2, None, "CPU", None),  # type: ignore[list-item]
                    VllmStoredPosLocality([9], 8, [5, 6], 2, None, "GPU", None, locality="LOCAL"),  # type: ignore[list-item]
                    VllmRemovedPos([7], "CPU"),  # type: ignore[list-item]
                    VllmClearedPos(),  # type: ignore[list-item]
                ],
                1,
            ),
        },
        {
            "name": "sglang-map-eagle-partial-signed",
            "dialect": "sglang map (since #37482)",
            "batch": SglangBatch(
                1767225602.25,
                [
                    SglangStored(
                        [-4242],
                        None,
                        [(11, 12), (12, 13), (13, 14), (14, 15)],
                        4,
                        None,
                        "GPU",
                        None,
                        cache_salt="salt-1",
                        session_id="sess-9",
                    ),
                    SglangStored([-17], -4242, [21, 22, 23], 3, None, "CPU_PINNED", None),
                    SglangRemoved([-17], "CPU_PINNED"),
                    SglangCleared(),
                ],
                2,
            ),
        },
        {
            "name": "sglang-positional-metadata",
            "dialect": "sglang positional (older SGLang)",
            "batch": SglangBatch(
                1767225603.0,
                [
                    SglangStoredPos(
                        [31, 32], None, [1, 2, 3, 4], 2, None, "DISK", {"priority": 3, "tier": "l2"}
                    ),
                    SglangStoredPos([33], 32, [5], 1, None, "GPU", None),
                    SglangRemovedPos([31], "DISK"),
                ],
                0,
            ),
        },
        {
            "name": "trtllm-vllm-wire",
            "dialect": "TensorRT-LLM (vLLM wire, map events)",
            "batch": vllm.KVEventBatch(
                1767225604.0,
                [
                    vllm.BlockStored([5, 6], None, list(range(64)), 32, None, "GPU", None),
                    vllm.BlockRemoved([5], "GPU"),
                ],
                None,
            ),
        },
    ]


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def golden() -> list[dict[str, Any]]:
    out = []
    for case in cases():
        payload = msgspec.msgpack.encode(case["batch"])
        out.append(
            {
                "name": case["name"],
                "dialect": case["dialect"],
                "decoded": _jsonable(msgspec.msgpack.decode(payload)),
                "msgpack_hex": payload.hex(),
            }
        )
    return out


GOLDEN = Path(__file__).parent / "golden" / "dialects.json"

if __name__ == "__main__":  # pragma: no cover - regenerates the golden file
    GOLDEN.write_text(json.dumps(golden(), indent=1) + "\n")
    sys.stdout.write(f"wrote {GOLDEN}\n")
