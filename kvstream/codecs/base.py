"""The codec contract: pure, synchronous, sans-IO.

A codec turns one :class:`~kvstream.events.EventBatch` into bytes and back. It
does no I/O and keeps no per-call state, so it can be tested and benchmarked
without an event loop and shared by every sink that uses it: the sinks' base
class encodes each batch once per codec instance, however many sinks share it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvstream.events import EventBatch

__all__ = ["Codec"]


@runtime_checkable
class Codec(Protocol):
    """Turns batches into bytes and back.

    ``decode`` raises :class:`~kvstream.errors.DecodeError` (and nothing else) for
    bytes that are not one valid batch.
    """

    #: Short name used in URLs (``?codec=json``) and logs.
    name: str
    #: True when an encoded batch carries its own end (JSON lines end in ``\\n``),
    #: so a byte stream needs no extra framing.
    self_delimiting: bool

    def encode(self, batch: EventBatch) -> bytes:
        """Return the bytes of one batch."""
        ...

    def decode(self, data: bytes) -> EventBatch:
        """Return the batch encoded in ``data``."""
        ...
