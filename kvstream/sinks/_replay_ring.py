"""The replay ring: what a sink has sent, oldest first, bounded in bytes.

A sink that lets readers catch up (the socket sink's subscribers, the ZMQ
sink's replay clients) keeps what it sent in a `ReplayRing`. Every item
has a **position** that counts the items ever appended, so a reader's cursor
stays valid while the ring moves and tells at once whether what it wants is
still held; every item also has an **offset** that counts the bytes appended
before it, so how far a reader is behind, in bytes, is a subtraction.

The ring holds at most `max_bytes` (each item costs what its owner says,
its bytes plus bookkeeping) and, optionally, `max_items` items; the oldest
go first. The newest item always stays, even when it alone is over the bound,
so a reader connected at the time can still take it.
"""

from __future__ import annotations

import sys
from typing import Generic, TypeVar

__all__ = ["Fifo", "ReplayRing"]

T = TypeVar("T")


class Fifo(Generic[T]):
    """A list with O(1) `append`, `popleft` and random access by index."""

    __slots__ = ("_head", "_items")

    def __init__(self) -> None:
        self._items: list[T] = []
        self._head = 0

    def __len__(self) -> int:
        return len(self._items) - self._head

    def __getitem__(self, i: int) -> T:
        return self._items[self._head + i]

    def append(self, item: T) -> None:
        self._items.append(item)

    def popleft(self) -> T:
        item = self._items[self._head]
        self._head += 1
        if self._head >= 1024 and self._head * 2 >= len(self._items):
            del self._items[: self._head]
            self._head = 0
        return item


class ReplayRing(Generic[T]):
    """Items oldest first, bounded in bytes (and optionally in count); see the module doc."""

    __slots__ = (
        "_base",
        "_head",
        "_items",
        "_offsets",
        "bytes",
        "end_offset",
        "max_bytes",
        "max_items",
    )

    def __init__(self, max_bytes: int, max_items: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_items = sys.maxsize if max_items is None else max_items
        # _items[i] is at position _base + i and starts at offset _offsets[i]. Those
        # before _head are evicted: None at once (the memory goes back), and dropped
        # from the lists a thousand or more at a time.
        self._items: list[T | None] = []
        self._offsets: list[int] = []
        self._head = 0
        self._base = 0
        #: What the items held cost.
        self.bytes = 0
        #: What every item ever appended cost: the offset of the next one.
        self.end_offset = 0

    def __len__(self) -> int:
        return len(self._items) - self._head

    @property
    def first_pos(self) -> int:
        """Position of the oldest item held (`end_pos` when empty)."""
        return self._base + self._head

    @property
    def end_pos(self) -> int:
        """Position the next item appended will have."""
        return self._base + len(self._items)

    def get(self, pos: int) -> T:
        """The item at position `pos` (`first_pos <= pos < end_pos`)."""
        item = self._items[pos - self._base]
        assert item is not None, "evicted"
        return item

    def offset(self, pos: int) -> int:
        """Bytes appended before position `pos` (held, or the end; older: the oldest's)."""
        i = pos - self._base
        if i >= len(self._items):
            return self.end_offset
        return self._offsets[max(i, self._head)]

    def push(self, item: T, cost: int) -> None:
        """`append()` for an owner that does not look at what was evicted (no list made)."""
        self._items.append(item)
        self._offsets.append(self.end_offset)
        self.end_offset += cost
        self.bytes += cost
        if self.bytes > self.max_bytes or len(self._items) - self._head > self.max_items:
            self._evict(None)

    def append(self, item: T, cost: int) -> list[tuple[int, T]]:
        """Add `item` costing `cost` bytes; return `(position, item)` of those evicted.

        The item just added is never evicted by its own append.
        """
        self._items.append(item)
        self._offsets.append(self.end_offset)
        self.end_offset += cost
        self.bytes += cost
        evicted: list[tuple[int, T]] = []
        self._evict(evicted)
        return evicted

    def _evict(self, out: list[tuple[int, T]] | None) -> None:
        """Drop the oldest items while over a bound (never the newest); `out` gets them."""
        items = self._items
        offsets = self._offsets
        head = self._head
        while len(items) - head > 1 and (
            self.bytes > self.max_bytes or len(items) - head > self.max_items
        ):
            self.bytes -= offsets[head + 1] - offsets[head]  # an item costs up to the next
            if out is not None:
                old = items[head]
                assert old is not None
                out.append((self._base + head, old))
            items[head] = None
            head += 1
        if head >= 1024 and head * 2 >= len(items):
            del items[:head]
            del offsets[:head]
            self._base += head
            head = 0
        self._head = head
