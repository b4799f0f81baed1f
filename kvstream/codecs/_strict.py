"""Strict screening: what consumers that drop what they dislike (Dynamo) need of hashes and media.

Used by `kvstream.codecs.msgpack` for `strict="refuse"` and `strict="convert"`.
"""

from __future__ import annotations

from array import array
from typing import Final

from kvstream.events import BlockHash
from kvstream.media import CANONICAL_MEDIA

#: The tiers strict consumers know: every canonical name of `kvstream.media`
#: (`STORAGE` included) and SGLang's `CPU_PINNED`; any other `medium` is
#: refused in strict mode.
STRICT_MEDIA: Final = frozenset({*CANONICAL_MEDIA, "CPU_PINNED"})

U64_MASK: Final = (1 << 64) - 1


def u64(h: BlockHash) -> int:
    """A hash as strict consumers read it: bytes -> low 64 bits, negative -> unsigned."""
    if type(h) is bytes:
        return int.from_bytes(h, "big") & U64_MASK
    return h & U64_MASK  # type: ignore[operator]


def hashes_ok(hashes: list[BlockHash]) -> bool:
    """True when every hash is an integer in [0, 2**64) (checked in C)."""
    try:
        array("Q", hashes)  # type: ignore[type-var]
    except (TypeError, OverflowError):
        return False
    return True


def bad_hash_reason(event: str, hashes: list[BlockHash], parent: BlockHash | None) -> str:
    for i, h in enumerate(hashes):
        if type(h) is bytes:
            return (
                f"{event}.block_hashes[{i}] is {len(h)} bytes; strict consumers need "
                "64-bit unsigned integers (strict=convert sends the low 64 bits)"
            )
        if type(h) is int and h < 0:
            return (
                f"{event}.block_hashes[{i}] is negative ({h}); strict consumers need "
                "64-bit unsigned integers (strict=convert sends its unsigned form)"
            )
    if type(parent) is bytes:
        return (
            f"{event}.parent_block_hash is {len(parent)} bytes; strict consumers need "
            "a 64-bit unsigned integer (strict=convert sends the low 64 bits)"
        )
    return (
        f"{event}.parent_block_hash is negative ({parent!r}); strict consumers need "
        "a 64-bit unsigned integer (strict=convert sends its unsigned form)"
    )


def medium_reason(medium: str, media: frozenset[str]) -> str:
    return (
        f"medium {medium!r} is not one strict consumers know ({', '.join(sorted(media))}); "
        "they would count it as GPU"
    )
