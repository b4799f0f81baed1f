"""Codec names and options to codecs: the built-in factories of `kvstream.codecs` entries."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstream.codecs.json import JsonCodec

if TYPE_CHECKING:
    from kvstream.codecs.msgpack import MsgpackCodec
    from kvstream.config import Options

__all__ = ["json_codec", "msgpack_codec"]


def json_codec(opts: Options) -> JsonCodec:
    """`codec=json` (`hash_strings=true` writes hashes as strings)."""
    return JsonCodec(hashes_as_strings=opts.pop_bool("hash_strings"))


def msgpack_codec(opts: Options) -> MsgpackCodec:
    """`codec=msgpack` and its options.

    `profile=map|positional|sglang|sglang-positional|llm-d-2025-12`,
    `metadata=true|false`, `strict=refuse|convert|off`,
    `strict_media=GPU,CPU,...`, `dialect=auto|vllm|sglang`,
    `media=keep|normalize`.
    """
    from kvstream.codecs._dialects import DIALECTS
    from kvstream.codecs.msgpack import PROFILES, STRICTNESS, MsgpackCodec
    from kvstream.media import MEDIA_POLICIES

    profile = opts.pop_choice("profile", PROFILES, "map")
    dialect = opts.pop_choice("dialect", DIALECTS, "auto")
    media_policy = opts.pop_choice("media", MEDIA_POLICIES, "keep")
    metadata = opts.pop_bool("metadata")
    strict = opts.pop_choice("strict", ("off", *STRICTNESS), "off")
    media = opts.pop_str("strict_media")
    return MsgpackCodec(
        profile=profile,  # type: ignore[arg-type]
        metadata=metadata,
        strict=None if strict == "off" else strict,  # type: ignore[arg-type]
        strict_media=None if media is None else [m.strip() for m in media.split(",") if m.strip()],
        dialect=dialect,  # type: ignore[arg-type]
        media=media_policy,  # type: ignore[arg-type]
    )
