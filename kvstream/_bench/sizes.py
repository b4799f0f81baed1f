"""How big each benchmark runs: the full suite and `--quick`."""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["FULL", "QUICK", "TINY", "Sizes"]


@dataclass(frozen=True)
class Sizes:
    """Knobs shared by the benchmarks (events are cycled from a pool of `pool_events`)."""

    pool_events: int = 8192
    #: Events per tick (and per batch) for the pipeline-efficiency sweep.
    events_per_tick: tuple[int, ...] = (1, 16, 64, 256, 1024)
    #: Each run moves about this many events (fewer at small batch sizes).
    events_per_run: int = 100_000
    #: ...but never more ticks than this, nor fewer than `min_ticks`.
    max_ticks: int = 10_000
    min_ticks: int = 64
    runs: int = 7
    warmup: int = 1
    #: Ticks timed per run for tick() latency.
    latency_ticks: int = 4000
    #: Single-event cost: repetitions per timing and timings.
    event_loops: int = 20_000
    event_repeats: int = 15
    sources: tuple[int, ...] = (1, 4, 16, 64)
    sinks: tuple[int, ...] = (1, 2, 4)
    scaling_events: int = 131_072
    #: Batch sizes of the ZMQ comparison, events per batch.
    zmq_batch_sizes: tuple[int, ...] = (1, 16, 256)
    zmq_events: int = 100_000
    #: The memory benchmark: events that flow, and each stalled sink's bound.
    memory_events: int = 1_000_000
    memory_bound_bytes: int = 16 * 1024 * 1024
    sink_events: int = 100_000
    sink_batch_size: int = 64

    def ticks_for(self, events_per_tick: int) -> int:
        ticks = self.events_per_run // events_per_tick
        return max(self.min_ticks, min(self.max_ticks, ticks))

    def scaled(self, **changes: object) -> Sizes:
        return replace(self, **changes)  # type: ignore[arg-type]


FULL = Sizes()

QUICK = Sizes(
    pool_events=4096,
    events_per_tick=(1, 16, 64, 256, 1024),
    events_per_run=16_384,
    max_ticks=1_000,
    min_ticks=16,
    runs=3,
    warmup=1,
    latency_ticks=600,
    event_loops=5_000,
    event_repeats=7,
    scaling_events=16_384,
    zmq_events=16_384,
    memory_events=200_000,
    memory_bound_bytes=8 * 1024 * 1024,
    sink_events=16_384,
)

#: For the test suite: every code path, as little work as possible.
TINY = Sizes(
    pool_events=512,
    events_per_tick=(16, 64),
    events_per_run=1_024,
    max_ticks=64,
    min_ticks=4,
    runs=1,
    warmup=0,
    latency_ticks=20,
    event_loops=200,
    event_repeats=2,
    sources=(1, 4),
    sinks=(1, 2),
    scaling_events=1_024,
    zmq_batch_sizes=(16,),
    zmq_events=512,
    memory_events=4_096,
    memory_bound_bytes=256 * 1024,
    sink_events=1_024,
)
