"""Routing with the index versus at random, on simulated engines sharing prefixes.

The same seeded requests (system prompts shared by everyone, multi-turn chats
whose every turn repeats the history) are routed twice over fresh fleets of
:class:`~kvstream.sim.SimulatedEngine`: once to the engine the index says holds
the longest prefix (ties: the engine that served fewest requests), once at
random. Each engine's events of a step are applied to that run's index as one
batch, as a subscriber would deliver them. The hit rate is the engines' own
count: prompt blocks found on the GPU of the engine that served the request.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from kvstream.errors import ConfigError
from kvstream.events import EventBatch
from kvstream.index.prefix import IndexStatistics, PrefixIndex
from kvstream.sim import Request, SimulatedEngine, Workload

__all__ = ["RoutingResult", "compare_routing"]


@dataclass
class RoutingResult:
    """One routing policy's outcome."""

    policy: str
    blocks_requested: int = 0
    blocks_hit: int = 0
    #: requests per engine
    load: list[int] = field(default_factory=list)
    #: seconds spent in PrefixIndex.match, and how many calls
    match_seconds: float = 0.0
    matches: int = 0
    index: IndexStatistics | None = None

    @property
    def hit_rate(self) -> float:
        return self.blocks_hit / self.blocks_requested if self.blocks_requested else 0.0


class _Routed(Workload):
    """A workload that hands an engine exactly the requests routed to it."""

    def __init__(self, block_size: int) -> None:
        super().__init__(seed=0, block_size=block_size, system_prompts=1, conversations=1)
        self.pending: list[Request] = []

    def next_requests(self, n: int) -> list[Request]:
        out, self.pending = self.pending, []
        return out


def _run(
    policy: str,
    requests: list[Request],
    *,
    engines: int,
    block_size: int,
    gpu_blocks: int,
    seed: int,
) -> RoutingResult:
    rng = random.Random(seed)
    index = PrefixIndex(block_size=block_size)
    fleet: list[tuple[SimulatedEngine, _Routed]] = []
    for i in range(engines):
        queue = _Routed(block_size)
        engine = SimulatedEngine(
            seed=seed + i,
            block_size=block_size,
            gpu_blocks=gpu_blocks,
            cpu_blocks=4 * gpu_blocks,
            remote_blocks=8 * gpu_blocks,
            workload=queue,
            origin=f"engine-{i}",
        )
        fleet.append((engine, queue))
    by_origin = {engine.origin: i for i, (engine, _) in enumerate(fleet)}
    result = RoutingResult(policy, load=[0] * engines)
    seqs = [0] * engines
    for request in requests:
        if policy == "index":
            started = time.perf_counter()
            matches = index.match(request.token_ids, request.lora_name)
            result.match_seconds += time.perf_counter() - started
            result.matches += 1
            best = matches[0].blocks if matches else 0
            candidates = [by_origin[m.origin] for m in matches if m.blocks == best] or list(
                range(engines)
            )
            target = min(candidates, key=lambda i: (result.load[i], i))
        else:
            target = rng.randrange(engines)
        result.load[target] += 1
        engine, queue = fleet[target]
        queue.pending.append(request)
        hits, requested = engine.prefix_hits, engine.blocks_requested
        events = engine.step_events()
        result.blocks_hit += engine.prefix_hits - hits
        result.blocks_requested += engine.blocks_requested - requested
        index.apply(
            EventBatch(seq=seqs[target], ts=time.time(), events=events, origin=engine.origin)
        )
        seqs[target] += 1
    result.index = index.statistics()
    return result


def compare_routing(
    *,
    engines: int = 4,
    requests: int = 2000,
    seed: int = 0,
    block_size: int = 16,
    gpu_blocks: int = 1024,
) -> tuple[RoutingResult, RoutingResult]:
    """Route the same requests with the index and at random; see the module doc."""
    for name, value in (
        ("engines", engines),
        ("requests", requests),
        ("block_size", block_size),
        ("gpu_blocks", gpu_blocks),
    ):
        if type(value) is not int or value <= 0:
            raise ConfigError(f"{name}: expected a positive int, got {value!r}")
    workload = Workload(seed=seed, block_size=block_size)
    prompts = workload.next_requests(requests)
    common = {"engines": engines, "block_size": block_size, "gpu_blocks": gpu_blocks, "seed": seed}
    return _run("index", prompts, **common), _run("random", prompts, **common)
