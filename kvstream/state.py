"""What an origin holds, kept from its batches, and the snapshot that re-announces it.

`StateKeeper` is pure and sans-IO: feed it an origin's batches in stream
order (`StateKeeper.apply()`) and it keeps, per origin and tier, every block
held with what re-announcing it needs (parent, tokens, block size, LoRA, extra
keys, group, KV-cache spec, locality). `StateKeeper.snapshot()` turns that
into a `Snapshot`: `AllBlocksCleared` then `BlockStored` events,
parents before children, tagged `(origin, epoch, resume_seq)`. Applied in
place of batches `0 .. resume_seq - 1` of the epoch and followed by the stream
from `resume_seq`, it leaves a consumer in the state the whole stream would.

The rules, per origin:

* **Tiers** are `medium` values taken as they are (`None` is a tier of its
  own: a stream that names no medium names none consistently). `group_idx`
  and `locality` are kept with each block and re-announced, not part of the
  tier's key.
* `BlockStored` holds each block in its tier; block `i` of an event has
  the block before it as parent, the first has `parent_block_hash`. Storing a
  hash the tier already holds replaces what is known of it, except that a
  **placeholder** (`block_size` 0, no tokens: vLLM's form for connectors
  that do not know them) never replaces a block held with its tokens; it says
  less, and the block is the same. A placeholder of a new block is held and
  re-announced as a placeholder.
* `BlockRemoved` of a hash the tier does not hold is ignored and counted
  (`KeeperStatistics.unknown_removals`); vLLM's GPU pool may report
  removals of blocks stored before a consumer started, and connectors may
  report removals twice.
* `AllBlocksCleared` empties every tier of the origin.
* **Batches**: a new epoch starts empty (the producer restarted). A repeat
  (`seq` below the next one) is ignored. A batch after a jump in `seq`, or
  the first batch seen of an epoch when it is not `seq 0`, is applied, but
  the state is then **unknown** (what the missing batches did is not known):
  the origin's blocks are dropped, its stores and removals are ignored, and
  `StateKeeper.snapshot()` refuses with `StateError`, until an
  `AllBlocksCleared` or a new epoch makes it known again. A snapshot never
  hides a gap a stream reader would see.
* **Bounded**: the keeper estimates the bytes it holds (`max_bytes`, over
  all origins). A store that would pass the bound raises
  `StateLimitError`; that origin's blocks are dropped and its state is
  unknown until its next clear or epoch, so the keeper's memory stays bounded
  and the producer's pipeline goes on.
* `metadata` is not kept: it describes an event, not a block.

A `SnapshotBatch`-like batch (any batch whose class sets
`is_snapshot`) replaces the origin's state and sets its position to the
snapshot's `seq + 1`, so a consumer can keep its state with the same keeper.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final, NamedTuple

import msgspec

from kvstream.errors import ConfigError, KVStreamError
from kvstream.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "BlockShape",
    "HeldBlock",
    "KeeperStatistics",
    "Snapshot",
    "SnapshotSchedule",
    "StateError",
    "StateKeeper",
    "StateLimitError",
]

#: The keeper's default bound: 1 GiB of estimated state, over all origins.
DEFAULT_MAX_BYTES: Final = 1 << 30
#: At most this many blocks in one `BlockStored` of a snapshot.
SNAPSHOT_EVENT_BLOCKS: Final = 256

# What one held block costs beyond its tokens: the tier's dict slot, the record,
# its token array's header, the hash and parent ints. benchmarks/bench_snapshot.py
# traces about 185 bytes (313 per block of 16 tokens) on CPython 3.11; the
# estimate errs above it.
_BLOCK_BYTES: Final = 200
_TOKEN_BYTES: Final = 8
_EXTRA_BYTES: Final = 64


class StateError(KVStreamError):
    """The keeper does not know an origin's state (a gap, or the byte bound was hit)."""


class StateLimitError(StateError):
    """Storing more would pass the keeper's `max_bytes`; the origin's state is dropped."""


class BlockShape(msgspec.Struct, frozen=True, gc=False):
    """What the blocks of one `BlockStored` share (one object for all of them)."""

    block_size: int
    lora_id: int | None
    lora_name: str | None
    group_idx: int | None
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None
    locality: str | None


class HeldBlock(msgspec.Struct, frozen=True, gc=False):
    """One block a tier holds: enough to announce it again.

    Not tracked by the garbage collector (`gc=False`: it holds no cycles), so a
    keeper of millions of blocks costs a full collection nothing.
    """

    parent: BlockHash | None
    #: `block_size` token ids, or None for a placeholder (block size 0).
    tokens: array[int] | None
    extra_keys: list[Any] | None
    shape: BlockShape


class Snapshot(NamedTuple):
    """An origin's state standing in for batches `0 .. resume_seq - 1` of `epoch`."""

    origin: str
    epoch: str
    #: The seq of the first batch the snapshot does not include.
    resume_seq: int
    data_parallel_rank: int | None
    #: The `ts` of the last batch included.
    ts: float
    #: `AllBlocksCleared`, then `BlockStored` events, parents first.
    events: list[KVCacheEvent]
    #: Blocks announced, over all tiers.
    blocks: int

    def to_batch(self) -> EventBatch:
        """The snapshot as the batch `resume_seq - 1` (what a codec encodes)."""
        if self.resume_seq < 1:
            raise StateError(f"{self.origin}: a snapshot of no batch cannot be a batch")
        return EventBatch(
            seq=self.resume_seq - 1,
            ts=self.ts,
            events=self.events,
            data_parallel_rank=self.data_parallel_rank,
            origin=self.origin,
            epoch=self.epoch,
        )


class KeeperStatistics(NamedTuple):
    origins: int
    blocks: int
    #: Estimated bytes held (the quantity `max_bytes` bounds).
    bytes: int
    max_bytes: int
    unknown_removals: int
    #: Times an origin's state became unknown (a gap, a late start, the bound).
    unknown: int
    #: Stores refused because of the bound.
    over_limit: int


class _Origin:
    __slots__ = ("bytes", "epoch", "name", "next_seq", "rank", "tiers", "ts", "unknown")

    def __init__(self, name: str, epoch: str) -> None:
        self.name = name
        self.epoch = epoch
        self.next_seq = 0
        self.rank: int | None = None
        self.ts = 0.0
        self.tiers: dict[str | None, dict[BlockHash, HeldBlock]] = {}
        self.bytes = 0
        #: Why the state is not known (None: it is).
        self.unknown: str | None = None


def _cost(block: HeldBlock) -> int:
    cost = _BLOCK_BYTES
    if block.tokens is not None:
        cost += _TOKEN_BYTES * len(block.tokens)
    if block.extra_keys is not None:
        cost += _EXTRA_BYTES + _TOKEN_BYTES * len(block.extra_keys)
    if type(block.parent) is bytes:
        cost += len(block.parent)
    return cost


def _shape(event: BlockStored) -> BlockShape:
    return BlockShape(
        event.block_size,
        event.lora_id,
        event.lora_name,
        event.group_idx,
        event.kv_cache_spec_kind,
        event.kv_cache_spec_sliding_window,
        event.locality,
    )


class StateKeeper:
    """Keeps what each origin holds, from its batches; see the module doc for the rules."""

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if type(max_bytes) is not int or max_bytes < 1:
            raise ConfigError(f"StateKeeper.max_bytes: expected an int >= 1, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._origins: dict[str, _Origin] = {}
        self._bytes = 0
        self._unknown_removals = 0
        self._unknown = 0
        self._over_limit = 0

    # -- reading ------------------------------------------------------------------------

    def origins(self) -> list[str]:
        return list(self._origins)

    def position(self, origin: str) -> tuple[str, int] | None:
        """`(epoch, next seq)` of `origin`, or None if never seen."""
        o = self._origins.get(origin)
        return None if o is None else (o.epoch, o.next_seq)

    def known(self, origin: str) -> bool:
        """True when `origin` has been seen and its state is known (it can be snapshot)."""
        o = self._origins.get(origin)
        return o is not None and o.unknown is None

    def held(self, origin: str) -> dict[str | None, dict[BlockHash, HeldBlock]]:
        """`{medium: {hash: block}}` of `origin` (empty tiers left out), a copy."""
        o = self._origins.get(origin)
        if o is None:
            return {}
        return {m: dict(blocks) for m, blocks in o.tiers.items() if blocks}

    def blocks(self, origin: str) -> int:
        o = self._origins.get(origin)
        return 0 if o is None else sum(len(t) for t in o.tiers.values())

    def statistics(self) -> KeeperStatistics:
        return KeeperStatistics(
            origins=len(self._origins),
            blocks=sum(self.blocks(o) for o in self._origins),
            bytes=self._bytes,
            max_bytes=self.max_bytes,
            unknown_removals=self._unknown_removals,
            unknown=self._unknown,
            over_limit=self._over_limit,
        )

    # -- applying batches ------------------------------------------------------------------

    def forget(self, origin: str) -> None:
        """Drop everything known of `origin` (it expired)."""
        o = self._origins.pop(origin, None)
        if o is not None:
            self._bytes -= o.bytes

    def apply_all(self, batches: Iterable[EventBatch]) -> None:
        for batch in batches:
            self.apply(batch)

    def apply(self, batch: EventBatch) -> None:
        """Apply one batch of its origin (see the module doc for repeats, gaps, epochs).

        Raises `StateLimitError` when a store passes `max_bytes`; the
        batch's position is still taken, so the next batch applies normally.
        """
        o = self._origins.get(batch.origin)
        if getattr(batch, "is_snapshot", False):
            if o is not None:
                self.forget(batch.origin)
            o = self._origins[batch.origin] = _Origin(batch.origin, batch.epoch)
        elif o is None or o.epoch != batch.epoch:
            if o is not None:
                self.forget(batch.origin)
            o = self._origins[batch.origin] = _Origin(batch.origin, batch.epoch)
            if batch.seq != 0:
                self._mark_unknown(
                    o, f"the first batch seen of epoch {batch.epoch} is seq {batch.seq}"
                )
        elif batch.seq < o.next_seq:
            return
        elif batch.seq > o.next_seq:
            self._mark_unknown(o, f"batches {o.next_seq}..{batch.seq - 1} are missing")
        o.next_seq = batch.seq + 1
        o.ts = batch.ts
        o.rank = batch.data_parallel_rank
        for event in batch.events:
            if o.unknown is None or type(event) is AllBlocksCleared:
                self._apply_event(o, event)

    def _mark_unknown(self, o: _Origin, why: str) -> None:
        if o.unknown is None:
            self._unknown += 1
        o.unknown = why
        self._drop_blocks(o)  # nothing is known until a clear: hold nothing

    def _drop_blocks(self, o: _Origin) -> None:
        self._bytes -= o.bytes
        o.bytes = 0
        o.tiers = {}

    def _apply_event(self, o: _Origin, event: KVCacheEvent) -> None:
        if type(event) is BlockStored:
            self._store(o, event)
        elif type(event) is BlockRemoved:
            tier = o.tiers.get(event.medium)
            for h in event.block_hashes:
                old = tier.pop(h, None) if tier is not None else None
                if old is None:
                    self._unknown_removals += 1
                else:
                    cost = _cost(old)
                    o.bytes -= cost
                    self._bytes -= cost
        elif type(event) is AllBlocksCleared:
            self._drop_blocks(o)
            o.unknown = None
        else:  # pragma: no cover - the event union is closed
            raise StateError(f"StateKeeper: unknown event type {type(event).__name__}")

    def _store(self, o: _Origin, event: BlockStored) -> None:
        tier = o.tiers.get(event.medium)
        if tier is None:
            tier = o.tiers[event.medium] = {}
        shape = _shape(event)
        size = event.block_size
        tokens = event.token_ids
        placeholder = not tokens
        extra = event.extra_keys
        parent = event.parent_block_hash
        added = 0
        packed = None if placeholder else array("Q", tokens)  # one conversion per event
        fixed = _BLOCK_BYTES + (0 if placeholder else _TOKEN_BYTES * size)
        get = tier.get
        for i, h in enumerate(event.block_hashes):
            old = get(h)
            if old is not None and placeholder and old.tokens is not None:
                parent = h  # the block is held with its tokens: keep them
                continue
            block = HeldBlock(
                parent,
                None if packed is None else packed[i * size : (i + 1) * size],
                None if extra is None else extra[i],
                shape,
            )
            cost = fixed if extra is None and type(parent) is not bytes else _cost(block)
            if old is not None:
                cost -= _cost(old)
            tier[h] = block
            added += cost
            parent = h
        o.bytes += added
        self._bytes += added
        if self._bytes > self.max_bytes:
            self._over_limit += 1
            self._mark_unknown(o, f"its state passed the keeper's bound of {self.max_bytes} bytes")
            raise StateLimitError(
                f"StateKeeper: origin {o.name!r}: storing {len(event.block_hashes)} "
                f"block(s) on {event.medium} passes max_bytes={self.max_bytes} (estimated); "
                f"its state is dropped until its next AllBlocksCleared or epoch"
            )

    # -- snapshots ---------------------------------------------------------------------

    def snapshot(self, origin: str) -> Snapshot:
        """`origin`'s state as of the last batch applied; `StateError` if unknown."""
        head = self.snapshot_header(origin)
        return head._replace(events=list(self.snapshot_events(origin)))

    def snapshot_header(self, origin: str) -> Snapshot:
        """`snapshot()` without its events (`events` is empty; `blocks` is right).

        With `snapshot_events()`, a caller can encode a large snapshot a slice at
        a time without holding all its events at once; the keeper must not be
        given batches until the events are all taken.
        """
        o = self._origins.get(origin)
        if o is None:
            raise StateError(f"StateKeeper: origin {origin!r} was never seen")
        if o.unknown is not None:
            raise StateError(f"StateKeeper: the state of origin {origin!r} is unknown: {o.unknown}")
        blocks = sum(len(t) for t in o.tiers.values())
        return Snapshot(origin, o.epoch, o.next_seq, o.rank, o.ts, [], blocks)

    def snapshot_events(self, origin: str) -> Iterator[KVCacheEvent]:
        """The events of `origin`'s snapshot, one at a time (see `snapshot_header()`)."""
        o = self._origins.get(origin)
        if o is None or o.unknown is not None:
            self.snapshot_header(origin)  # raises the reason
            return
        yield AllBlocksCleared()
        for medium, tier in o.tiers.items():
            for run in _runs(tier):
                yield _stored(medium, run, tier)


def _parent_order(tier: dict[BlockHash, HeldBlock]) -> Iterator[BlockHash]:
    """Every hash of `tier` once, each after its parent when the tier holds the parent."""
    done: set[BlockHash] = set()
    add = done.add
    for h, block in tier.items():
        if h in done:
            continue
        parent = block.parent
        if parent is None or parent in done or parent not in tier:
            add(h)  # the usual case: stored after its parent
            yield h
            continue
        path: list[BlockHash] = []
        on_path: set[BlockHash] = set()
        cur: BlockHash | None = h
        while cur is not None and cur not in done and cur not in on_path:
            held = tier.get(cur)
            if held is None:
                break
            path.append(cur)
            on_path.add(cur)
            cur = held.parent
        for x in reversed(path):
            add(x)
            yield x


def _runs(tier: dict[BlockHash, HeldBlock]) -> Iterator[list[BlockHash]]:
    """The hashes in parent order, cut into chains one `BlockStored` can carry."""
    run: list[BlockHash] = []
    last: HeldBlock | None = None
    limit = SNAPSHOT_EVENT_BLOCKS
    for h in _parent_order(tier):
        block = tier[h]
        if (
            last is not None
            and len(run) < limit
            and block.parent == run[-1]
            and (block.shape is last.shape or block.shape == last.shape)
            and (block.tokens is None) == (last.tokens is None)
        ):
            run.append(h)
        else:
            if run:
                yield run
            run = [h]
        last = block
    if run:
        yield run


def _stored(
    medium: str | None, run: list[BlockHash], tier: dict[BlockHash, HeldBlock]
) -> BlockStored:
    first = tier[run[0]]
    shape = first.shape
    tokens: list[int] = []
    if first.tokens is not None:
        for h in run:
            t = tier[h].tokens
            assert t is not None
            tokens.extend(t.tolist())
    extra: list[Any] | None = [tier[h].extra_keys for h in run]
    if extra is not None and all(e is None for e in extra):
        extra = None
    return BlockStored(
        block_hashes=run,
        parent_block_hash=first.parent,
        token_ids=tokens,
        block_size=shape.block_size if first.tokens is not None else 0,
        lora_id=shape.lora_id,
        medium=medium,
        lora_name=shape.lora_name,
        extra_keys=extra,
        group_idx=shape.group_idx,
        kv_cache_spec_kind=shape.kv_cache_spec_kind,
        kv_cache_spec_sliding_window=shape.kv_cache_spec_sliding_window,
        locality=shape.locality,
    )


class SnapshotSchedule:
    """When a sink should publish an origin's snapshot: every `every` batches or
    `interval` seconds (whichever comes first, checked as batches are delivered),
    and at once after the first batch of each epoch, so every origin a reader can
    meet has a snapshot from its start. Sans-IO: `clock` is injected.
    """

    __slots__ = ("_clock", "_last", "every", "interval")

    def __init__(
        self,
        every: int | None,
        interval: float | None,
        *,
        clock: Callable[[], float],
    ) -> None:
        if every is not None and (type(every) is not int or every < 1):
            raise ConfigError(f"snapshot_every: expected an int >= 1 (batches), got {every!r}")
        if interval is not None and not (isinstance(interval, int | float) and interval > 0):
            raise ConfigError(f"snapshot_interval: expected seconds > 0, got {interval!r}")
        self.every = every
        self.interval = interval
        self._clock = clock
        # origin -> (epoch of the last snapshot, batches since it, when it was taken)
        self._last: dict[str, tuple[str, int, float]] = {}

    def due(self, batch: EventBatch) -> bool:
        """Count `batch` (just delivered); True when its origin's snapshot is due."""
        last = self._last.get(batch.origin)
        if last is None or last[0] != batch.epoch:
            return True
        epoch, since, when = last
        since += 1
        self._last[batch.origin] = (epoch, since, when)
        if self.every is not None and since >= self.every:
            return True
        return self.interval is not None and self._clock() - when >= self.interval

    def taken(self, origin: str, epoch: str) -> None:
        """The snapshot of `origin` was published."""
        self._last[origin] = (epoch, 0, self._clock())
