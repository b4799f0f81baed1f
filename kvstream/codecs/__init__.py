"""Codecs: pure, synchronous batch <-> bytes converters."""

from kvstream.codecs.base import Codec
from kvstream.codecs.json import JsonCodec
from kvstream.codecs.msgpack import MsgpackCodec

__all__ = ["Codec", "JsonCodec", "MsgpackCodec"]
