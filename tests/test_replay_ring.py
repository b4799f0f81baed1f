"""The replay ring: bounded in bytes and count, positions and offsets stable; push = append."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvstream.sinks._replay_ring import ReplayRing


def state(ring: ReplayRing[int]) -> tuple[object, ...]:
    held = [ring.get(p) for p in range(ring.first_pos, ring.end_pos)]
    offsets = [ring.offset(p) for p in range(ring.first_pos, ring.end_pos + 1)]
    return ring.first_pos, ring.end_pos, ring.bytes, ring.end_offset, held, offsets


@given(
    costs=st.lists(st.integers(0, 5_000), max_size=3_000),
    max_bytes=st.integers(1, 20_000),
    max_items=st.none() | st.integers(1, 50),
)
def test_push_keeps_what_append_keeps(
    costs: list[int], max_bytes: int, max_items: int | None
) -> None:
    pushed: ReplayRing[int] = ReplayRing(max_bytes, max_items)
    appended: ReplayRing[int] = ReplayRing(max_bytes, max_items)
    for i, cost in enumerate(costs):
        pushed.push(i, cost)
        appended.append(i, cost)
        assert pushed.end_pos == i + 1
        # Within bounds, except that the newest item always stays.
        assert len(pushed) == 1 or (
            pushed.bytes <= max_bytes and (max_items is None or len(pushed) <= max_items)
        )
    assert state(pushed) == state(appended)


def test_append_reports_what_it_evicted_with_positions() -> None:
    ring: ReplayRing[str] = ReplayRing(max_bytes=10)
    assert ring.append("a", 4) == []
    assert ring.append("b", 4) == []
    assert ring.append("c", 4) == [(0, "a")]
    assert (ring.first_pos, ring.end_pos, ring.bytes) == (1, 3, 8)
    assert ring.append("huge", 100) == [(1, "b"), (2, "c")]
    assert ring.get(3) == "huge"  # the newest stays, even over the bound
