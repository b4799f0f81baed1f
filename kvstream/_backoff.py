"""How long to wait between failed attempts: the one backoff rule.

    backoff = Backoff(initial=0.05, maximum=5.0)
    while True:
        try:
            await connect()
        except OSError:
            await backoff.wait()
            continue
        backoff.reset()

The first wait is `initial` seconds (at most `maximum`); each failure multiplies the next one by
`factor`, up to `maximum`. `jitter` (0 to 1) takes a random share of up to
that fraction off each wait, so many clients that lost the same server do
not come back in step. `reset()` after a success starts the next outage
from `initial` again.
"""

from __future__ import annotations

import random

import anyio

from kvstream.errors import ConfigError

__all__ = ["Backoff"]


class Backoff:
    """Waits between failed attempts: `initial`, times `factor` per failure, at most `maximum`."""

    __slots__ = ("_next", "factor", "failures", "initial", "jitter", "maximum")

    def __init__(
        self,
        initial: float = 0.05,
        maximum: float = 5.0,
        *,
        factor: float = 2.0,
        jitter: float = 0.0,
        where: str = "Backoff",
    ) -> None:
        for name, value in (("initial", initial), ("maximum", maximum)):
            if not (isinstance(value, int | float) and value > 0):
                raise ConfigError(f"{where}: {name}: expected seconds > 0, got {value!r}")
        if not (isinstance(factor, int | float) and factor >= 1):
            raise ConfigError(f"{where}: factor: expected a number >= 1, got {factor!r}")
        if not (isinstance(jitter, int | float) and 0 <= jitter <= 1):
            raise ConfigError(f"{where}: jitter: expected a number in [0, 1], got {jitter!r}")
        self.initial = float(initial)
        self.maximum = float(maximum)
        self.factor = float(factor)
        self.jitter = float(jitter)
        #: Failed attempts since the last `reset()`.
        self.failures = 0
        self._next = min(self.initial, self.maximum)

    def next_delay(self) -> float:
        """Count a failure and return how long to wait before the next attempt."""
        delay = self._next
        self.failures += 1
        self._next = min(delay * self.factor, self.maximum)
        if self.jitter:
            delay *= 1.0 - self.jitter * random.random()
        return delay

    async def wait(self) -> None:
        """Count a failure and sleep `next_delay()` seconds."""
        await anyio.sleep(self.next_delay())

    def reset(self) -> None:
        """An attempt worked: the next failure waits `initial` again."""
        self.failures = 0
        self._next = min(self.initial, self.maximum)

    def __repr__(self) -> str:
        return (
            f"Backoff(initial={self.initial}, maximum={self.maximum}, factor={self.factor}, "
            f"jitter={self.jitter}, failures={self.failures})"
        )
