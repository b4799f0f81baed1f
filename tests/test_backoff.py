"""`Backoff`: the one rule for waiting between failed attempts."""

from __future__ import annotations

import pytest

from kvstream._backoff import Backoff
from kvstream.errors import ConfigError


def test_delays_grow_by_the_factor_up_to_the_maximum_and_reset() -> None:
    backoff = Backoff(0.1, 0.5)
    assert [backoff.next_delay() for _ in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert backoff.failures == 5
    backoff.reset()
    assert backoff.failures == 0
    assert backoff.next_delay() == pytest.approx(0.1)
    tripled = Backoff(1, 100, factor=3)
    assert [tripled.next_delay() for _ in range(3)] == pytest.approx([1, 3, 9])


def test_a_maximum_below_initial_caps_the_first_wait_too() -> None:
    backoff = Backoff(2.0, 0.5)
    assert [backoff.next_delay() for _ in range(2)] == pytest.approx([0.5, 0.5])


def test_jitter_takes_at_most_its_share_off_each_wait() -> None:
    backoff = Backoff(1.0, 8.0, jitter=0.5)
    for full in (1.0, 2.0, 4.0, 8.0, 8.0):
        assert full * 0.5 <= backoff.next_delay() <= full


async def test_wait_sleeps_and_counts() -> None:
    backoff = Backoff(0.001, 0.002)
    await backoff.wait()
    await backoff.wait()
    assert backoff.failures == 2


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"initial": 0}, "x: initial: expected seconds > 0, got 0"),
        ({"maximum": -1.0}, "x: maximum: expected seconds > 0, got -1.0"),
        ({"initial": "1"}, "x: initial: expected seconds > 0, got '1'"),
        ({"factor": 0.5}, "x: factor: expected a number >= 1, got 0.5"),
        ({"jitter": 2}, "x: jitter: expected a number in [0, 1], got 2"),
    ],
)
def test_bad_settings_name_the_field_and_value(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as info:
        Backoff(**kwargs, where="x")  # type: ignore[arg-type]
    assert str(info.value) == named
