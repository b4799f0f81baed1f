"""The prefix index: which origin holds how long a prefix of a prompt, on which tier.

:class:`PrefixIndex` is fed batches (from any subscriber, or in-process from a
``QueueSink``) and answers :meth:`PrefixIndex.match`: for a prompt, every origin
holding its first block, with the number of leading blocks it holds and the
tier of the last of them, best first.

State, per block, is integers in dicts (no object per block), so it costs a few
dozen bytes per block and the garbage collector never walks it (dicts holding
only integers are not tracked by the GC):

* ``nodes``: own hash -> holders, an integer with one bit per (tier, origin
  slot): bit ``tier * width + slot``. ``width`` is a power of two >= the number
  of origin slots; tiers are numbered in the order the index first sees them.
  A block no origin holds has no node.
* per origin, ``blocks``: engine hash (folded to 60 bits) -> own hash, for the
  blocks it holds in at least one tier; ``dups``: extra references when the same
  block is stored again in a tier that holds it; ``recent``: the last
  ``keep_removed`` blocks that left every tier (so a placeholder or a child that
  arrives just after its block was evicted still resolves); ``orphans``: blocks
  whose parent chain is unknown, kept with their tokens until it is.

See ``docs/prefix-index.md`` for the semantics of every edge case and measured numbers.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple

from kvstream.consumers.base import Gap
from kvstream.errors import ConfigError
from kvstream.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch
from kvstream.index.hashing import DIGEST_SIZE, BlockHasher, fold_engine_hash

__all__ = ["IndexStatistics", "OriginStatistics", "PrefixIndex", "PrefixMatch"]

log = logging.getLogger("kvstream.index")

#: Tiers reported for a block held on several, fastest first; others follow in
#: the order the index first saw them.
TIER_PREFERENCE: Final = ("GPU", "CPU_PINNED", "CPU", "DISK", "EXTERNAL", "STORAGE")

#: Distinct ``medium`` strings one index accepts (events on more are counted and ignored).
MAX_TIERS: Final = 16

_ENGINE_MASK: Final = (1 << 60) - 1
_TIER_SHIFT: Final = 8 * DIGEST_SIZE  # dups key: own hash | tier << 56


class PrefixMatch(NamedTuple):
    """One origin's hit for a prompt: ``blocks`` leading blocks, the last on ``medium``.

    ``stale`` is True when the index missed some of the origin's events since
    its last snapshot (``AllBlocksCleared``) or restart: the answer is then the
    best the index knows, not a certainty.
    """

    origin: str
    blocks: int
    medium: str
    stale: bool = False


class OriginStatistics(NamedTuple):
    """What the index holds for one origin."""

    #: distinct blocks held on at least one tier
    blocks: int
    #: medium -> blocks held on it
    by_medium: Mapping[str, int]
    #: blocks kept until their parent chain is known
    orphans: int
    stale: bool
    stale_reason: str | None
    epoch: str | None
    next_seq: int
    data_parallel_rank: int | None


class IndexStatistics(NamedTuple):
    """An immutable snapshot of :meth:`PrefixIndex.statistics`."""

    block_size: int
    origins: Mapping[str, OriginStatistics]
    #: blocks (own hashes) held by at least one origin
    distinct_blocks: int
    #: an estimate (upper bound) of the bytes the index's state takes
    memory_bytes: int
    batches: int
    events: int
    blocks_stored: int
    blocks_removed: int
    #: batches skipped because their (origin, epoch, seq) was already applied
    duplicate_batches: int
    #: gaps seen (in seq numbers or reported by a subscriber)
    gaps: int
    #: new epochs of origins already known (their old state was dropped)
    restarts: int
    #: removals of blocks (or tiers of blocks) the origin was not known to hold
    unknown_removals: int
    #: placeholder stores (no tokens) of blocks the index does not know
    unknown_placeholders: int
    #: blocks in events whose block_size is not the index's (ignored)
    wrong_block_size: int
    #: blocks stored while their parent chain was unknown
    orphans_stored: int
    #: orphans dropped because an origin had more than max_orphans
    orphans_dropped: int
    #: blocks in events on a tier beyond the MAX_TIERS distinct media (ignored)
    unknown_media: int


class _Orphan:
    """A stored block whose parent chain is unknown: what is needed to hash it later."""

    __slots__ = ("block", "parent", "payload", "tiers")

    def __init__(self, parent: int, block: bytes, payload: bytes | None, tier: int) -> None:
        self.parent = parent
        self.block = block
        self.payload = payload
        #: one entry per store (a tier stored twice appears twice)
        self.tiers = [tier]


class _Origin:
    """Everything the index knows about one origin."""

    __slots__ = (
        "anymask",
        "bits",
        "blocks",
        "data_parallel_rank",
        "dups",
        "epoch",
        "held",
        "name",
        "next_seq",
        "orphans",
        "recent",
        "slot",
        "stale",
        "stale_reason",
        "waiting",
    )

    def __init__(self, name: str, slot: int) -> None:
        self.name = name
        self.slot = slot
        self.epoch: str | None = None
        self.next_seq = 0
        self.stale = False
        self.stale_reason: str | None = None
        self.data_parallel_rank: int | None = None
        #: engine hash (60 bits) -> own hash, for blocks held on some tier
        self.blocks: dict[int, int] = {}
        #: engine hash -> own hash of blocks that left every tier, oldest first
        self.recent: OrderedDict[int, int] = OrderedDict()
        #: own hash | tier << 56 -> references beyond the first
        self.dups: dict[int, int] = {}
        #: engine hash -> block waiting for its parent chain
        self.orphans: dict[int, _Orphan] = {}
        #: parent engine hash -> orphans waiting for it
        self.waiting: dict[int, list[int]] = {}
        #: per tier: this origin's bit in a node
        self.bits: list[int] = []
        #: every tier's bit
        self.anymask = 0
        #: per tier: blocks held
        self.held: list[int] = []


def _fold_all(hashes: list[BlockHash]) -> list[int]:
    try:
        return [h & _ENGINE_MASK for h in hashes]  # type: ignore[operator]
    except TypeError:  # bytes digests
        return [fold_engine_hash(h) for h in hashes]


class PrefixIndex:
    """Which origin holds how long a prefix of a prompt, on which tier.

    ``block_size`` must be the engines' (events with another are counted and
    ignored). ``seed`` keys the index's own block hashes. ``keep_removed``
    blocks per origin are remembered after they leave every tier, so that late
    placeholders and children still resolve; ``max_orphans`` bounds, per origin,
    the blocks kept while their parent chain is unknown (the oldest go first).

    Feed it with :meth:`apply` (batches and :class:`~kvstream.consumers.Gap`
    items, in stream order) and ask :meth:`match`. Not thread-safe: use it from
    one task, as the subscriber loop that feeds it.
    """

    def __init__(
        self,
        *,
        block_size: int,
        seed: int | str | bytes = 0,
        keep_removed: int = 4096,
        max_orphans: int = 65536,
    ) -> None:
        for name, value in (("keep_removed", keep_removed), ("max_orphans", max_orphans)):
            if type(value) is not int or value < 0:
                raise ConfigError(f"PrefixIndex.{name}: expected an int >= 0, got {value!r}")
        self._hasher = BlockHasher(block_size, seed)
        self.block_size = block_size
        self.keep_removed = keep_removed
        self.max_orphans = max_orphans
        self._nodes: dict[int, int] = {}
        self._origins: dict[str, _Origin] = {}
        self._slots: list[_Origin | None] = []
        self._width = 8
        self._origin_mask = 0
        self._stale_mask = 0
        self._tiers: list[str] = []
        self._tier_index: dict[str, int] = {}
        #: tier indices, preferred first
        self._tier_order: list[int] = []
        #: shifts that fold every tier's field onto the first: t * width, t >= 1
        self._shifts: list[int] = []
        self._logged: set[tuple[str, str]] = set()
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "batches",
                "events",
                "blocks_stored",
                "blocks_removed",
                "duplicate_batches",
                "gaps",
                "restarts",
                "unknown_removals",
                "unknown_placeholders",
                "wrong_block_size",
                "orphans_stored",
                "orphans_dropped",
                "unknown_media",
            ),
            0,
        )

    # -- feeding -------------------------------------------------------------------------

    def apply(self, item: EventBatch | Gap, origin: str | None = None) -> None:
        """Apply a batch (or a subscriber's :class:`Gap`) of ``origin`` (default: its own).

        Batches must come in stream order per origin. Continuity is checked on
        ``(epoch, seq)``: a batch already applied is skipped (counted), a jump in
        ``seq`` marks the origin stale, a new ``epoch`` drops the origin's state
        (it restarted), and a first batch with ``seq > 0`` marks it stale (the
        index joined late).
        """
        if isinstance(item, Gap):
            self._apply_gap(item, item.origin if origin is None else origin)
            return
        name = item.origin if origin is None else origin
        state = self._origins.get(name)
        if state is None:
            state = self._add_origin(name)
        seq = item.seq
        if state.epoch != item.epoch:
            if state.epoch is not None:
                self._counts["restarts"] += 1
                self._clear(state)
            state.epoch = item.epoch
            if seq != 0:
                self._set_stale(state, f"joined epoch {item.epoch!r} at seq {seq}")
            else:
                self._set_fresh(state)
        elif seq < state.next_seq:
            self._counts["duplicate_batches"] += 1
            return
        elif seq > state.next_seq:
            self._counts["gaps"] += 1
            self._set_stale(state, f"batches {state.next_seq}..{seq - 1} missing")
        state.next_seq = seq + 1
        state.data_parallel_rank = item.data_parallel_rank
        counts = self._counts
        counts["batches"] += 1
        counts["events"] += len(item.events)
        for event in item.events:
            kind = type(event)
            if kind is BlockStored:
                self._store(state, event)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                self._remove(state, event)  # type: ignore[arg-type]
            elif kind is AllBlocksCleared:
                self._clear(state)
            else:  # pragma: no cover - the event union is closed
                raise AssertionError(f"unknown event type {kind.__name__}")

    def mark_stale(self, origin: str, reason: str = "marked stale") -> None:
        """Mark ``origin`` stale until its next snapshot (``AllBlocksCleared``) or epoch."""
        state = self._origins.get(origin)
        if state is None:
            state = self._add_origin(origin)
        self._set_stale(state, reason)

    def forget(self, origin: str) -> bool:
        """Drop everything about ``origin`` (an engine that is gone). False if unknown."""
        state = self._origins.pop(origin, None)
        if state is None:
            return False
        self._clear(state)
        self._slots[state.slot] = None
        bit = 1 << state.slot
        self._origin_mask &= ~bit
        self._stale_mask &= ~bit
        self._logged = {k for k in self._logged if k[0] != origin}
        return True

    def _apply_gap(self, gap: Gap, name: str) -> None:
        state = self._origins.get(name)
        if state is None:
            state = self._add_origin(name)
        self._counts["gaps"] += 1
        if state.epoch != gap.epoch:
            if state.epoch is not None:
                self._counts["restarts"] += 1
                self._clear(state)
            state.epoch = gap.epoch
            state.next_seq = gap.next_seq
        else:
            state.next_seq = max(state.next_seq, gap.next_seq)
        self._set_stale(
            state, f"batches {gap.first_missing}..{gap.next_seq - 1} missing ({gap.reason})"
        )

    # -- origins, slots and tiers ----------------------------------------------------------

    def _add_origin(self, name: str) -> _Origin:
        if type(name) is not str:
            raise ConfigError(f"origin: expected a str, got {name!r}")
        try:
            slot = self._slots.index(None)
        except ValueError:
            slot = len(self._slots)
            self._slots.append(None)
        if slot >= self._width:
            width = self._width
            while width <= slot:
                width *= 2
            self._set_width(width)
        state = _Origin(name, slot)
        self._slots[slot] = state
        self._origins[name] = state
        self._origin_mask |= 1 << slot
        self._set_bits(state)
        return state

    def _set_bits(self, state: _Origin) -> None:
        width = self._width
        state.bits = [1 << (t * width + state.slot) for t in range(len(self._tiers))]
        state.anymask = sum(state.bits)
        while len(state.held) < len(self._tiers):
            state.held.append(0)

    def _set_width(self, width: int) -> None:
        """Re-lay every node for ``width`` origin slots per tier (rare: width doubles)."""
        old = self._width
        field = (1 << old) - 1
        tiers = range(len(self._tiers))
        nodes = self._nodes
        for own, v in nodes.items():
            new = 0
            for t in tiers:
                new |= ((v >> (t * old)) & field) << (t * width)
            nodes[own] = new
        self._width = width
        self._shifts = [t * width for t in range(1, len(self._tiers))]
        for state in self._origins.values():
            self._set_bits(state)

    def _tier(self, medium: str | None) -> int:
        """The index of ``medium`` (None is GPU); -1 when there are too many tiers."""
        name = "GPU" if medium is None else medium
        t = self._tier_index.get(name)
        if t is not None:
            return t
        if len(self._tiers) >= MAX_TIERS:
            return -1
        t = len(self._tiers)
        self._tiers.append(name)
        self._tier_index[name] = t
        rank = {m: i for i, m in enumerate(TIER_PREFERENCE)}
        self._tier_order = sorted(
            range(len(self._tiers)), key=lambda i: (rank.get(self._tiers[i], len(rank)), i)
        )
        self._shifts = [i * self._width for i in range(1, len(self._tiers))]
        for state in self._origins.values():
            self._set_bits(state)
        return t

    def _set_stale(self, state: _Origin, reason: str) -> None:
        if not state.stale:
            log.info("index: origin %r is stale: %s", state.name, reason)
        state.stale = True
        state.stale_reason = reason
        self._stale_mask |= 1 << state.slot

    def _set_fresh(self, state: _Origin) -> None:
        state.stale = False
        state.stale_reason = None
        self._stale_mask &= ~(1 << state.slot)

    def _note(self, state: _Origin, kind: str, n: int = 1) -> None:
        """Count an anomaly; log it once per origin and kind until the origin is cleared."""
        self._counts[kind] += n
        key = (state.name, kind)
        if key not in self._logged:
            self._logged.add(key)
            log.warning(
                "index: origin %r: %s (counted in statistics(); logged once until the "
                "origin's next snapshot or epoch)",
                state.name,
                kind.replace("_", " "),
            )

    # -- events ----------------------------------------------------------------------------

    def _store(self, state: _Origin, event: BlockStored) -> None:
        hashes = event.block_hashes
        if not hashes:
            return
        t = self._tier(event.medium)
        if t < 0:
            self._note(state, "unknown_media", len(hashes))
            return
        self._counts["blocks_stored"] += len(hashes)
        tokens = event.token_ids
        if not tokens:
            self._store_placeholders(state, _fold_all(hashes), t)
            return
        hasher = self._hasher
        size = event.block_size
        if size != hasher.block_size:
            self._note(state, "wrong_block_size", len(hashes))
            return
        keys = _fold_all(hashes)
        blocks = state.blocks
        recent = state.recent
        parent = event.parent_block_hash
        lora = event.lora_name
        extra = event.extra_keys
        plain = lora is None and extra is None
        if parent is None:
            prev: int | None = hasher.root
            prev_key = -1
        else:
            prev_key = fold_engine_hash(parent)
            prev = blocks.get(prev_key)
            if prev is None and recent:
                prev = recent.get(prev_key)
        packed: list[bytes] | None = None
        # The previous block's own hash as bytes, when at hand (saves a to_bytes).
        prev_bytes: bytes | None = hasher.root_bytes if parent is None else None
        digest = hashlib.blake2b
        from_bytes = int.from_bytes
        narrow = 4 * size
        nodes = self._nodes
        bit = state.bits[t]
        added = 0
        for i, key in enumerate(keys):
            own = blocks.get(key)
            if own is not None:
                prev_bytes = None
            else:
                if recent:
                    own = recent.pop(key, None)
                if own is not None:  # it left every tier a moment ago: back again
                    prev_bytes = None
                elif prev is not None:  # the usual case: a new block, rehashed
                    if packed is None:
                        packed = hasher.pack(tokens, len(keys))
                    block = packed[i]
                    if prev_bytes is None:
                        prev_bytes = prev.to_bytes(DIGEST_SIZE, "little")
                    if plain and len(block) == narrow:
                        message = prev_bytes + block
                    else:
                        payload = hasher.payload(lora, extra[i] if extra is not None else None)
                        message = prev_bytes + block + hasher.suffix(block, payload)
                    prev_bytes = digest(message, digest_size=DIGEST_SIZE).digest()
                    own = from_bytes(prev_bytes, "little")
                else:  # its chain is unknown: keep it until it is
                    if packed is None:
                        packed = hasher.pack(tokens, len(keys))
                    payload = hasher.payload(lora, extra[i] if extra is not None else None)
                    self._add_orphan(state, key, prev_key, packed[i], payload, t)
                    prev_key = key
                    continue
                blocks[key] = own
                if state.orphans:
                    self._resolve(state, key, own)
            v = nodes.get(own, 0)
            if v & bit:
                self._add(state, own, t)  # stored again: counted in dups
            else:
                nodes[own] = v | bit
                added += 1
            prev = own
            prev_key = key
        state.held[t] += added

    def _store_placeholders(self, state: _Origin, keys: list[int], t: int) -> None:
        """Placeholders (no tokens): a tier now holds blocks the index may know."""
        blocks = state.blocks
        for key in keys:
            own = blocks.get(key)
            if own is None and state.recent:
                own = state.recent.pop(key, None)
                if own is not None:
                    blocks[key] = own
            if own is not None:
                self._add(state, own, t)
                continue
            orphan = state.orphans.get(key)
            if orphan is not None:
                orphan.tiers.append(t)
            else:
                self._note(state, "unknown_placeholders")

    def _add(self, state: _Origin, own: int, t: int) -> None:
        bit = state.bits[t]
        nodes = self._nodes
        v = nodes.get(own, 0)
        if v & bit:
            key = own | t << _TIER_SHIFT
            state.dups[key] = state.dups.get(key, 0) + 1
        else:
            nodes[own] = v | bit
            state.held[t] += 1

    def _remove(self, state: _Origin, event: BlockRemoved) -> None:
        hashes = event.block_hashes
        if not hashes:
            return
        t = self._tier(event.medium)
        if t < 0:
            self._note(state, "unknown_media", len(hashes))
            return
        self._counts["blocks_removed"] += len(hashes)
        bit = state.bits[t]
        anymask = state.anymask
        nodes = self._nodes
        blocks = state.blocks
        dups = state.dups
        for key in _fold_all(hashes):
            own = blocks.get(key)
            if own is None:
                orphan = state.orphans.get(key)
                if orphan is not None and t in orphan.tiers:
                    orphan.tiers.remove(t)
                    if not orphan.tiers:
                        self._drop_orphan(state, key)
                else:
                    self._note(state, "unknown_removals")
                continue
            v = nodes.get(own, 0)
            if not v & bit:
                self._note(state, "unknown_removals")
                continue
            if dups:
                dkey = own | t << _TIER_SHIFT
                n = dups.get(dkey)
                if n:
                    if n == 1:
                        del dups[dkey]
                    else:
                        dups[dkey] = n - 1
                    continue
            v ^= bit
            state.held[t] -= 1
            if v:
                nodes[own] = v
            else:
                del nodes[own]
            if not v & anymask:
                del blocks[key]
                if self.keep_removed:
                    recent = state.recent
                    recent[key] = own
                    if len(recent) > self.keep_removed:
                        recent.popitem(last=False)

    def _clear(self, state: _Origin) -> None:
        """The origin holds nothing any more (AllBlocksCleared, a new epoch, forget)."""
        nodes = self._nodes
        keep = ~state.anymask
        for own in state.blocks.values():
            v = nodes.get(own)
            if v is not None:
                v &= keep
                if v:
                    nodes[own] = v
                else:
                    del nodes[own]
        state.blocks = {}
        state.recent = OrderedDict()
        state.dups = {}
        state.orphans = {}
        state.waiting = {}
        state.held = [0] * len(self._tiers)
        self._set_fresh(state)
        self._logged = {k for k in self._logged if k[0] != state.name}

    # -- orphans -----------------------------------------------------------------------------

    def _add_orphan(
        self, state: _Origin, key: int, parent: int, block: bytes, payload: bytes | None, t: int
    ) -> None:
        orphan = state.orphans.get(key)
        if orphan is not None:
            orphan.tiers.append(t)
            return
        self._note(state, "orphans_stored")
        state.orphans[key] = _Orphan(parent, block, payload, t)
        state.waiting.setdefault(parent, []).append(key)
        if len(state.orphans) > self.max_orphans:
            oldest = next(iter(state.orphans))
            self._drop_orphan(state, oldest)
            self._note(state, "orphans_dropped")

    def _drop_orphan(self, state: _Origin, key: int) -> None:
        orphan = state.orphans.pop(key)
        siblings = state.waiting.get(orphan.parent)
        if siblings is not None:
            siblings.remove(key)
            if not siblings:
                del state.waiting[orphan.parent]

    def _resolve(self, state: _Origin, key: int, own: int) -> None:
        """``key`` is now known as ``own``: merge its orphan record, hash its waiting children."""
        orphans = state.orphans
        if key in orphans:
            orphan = orphans[key]
            self._drop_orphan(state, key)
            for t in orphan.tiers:
                self._add(state, own, t)
        hasher = self._hasher
        stack = [(key, own)]
        while stack:
            parent_key, parent_own = stack.pop()
            for child in state.waiting.pop(parent_key, ()):
                orphan = orphans.pop(child)
                block = orphan.block
                message = (
                    parent_own.to_bytes(DIGEST_SIZE, "little")
                    + block
                    + hasher.suffix(block, orphan.payload)
                )
                child_own = int.from_bytes(
                    hashlib.blake2b(message, digest_size=DIGEST_SIZE).digest(), "little"
                )
                state.blocks[child] = child_own
                for t in orphan.tiers:
                    self._add(state, child_own, t)
                stack.append((child, child_own))

    # -- queries -----------------------------------------------------------------------------

    def match(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        *,
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
        include_stale: bool = True,
    ) -> list[PrefixMatch]:
        """Per origin holding the first block of ``token_ids``: how many leading blocks.

        Only full blocks count. A block counts when the origin holds it on any
        tier; ``medium`` is the tier of the last counted block (the fastest, if
        several hold it). ``extra_keys`` gives one entry per block, as in
        ``BlockStored`` (multimodal hashes, cache salts). Stale origins are
        included, flagged, unless ``include_stale=False``. Best first: most
        blocks, then fresh before stale, then the faster tier, then by origin.
        """
        hasher = self._hasher
        size = hasher.block_size
        n = len(token_ids) // size
        active = self._origin_mask
        if not include_stale:
            active &= ~self._stale_mask
        nodes = self._nodes
        if not n or not active or not nodes:
            return []
        shifts = self._shifts
        digest = hashlib.blake2b
        from_bytes = int.from_bytes
        plain = lora_name is None and extra_keys is None
        narrow = 4 * size
        results: list[PrefixMatch] = []
        get = nodes.get
        prev = hasher.root_bytes
        last = 0  # the node of the last block every active origin holds
        k = 0  # blocks every active origin holds
        chunk = 32  # pack lazily, a growing chunk at a time: most prompts stop early
        while True:
            stop = min(n, k + chunk)
            chunk *= 4
            for block in hasher.pack(token_ids[k * size : stop * size], stop - k):
                if plain and len(block) == narrow:
                    message = prev + block
                else:
                    extra = (
                        extra_keys[k] if extra_keys is not None and k < len(extra_keys) else None
                    )
                    message = prev + block + hasher.suffix(block, hasher.payload(lora_name, extra))
                prev = digest(message, digest_size=DIGEST_SIZE).digest()
                v = get(from_bytes(prev, "little"), 0)
                if v & active != active:  # not every origin on the first tier: fold tiers
                    held = v
                    for shift in shifts:
                        held |= v >> shift
                    held &= active
                    if held != active:  # some origins stop here
                        if k:
                            self._record(results, active & ~held, k, last)
                        active = held
                        if not active:
                            break
                last = v
                k += 1
            if not active or k == n:
                break
        if active:
            self._record(results, active, n, last)
        rank = {t: i for i, t in enumerate(self._tier_order)}
        tier_index = self._tier_index
        results.sort(key=lambda m: (-m.blocks, m.stale, rank[tier_index[m.medium]], m.origin))
        return results

    def _record(self, results: list[PrefixMatch], mask: int, blocks: int, node: int) -> None:
        width = self._width
        while mask:
            low = mask & -mask
            mask ^= low
            slot = low.bit_length() - 1
            state = self._slots[slot]
            assert state is not None
            for t in self._tier_order:
                if node >> (t * width + slot) & 1:
                    results.append(PrefixMatch(state.name, blocks, self._tiers[t], state.stale))
                    break

    def origins(self) -> list[str]:
        """The origins the index knows, in the order it first saw them."""
        return list(self._origins)

    def statistics(self) -> IndexStatistics:
        """Blocks per origin and tier, counters, and a memory estimate."""
        origins = {
            name: OriginStatistics(
                blocks=len(s.blocks),
                by_medium={self._tiers[t]: n for t, n in enumerate(s.held) if n},
                orphans=len(s.orphans),
                stale=s.stale,
                stale_reason=s.stale_reason,
                epoch=s.epoch,
                next_seq=s.next_seq,
                data_parallel_rank=s.data_parallel_rank,
            )
            for name, s in self._origins.items()
        }
        return IndexStatistics(
            block_size=self.block_size,
            origins=origins,
            distinct_blocks=len(self._nodes),
            memory_bytes=self._memory_estimate(),
            **self._counts,
        )

    def _memory_estimate(self) -> int:
        """Containers measured, integers estimated from their size (no walk over blocks)."""
        size = sys.getsizeof
        top_bit = max(self._width * max(len(self._tiers), 1) - 1, 0)
        value = -(-size(1 << top_bit) // 8) * 8  # pymalloc rounds to 8 bytes
        total = size(self._nodes) + len(self._nodes) * (32 + value)
        for s in self._origins.values():
            total += size(s.blocks) + 32 * len(s.blocks)  # engine hash keys
            total += size(s.recent) + 64 * len(s.recent)
            total += size(s.dups) + 64 * len(s.dups)
            total += size(s.orphans) + size(s.waiting)
            for orphan in s.orphans.values():
                total += size(orphan) + size(orphan.block) + size(orphan.tiers) + 32
        return total

    def __repr__(self) -> str:
        return (
            f"<PrefixIndex block_size={self.block_size} origins={len(self._origins)} "
            f"blocks={len(self._nodes)}>"
        )
