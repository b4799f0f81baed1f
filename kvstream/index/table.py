"""A numpy copy of the index's nodes (own hash -> holders) for lookups of a whole prompt at once.

A dict lookup per block costs three cache misses at a million blocks (the
dict's index, its entry, the key object), one after the other. This table is
two uint64 arrays (keys, values) with open addressing and linear probing: all
of a prompt's hashes are probed in one vectorized pass, so their misses overlap.

It is a cache, kept in step lazily: the index records which own hashes it
changed (`NodeTable.dirty`), and `NodeTable.sync()` writes their
current values before the next lookup. A key whose value became 0 stays, with
value 0 (a miss); the table is rebuilt from the dict when dead and live keys
fill half of it. Holders wider than 64 bits (many streams times many tiers)
cannot be stored: the index then looks up in the dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import repeat
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    U64 = npt.NDArray[np.uint64]

__all__ = ["NodeTable"]

_MIN_CAPACITY: Final = 1 << 12
#: slots read at once per key by a lookup
_WINDOW: Final = 8
_OFFSETS: Any = None  # numpy's arange(_WINDOW), made on first use


class NodeTable:
    """Rows of (own hash + 1, holders): 0 marks an empty slot; capacity a power of two.

    A key and its value share a 16-byte row, so a probe costs one cache miss.
    """

    __slots__ = ("_mask", "_rows", "_used", "dirty")

    def __init__(self) -> None:
        import numpy as np  # imported on first use: `import kvstream` stays light

        global _OFFSETS
        if _OFFSETS is None:
            _OFFSETS = np.arange(_WINDOW, dtype=np.uint64)

        self._rows: Any = np.zeros((_MIN_CAPACITY, 2), dtype=np.uint64)
        self._mask = _MIN_CAPACITY - 1
        self._used = 0
        #: own hashes changed in the dict since the last sync (a dict of ints, None:
        #: unlike a set, the garbage collector does not track it)
        self.dirty: dict[int, None] = {}

    @property
    def nbytes(self) -> int:
        return int(self._rows.nbytes)

    def sync(self, nodes: Mapping[int, int]) -> bool:
        """Write the dirty keys' current values; False if one does not fit in 64 bits."""
        if not self.dirty:
            return True
        import numpy as np

        keys = list(self.dirty)
        values = list(map(nodes.get, keys, repeat(0)))
        self.dirty.clear()  # in place: the index holds this dict
        try:
            v = np.array(values, dtype=np.uint64)
        except OverflowError:
            return False
        k = np.array(keys, dtype=np.uint64) + np.uint64(1)
        if 5 * (self._used + len(k)) > 3 * len(self._rows):  # over 60% full
            self.rebuild(nodes)
            return True
        self._upsert(k, v)
        return True

    def rebuild(self, nodes: Mapping[int, int]) -> None:
        """Start afresh from the dict's live entries (dead keys go). Raises
        OverflowError when a value does not fit in 64 bits."""
        import numpy as np

        n = len(nodes)
        capacity = _MIN_CAPACITY
        while capacity < 2 * n:
            capacity *= 2
        self._rows = np.zeros((capacity, 2), dtype=np.uint64)
        self._mask = capacity - 1
        self._used = 0
        self.dirty.clear()
        if n:
            k = np.fromiter(nodes.keys(), dtype=np.uint64, count=n) + np.uint64(1)
            v = np.fromiter(nodes.values(), dtype=np.uint64, count=n)
            self._upsert(k, v)

    def _upsert(self, k: U64, v: U64) -> None:
        """Set `k -> v` for distinct keys `k`, probing all of them at once."""
        import numpy as np

        rows = self._rows
        mask = np.uint64(self._mask)
        slot = k & mask
        pending = np.arange(len(k))
        while len(pending):
            s = slot[pending]
            found = np.take(rows, s, axis=0)[:, 0]
            hit = found == k[pending]
            if hit.any():
                rows[s[hit], 1] = v[pending[hit]]
            empty = found == 0
            claim = pending[empty]
            if len(claim):
                # Several new keys may probe the same empty slot: the first one takes it,
                # the others see it taken on the next round and probe on.
                _, first = np.unique(slot[claim], return_index=True)
                won = claim[first]
                rows[slot[won], 0] = k[won]
                rows[slot[won], 1] = v[won]
                self._used += len(won)
                empty[np.searchsorted(pending, won)] = False
                hit |= np.isin(pending, won, assume_unique=True)
            moving = pending[~hit & ~empty]
            slot[moving] = (slot[moving] + np.uint64(1)) & mask
            pending = pending[~hit]

    def lookup(self, own: Any) -> Any:
        """Holders of each own hash (a uint64 array), 0 where none.

        Each key's first `_WINDOW` slots are read in one gather (two cache lines);
        the rare key whose run of occupied slots is longer is probed on.
        """
        import numpy as np

        k = own + np.uint64(1)
        rows = self._rows
        mask = np.uint64(self._mask)
        slots = (k[:, None] + _OFFSETS) & mask
        window = np.take(rows, slots, axis=0)  # (keys, window, 2)
        keys = window[:, :, 0]
        match = keys == k[:, None]
        at = match.argmax(axis=1)
        found = match[np.arange(len(k)), at]
        out = np.where(found, window[np.arange(len(k)), at, 1], np.uint64(0))
        # Not found, and no empty slot in the window: the run goes on past it.
        longer = np.flatnonzero(~found & (keys != 0).all(axis=1))
        for i in longer.tolist():
            slot = (int(k[i]) + _WINDOW) & self._mask
            key = int(k[i])
            while True:
                row_key = int(rows[slot, 0])
                if row_key == key:
                    out[i] = rows[slot, 1]
                    break
                if row_key == 0:
                    break
                slot = (slot + 1) & self._mask
        return out
