"""The codec contract: pure, synchronous, sans-IO.

A codec turns one [`EventBatch`][kvstream.events.EventBatch] into bytes and back. It
does no I/O and keeps no per-call state, so it can be tested and benchmarked
without an event loop and shared by every sink that uses it. Sinks never call
a codec themselves: the scheduler's encoding group
(`kvstream.sinks._encoding.EncodingGroup`) encodes each batch once per
equal codec, with `Codec.encode_screened()`, however many sinks share it.

Every caller uses the contract as declared here: no probing for optional
methods, no branching on `name`, no `except TypeError` to find a signature.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from kvstream.events import EventBatch

__all__ = ["Codec", "Refusal"]


class Refusal(NamedTuple):
    """An event a strict codec left out of a batch, and why."""

    #: Position of the event in the batch it came in.
    position: int
    event_type: str
    reason: str


@runtime_checkable
class Codec(Protocol):
    """Turns batches into bytes and back.

    Equal configurations must compare equal (and hash equal): sinks whose codecs
    are equal share one encoding of every batch.
    """

    #: Short name used in URLs (`?codec=json`) and logs.
    name: str
    #: True when an encoded batch carries its own end (JSON lines end in `\\n`),
    #: so a byte stream needs no extra framing.
    self_delimiting: bool

    def encode(self, batch: EventBatch) -> bytes:
        """Return the bytes of one batch (every event the codec writes)."""
        ...

    def encode_screened(self, batch: EventBatch) -> tuple[bytes, tuple[Refusal, ...]]:
        """Return the bytes of one batch and the events left out of them.

        A codec with a strict profile leaves out the events its consumers would
        reject and says why; the batch itself (and its `seq`) is always
        written. A codec without one returns `(encode(batch), ())`.
        """
        ...

    def decode(self, data: bytes) -> EventBatch:
        """Return the batch encoded in `data`.

        Raises [`DecodeError`][kvstream.errors.DecodeError] (and nothing else) for bytes
        that are not one valid batch. Bytes that do not carry the batch's
        `(origin, epoch, seq)` give `("", "", 0)`: use `decode_keyed()`.
        """
        ...

    def decode_keyed(self, data: bytes, *, seq: int, origin: str, epoch: str) -> EventBatch:
        """Return the batch in `data`, named `(origin, epoch, seq)` by its transport.

        A codec whose bytes carry their own name checks that it is this one and
        raises [`DecodeError`][kvstream.errors.DecodeError] when it is not.
        """
        ...
