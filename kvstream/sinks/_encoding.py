"""Encoding groups: each batch encoded once per codec, shared by every sink using it.

A scheduler owns one `EncodingGroup`. Every sink it feeds is joined to
the group's `SharedEncoding` for the sink's codec (codecs that compare
equal share one). The scheduler hands a batch to its sinks one after another,
so a shared encoding only has to remember the batch it encoded last: the first
sink that needs the batch encodes it, the others get the same bytes. Nothing
is cached on the batch itself, and nothing grows: a group holds one encoding
per codec.

A sink outside a scheduler has a private encoding of its own. Either way a sink
encodes when the batch is offered to it (on the scheduler's tick), so its
outbox holds encoded bytes and is bounded by what they really cost
(`held_bytes()`), and a sink whose transport has room can write at once
(see [`kvstream.sinks.base.Sink.write_nowait()`][kvstream.sinks.base.Sink.write_nowait]).
"""

from __future__ import annotations

from typing import Final, NamedTuple

from kvstream.codecs.base import Codec, Refusal
from kvstream.events import EventBatch

__all__ = ["OBJECT_EVENT_COST", "Encoded", "EncodingGroup", "SharedEncoding", "held_bytes"]

#: What CPython's bytes object adds to its payload (header and trailing NUL).
_BYTES_HEADER: Final = 33
#: Allocations at least this big are served by mmap in whole pages.
_MMAP_THRESHOLD: Final = 128 * 1024
_PAGE: Final = 4096


def held_bytes(nbytes: int) -> int:
    """What a `bytes` of `nbytes` costs the process, allocator rounding included."""
    size = nbytes + _BYTES_HEADER
    if size >= _MMAP_THRESHOLD:
        return (size + 16 + _PAGE - 1) // _PAGE * _PAGE  # the chunk header, whole pages
    return (size + 8 + 15) & ~15  # malloc's 16-byte granularity and its size word


class Encoded(NamedTuple):
    """One batch encoded by one codec."""

    data: bytes
    #: The events a strict codec left out of `data` (empty otherwise).
    refused: tuple[Refusal, ...]
    #: What `data` costs in memory (`held_bytes()`).
    cost: int


_NOTHING: Final = Encoded(b"", (), 0)
_MAKE: Final = tuple.__new__
#: What a sink without a codec (it hands over the events themselves) is charged
#: per queued event: the events it keeps alive, about what a 16-block event holds.
OBJECT_EVENT_COST: Final = 512


class SharedEncoding:
    """One codec's encodings, shared by the sinks that use it.

    `encode()` remembers the last batch it encoded, by identity: asking
    again for that batch (the next sink, or a sink retrying a full outbox)
    returns the same bytes without encoding again.
    """

    __slots__ = ("_last", "_last_batch", "codec", "encodes", "users")

    def __init__(self, codec: Codec | None) -> None:
        self.codec = codec
        self._last_batch: EventBatch | None = None
        self._last = _NOTHING
        #: Batches encoded (for tests and statistics: sharing shows as fewer encodes).
        self.encodes = 0
        #: Sinks joined to this encoding.
        self.users = 0

    def encode(self, batch: EventBatch) -> Encoded:
        """`batch` encoded (raises what the codec raises for a batch it cannot write)."""
        if batch is self._last_batch:
            return self._last
        codec = self.codec
        if codec is None:
            return Encoded(b"", (), len(batch.events) * OBJECT_EVENT_COST)
        data, refused = codec.encode_screened(batch)
        # tuple.__new__: the NamedTuple's own __new__ is a Python call, on every batch
        encoded = _MAKE(Encoded, (data, refused, held_bytes(len(data))))
        self.encodes += 1
        self._last_batch = batch
        self._last = encoded
        return encoded

    def __repr__(self) -> str:
        return f"<SharedEncoding {self.codec!r} users={self.users} encodes={self.encodes}>"


class EncodingGroup:
    """The encodings of one scheduler: one `SharedEncoding` per distinct codec."""

    __slots__ = ("_encodings",)

    def __init__(self) -> None:
        self._encodings: list[SharedEncoding] = []

    def encoding_for(self, codec: Codec | None) -> SharedEncoding:
        """The shared encoding of `codec` (codecs that compare equal share one)."""
        if codec is not None:
            for encoding in self._encodings:
                if encoding.codec == codec:
                    return encoding
        encoding = SharedEncoding(codec)
        if codec is not None:
            self._encodings.append(encoding)
        return encoding

    @property
    def encodings(self) -> tuple[SharedEncoding, ...]:
        return tuple(self._encodings)

    def forget(self) -> None:
        """Drop every remembered batch (after a tick handed its batches to every sink)."""
        for encoding in self._encodings:  # each lets go of its last batch and its bytes
            encoding._last_batch = None
            encoding._last = _NOTHING
