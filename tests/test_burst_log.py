"""`BurstLog`: one record per burst at the level asked, the rest at DEBUG, until it clears."""

from __future__ import annotations

import logging
import math

import pytest

from kvstream._burst_log import BurstLog, BurstLogs

log = logging.getLogger("kvstream.test_burst_log")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _levels(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    out = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == log.name]
    caplog.clear()
    return out


def test_a_burst_logs_once_and_clearing_starts_the_next(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)
    burst = BurstLog(log, math.inf)
    assert not burst.clear()  # nothing to clear yet
    assert burst.log("bad %d", 1)
    assert not burst.log("bad %d", 2)
    assert _levels(caplog) == [(logging.WARNING, "bad 1"), (logging.DEBUG, "bad 2")]
    assert burst.clear()
    assert not burst.active
    assert burst.log("bad %d", 3)  # a new burst warns again at once
    assert _levels(caplog) == [(logging.WARNING, "bad 3")]


def test_a_burst_also_ends_by_time_and_counts_what_it_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)
    clock = Clock()
    burst = BurstLog(log, 10.0, level=logging.ERROR, clock=clock)
    burst.log("refused")
    clock.now += 5
    burst.log("refused")
    burst.log("refused")
    clock.now += 6  # 11 s after the burst's record
    assert not burst.active
    burst.log("refused")
    assert _levels(caplog) == [
        (logging.ERROR, "refused"),
        (logging.DEBUG, "refused"),
        (logging.DEBUG, "refused"),
        (logging.ERROR, "refused (2 more like it in the last burst)"),
    ]


def test_keyed_bursts_are_apart_and_clear_apart(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=log.name)
    bursts: BurstLogs[tuple[str, str]] = BurstLogs(log, math.inf)
    for key in [("a", "gap"), ("a", "gap"), ("a", "dup"), ("b", "gap")]:
        bursts.log(key, "%s %s", *key)
    assert _levels(caplog) == [
        (logging.WARNING, "a gap"),
        (logging.WARNING, "a dup"),
        (logging.WARNING, "b gap"),
    ]
    bursts.clear_where(lambda key: key[0] == "a")
    for key in [("a", "gap"), ("b", "gap")]:
        bursts.log(key, "%s %s", *key)
    assert _levels(caplog) == [(logging.WARNING, "a gap")]  # b's burst goes on
    assert bursts.clear(("b", "gap"))
    assert not bursts.clear(("c", "gap"))


def test_on_says_a_burst_started_and_was_not_cleared() -> None:
    burst = BurstLog(log, math.inf)
    seen = [burst.on]
    burst.log("first")
    burst.log("second, inside the burst")
    seen.append(burst.on)
    assert burst.clear() is True
    seen.append(burst.on)
    assert seen == [False, True, False]
    assert burst.clear() is False  # nothing was on


async def test_a_sinks_refusal_burst_ends_with_the_first_batch_taken_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvstream import BlockStored, MemorySink, Scheduler
    from kvstream.codecs.msgpack import MsgpackCodec

    caplog.set_level(logging.WARNING, logger="kvstream.sinks")
    sink = MemorySink(codec=MsgpackCodec(strict="refuse"), name="strict")
    bad = BlockStored(block_hashes=[-1], parent_block_hash=None, token_ids=[1], block_size=1)
    good = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=1)
    async with Scheduler(sinks=[sink], origin="e") as s:
        for events in ([bad], [bad], [good], [bad]):
            s.emit(events)
            await s.tick()
    refusals = [r for r in caplog.records if "the codec refused" in r.getMessage()]
    assert len(refusals) == 2  # two bursts: the good batch between them ended the first
    assert sink.statistics().events_refused == 3
