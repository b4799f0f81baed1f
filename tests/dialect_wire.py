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


def llm_d_2025_12_accepts(payload: bytes) -> bool:
    """The Dec-2025 llm-d-kv-cache decoder's guard, as issue 14 reports it: exact lengths.

    It reads ``BlockStored`` as tag + 7 fields, ``BlockRemoved`` as tag + 2 and
    ``AllBlocksCleared`` as the tag alone, and rejects any other length.
    """
    ts, events, _rank = msgspec.msgpack.decode(payload)
    lengths = {"BlockStored": 8, "BlockRemoved": 3, "AllBlocksCleared": 1}
    return type(ts) is float and all(
        type(e) is list and e and lengths.get(e[0]) == len(e) for e in events
    )


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
                    VllmStoredV1([7], None, [1, 2], 2, None),
                    VllmStoredPos([8], 7, [3, 4], 2, None, "CPU", None),
                    VllmStoredPosLocality([9], 8, [5, 6], 2, None, "GPU", None, locality="LOCAL"),
                    VllmRemovedPos([7], "CPU"),
                    VllmClearedPos(),
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
