"""Logging a burst of like events once: the first at WARNING (or `level`), the rest at DEBUG.

The one rule for "log once per burst" wherever something can repeat fast (a
refused request, an undecodable message, an unreachable peer):

    refusals = BurstLog(log)
    refusals.log("%s: request refused: %s", name, reason)  # WARNING, then DEBUG
    ...
    refusals.clear()  # the condition cleared: the next one starts a new burst

A burst ends when the owner calls `clear()` (the condition went away: a
peer answered, a batch decoded), or `window` seconds after the burst's
warning, whichever comes first; `window=math.inf` ends it only by `clear()`.
A warning that starts a burst after one ended by time says how many records
that burst held beyond its warning. `BurstLogs` keeps one burst per key (an
origin, a stream).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["BurstLog", "BurstLogs"]

K = TypeVar("K", bound=Hashable)


class BurstLog:
    """Logs the first of a burst of similar events at `level`, the rest at DEBUG."""

    __slots__ = ("_clock", "_last", "_level", "_log", "_suppressed", "on", "window")

    def __init__(
        self,
        logger: logging.Logger,
        window: float = 10.0,
        *,
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self.window = window
        self._level = level
        self._clock = clock
        self._last = -math.inf
        self._suppressed = 0
        #: True from a burst's first record until `clear()` (a plain attribute,
        #: cheap enough for a hot path to test on every call).
        self.on = False

    @property
    def active(self) -> bool:
        """Whether a burst is on (its warning logged, not cleared, its window not over)."""
        return self._clock() - self._last < self.window

    def log(self, msg: str, *args: object) -> bool:
        """Log `msg % args`: at `level` when a burst starts (then True), else at DEBUG."""
        now = self._clock()
        if now - self._last >= self.window:
            if self._suppressed:
                msg += f" ({self._suppressed} more like it in the last burst)"
            self._log.log(self._level, msg, *args)
            self._last = now
            self._suppressed = 0
            self.on = True
            return True
        self._suppressed += 1
        self._log.debug(msg, *args)
        return False

    def clear(self) -> bool:
        """The condition cleared: the next `log()` starts a new burst.

        True when a burst was on (so the owner can say it recovered).
        """
        if self._last == -math.inf:
            return False
        was = self.active
        self._last = -math.inf
        self._suppressed = 0
        self.on = False
        return was


class BurstLogs(Generic[K]):
    """One `BurstLog` per key, made on first use and dropped when cleared."""

    __slots__ = ("_bursts", "_clock", "_level", "_log", "window")

    def __init__(
        self,
        logger: logging.Logger,
        window: float = 10.0,
        *,
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self.window = window
        self._level = level
        self._clock = clock
        self._bursts: dict[K, BurstLog] = {}

    def log(self, key: K, msg: str, *args: object) -> bool:
        """`BurstLog.log()` in the burst of `key`."""
        burst = self._bursts.get(key)
        if burst is None:
            burst = self._bursts[key] = BurstLog(
                self._log, self.window, level=self._level, clock=self._clock
            )
        return burst.log(msg, *args)

    def clear(self, key: K) -> bool:
        """`BurstLog.clear()` of `key`'s burst (True when one was on)."""
        burst = self._bursts.pop(key, None)
        return burst is not None and burst.clear()

    def clear_where(self, matches: Callable[[K], bool]) -> None:
        """Clear the burst of every key for which `matches(key)` is true."""
        for key in [k for k in self._bursts if matches(k)]:
            del self._bursts[key]
