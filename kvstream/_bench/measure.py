"""Timing helpers: samples, medians, percentiles, interleaved runs, RSS.

Every benchmark measures its baseline in the same run, interleaved with the
case it is compared with (round-robin, a warm-up round first), and reports the
median of the runs. CPU time is `time.process_time()` (every thread of the
process), wall time `time.perf_counter()`.
"""

from __future__ import annotations

import gc
import math
import os
import resource
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Meter",
    "Sample",
    "Summary",
    "interleave",
    "percentile",
    "rss_bytes",
    "summarize",
]


@dataclass(frozen=True)
class Sample:
    """One timed run: wall and CPU seconds for `events` events (and `nbytes` bytes)."""

    wall: float
    cpu: float
    events: int
    nbytes: int = 0
    extra: Mapping[str, Any] | None = None

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall if self.wall > 0 else math.inf

    @property
    def cpu_us_per_event(self) -> float:
        return self.cpu / self.events * 1e6 if self.events else math.nan


class Meter:
    """Start/stop wall and CPU clocks: `m = Meter(); ...; sample = m.stop(events)`."""

    __slots__ = ("_cpu", "_wall")

    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._cpu = time.process_time()

    def stop(self, events: int, nbytes: int = 0, **extra: Any) -> Sample:
        wall = time.perf_counter() - self._wall
        cpu = time.process_time() - self._cpu
        return Sample(wall, cpu, events, nbytes, extra or None)


@dataclass(frozen=True)
class Summary:
    """Medians over runs."""

    runs: int
    events: int
    events_per_s: float
    events_per_s_min: float
    events_per_s_max: float
    cpu_us_per_event: float
    mb_per_s: float

    def as_dict(self) -> dict[str, float]:
        return {
            "runs": self.runs,
            "events": self.events,
            "events_per_s": round(self.events_per_s, 1),
            "events_per_s_min": round(self.events_per_s_min, 1),
            "events_per_s_max": round(self.events_per_s_max, 1),
            "cpu_us_per_event": round(self.cpu_us_per_event, 4),
            "mb_per_s": round(self.mb_per_s, 2),
        }


def summarize(samples: Sequence[Sample]) -> Summary:
    rates = [s.events_per_s for s in samples]
    return Summary(
        runs=len(samples),
        events=samples[0].events if samples else 0,
        events_per_s=statistics.median(rates),
        events_per_s_min=min(rates),
        events_per_s_max=max(rates),
        cpu_us_per_event=statistics.median(s.cpu_us_per_event for s in samples),
        mb_per_s=statistics.median(s.nbytes / s.wall / 1e6 if s.wall else 0.0 for s in samples),
    )


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) of `values`, by nearest rank."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(math.ceil(q / 100 * len(ordered)), 1)
    return ordered[min(rank, len(ordered)) - 1]


Case = Callable[[], Awaitable[Sample]]


async def interleave(
    cases: Mapping[str, Case],
    *,
    runs: int,
    warmup: int = 1,
    on_run: Callable[[], None] | None = None,
) -> dict[str, list[Sample]]:
    """Run every case `warmup` times untimed, then `runs` rounds, round-robin.

    The order rotates each round so no case always runs right after another.
    A full garbage collection precedes every run.
    """
    names = list(cases)
    for _ in range(warmup):
        for name in names:
            gc.collect()
            await cases[name]()
    out: dict[str, list[Sample]] = {name: [] for name in names}
    for r in range(runs):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            gc.collect()
            out[name].append(await cases[name]())
            if on_run is not None:
                on_run()
    return out


def rss_bytes() -> int:
    """The process's resident set size now (Linux `/proc`; else the peak)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
