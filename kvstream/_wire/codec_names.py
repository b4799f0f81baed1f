"""A codec by the name a peer announces (a socket sink's welcome, a broker's codec header).

A subscriber is given how to find a codec by name (`codecs=`): through a URL,
`kvstream.config` hands it the registry's lookup (kvstream's codecs and every
installed plug-in's, with the URL's options); built by hand, it knows
kvstream's own codecs, with their default options (`builtin_codec`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

from kvstream.codecs.base import Codec
from kvstream.codecs.json import JsonCodec
from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.errors import ConfigError

__all__ = ["CodecByName", "builtin_codec"]

#: `name -> Codec`, raising `ConfigError` for a name it does not know.
CodecByName: TypeAlias = Callable[[str], Codec]

_BUILTIN: tuple[type[JsonCodec] | type[MsgpackCodec], ...] = (JsonCodec, MsgpackCodec)


def builtin_codec(name: str) -> Codec:
    """kvstream's own codec called `name`, with its default options."""
    for cls in _BUILTIN:
        if cls.name == name:
            return cls()
    known = ", ".join(sorted(cls.name for cls in _BUILTIN))
    raise ConfigError(f"codec: unknown codec {name!r}; expected one of: {known}")
