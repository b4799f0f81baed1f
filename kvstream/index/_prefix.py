"""The prefix index: which stream holds how long a prefix of a prompt, on which tiers.

`PrefixIndex` is fed batches (from any subscriber, or in-process from a
`QueueSink`) and answers `PrefixIndex.match()`: for a prompt, every
stream holding its first block, with the leading blocks it holds on any tier,
on each tier, and a score from tier weights, best first.

A *stream* is one `(origin, data_parallel_rank)`: data-parallel ranks of one
engine are kept apart. State, per block, is integers in dicts (no object per
block), so the garbage collector never walks it:

* `nodes`: own hash -> holders, an integer with one bit per (tier, stream
  slot): bit `tier * width + slot`. `width` is a power of two >= the number
  of slots; tiers are numbered in the order the index first sees them.
* per stream, `blocks`: engine hash (folded to 60 bits) -> own hash (for an
  engine block spanning several index blocks, the last; `spans` keeps them
  all; `partial`, for engine blocks smaller than an index block, the tokens since
  the last full one); `dups`: extra references when a tier holding a block stores it again;
  `recent`: the last `keep_removed` blocks that left every tier;
  `orphans`: blocks whose parent chain is unknown, kept (as their hash
  values) until it is.

See `docs/prefix-index.md` for the semantics of every edge case and measured numbers.
"""

from __future__ import annotations

import logging
import math
import operator
import struct
import sys
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat
from types import EllipsisType, MappingProxyType
from typing import Any, Final, NamedTuple, NoReturn, cast

from kvstream._burst_log import BurstLogs
from kvstream._checks import flag, function
from kvstream.consumers.base import Continuity, Gap, continuity
from kvstream.errors import ConfigError
from kvstream.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch
from kvstream.index._hashing import BlockHasher, fold_engine_hash, tokens_array
from kvstream.index._keys import split_lora
from kvstream.index._table import NodeTable

__all__ = [
    "DEFAULT_TIER_WEIGHTS",
    "IndexStatistics",
    "OriginStatistics",
    "PrefixIndex",
    "PrefixMatch",
    "StreamKey",
]

log = logging.getLogger("kvstream.index")
#: The continuity rule's usual answer, as a global (a member looked up on its enum: ~80 ns).
_NEXT: Final = Continuity.NEXT

#: Tiers reported for a block held on several, fastest first; others follow in
#: the order the index first saw them.
TIER_PREFERENCE: Final = ("GPU", "CPU_PINNED", "CPU", "DISK", "EXTERNAL", "STORAGE")

#: What one block on a tier is worth to a router (llm-d scores GPU 1.0, CPU 0.8;
#: Dynamo credits lower tiers less). A tier not named here weighs `default_weight`.
DEFAULT_TIER_WEIGHTS: Final[Mapping[str, float]] = MappingProxyType(
    {
        "GPU": 1.0,
        "CPU_PINNED": 0.8,
        "CPU": 0.8,
        "DISK": 0.5,
        "STORAGE": 0.5,
        "EXTERNAL": 0.3,
    }
)

#: Distinct `medium` strings one index accepts (events on more are counted and ignored).
MAX_TIERS: Final = 16

#: Retired epochs remembered per stream (their late batches are dropped and counted).
RETIRED_EPOCHS: Final = 16

_ENGINE_MASK: Final = (1 << 60) - 1
_HASH_MASK: Final = (1 << 60) - 1
_TIER_SHIFT: Final = 60  # dups key: own hash | tier << 60
_EMPTY: Final[Mapping[str, int]] = MappingProxyType({})
#: a ranked answer's key: `(key, match)` pairs sort by the key alone
_first: Final = operator.itemgetter(0)
#: what a bulk store enters for a key before its own hash (own hashes are >= 0)
_NEW: Final = -1

#: `(origin, data_parallel_rank)`: what the index keys a stream by.
StreamKey = tuple[str, int | None]


class PrefixMatch(NamedTuple):
    """One stream's hit for a prompt.

    `blocks` leading blocks are held on some tier; `medium` is the fastest
    tier holding the last of them; `tiers` gives, per tier, the leading blocks
    held on that tier alone; `score` sums, over the `blocks` blocks, the
    weight of the best tier holding each. `stale` is True when the index
    missed some of the stream's events since its last snapshot or restart: the
    answer is then the best the index knows, not a certainty.
    """

    origin: str
    blocks: int
    medium: str
    stale: bool = False
    data_parallel_rank: int | None = None
    tiers: Mapping[str, int] = _EMPTY
    score: float = 0.0


class OriginStatistics(NamedTuple):
    """What the index holds for one stream."""

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
    origin: str = ""
    #: the block size this stream's events carry (0 until a block with tokens arrived)
    block_size: int = 0
    #: seconds since its last batch or heartbeat
    idle_seconds: float = 0.0


class IndexStatistics(NamedTuple):
    """An immutable snapshot of `PrefixIndex.statistics()`."""

    block_size: int
    #: keyed by origin, or `origin/dpN` for a stream with a data-parallel rank
    origins: Mapping[str, OriginStatistics]
    #: blocks (own hashes) held by at least one stream
    distinct_blocks: int
    #: an estimate (upper bound) of the bytes the index's state takes
    memory_bytes: int
    batches: int
    events: int
    blocks_stored: int
    blocks_removed: int
    #: batches skipped because their (stream, epoch, seq) was already applied
    duplicate_batches: int
    #: gaps seen (in seq numbers or reported by a subscriber)
    gaps: int
    #: new epochs of streams already known (their old state was dropped)
    restarts: int
    #: removals of blocks (or tiers of blocks) the stream was not known to hold
    unknown_removals: int
    #: placeholder stores (no tokens) of blocks the index does not know
    unknown_placeholders: int
    #: blocks whose block_size the index cannot map to its own (not a multiple; ignored)
    wrong_block_size: int
    #: blocks stored while their parent chain was unknown
    orphans_stored: int
    #: orphans dropped because a stream had more than max_orphans
    orphans_dropped: int
    #: blocks in events on a tier beyond the MAX_TIERS distinct media (ignored)
    unknown_media: int
    #: batches (and gaps) of an epoch the stream had already left (dropped)
    retired_epoch_batches: int = 0
    #: streams dropped after ttl seconds without a batch or heartbeat
    expired: int = 0
    #: (stream, block) entries evicted by the max_blocks bound, least recently stored first
    evicted: int = 0
    #: blocks stored with a block size that is a multiple of the index's (mapped 1:many)
    remapped_blocks: int = 0
    #: blocks stored with a block size that divides the index's (mapped many:1)
    divided_blocks: int = 0
    #: blocks of a divisor size whose parent's place in an index block is unknown (its
    #: parent was never seen, or left): ignored, as their descendants of that size
    unaligned_blocks: int = 0
    #: blocks of a divisor size with extra keys besides the adapter (multimodal, cache
    #: salt): which index block they would salt is not defined, so they are ignored
    unmapped_extra_keys: int = 0
    #: blocks of stores with fewer hashes than blocks of tokens (vLLM's sliding-window
    #: and Mamba groups skip null blocks): which index blocks the hashes name is not
    #: known from the root, so they are counted and ignored, never chained wrongly
    skipped_blocks: int = 0


class _Orphan:
    """A stored block whose parent chain is unknown: its hash values, to chain later."""

    __slots__ = ("parent", "tiers", "values")

    def __init__(self, parent: int, values: list[int], tier: int) -> None:
        self.parent = parent
        self.values = values
        #: one entry per store (a tier stored twice appears twice)
        self.tiers = [tier]


class _Stream:
    """Everything the index knows about one (origin, data-parallel rank)."""

    __slots__ = (
        "anymask",
        "bits",
        "block_size",
        "blocks",
        "dups",
        "epoch",
        "held",
        "label",
        "last_seen",
        "name",
        "next_seq",
        "orphans",
        "partial",
        "rank",
        "recent",
        "retired",
        "slot",
        "spans",
        "stale",
        "stale_reason",
        "waiting",
    )

    def __init__(self, name: str, rank: int | None, slot: int, now: float) -> None:
        self.name = name
        self.rank = rank
        self.label = name if rank is None else f"{name}/dp{rank}"
        self.slot = slot
        self.epoch: str | None = None
        self.retired: list[str] = []
        self.next_seq = 0
        self.stale = False
        self.stale_reason: str | None = None
        self.last_seen = now
        self.block_size = 0
        #: engine hash (60 bits) -> own hash, for blocks held on some tier
        self.blocks: dict[int, int] = {}
        #: engine hash -> own hashes, for engine blocks of several index blocks
        self.spans: dict[int, list[int]] = {}
        #: engine hash -> (own hash of the last full index block before it, the tokens
        #: since), for engine blocks of a divisor size that end inside an index block
        self.partial: dict[int, tuple[int, list[int]]] = {}
        #: engine hash -> own hash of blocks that left every tier, oldest first
        self.recent: OrderedDict[int, int] = OrderedDict()
        #: own hash | tier << 60 -> references beyond the first
        self.dups: dict[int, int] = {}
        #: engine hash -> block waiting for its parent chain
        self.orphans: dict[int, _Orphan] = {}
        #: parent engine hash -> orphans waiting for it
        self.waiting: dict[int, list[int]] = {}
        #: per tier: this stream's bit in a node
        self.bits: list[int] = []
        #: every tier's bit
        self.anymask = 0
        #: per tier: blocks held
        self.held: list[int] = []


def _fold_all(hashes: list[BlockHash]) -> list[int]:
    try:
        return list(map(operator.and_, hashes, repeat(_ENGINE_MASK)))
    except TypeError:  # bytes digests
        return [fold_engine_hash(h) for h in hashes]


class PrefixIndex:
    """Which stream holds how long a prefix of a prompt, on which tiers.

    `block_size` is the index's; events whose block size is a multiple of it
    are split into index blocks (1:many), those whose block size divides it are
    gathered into index blocks (many:1: the engine block that fills an index
    block stands for it), others are counted and ignored.
    `seed` keys the index's own block hashes. `keep_removed` blocks per
    stream are remembered after they leave every tier, so that late placeholders
    and children still resolve; `max_orphans` bounds, per stream, the blocks
    kept while their parent chain is unknown (the oldest go first).

    `tier_weights` (default `DEFAULT_TIER_WEIGHTS`, other tiers
    `default_weight`) score matches. `ttl` drops a stream after that many
    seconds without a batch or `heartbeat()` (`clock` tells the time;
    monotonic by default). `max_blocks` bounds the (stream, block) entries:
    past it the least recently stored are evicted, counted. `lookup_table`
    keeps a numpy copy of the nodes for fast matches (about 32 to 43 bytes per
    distinct block; False looks up in the dict, slower at a million blocks).

    Feed it with `apply()` (batches and [`Gap`][kvstream.consumers.base.Gap]
    items, in stream order) and ask `match()`. Not thread-safe: use it from
    one task, as the subscriber loop that feeds it.
    """

    def __init__(
        self,
        *,
        block_size: int,
        seed: int | str | bytes = 0,
        keep_removed: int = 4096,
        max_orphans: int = 65536,
        tier_weights: Mapping[str, float] | None = None,
        default_weight: float = 0.5,
        ttl: float | None = None,
        max_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        lookup_table: bool = True,
    ) -> None:
        for name, value in (("keep_removed", keep_removed), ("max_orphans", max_orphans)):
            if type(value) is not int or value < 0:
                raise ConfigError(f"PrefixIndex.{name}: expected an int >= 0, got {value!r}")
        if ttl is not None and (type(ttl) not in (int, float) or not ttl > 0):
            raise ConfigError(f"PrefixIndex.ttl: expected seconds > 0 or None, got {ttl!r}")
        if max_blocks is not None and (type(max_blocks) is not int or max_blocks <= 0):
            raise ConfigError(
                f"PrefixIndex.max_blocks: expected a positive int or None, got {max_blocks!r}"
            )
        self._hasher = BlockHasher(block_size, seed)
        self.seed = seed
        self.block_size = block_size
        self.keep_removed = keep_removed
        self.max_orphans = max_orphans
        self.tier_weights: dict[str, float] = _checked_weights(
            DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights, "tier_weights"
        )
        if type(default_weight) not in (int, float) or not 0 <= default_weight < math.inf:
            raise ConfigError(
                f"PrefixIndex.default_weight: expected a number >= 0, got {default_weight!r}"
            )
        self.default_weight = float(default_weight)
        self.ttl = None if ttl is None else float(ttl)
        self.max_blocks = max_blocks
        function("PrefixIndex.clock", clock)
        flag("PrefixIndex.lookup_table", lookup_table)
        self._clock = clock
        self._next_expiry = clock() + (self.ttl or 0.0)
        #: (slot << 60 | engine key) -> None, least recently stored first (max_blocks only)
        self._lru: OrderedDict[int, None] | None = OrderedDict() if max_blocks else None
        self._nodes: dict[int, int] = {}
        #: one int object per distinct holders value: a match compares them by identity
        #: and touches a few hot objects instead of one per block (bounded: see apply)
        self._canon: dict[int, int] = {}
        #: a numpy copy of nodes for whole-prompt lookups (None: holders too wide for it),
        #: the own hashes changed since it was last synced, and whether to rebuild it
        self._table: NodeTable | None = NodeTable() if lookup_table else None
        self._dirty: dict[int, None] = self._table.dirty if self._table is not None else {}
        self._table_stale = False
        #: runs of own hashes changed in bulk (a batch's stores), folded into the dirty
        #: keys before the next sync; dropped unread when the table is rebuilt instead
        self._dirty_runs: list[list[int]] = []
        self._dirty_run_len = 0
        #: prompts shorter than this look up in the dict (numpy's fixed costs are higher)
        self._table_min_blocks = 48
        #: the current batch's block values, and the last run of chained hashes computed
        self._batch_fin: Any = None
        #: the same as a list, made when a store needs it
        self._batch_list: list[int] | None = None
        self._run_cache: tuple[int, int, list[int], int, bool] | None = None
        self._streams: dict[StreamKey, _Stream] = {}
        self._slots: list[_Stream | None] = []
        self._width = 8
        self._origin_mask = 0
        self._stale_mask = 0
        self._tiers: list[str] = []
        self._tier_index: dict[str, int] = {}
        #: tier indices, preferred first
        self._tier_order: list[int] = []
        #: shifts that fold every tier's field onto the first: t * width, t >= 1
        self._shifts: list[int] = []
        #: (t * width, tier name) per tier index; (t * width, tier name, rank) in `_tier_order`
        self._tier_fields: list[tuple[int, str]] = []
        self._preferred_fields: list[tuple[int, str, int]] = []
        #: 1 at the first bit of every tier's field: a slot mask times it is on every tier
        self._every_tier = 0
        #: the index's own weights per tier index, and those tiers heaviest first (made
        #: when first needed after a new tier)
        self._weight_cache: tuple[list[float], list[int]] | None = None
        self._anomaly_log: BurstLogs[tuple[str, str]] = BurstLogs(log, math.inf)
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
                "retired_epoch_batches",
                "expired",
                "evicted",
                "remapped_blocks",
                "skipped_blocks",
                "divided_blocks",
                "unaligned_blocks",
                "unmapped_extra_keys",
            ),
            0,
        )

    # -- feeding -------------------------------------------------------------------------

    def apply(self, item: EventBatch | Gap, origin: str | None = None) -> None:
        """Apply a batch (or a subscriber's `Gap`) of `origin` (default: its own).

        The stream is `(origin, batch.data_parallel_rank)`. Batches must come
        in stream order per stream. Continuity is checked on `(epoch, seq)`: a
        batch already applied is skipped (counted), a jump in `seq` marks the
        stream stale, a new `epoch` drops the stream's state (it restarted), a
        batch of an epoch the stream already left is dropped (counted in
        `retired_epoch_batches`), and a first batch with `seq > 0` marks it
        stale (the index joined late).
        """
        now = self._clock()
        if self.ttl is not None and now >= self._next_expiry:
            self.expire(now)
        if isinstance(item, Gap):
            self._apply_gap(item, item.origin if origin is None else origin, now)
            return
        if not isinstance(item, EventBatch):
            raise ConfigError(
                f"PrefixIndex.apply: expected an EventBatch or a Gap, got {item!r:.80}"
            )
        if origin is not None and type(origin) is not str:
            raise ConfigError(f"PrefixIndex.apply: origin: expected a str, got {origin!r:.80}")
        name = item.origin if origin is None else origin
        key = (name, item.data_parallel_rank)
        state = self._streams.get(key)
        if state is None:
            state = self._add_stream(key, now)
        seq = item.seq
        known = None if state.epoch is None else (state.epoch, state.next_seq)
        place = continuity(known, item.epoch, seq, state.retired)
        if place is not _NEXT:
            if place is Continuity.DUPLICATE:
                self._counts["duplicate_batches"] += 1
                return
            if place is Continuity.GAP:
                self._counts["gaps"] += 1
                self._set_stale(state, f"batches {state.next_seq}..{seq - 1} missing")
            elif place is Continuity.RETIRED:
                self._counts["retired_epoch_batches"] += 1
                self._note(state, "retired_epoch_batches", 0)
                return
            else:  # the first batch of an epoch
                if place is Continuity.NEW_EPOCH:
                    self._counts["restarts"] += 1
                    self._retire(state)
                    self._clear(state)
                state.epoch = item.epoch
                if seq != 0:
                    self._set_stale(state, f"joined epoch {item.epoch!r} at seq {seq}")
                else:
                    self._set_fresh(state)
        state.next_seq = seq + 1
        state.last_seen = now
        counts = self._counts
        counts["batches"] += 1
        events = item.events
        counts["events"] += len(events)
        if len(self._canon) > 65536:  # only an optimisation: start afresh
            self._canon = {}
        if len(self._dirty) + self._dirty_run_len > 65536 + len(self._nodes) // 4:
            self._dirty.clear()  # cheaper to rebuild the table
            self._dirty_runs = []
            self._dirty_run_len = 0
            self._table_stale = True
        # Stores whose effect on the nodes only adds bits are gathered (own hashes per
        # tier) and merged into the nodes in bulk, before any other event and at the end.
        pending: dict[int, list[int]] | None = {} if self._lru is None else None
        if pending is not None and self._defer_batch(state, events, pending):
            if pending:
                self._merge(state, pending)
            return
        prepared = self._batch_values(events)
        for i, event in enumerate(events):
            kind = type(event)
            if kind is BlockStored:
                if pending is not None and self._defer_store(
                    state,
                    event,  # type: ignore[arg-type]
                    prepared.get(i),
                    pending,
                ):
                    continue
                if pending:
                    self._merge(state, pending)
                self._store(state, event, prepared.get(i))  # type: ignore[arg-type]
                continue
            if pending:
                self._merge(state, pending)
            if kind is BlockRemoved:
                self._remove(state, event)  # type: ignore[arg-type]
            elif kind is AllBlocksCleared:
                self._clear(state)
            else:  # pragma: no cover - the event union is closed
                raise AssertionError(f"unknown event type {kind.__name__}")
        if pending:
            self._merge(state, pending)

    def _defer_store(
        self,
        state: _Stream,
        event: BlockStored,
        prepared: tuple[int, int, int] | None,
        pending: dict[int, list[int]],
    ) -> bool:
        """Take the usual store (every block new and chained, or placeholders of known
        blocks) for `_merge()`: its blocks enter the stream now, its holders later.
        False (nothing done) for any other store."""
        hashes = event.block_hashes
        if not hashes:
            return True
        medium = event.medium
        t = self._tier_index.get("GPU" if medium is None else medium)
        if t is None:
            t = self._tier(medium)  # a new tier: only appended, the others keep their bits
            if t < 0:
                return False
        if state.spans:
            return False
        blocks = state.blocks
        if not event.token_ids:
            found = list(map(blocks.get, _fold_all(hashes)))
            if None in found:
                return False
            owns = cast("list[int]", found)
        else:
            if prepared is None or event.block_size != self.block_size or state.orphans:
                return False
            keys = _fold_all(hashes)
            recent = state.recent
            parent = event.parent_block_hash
            if parent is None:
                prev: int | None = self._hasher.root
            else:
                key = parent & _ENGINE_MASK if type(parent) is int else fold_engine_hash(parent)
                prev = blocks.get(key)
                if prev is None and recent:
                    prev = recent.get(key)
            if prev is None or (recent and not recent.keys().isdisjoint(keys)):
                return False
            # The hashes of a run of chained stores are computed once, with numpy.
            first, _, run_end = prepared
            m = len(keys)
            cache = self._run_cache
            if cache is not None and cache[0] == first and cache[1] == prev:
                chained, offset, fresh = cache[2], cache[3], cache[4]
            else:
                run = self._hasher.chain_array(prev, self._batch_fin[first:run_end])
                chained = run.tolist()
                offset = 0
                # no own hash a cached small int: each is a new object, known by identity
                fresh = bool(run.min() > 256)
            owns = chained[offset : offset + m]
            # One cold probe per block: a key not yet held is entered with its own hash
            # (or _NEW, never an own hash); if some key was held, those entered are taken
            # out again and the store is left to `_store()`.
            before = len(blocks)
            marks: Any = owns if fresh else repeat(_NEW)
            olds = list(map(blocks.setdefault, keys, marks))
            if len(blocks) - before != m:
                for key, old, mark in zip(keys, olds, marks):  # noqa: B905 - marks may repeat
                    if old is mark:  # entered now (pop: a key named twice is entered once)
                        blocks.pop(key, None)
                return False
            if not fresh:
                blocks.update(zip(keys, owns, strict=True))
            self._run_cache = (first + m, owns[-1], chained, offset + m, fresh)
            state.block_size = event.block_size
        self._counts["blocks_stored"] += len(hashes)
        held = pending.get(t)
        if held is None:
            pending[t] = owns
        else:
            held += owns
        return True

    def _defer_batch(
        self, state: _Stream, events: Sequence[Any], pending: dict[int, list[int]]
    ) -> bool:
        """`_defer_store()` of every event of the usual batch at once: True when each
        event is a store it would take, all done; False, with nothing changed, otherwise.

        The usual batch: only stores on known tiers, of the index's block size, without
        adapter or extra keys, each chained on the store before it or on a block the
        stream held before the batch, and placeholders of blocks held before the batch
        or of the store just before them. Its tokens are hashed in one pass, one chain
        per run of chained stores; its blocks enter the stream with one `setdefault`
        pass; its own hashes go to `pending` in event order, as one event at a time
        would put them.
        """
        if state.spans or state.orphans or not events:
            return False
        tiers = self._tier_index
        blocks = state.blocks
        recent = state.recent
        size = self.block_size
        hashes_all: list[BlockHash] = []  # the stores' hashes, in order
        parts: list[list[int]] = []  # and their tokens
        # per event with blocks: (tier, its first hash in hashes_all, count, own hashes
        # when known: a placeholder of blocks held before the batch)
        plan: list[tuple[int, int, int, list[int] | None]] = []
        runs: list[tuple[int, int | None]] = []  # (first hash, its parent's key; None: root)
        last_hashes: list[BlockHash] | None = None  # the previous store's
        last: BlockHash | None = None  # its last block
        one_tier = -1  # the tier of every store when they share one, else -2
        for event in events:
            if type(event) is not BlockStored:
                return False
            hashes = event.block_hashes
            if not hashes:
                continue
            medium = event.medium
            t = tiers.get("GPU" if medium is None else medium)
            if t is None:
                return False
            tokens = event.token_ids
            if not tokens:  # a placeholder
                if t == one_tier:  # on the stores' tier: listed in event order
                    one_tier = -2
                if hashes == last_hashes:  # of the store just before it
                    plan.append((t, len(hashes_all) - len(hashes), len(hashes), None))
                    continue
                found = list(map(blocks.get, _fold_all(hashes)))
                if None in found:
                    return False
                plan.append((t, 0, len(hashes), cast("list[int]", found)))
                continue
            if (
                event.block_size != size
                or len(tokens) != size * len(hashes)
                or event.lora_name is not None
                or event.extra_keys is not None
            ):
                return False
            start = len(hashes_all)
            parent = event.parent_block_hash
            if parent is None:
                runs.append((start, None))
            elif parent != last:  # (equal: chained on the store before, the run goes on)
                key = fold_engine_hash(parent)  # (a run starts, or the same block renamed)
                if last is None or key != fold_engine_hash(last):
                    if key not in blocks and key not in recent:
                        return False  # (on a block of this batch but the last: one at a time)
                    runs.append((start, key))
            if one_tier != t:
                one_tier = t if one_tier == -1 and not plan else -2
            plan.append((t, start, len(hashes), None))
            hashes_all += hashes
            parts.append(tokens)
            last_hashes = hashes
            last = hashes[-1]
        owns_all: list[int] = []
        if hashes_all:
            keys_all = _fold_all(hashes_all)
            if recent and not recent.keys().isdisjoint(keys_all):
                return False
            data = array("I")
            try:
                if sys.byteorder == "big":  # pragma: no cover - the hash reads little-endian
                    raise TypeError
                for tokens in parts:
                    data.fromlist(tokens)
            except (OverflowError, TypeError):  # wide or bad tokens: the general path
                return False
            hasher = self._hasher
            n = len(hashes_all)
            fin = hasher.finish(hasher.values(data, n))
            ends = [first for first, _ in runs[1:]]
            ends.append(n)
            for (first, on), end in zip(runs, ends, strict=True):
                if on is None:
                    prev = hasher.root
                else:
                    got = blocks.get(on)
                    prev = recent[on] if got is None else got
                run = hasher.chain_array(prev, fin[first:end])
                if not run.min() > 256:  # pragma: no cover - one in 2**52: a cached small int
                    return False
                owns_all += run.tolist()
            before = len(blocks)
            olds = list(map(blocks.setdefault, keys_all, owns_all))
            if len(blocks) - before != n:  # some block held already: undo
                for key, old, own in zip(keys_all, olds, owns_all, strict=True):
                    if old is own:  # entered now (a key named twice is entered once)
                        blocks.pop(key, None)
                return False
            state.block_size = size
        stored = 0
        if one_tier >= 0:  # the stores, first in the batch, on one tier: one list
            pending[one_tier] = owns_all
            stored = len(owns_all)
        for t, start, m, owns in plan:
            if t == one_tier:  # a store, listed above
                continue
            if owns is None:
                owns = owns_all[start : start + m]
            held = pending.get(t)
            if held is None:
                pending[t] = owns
            else:
                held += owns
            stored += m
        self._counts["blocks_stored"] += stored
        return True

    def _merge(self, state: _Stream, pending: dict[int, list[int]]) -> None:
        """Add `state`'s bit on tier t to the nodes of `pending[t]`, in bulk (a node named
        twice, or held already on that tier, is referenced once more: counted in dups)."""
        nodes = self._nodes
        for t, owns in pending.items():
            bit = state.bits[t]
            if nodes.keys().isdisjoint(owns):  # blocks no stream holds yet: the usual case
                before = len(nodes)
                nodes.update(dict.fromkeys(owns, bit))
                added = len(nodes) - before
            else:
                olds = list(map(nodes.get, owns, repeat(0)))
                if any(map(operator.and_, olds, repeat(bit))):
                    for o in owns:  # some held on this tier already: one at a time
                        self._add(state, o, t)
                    continue
                merged = list(map(operator.or_, olds, repeat(bit)))
                canon = self._canon.setdefault
                fresh = dict(zip(owns, map(canon, merged, merged), strict=True))
                nodes.update(fresh)
                added = len(fresh)
            self._dirty_runs.append(owns)
            self._dirty_run_len += len(owns)
            state.held[t] += added
            if added != len(owns):  # a node named more than once: its repeats are dups
                dups = state.dups
                for o, count in Counter(owns).items():
                    if count > 1:
                        key = o | t << _TIER_SHIFT
                        dups[key] = dups.get(key, 0) + count - 1
        pending.clear()

    def _batch_values(self, events: Sequence[Any]) -> dict[int, tuple[int, int, int]]:
        """The hash values of every index block of the batch's stores, in one numpy pass.

        Returns event position -> (first, count, run end), for stores with tokens
        of a block size the index maps: their `count` values (`block_size //
        index block size` per engine block) start at `first` in the batch's
        value array (kept in `self._batch_fin`), and `run end` is where
        the run of stores chained one on the previous one ends (their hashes are
        then chained in one numpy pass).
        """
        size = self._hasher.block_size
        parts: list[list[int]] = []
        spans: list[tuple[int, int, int]] = []  # (event position, first block, blocks)
        run_starts: list[bool] = []
        salted = False
        n = 0
        last: Any = None  # the previous store kept here
        for i, event in enumerate(events):
            if type(event) is not BlockStored:
                continue
            t = event.token_ids
            bs = event.block_size
            if not t or bs % size:
                continue
            hashes = event.block_hashes
            if len(t) != len(hashes) * bs:
                continue  # skipped null blocks: see _store's skipped_blocks
            m = len(t) // size
            parent = event.parent_block_hash
            run_starts.append(
                last is None
                or parent is None
                or bs != size
                or last.block_size != size
                or parent != last.block_hashes[-1]
            )
            last = event
            spans.append((i, n, m))
            parts.append(t)
            n += m
            if event.lora_name is not None or event.extra_keys is not None:
                salted = True
        if not n:
            return {}
        hasher = self._hasher
        self._run_cache = None
        data = array("I")
        wide = False
        tokens: list[int] = []
        try:  # each list straight into the array (it is left unchanged on a bad token)
            if sys.byteorder == "big":  # pragma: no cover - the hash reads little-endian words
                raise TypeError
            for t in parts:
                data.fromlist(t)
        except (OverflowError, TypeError):  # wide or bad tokens, or not lists: the general path
            tokens = [x for t in parts for x in t]
            data, wide = tokens_array(tokens, "BlockStored.token_ids")
        v = hasher.values(data, n)
        if salted or wide:
            import numpy as np

            salts = np.zeros(n, dtype=np.uint64)
            for i, first, m in spans:
                event = events[i]
                per = event.block_size // size
                extra = event.extra_keys
                lora = event.lora_name
                if lora is None and extra is None and not wide:
                    continue
                keys = None
                if extra is not None:
                    keys = []
                    for e in extra[: len(event.block_hashes)]:
                        keys.extend([split_lora(lora, e)] + [None] * (per - 1))
                # the tokens are read for their high bits only: when some are wide
                s = hasher.salts(tokens[first * size : (first + m) * size], m, lora, keys, wide)
                if s is not None:
                    salts[first : first + m] = s
            v ^= salts
        fin = hasher.finish(v)
        self._batch_fin = fin
        self._batch_list = None
        result = {}
        end = n
        for (i, first, m), starts in zip(reversed(spans), reversed(run_starts), strict=True):
            result[i] = (first, m, end)
            if starts:
                end = first
        return result

    def heartbeat(self, origin: str, data_parallel_rank: int | EllipsisType | None = None) -> bool:
        """Mark a stream alive now (for `ttl`), as a batch would. False if unknown.

        `data_parallel_rank=...` marks every rank of `origin` (a publisher's
        heartbeat names its origin, not a rank).
        """
        now = self._clock()
        if data_parallel_rank is ...:
            states = [st for key, st in self._streams.items() if key[0] == origin]
        else:
            one = self._streams.get((origin, data_parallel_rank))
            states = [] if one is None else [one]
        for state in states:
            state.last_seen = now
        return bool(states)

    def expire(self, now: float | None = None) -> list[StreamKey]:
        """Drop every stream idle for more than `ttl` seconds; return their keys.

        Called by `apply()` and `match()` at most once per `ttl` on
        their own; call it to expire sooner. Each expiry is counted and logged.
        """
        if self.ttl is None:
            return []
        now = self._clock() if now is None else now
        self._next_expiry = now + min(self.ttl, 1.0)
        limit = now - self.ttl
        gone = [k for k, s in self._streams.items() if s.last_seen < limit]
        for key in gone:
            state = self._streams[key]
            log.warning(
                "index: stream %r expired: no batch or heartbeat for %.1f s (ttl %.1f s)",
                state.label,
                now - state.last_seen,
                self.ttl,
            )
            self._drop_stream(state)
            self._counts["expired"] += 1
        return gone

    def mark_stale(
        self, origin: str, reason: str = "marked stale", data_parallel_rank: int | None = None
    ) -> None:
        """Mark a stream stale until its next snapshot (`AllBlocksCleared`) or epoch."""
        key = (origin, data_parallel_rank)
        state = self._streams.get(key)
        if state is None:
            state = self._add_stream(key, self._clock())
        self._set_stale(state, reason)

    def forget(self, origin: str, data_parallel_rank: int | EllipsisType | None = ...) -> bool:
        """Drop everything about `origin` (an engine that is gone): every rank of
        it, or only `data_parallel_rank` when given. False if unknown."""
        keys = [
            k
            for k in self._streams
            if k[0] == origin and (data_parallel_rank is ... or k[1] == data_parallel_rank)
        ]
        for key in keys:
            self._drop_stream(self._streams[key])
        return bool(keys)

    def _drop_stream(self, state: _Stream) -> None:
        self._clear(state)
        del self._streams[(state.name, state.rank)]
        self._slots[state.slot] = None
        bit = 1 << state.slot
        self._origin_mask &= ~bit
        self._stale_mask &= ~bit
        label = state.label
        self._anomaly_log.clear_where(lambda key: key[0] == label)

    def _retire(self, state: _Stream) -> None:
        assert state.epoch is not None
        state.retired.append(state.epoch)
        if len(state.retired) > RETIRED_EPOCHS:
            del state.retired[0]

    def _apply_gap(self, gap: Gap, name: str, now: float) -> None:
        """A gap names an origin, not a rank: it applies to every rank of it."""
        targets = [s for k, s in self._streams.items() if k[0] == name]
        if not targets:
            targets = [self._add_stream((name, None), now)]
        for state in targets:
            known = None if state.epoch is None else (state.epoch, state.next_seq)
            place = continuity(known, gap.epoch, gap.first_missing, state.retired)
            if place is Continuity.RETIRED:
                self._counts["retired_epoch_batches"] += 1
                continue
            self._counts["gaps"] += 1
            if place is Continuity.FIRST or place is Continuity.NEW_EPOCH:
                if place is Continuity.NEW_EPOCH:
                    self._counts["restarts"] += 1
                    self._retire(state)
                    self._clear(state)
                state.epoch = gap.epoch
                state.next_seq = gap.next_seq
            else:
                state.next_seq = max(state.next_seq, gap.next_seq)
            self._set_stale(
                state, f"batches {gap.first_missing}..{gap.next_seq - 1} missing ({gap.reason})"
            )

    # -- streams, slots and tiers ----------------------------------------------------------

    def _add_stream(self, key: StreamKey, now: float) -> _Stream:
        name, rank = key
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
        state = _Stream(name, rank, slot, now)
        self._slots[slot] = state
        self._streams[key] = state
        self._origin_mask |= 1 << slot
        self._set_bits(state)
        return state

    def _set_bits(self, state: _Stream) -> None:
        width = self._width
        state.bits = [1 << (t * width + state.slot) for t in range(len(self._tiers))]
        state.anymask = sum(state.bits)
        while len(state.held) < len(self._tiers):
            state.held.append(0)

    def _set_width(self, width: int) -> None:
        """Re-lay every node for `width` slots per tier (rare: width doubles)."""
        old = self._width
        field = (1 << old) - 1
        tiers = range(len(self._tiers))
        nodes = self._nodes
        self._canon = {}
        canon = self._canon.setdefault
        for own, v in nodes.items():
            new = 0
            for t in tiers:
                new |= ((v >> (t * old)) & field) << (t * width)
            nodes[own] = canon(new, new)
        self._width = width
        self._layout_changed()
        self._table_stale = True
        for state in self._streams.values():
            self._set_bits(state)

    def _tier(self, medium: str | None) -> int:
        """The index of `medium` (None is GPU); -1 when there are too many tiers."""
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
        self._layout_changed()
        for state in self._streams.values():
            self._set_bits(state)
        return t

    def _layout_changed(self) -> None:
        """Derive what a match needs from the tiers and the width (both change rarely)."""
        width = self._width
        ntiers = len(self._tiers)
        self._shifts = [t * width for t in range(1, ntiers)]
        self._tier_fields = [(t * width, self._tiers[t]) for t in range(ntiers)]
        self._preferred_fields = [
            (t * width, self._tiers[t], rank) for rank, t in enumerate(self._tier_order)
        ]
        self._every_tier = sum(1 << (t * width) for t in range(ntiers))
        self._weight_cache = None

    def _set_stale(self, state: _Stream, reason: str) -> None:
        if not state.stale:
            log.info("index: stream %r is stale: %s", state.label, reason)
        state.stale = True
        state.stale_reason = reason
        self._stale_mask |= 1 << state.slot

    def _set_fresh(self, state: _Stream) -> None:
        state.stale = False
        state.stale_reason = None
        self._stale_mask &= ~(1 << state.slot)

    def _note(self, state: _Stream, kind: str, n: int = 1) -> None:
        """Count an anomaly; log it once per stream and kind until the stream is cleared."""
        self._counts[kind] += n
        self._anomaly_log.log(
            (state.label, kind),
            "index: stream %r: %s (counted in statistics(); logged once until the "
            "stream's next snapshot or epoch)",
            state.label,
            kind.replace("_", " "),
        )

    # -- events ----------------------------------------------------------------------------

    def _store(
        self, state: _Stream, event: BlockStored, prepared: tuple[int, int, int] | None
    ) -> None:
        hashes = event.block_hashes
        if not hashes:
            return
        medium = event.medium
        t = self._tier_index.get("GPU" if medium is None else medium)
        if t is None:
            t = self._tier(event.medium)
            if t < 0:
                self._note(state, "unknown_media", len(hashes))
                return
        self._counts["blocks_stored"] += len(hashes)
        if not event.token_ids:
            self._store_placeholders(state, _fold_all(hashes), t)
            return
        if prepared is None:
            size = event.block_size
            if size and len(event.token_ids) != len(hashes) * size:
                self._note(state, "skipped_blocks", len(hashes))
            elif 0 < size < self.block_size and self.block_size % size == 0:
                self._store_divided(state, event, t)
            else:  # a block size the index cannot map
                self._note(state, "wrong_block_size", len(hashes))
            return
        first, m, _ = prepared
        if self._batch_list is None:
            self._batch_list = self._batch_fin.tolist()
        values: list[int] = self._batch_list[first : first + m]
        per = event.block_size // self._hasher.block_size
        state.block_size = event.block_size
        if per != 1:
            self._counts["remapped_blocks"] += len(hashes)
        keys = _fold_all(hashes)
        blocks = state.blocks
        recent = state.recent
        parent = event.parent_block_hash
        if parent is None:
            prev: int | None = self._hasher.root
            prev_key = -1
        else:
            prev_key = parent & _ENGINE_MASK if type(parent) is int else fold_engine_hash(parent)
            prev = blocks.get(prev_key)
            if prev is None and recent:
                prev = recent.get(prev_key)
        p = self._hasher.multiplier
        mask = _HASH_MASK
        nodes = self._nodes
        canon = self._canon.setdefault
        bit = state.bits[t]
        lru = self._lru
        slot_tag = state.slot << 60
        added = 0
        for i, key in enumerate(keys):
            own = blocks.get(key)
            if own is None:
                if recent:
                    own = recent.pop(key, None)
                if own is None:
                    if prev is None:  # its chain is unknown: keep it until it is
                        self._add_orphan(state, key, prev_key, values[i * per : (i + 1) * per], t)
                        prev_key = key
                        continue
                    if per == 1:  # the usual case: a new block, chained
                        own = (prev * p + values[i]) & mask
                    else:
                        span = []
                        own = prev
                        for v in values[i * per : (i + 1) * per]:
                            own = (own * p + v) & mask
                            span.append(own)
                        state.spans[key] = span
                blocks[key] = own
                if lru is not None:
                    lru[slot_tag | key] = None
                if state.orphans:
                    self._resolve(state, key, own)
            elif lru is not None:
                lru.move_to_end(slot_tag | key)
            if per != 1 or state.spans:
                known = state.spans.get(key)
                if known is not None:
                    for o in known:
                        self._add(state, o, t)
                    prev = own
                    prev_key = key
                    continue
            v = nodes.get(own, 0)
            if v & bit:
                self._add(state, own, t)  # stored again: counted in dups
            else:
                v |= bit
                nodes[own] = canon(v, v)
                self._dirty[own] = None
                added += 1
            prev = own
            prev_key = key
        state.held[t] += added
        if lru is not None and len(lru) > self.max_blocks:  # type: ignore[operator]
            self._evict()

    def _store_divided(self, state: _Stream, event: BlockStored, t: int) -> None:
        """Engine blocks of a size that divides the index's (many:1): tokens gather until
        an index block is full; the engine block that fills it stands for it.

        An engine block ending inside an index block keeps the tokens since the last
        full one (in `partial`), so that its children can go on from there.
        """
        hashes = event.block_hashes
        keys = _fold_all(hashes)
        lora = event.lora_name
        extra = event.extra_keys
        if extra is not None and any(split_lora(lora, e) is not None for e in extra):
            self._note(state, "unmapped_extra_keys", len(keys))
            return
        size = event.block_size
        state.block_size = size
        blocks = state.blocks
        partial = state.partial
        parent = event.parent_block_hash
        pending: list[int] = []
        if parent is None:
            prev = self._hasher.root
        else:
            prev_key = parent & _ENGINE_MASK if type(parent) is int else fold_engine_hash(parent)
            found = blocks.get(prev_key)
            if found is None and state.recent:
                found = state.recent.get(prev_key)
            if found is not None:
                prev = found
            elif prev_key in partial:
                prev, pending = partial[prev_key]
            else:
                self._note(state, "unaligned_blocks", len(keys))
                return
        self._counts["divided_blocks"] += len(keys)
        tokens = event.token_ids
        full = self.block_size
        lru = self._lru
        hasher = self._hasher
        salt = hasher.salt(lora, None)
        for i, key in enumerate(keys):
            own = blocks.get(key)
            if own is not None:  # stored again (another tier): the same index block
                if lru is not None:
                    lru.move_to_end(state.slot << 60 | key)
                self._add(state, own, t)
                prev, pending = own, []
                continue
            known = partial.get(key)
            if known is not None:
                prev, pending = known
                continue
            pending = pending + list(tokens[i * size : (i + 1) * size])
            if len(pending) < full:
                partial[key] = (prev, pending)
                continue
            try:
                own = hasher.block_hash(prev, pending, salt)
            except struct.error:  # a token of 32 bits or more: the general path
                own = hasher.chain(prev, pending, lora)[0]
            if state.recent:
                state.recent.pop(key, None)
            blocks[key] = own
            if lru is not None:
                lru[state.slot << 60 | key] = None
            self._add(state, own, t)
            if state.orphans:
                self._resolve(state, key, own)
            prev, pending = own, []
        if lru is not None and len(lru) > self.max_blocks:  # type: ignore[operator]
            self._evict()

    def _evict(self) -> None:
        """Drop least recently stored (stream, block) entries down to `max_blocks`."""
        lru = self._lru
        assert lru is not None
        assert self.max_blocks is not None
        while len(lru) > self.max_blocks:
            tag, _ = lru.popitem(last=False)
            state = self._slots[tag >> 60]
            if state is None:  # pragma: no cover - entries leave with their stream
                continue
            key = tag & _ENGINE_MASK
            own = state.blocks.pop(key, None)
            if own is None:  # pragma: no cover - entries leave with their block
                continue
            span = state.spans.pop(key, None)
            for o in span if span is not None else (own,):
                self._drop_own(state, o)
            self._counts["evicted"] += 1

    def _drop_own(self, state: _Stream, own: int) -> None:
        """Remove `own` from every tier of `state` (and its extra references)."""
        nodes = self._nodes
        v = nodes.get(own, 0)
        for t, bit in enumerate(state.bits):
            if v & bit:
                state.held[t] -= 1
                state.dups.pop(own | t << _TIER_SHIFT, None)
        v &= ~state.anymask
        self._dirty[own] = None
        if v:
            nodes[own] = self._canon.setdefault(v, v)
        else:
            nodes.pop(own, None)

    def _store_placeholders(self, state: _Stream, keys: list[int], t: int) -> None:
        """Placeholders (no tokens): a tier now holds blocks the index may know."""
        blocks = state.blocks
        lru = self._lru
        if lru is None and not state.spans:
            found = list(map(blocks.get, keys))
            if None not in found:  # the usual case, in bulk: known blocks on a new tier
                owns = cast("list[int]", found)
                nodes = self._nodes
                bit = state.bits[t]
                olds = list(map(nodes.get, owns, repeat(0)))
                if not any(map(operator.and_, olds, repeat(bit))):
                    merged = list(map(operator.or_, olds, repeat(bit)))
                    canon = self._canon.setdefault
                    nodes.update(zip(owns, map(canon, merged, merged), strict=True))
                    self._dirty.update(zip(owns, repeat(None)))
                    state.held[t] += len(owns)
                    return
        for key in keys:
            own = blocks.get(key)
            if own is None and state.recent:
                own = state.recent.pop(key, None)
                if own is not None:
                    blocks[key] = own
                    if lru is not None:
                        lru[state.slot << 60 | key] = None
            elif own is not None and lru is not None:
                lru.move_to_end(state.slot << 60 | key)
            if own is not None:
                span = state.spans.get(key) if state.spans else None
                for o in span if span is not None else (own,):
                    self._add(state, o, t)
                continue
            orphan = state.orphans.get(key)
            if orphan is not None:
                orphan.tiers.append(t)
            elif key not in state.partial:  # a partial engine block holds no index block
                self._note(state, "unknown_placeholders")
        if lru is not None and len(lru) > self.max_blocks:  # type: ignore[operator]
            self._evict()

    def _add(self, state: _Stream, own: int, t: int) -> None:
        bit = state.bits[t]
        nodes = self._nodes
        v = nodes.get(own, 0)
        if v & bit:
            key = own | t << _TIER_SHIFT
            state.dups[key] = state.dups.get(key, 0) + 1
        else:
            v |= bit
            nodes[own] = self._canon.setdefault(v, v)
            self._dirty[own] = None
            state.held[t] += 1

    def _remove(self, state: _Stream, event: BlockRemoved) -> None:
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
        spans = state.spans
        for key in _fold_all(hashes):
            own = blocks.get(key)
            if own is None:
                if state.partial and state.partial.pop(key, None) is not None:
                    continue  # an engine block inside an index block: nothing was held
                orphan = state.orphans.get(key)
                if orphan is not None and t in orphan.tiers:
                    orphan.tiers.remove(t)
                    if not orphan.tiers:
                        self._drop_orphan(state, key)
                else:
                    self._note(state, "unknown_removals")
                continue
            span = spans.get(key) if spans else None
            last = own
            if span is not None:
                if not nodes.get(own, 0) & bit:
                    self._note(state, "unknown_removals")
                    continue
                for o in span:
                    self._unref(state, o, t, bit)
            elif not self._unref(state, own, t, bit):
                continue
            if not nodes.get(last, 0) & anymask:
                del blocks[key]
                if self._lru is not None:
                    self._lru.pop(state.slot << 60 | key, None)
                if self.keep_removed:
                    recent = state.recent
                    recent[key] = own
                    if len(recent) > self.keep_removed:
                        old, _ = recent.popitem(last=False)
                        if spans and old not in blocks:
                            spans.pop(old, None)
                elif span is not None:
                    del spans[key]

    def _unref(self, state: _Stream, own: int, t: int, bit: int) -> bool:
        """One reference fewer to `own` on tier `t`; False (counted) if it had none."""
        nodes = self._nodes
        v = nodes.get(own, 0)
        if not v & bit:
            self._note(state, "unknown_removals")
            return False
        dups = state.dups
        if dups:
            dkey = own | t << _TIER_SHIFT
            n = dups.get(dkey)
            if n:
                if n == 1:
                    del dups[dkey]
                else:
                    dups[dkey] = n - 1
                return True
        v ^= bit
        state.held[t] -= 1
        self._dirty[own] = None
        if v:
            nodes[own] = self._canon.setdefault(v, v)
        else:
            del nodes[own]
        return True

    def _clear(self, state: _Stream) -> None:
        """The stream holds nothing any more (AllBlocksCleared, a new epoch, forget)."""
        nodes = self._nodes
        keep = ~state.anymask
        owns: Any = state.blocks.values()
        if state.spans:
            owns = [o for span in state.spans.values() for o in span] + list(owns)
        dirty = self._dirty
        for own in owns:
            v = nodes.get(own)
            if v is not None:
                dirty[own] = None
                v &= keep
                if v:
                    nodes[own] = self._canon.setdefault(v, v)
                else:
                    del nodes[own]
        if self._lru is not None:
            tag = state.slot << 60
            for key in state.blocks:
                self._lru.pop(tag | key, None)
        state.blocks = {}
        state.spans = {}
        state.partial = {}
        state.recent = OrderedDict()
        state.dups = {}
        state.orphans = {}
        state.waiting = {}
        state.held = [0] * len(self._tiers)
        self._set_fresh(state)
        label = state.label
        self._anomaly_log.clear_where(lambda key: key[0] == label)

    # -- orphans -----------------------------------------------------------------------------

    def _add_orphan(self, state: _Stream, key: int, parent: int, values: list[int], t: int) -> None:
        orphan = state.orphans.get(key)
        if orphan is not None:
            orphan.tiers.append(t)
            return
        self._note(state, "orphans_stored")
        state.orphans[key] = _Orphan(parent, values, t)
        state.waiting.setdefault(parent, []).append(key)
        if len(state.orphans) > self.max_orphans:
            oldest = next(iter(state.orphans))
            self._drop_orphan(state, oldest)
            self._note(state, "orphans_dropped")

    def _drop_orphan(self, state: _Stream, key: int) -> None:
        orphan = state.orphans.pop(key)
        siblings = state.waiting.get(orphan.parent)
        if siblings is not None:
            siblings.remove(key)
            if not siblings:
                del state.waiting[orphan.parent]

    def _resolve(self, state: _Stream, key: int, own: int) -> None:
        """`key` is now known as `own`: merge its orphan record, chain its waiting children."""
        orphans = state.orphans
        if key in orphans:
            orphan = orphans[key]
            self._drop_orphan(state, key)
            for t in orphan.tiers:
                for o in state.spans.get(key, (own,)):
                    self._add(state, o, t)
        p = self._hasher.multiplier
        lru = self._lru
        # Depth first, children in the order they arrived.
        stack = [(iter(state.waiting.pop(key, ())), own)]
        while stack:
            children, parent_own = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                continue
            orphan = orphans.pop(child)
            h = parent_own
            span = []
            for v in orphan.values:
                h = (h * p + v) & _HASH_MASK
                span.append(h)
            state.blocks[child] = h
            if len(span) > 1:
                state.spans[child] = span
            if lru is not None:
                lru[state.slot << 60 | child] = None
            for t in orphan.tiers:
                for o in span:
                    self._add(state, o, t)
            stack.append((iter(state.waiting.pop(child, ())), h))

    # -- queries -----------------------------------------------------------------------------

    def hashes(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        *,
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
    ) -> list[int]:
        """The index's own hash of every full block of `token_ids`."""
        n = len(token_ids) // self._hasher.block_size
        out: list[int] = self._own_hashes(token_ids, n, lora_name, extra_keys).tolist()
        return out

    def _own_hashes(
        self,
        token_ids: Sequence[int],
        n: int,
        lora_name: str | None,
        extra_keys: Sequence[Sequence[Any] | None] | None,
        *,
        probe: bool = False,
    ) -> Any:
        """The prompt's own hashes (a uint64 array); with `probe`, None when no stream
        holds its first block (checked before the rest is hashed: a miss stays cheap)."""
        if extra_keys is not None:
            extra_keys = [split_lora(lora_name, e) for e in extra_keys]
        data, wide = tokens_array(token_ids)  # every token checked, the partial block too
        return self._hash_data(data, n, lora_name, extra_keys, token_ids, wide, probe)

    def _hash_data(
        self,
        data: Any,
        n: int,
        lora_name: str | None,
        keys: Sequence[Sequence[Any] | None] | None,
        token_ids: Sequence[int],
        wide: bool,
        probe: bool,
    ) -> Any:
        hasher = self._hasher
        salted = lora_name is not None or keys is not None or wide
        if probe:  # the first block alone, without numpy: a miss stays cheap
            salt = hasher.salts(token_ids, 1, lora_name, keys, wide) if salted else None
            first = hasher.first_hash(data, 0 if salt is None else int(salt[0]))
            if not self._nodes.get(first):
                return None
            if n == 1:
                return [first]
        salts = hasher.salts(token_ids, n, lora_name, keys, wide) if salted else None
        return hasher.prompt_hashes(data, n, salts)

    def match(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        *,
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
        include_stale: bool = True,
        tier_weights: Mapping[str, float] | None = None,
    ) -> list[PrefixMatch]:
        """Per stream holding the first block of `token_ids`: how many leading blocks.

        Only full blocks count. `lora_name` alone matches vLLM's LoRA blocks;
        `extra_keys` gives one entry per block, as vLLM sends them (see
        `kvstream.index._keys.vllm_extra_keys()`). Stale streams are
        included, flagged, unless `include_stale=False`. `tier_weights`
        overrides the index's for this query. Best first: highest score, then
        most blocks, fresh before stale, the faster tier, then by origin and rank.
        """
        odd_lora = lora_name is not None and type(lora_name) is not str
        if odd_lora or type(include_stale) is not bool:
            _bad_query(lora_name, include_stale)
        if extra_keys is not None:
            _check_extra_keys(extra_keys)
        n = len(token_ids) // self._hasher.block_size
        if not n:
            return []
        own = self._own_hashes(token_ids, n, lora_name, extra_keys, probe=True)
        if own is None or not self._nodes:
            return []
        return self._match_hashes(own, include_stale, tier_weights, probed=True)

    def match_bytes(
        self,
        data: bytes | bytearray | memoryview,
        lora_name: str | None = None,
        *,
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
        include_stale: bool = True,
        tier_weights: Mapping[str, float] | None = None,
    ) -> list[PrefixMatch]:
        """`match()` for tokens given as uint32 little-endian bytes (the fast path)."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ConfigError(
                f"token bytes: expected bytes (uint32 little-endian), got {type(data).__name__}"
            )
        odd_lora = lora_name is not None and type(lora_name) is not str
        if odd_lora or type(include_stale) is not bool:
            _bad_query(lora_name, include_stale)
        if extra_keys is not None:
            _check_extra_keys(extra_keys)
        if len(data) % 4:
            raise ConfigError(
                f"token bytes: expected a multiple of 4 (uint32 little-endian), got {len(data)}"
            )
        hasher = self._hasher
        n = len(data) // 4 // hasher.block_size
        if not n or not self._nodes:
            return []
        keys = None if extra_keys is None else [split_lora(lora_name, e) for e in extra_keys]
        own = self._hash_data(data, n, lora_name, keys, (), False, True)
        if own is None:
            return []
        return self._match_hashes(own, include_stale, tier_weights, probed=True)

    def match_engine_hashes(
        self,
        block_hashes: Sequence[BlockHash],
        *,
        origin: str | None = None,
        data_parallel_rank: int | None = None,
        include_stale: bool = True,
        tier_weights: Mapping[str, float] | None = None,
    ) -> list[PrefixMatch]:
        """`match()` for a prompt given as an engine's block hashes (Dynamo's
        `query_by_hash`).

        The hashes are translated to the index's own through `origin`'s
        stream when given, else through any stream that reported them (engines
        sharing a hash seed give a block the same hash). A hash no stream knows
        ends the prompt there.
        """
        if isinstance(block_hashes, str | bytes) or not isinstance(block_hashes, Sequence):
            raise ConfigError(
                f"block_hashes: expected a list of engine hashes (int or bytes), "
                f"got {block_hashes!r:.80}"
            )
        if origin is not None and type(origin) is not str:
            raise ConfigError(f"origin: expected a str or None, got {origin!r:.80}")
        if type(include_stale) is not bool:
            _bad_query(None, include_stale)
        try:
            keys = _fold_all(list(block_hashes))
        except TypeError:  # found only now, not with a pass of its own over every hash
            odd = (h for h in block_hashes if type(h) is not int and type(h) is not bytes)
            bad = next(odd, block_hashes)
            raise ConfigError(
                f"block_hashes: expected engine hashes (int or bytes), got {bad!r:.80}"
            ) from None
        if origin is not None:
            state = self._streams.get((origin, data_parallel_rank))
            maps = [state.blocks] if state is not None else []
        else:
            maps = [s.blocks for s in self._streams.values()]
        own: list[int] = []
        for key in keys:
            for blocks in maps:
                o = blocks.get(key)
                if o is not None:
                    own.append(o)
                    break
            else:
                break
        if not own:
            return []
        return self._match_hashes(own, include_stale, tier_weights)

    def _match_hashes(
        self,
        own: Any,
        include_stale: bool,
        tier_weights: Mapping[str, float] | None,
        probed: bool = False,
    ) -> list[PrefixMatch]:
        """`own`: the prompt's own hashes, a list or a uint64 array (`probed`: the
        first is known to be held)."""
        if self.ttl is not None:
            now = self._clock()
            if now >= self._next_expiry:
                self.expire(now)
        active = self._origin_mask
        if not include_stale:
            active &= ~self._stale_mask
        n = len(own)
        if not n or not active:
            return []
        runs, run_values = self._holders(own, n, probed)
        if not runs:
            return []
        # (tier, slot) bits still within their tier's leading run
        tier_alive = active * self._every_tier
        alive = active  # slots still within their any-tier leading run
        ended_at: dict[int, tuple[int, int]] = {}  # slot -> (blocks, holders of the last)
        tier_len: dict[int, int] = {}  # (tier, slot) bit -> leading blocks on that tier
        #: blocks per distinct holders value since `alive` last changed (scored in bulk)
        segment: dict[int, int] = {}
        score: dict[int, float] = {}  # a mask of slots -> what each of them scored
        weights, heaviest = self._weights(tier_weights)
        shifts = self._shifts
        prev_v = 0
        seen: set[int] = set()
        for (start, end), v in zip(runs, run_values, strict=True):
            if v in seen:  # nothing can end on a value seen before: count it
                segment[v] = segment.get(v, 0) + end - start
                prev_v = v
                continue
            seen.add(v)
            gone = tier_alive & ~v
            if gone:
                tier_alive &= v
                while start and gone:  # (a run that never started is no answer)
                    low = gone & -gone
                    gone ^= low
                    tier_len[low] = start
            held = v
            for shift in shifts:
                held |= v >> shift
            held &= alive
            if held != alive:
                if segment:
                    self._score(segment, alive, weights, heaviest, score)
                    segment = {}
                gone = alive & ~held
                alive = held
                while start and gone:
                    low = gone & -gone
                    gone ^= low
                    ended_at[low.bit_length() - 1] = (start, prev_v)
                if not alive:
                    break
            segment[v] = segment.get(v, 0) + end - start
            prev_v = v
        if alive:
            self._score(segment, alive, weights, heaviest, score)
        while alive:
            low = alive & -alive
            alive ^= low
            ended_at[low.bit_length() - 1] = (n, prev_v)
        preferred = self._preferred_fields
        fields = self._tier_fields
        make = tuple.__new__  # PrefixMatch's own __new__ is a Python call: the fields as they are
        single = len(ended_at) == 1
        scored = list(score.items())
        keyed: list[tuple[tuple[float, int, bool, int, str, int], PrefixMatch]] = []
        for slot, (blocks, last) in ended_at.items():
            state = self._slots[slot]
            assert state is not None
            bit = 1 << slot
            medium = ""
            preference = 0
            for shift, name, r in preferred:  # the fastest tier holding the last block
                if last >> shift & bit:
                    medium, preference = name, r
                    break
            per_tier = {}
            for shift, name in fields:
                # still on its tier's leading run: every block; else where that run ended
                k = n if tier_alive >> shift & bit else tier_len.get(bit << shift, 0)
                if k:
                    per_tier[name] = k
            points = 0.0
            for mask, w in scored:
                if mask & bit:
                    points += w
            points = round(points, 6)
            rank = state.rank
            match = make(
                PrefixMatch, (state.name, blocks, medium, state.stale, rank, per_tier, points)
            )
            if single:
                return [match]
            # best first: score, blocks, fresh before stale, the faster tier, origin, rank
            dp = -1 if rank is None else rank
            keyed.append(((-points, -blocks, state.stale, preference, state.name, dp), match))
        keyed.sort(key=_first)  # stable: equal keys keep the slots' order
        return [match for _, match in keyed]

    def _holders(
        self, own: Any, n: int, probed: bool = False
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """Runs `[start, end)` of blocks with equal holders, and those holders, up to the
        prompt's end; nothing when no stream holds the first block (`probed`: some
        stream does, the caller checked)."""
        if not probed and not self._nodes.get(int(own[0])):  # a miss: nothing to look up
            return [], []
        table = self._table if n >= self._table_min_blocks else None
        if table is not None:
            try:
                bulk = self._dirty_runs
                if bulk:
                    self._dirty_runs = []
                    self._dirty_run_len = 0
                if self._table_stale:
                    self._table_stale = False
                    table.rebuild(self._nodes)
                else:
                    for run in bulk:
                        self._dirty.update(dict.fromkeys(run))
                    if not table.sync(self._nodes):
                        raise OverflowError
            except OverflowError:  # holders wider than 64 bits: look up in the dict from now on
                self._table = table = None
                self._dirty = {}
        if table is not None:
            import numpy as np

            if type(own) is list:
                own = np.array(own, dtype=np.uint64)
            vals = table.lookup(own)
            # the array methods, not np.flatnonzero or .any(): their Python-level
            # dispatch costs more than the work at a few hundred blocks
            at = (vals[1:] != vals[:-1]).nonzero()[0]
            if not len(at):  # one run: the usual answer
                return [(0, n)], [int(vals[0])]
            at += 1
            cuts: list[int] = at.tolist()
            values: list[int] = [int(vals[0]), *vals[at].tolist()]
            return list(zip([0, *cuts], [*cuts, n], strict=True)), values
        if type(own) is not list:
            own = own.tolist()
        get = self._nodes.get
        found = list(map(get, own, repeat(0, n)))
        v0 = found[0]
        if not v0:
            return [], []
        if found.count(v0) == n:  # one run: the usual answer
            return [(0, n)], [v0]
        # Equal holders are one object (see _canon): identity is enough, and cheaper.
        # A run split in two by a stray equal object is still counted right.
        runs = _runs(list(map(operator.is_not, found, found[1:])), n)
        return runs, [found[s] for s, _ in runs]

    def _score(
        self,
        segment: dict[int, int],
        alive: int,
        weights: list[float],
        order: list[int],
        score: dict[int, float],
    ) -> None:
        """Add its blocks of `segment` times their best tier's weight to every slot of
        `alive` holding them (`order`: the tiers, heaviest first). `score` is kept per
        set of slots (a mask), which the slots sharing a tier take as one; a slot's
        score is the sum over the masks holding its bit."""
        width = self._width
        field = (1 << width) - 1
        for v, count in segment.items():
            rest = alive
            for t in order:
                f = (v >> (t * width)) & field & rest
                if not f:
                    continue
                rest &= ~f
                score[f] = score.get(f, 0.0) + weights[t] * count
                if not rest:
                    break

    def _weights(self, override: Mapping[str, float] | None) -> tuple[list[float], list[int]]:
        """The weight of each tier index, and the tier indices heaviest first."""
        table = (
            self.tier_weights if override is None else _checked_weights(override, "tier_weights")
        )
        d = self.default_weight
        weights = [table.get(name, d) for name in self._tiers]
        cache = self._weight_cache
        if cache is not None and cache[0] == weights:
            return cache
        order = sorted(range(len(weights)), key=lambda t: -weights[t])
        self._weight_cache = cache = (weights, order)
        return cache

    # -- state -------------------------------------------------------------------------------

    def dump(self) -> bytes:
        """The whole state as bytes, versioned (see `kvstream.index._state`).

        Taken between two batches, it holds each stream up to its `next_seq`
        (in `statistics()`): resume each subscription from there.
        """
        from kvstream.index._state import dump_index

        return dump_index(self)

    def load(self, data: bytes) -> None:
        """Load what `dump()` returned into this index, which must be empty and
        have the same `block_size` and `seed` (a `ConfigError` says
        which field differs). Other settings (weights, ttl, bounds) are this index's."""
        from kvstream.index._state import load_index

        load_index(self, data)

    # -- introspection -------------------------------------------------------------------------

    def origins(self) -> list[str]:
        """The origins the index knows (each once), in the order it first saw them."""
        return list(dict.fromkeys(name for name, _ in self._streams))

    def streams(self) -> list[StreamKey]:
        """The `(origin, data_parallel_rank)` streams the index knows."""
        return list(self._streams)

    def statistics(self) -> IndexStatistics:
        """Blocks per stream and tier, counters, and a memory estimate."""
        now = self._clock()
        origins = {
            s.label: OriginStatistics(
                blocks=len(s.blocks),
                by_medium={self._tiers[t]: n for t, n in enumerate(s.held) if n},
                orphans=len(s.orphans),
                stale=s.stale,
                stale_reason=s.stale_reason,
                epoch=s.epoch,
                next_seq=s.next_seq,
                data_parallel_rank=s.rank,
                origin=s.name,
                block_size=s.block_size,
                idle_seconds=max(0.0, now - s.last_seen),
            )
            for s in self._streams.values()
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
        if self._lru is not None:
            total += size(self._lru) + 100 * len(self._lru)
        if self._table is not None:
            total += self._table.nbytes + size(self._dirty)
        for s in self._streams.values():
            total += size(s.blocks) + 32 * len(s.blocks)  # engine hash keys
            total += size(s.spans) + 100 * len(s.spans)
            total += size(s.partial) + 100 * len(s.partial)
            total += sum(size(p) + 8 * len(p) for _, p in s.partial.values())
            total += size(s.recent) + 64 * len(s.recent)
            total += size(s.dups) + 64 * len(s.dups)
            total += size(s.orphans) + size(s.waiting)
            for orphan in s.orphans.values():
                total += size(orphan) + size(orphan.values) + 32 * len(orphan.values) + 32
        return total

    def __repr__(self) -> str:
        return (
            f"<PrefixIndex block_size={self.block_size} streams={len(self._streams)} "
            f"blocks={len(self._nodes)}>"
        )


def _runs(changed: list[bool], n: int) -> list[tuple[int, int]]:
    """`[start, end)` of each run of equal values, from `changed[i]`: item i != item i+1."""
    out = []
    start = 0
    find = changed.index
    while start < n:
        try:
            end = find(True, start) + 1
        except ValueError:
            end = n
        out.append((start, end))
        start = end
    return out


def _checked_weights(weights: Mapping[str, float], what: str) -> dict[str, float]:
    if not isinstance(weights, Mapping):
        raise ConfigError(f"{what}: expected a mapping of medium -> weight, got {weights!r:.80}")
    out = {}
    for name, w in weights.items():
        if type(name) is not str or type(w) not in (int, float) or not 0 <= w < float("inf"):
            raise ConfigError(
                f"{what}[{name!r:.40}]: expected a finite weight >= 0 for a medium string, "
                f"got {w!r:.40}"
            )
        out[name] = float(w)
    return out


def _bad_query(lora_name: object, include_stale: object) -> NoReturn:
    """Raise for the query option that is wrong (the caller checked that one is)."""
    if lora_name is not None and type(lora_name) is not str:
        raise ConfigError(f"lora_name: expected a str or None, got {lora_name!r:.80}")
    raise ConfigError(f"include_stale: expected True or False, got {include_stale!r:.80}")


def _check_extra_keys(extra_keys: object) -> None:
    """`extra_keys` of a query: a list with one entry per block, each a list or None."""
    if not isinstance(extra_keys, list | tuple) or any(
        e is not None and not isinstance(e, list | tuple) for e in extra_keys
    ):
        raise ConfigError(
            f"extra_keys: expected a list with one entry per block (a list or None), "
            f"got {extra_keys!r:.80}"
        )
