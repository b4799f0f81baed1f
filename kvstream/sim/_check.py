"""Checking that a stream of batches describes a consistent cache.

Per origin and tier (`medium`) the checker keeps the set of blocks held and
refuses, with `ConsistencyError`:

* a `BlockRemoved` of a block the tier does not hold;
* a `BlockStored` whose non-null parent the tier does not hold (within one
  event, each block's parent is the block before it);
* a `BlockStored` of a block the tier already holds;
* a batch whose `seq` is not the next one of its `(origin, epoch)`
  (contiguous from 0; a new epoch starts a new, empty state).

`AllBlocksCleared` empties every tier of its origin (vLLM gives it no tier).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvstream.errors import KVStreamError
from kvstream.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

__all__ = ["ConsistencyError", "ConsistencyReport", "check_consistency"]


class ConsistencyError(KVStreamError, AssertionError):
    """The stream contradicts itself; the message says where and how."""


@dataclass
class ConsistencyReport:
    batches: int = 0
    events: int = 0
    #: (event type, medium) -> count; AllBlocksCleared has medium None
    by_type: Counter[tuple[str, str | None]] = field(default_factory=Counter)
    #: origin -> (epoch, last seq)
    last_seq: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: origin -> medium -> blocks held at the end
    held: dict[str, dict[str | None, int]] = field(default_factory=dict)


def check_consistency(
    batches: Iterable[EventBatch], *, start_seq: int | None = 0, joined_late: bool = False
) -> ConsistencyReport:
    """Check `batches` (in stream order); see the module doc. Returns a summary.

    `start_seq=None` accepts a first batch of any seq (a stream joined late,
    whose state before it is unknown: then removals of unknown blocks are not
    errors until a snapshot or clear). `joined_late=True` also judges an
    origin whose first batch is seq 0 that way (a relay that joined its upstream
    late numbers from 0); it implies `start_seq=None`.
    """
    if joined_late:
        start_seq = None
    report = ConsistencyReport()
    state: dict[str, dict[str | None, set[int | bytes]]] = {}
    position: dict[str, tuple[str, int]] = {}
    partial: set[str] = set()
    for batch in batches:
        where = f"{batch.origin} epoch {batch.epoch} seq {batch.seq}"
        known = position.get(batch.origin)
        if known is None or known[0] != batch.epoch:
            if start_seq is not None and batch.seq != start_seq:
                raise ConsistencyError(
                    f"{where}: first batch of the epoch, expected seq {start_seq}"
                )
            if known is not None and batch.seq != 0 and not joined_late:
                # Seen restarting inside the recording: its new epoch starts at 0.
                raise ConsistencyError(
                    f"{where}: the origin restarted (epoch {known[0]} -> {batch.epoch}) but "
                    f"the new epoch's first batch here is seq {batch.seq}: seq 0.."
                    f"{batch.seq - 1} are missing"
                )
            partial.discard(batch.origin)  # a new epoch starts empty...
            if start_seq is None and (batch.seq != 0 or (joined_late and known is None)):
                partial.add(batch.origin)  # ...unless it was joined late
            state[batch.origin] = {}
        elif batch.seq != known[1] + 1:
            raise ConsistencyError(f"{where}: expected seq {known[1] + 1}")
        position[batch.origin] = (batch.epoch, batch.seq)
        tiers = state[batch.origin]
        report.batches += 1
        for i, event in enumerate(batch.events):
            report.events += 1
            at = f"{where} event {i}"
            if isinstance(event, BlockStored):
                report.by_type["BlockStored", event.medium] += 1
                held = tiers.setdefault(event.medium, set())
                parent = event.parent_block_hash
                if parent is not None and parent not in held and batch.origin not in partial:
                    raise ConsistencyError(
                        f"{at}: BlockStored on {event.medium}: parent {parent!r} is not held"
                    )
                for h in event.block_hashes:
                    if h in held:
                        raise ConsistencyError(
                            f"{at}: BlockStored on {event.medium}: block {h!r} is already held"
                        )
                    held.add(h)
            elif isinstance(event, BlockRemoved):
                report.by_type["BlockRemoved", event.medium] += 1
                held = tiers.setdefault(event.medium, set())
                for h in event.block_hashes:
                    if h not in held:
                        if batch.origin in partial:
                            continue
                        raise ConsistencyError(
                            f"{at}: BlockRemoved on {event.medium}: block {h!r} is not held"
                        )
                    held.discard(h)
            elif isinstance(event, AllBlocksCleared):
                report.by_type["AllBlocksCleared", None] += 1
                tiers.clear()
                partial.discard(batch.origin)
            else:  # pragma: no cover - the event union is closed
                raise ConsistencyError(f"{at}: unknown event {event!r}")
    report.last_seq = dict(position)
    report.held = {o: {m: len(s) for m, s in t.items()} for o, t in state.items()}
    return report
