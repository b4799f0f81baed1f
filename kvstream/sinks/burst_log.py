"""Logging a burst of like events once: the first at WARNING, the rest at DEBUG."""

from __future__ import annotations

import logging
import math
import time

__all__ = ["BurstLog"]


class BurstLog:
    """Logs the first of a burst of similar events at WARNING, the rest at DEBUG.

    A burst ends `window` seconds after the last warning; the next warning
    says how many records the burst held beyond it.
    """

    __slots__ = ("_last", "_log", "_suppressed", "window")

    def __init__(self, logger: logging.Logger, window: float = 10.0) -> None:
        self._log = logger
        self.window = window
        self._last = -math.inf
        self._suppressed = 0

    def log(self, msg: str, *args: object) -> None:
        """Log `msg % args`: at WARNING when a burst starts, else at DEBUG."""
        now = time.monotonic()
        if now - self._last >= self.window:
            if self._suppressed:
                msg += f" ({self._suppressed} more like it in the last burst)"
            self._log.warning(msg, *args)
            self._last = now
            self._suppressed = 0
        else:
            self._suppressed += 1
            self._log.debug(msg, *args)
