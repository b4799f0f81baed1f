"""`continuity()`: the one rule for where a batch stands in its `(origin, epoch)` stream."""

from __future__ import annotations

import pytest

from kvstream.consumers.base import Continuity, Gap, SequenceTracker, continuity
from kvstream.events import EventBatch
from kvstream.index._prefix import PrefixIndex


@pytest.mark.parametrize(
    ("known", "epoch", "seq", "retired", "place"),
    [
        (None, "e1", 5, (), Continuity.FIRST),
        (("e1", 3), "e1", 3, (), Continuity.NEXT),
        (("e1", 3), "e1", 2, (), Continuity.DUPLICATE),
        (("e1", 3), "e1", 7, (), Continuity.GAP),
        (("e1", 3), "e2", 0, (), Continuity.NEW_EPOCH),
        (("e1", 3), "e2", 9, (), Continuity.NEW_EPOCH),  # a restart, never a gap
        (("e2", 3), "e1", 0, ("e1",), Continuity.RETIRED),
        (("e2", 3), "e1", 0, (), Continuity.NEW_EPOCH),  # without memory: a new epoch
    ],
)
def test_the_rule(
    known: tuple[str, int] | None, epoch: str, seq: int, retired: tuple[str, ...], place: Continuity
) -> None:
    assert continuity(known, epoch, seq, retired) is place


def _batch(seq: int, epoch: str = "e1", origin: str = "a") -> EventBatch:
    return EventBatch(seq=seq, ts=0.0, events=[], origin=origin, epoch=epoch)


def test_a_subscriber_tracker_follows_it() -> None:
    tracker = SequenceTracker()
    got = [
        tracker.check(_batch(seq, epoch))
        for seq, epoch in [(0, "e1"), (1, "e1"), (1, "e1"), (4, "e1"), (0, "e2")]
    ]
    assert [state for state, _ in got] == [
        Continuity.FIRST,
        Continuity.NEXT,
        Continuity.DUPLICATE,
        Continuity.GAP,
        Continuity.NEW_EPOCH,
    ]
    assert got[3][1] == Gap("a", "e1", 2, 4)
    assert (tracker.duplicates, tracker.gaps, tracker.missing) == (1, 1, 2)
    assert tracker.position("a") == ("e2", 1)


def test_the_index_follows_it_and_drops_a_retired_epoch() -> None:
    index = PrefixIndex(block_size=4)
    for seq, epoch in [(0, "e1"), (1, "e1"), (1, "e1"), (3, "e1"), (0, "e2"), (4, "e1")]:
        index.apply(_batch(seq, epoch))
    stats = index.statistics()
    assert (stats.duplicate_batches, stats.gaps, stats.restarts, stats.retired_epoch_batches) == (
        1,
        1,
        1,
        1,
    )
