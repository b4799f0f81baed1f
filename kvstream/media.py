"""Storage tiers: one table of canonical `medium` names and the spellings the field uses.

Engines and connectors spell tiers about fifteen ways (vLLM `GPU`/`CPU`/
`STORAGE`, and `FS`/`OBJ` in v0.26.0 only; SGLang `CPU_PINNED`/`DISK`/
`EXTERNAL`; Dynamo's aliases; LMCache once sent a torch device repr). Strict
consumers fail closed on names they do not know (Dynamo #12456), so kvstream
can normalise `medium` on input (`media=normalize` on a decoder) to one of
the canonical names below. The raw spelling is kept in
`metadata["wire"]["medium"]`, and written back by the encoders of dialects
that had it (an SGLang stream relayed to SGLang keeps `CPU_PINNED`).

======================  =============================================================
canonical               aliases (matched case-insensitively, `-`/space as `_`)
======================  =============================================================
`GPU`                 `DEVICE`, `CUDA`, `HBM`, `device(type='cuda', ...)`
`CPU`                 `CPU_PINNED`, `CPU_TIER1`, `HOST`, `DRAM`
`DISK`                `CPU_TIER2`, `NVME`, `SSD`, `LOCAL_DISK`
`STORAGE`             `FS`, `OBJ`, `OBJECT`, `FILESYSTEM` (vLLM #48123)
`EXTERNAL`            `NETWORK`, `REMOTE`, `SHARED`
======================  =============================================================

`STORAGE` stays its own name: it is what current vLLM sends for disk and
object tiers, and what Dynamo maps to its disk tier.
"""

from __future__ import annotations

import re
from typing import Final, Literal, TypeAlias

from kvstream.errors import ConfigError

__all__ = [
    "CANONICAL_MEDIA",
    "MEDIA_ALIASES",
    "MediaPolicy",
    "canonical_medium",
    "check_media_policy",
]

#: What to do with `medium` on input: keep it as sent, or normalise it.
MediaPolicy: TypeAlias = Literal["keep", "normalize"]
MEDIA_POLICIES: Final = ("keep", "normalize")

CANONICAL_MEDIA: Final = ("GPU", "CPU", "DISK", "STORAGE", "EXTERNAL")

#: alias -> canonical name (keys upper-case, `-` and spaces as `_`).
MEDIA_ALIASES: Final[dict[str, str]] = {
    "DEVICE": "GPU",
    "CUDA": "GPU",
    "HBM": "GPU",
    "CPU_PINNED": "CPU",
    "CPU_TIER1": "CPU",
    "HOST": "CPU",
    "DRAM": "CPU",
    "CPU_TIER2": "DISK",
    "NVME": "DISK",
    "SSD": "DISK",
    "LOCAL_DISK": "DISK",
    "FS": "STORAGE",
    "OBJ": "STORAGE",
    "OBJECT": "STORAGE",
    "FILESYSTEM": "STORAGE",
    "NETWORK": "EXTERNAL",
    "REMOTE": "EXTERNAL",
    "SHARED": "EXTERNAL",
}

_TORCH_DEVICE: Final = re.compile(r"device\(type='(cuda|cpu)'(?:, index=\d+)?\)\Z")
_CANONICAL: Final = frozenset(CANONICAL_MEDIA)


def canonical_medium(medium: str) -> str | None:
    """The canonical name of `medium`, or None when the table does not know it."""
    if medium in _CANONICAL:
        return medium
    key = medium.strip().upper().replace("-", "_").replace(" ", "_")
    if key in _CANONICAL:
        return key
    alias = MEDIA_ALIASES.get(key)
    if alias is not None:
        return alias
    device = _TORCH_DEVICE.match(medium.strip())
    if device is not None:
        return "GPU" if device.group(1) == "cuda" else "CPU"
    return None


def check_media_policy(policy: object) -> MediaPolicy:
    if policy not in MEDIA_POLICIES:
        raise ConfigError(f"media: expected one of {', '.join(MEDIA_POLICIES)}, got {policy!r}")
    return policy
