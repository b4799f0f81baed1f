"""Block storage tiers with prefix-closed LRU eviction, and the hash chain.

Every tier holds a forest of block chains that is closed under "parent": a
block is stored only when its parent is held (or it is a root), and only leaves
are evicted (least recently used first). So every `BlockStored` a tier emits
names a parent the tier holds, and every `BlockRemoved` names a block it
holds: the consistency rules consumers rely on hold by construction.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from kvstream.events import BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["BlockInfo", "BlockRegistry", "Tier", "block_hash"]

_MASK64 = (1 << 64) - 1


def block_hash(parent: int | None, tokens: list[int], lora_name: str | None) -> int:
    """vLLM's default scheme in spirit: the low 64 bits of a sha256 over the chain."""
    h = hashlib.sha256()
    h.update(b"\x00" * 8 if parent is None else parent.to_bytes(8, "big"))
    h.update(array("I", tokens).tobytes())
    if lora_name is not None:
        h.update(lora_name.encode())
    return int.from_bytes(h.digest(), "big") & _MASK64


@dataclass(frozen=True, slots=True)
class BlockInfo:
    hash: int
    parent: int | None
    tokens: tuple[int, ...]
    lora_name: str | None


class BlockRegistry:
    """What every block held in some tier is: parent, tokens, adapter.

    Entries live while at least one tier holds the block, so memory follows the
    tiers' capacities, not the length of the run.
    """

    def __init__(self) -> None:
        self._info: dict[int, BlockInfo] = {}
        self._holders: dict[int, int] = {}

    def get(self, h: int) -> BlockInfo | None:
        return self._info.get(h)

    def hold(self, info: BlockInfo) -> None:
        self._info[info.hash] = info
        self._holders[info.hash] = self._holders.get(info.hash, 0) + 1

    def release(self, h: int) -> None:
        n = self._holders[h] - 1
        if n:
            self._holders[h] = n
        else:
            del self._holders[h]
            del self._info[h]

    def __len__(self) -> int:
        return len(self._info)


class Tier:
    """One storage tier (`medium`) of one engine; see the module doc."""

    def __init__(
        self, medium: str, capacity: int, block_size: int, registry: BlockRegistry
    ) -> None:
        self.medium = medium
        self.capacity = capacity
        self.block_size = block_size
        self.registry = registry
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}
        self.pins: dict[int, int] = {}
        #: evictable blocks (unpinned leaves), least recently used first
        self.lru: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, h: int) -> bool:
        return h in self.parent

    def __len__(self) -> int:
        return len(self.parent)

    # -- bookkeeping ---------------------------------------------------------------

    def _add(self, info: BlockInfo) -> None:
        self.parent[info.hash] = info.parent
        self.children[info.hash] = 0
        self.registry.hold(info)
        if info.parent is not None:
            p = info.parent
            self.children[p] += 1
            self.lru.pop(p, None)
        self.lru[info.hash] = None

    def _remove(self, h: int) -> None:
        p = self.parent.pop(h)
        del self.children[h]
        self.lru.pop(h, None)
        self.registry.release(h)
        if p is not None:
            self.children[p] -= 1
            if self.children[p] == 0 and not self.pins.get(p):
                # A parent that became a leaf is evicted next, so chains go tail first.
                self.lru[p] = None
                self.lru.move_to_end(p, last=False)

    def touch(self, h: int) -> None:
        if h in self.lru:
            self.lru.move_to_end(h)

    def pin(self, h: int) -> None:
        self.pins[h] = self.pins.get(h, 0) + 1
        self.lru.pop(h, None)

    def unpin(self, h: int) -> None:
        n = self.pins[h] - 1
        if n:
            self.pins[h] = n
            return
        del self.pins[h]
        if h in self.children and self.children[h] == 0:
            self.lru[h] = None

    def evict(self, n: int, keep: set[int]) -> list[BlockInfo]:
        """Remove up to `n` least recently used leaves not in `keep`; returns them."""
        out: list[BlockInfo] = []
        while len(out) < n:
            victim = next((h for h in self.lru if h not in keep), None)
            if victim is None:
                break
            info = self.registry.get(victim)
            assert info is not None
            self._remove(victim)
            out.append(info)
        return out

    def clear(self) -> None:
        for h in list(self.parent):
            self.registry.release(h)
        self.parent.clear()
        self.children.clear()
        self.pins.clear()
        self.lru.clear()

    # -- storing chains ------------------------------------------------------------

    def store_chain(self, chain: list[BlockInfo]) -> list[KVCacheEvent]:
        """Store `chain` (root first, each the parent of the next; the first one's
        parent held here or None), evicting leaves to make room. Returns the events:
        one BlockRemoved for what was evicted, one BlockStored per run of new blocks.
        """
        new = [b for b in chain if b.hash not in self.parent]
        if not new:
            for b in chain:
                self.touch(b.hash)
            return []
        room = self.capacity - len(self.parent)
        events: list[KVCacheEvent] = []
        if room < len(new):
            keep = {b.hash for b in chain}
            anchor = chain[0].parent
            if anchor is not None:
                keep.add(anchor)
            evicted = self.evict(len(new) - room, keep)
            if evicted:
                events.append(
                    BlockRemoved(block_hashes=[b.hash for b in evicted], medium=self.medium)
                )
            room = self.capacity - len(self.parent)
            if room < len(new):  # cannot fit: store the longest prefix that fits
                cut = chain.index(new[room]) if room < len(new) else len(chain)
                chain = chain[:cut]
        run: list[BlockInfo] = []
        for b in chain:
            if b.hash in self.parent:
                self.touch(b.hash)
                if run:
                    events.append(self._stored(run))
                    run = []
                continue
            self._add(b)
            run.append(b)
        if run:
            events.append(self._stored(run))
        return events

    def _stored(self, run: list[BlockInfo]) -> BlockStored:
        tokens: list[int] = []
        for b in run:
            tokens.extend(b.tokens)
        return BlockStored(
            block_hashes=[b.hash for b in run],
            parent_block_hash=run[0].parent,
            token_ids=tokens,
            block_size=self.block_size,
            medium=self.medium,
            lora_name=run[0].lora_name,
        )

    def chain_to(
        self, h: int, extra: Mapping[int, BlockInfo] | None = None
    ) -> list[BlockInfo] | None:
        """`h` and its ancestors not held here, root first; None if one is unknown.

        Blocks are looked up in `extra` (just evicted elsewhere), then the registry.
        """
        chain: list[BlockInfo] = []
        cur: int | None = h
        while cur is not None and cur not in self.parent:
            info = extra.get(cur) if extra else None
            if info is None:
                info = self.registry.get(cur)
            if info is None:
                return None
            chain.append(info)
            cur = info.parent
        chain.reverse()
        return chain

    def snapshot(self) -> list[KVCacheEvent]:
        """BlockStored events (parents first) that rebuild this tier's content."""
        depth: dict[int, int] = {}

        def depth_of(h: int) -> int:
            cur: int | None = h
            path = []
            while cur is not None and cur not in depth:
                path.append(cur)
                cur = self.parent[cur]
            base = -1 if cur is None else depth[cur]
            for node in reversed(path):
                base += 1
                depth[node] = base
            return depth[h]

        order = sorted(self.parent, key=depth_of)
        events: list[KVCacheEvent] = []
        for h in order:
            info = self.registry.get(h)
            assert info is not None
            events.append(self._stored([info]))
        return events
