"""Codecs: pure, synchronous batch <-> bytes converters."""

from kvstream.codecs.base import Codec
from kvstream.codecs.json import JsonCodec

__all__ = ["Codec", "JsonCodec"]
