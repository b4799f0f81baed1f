"""Routing policies compared on a simulated fleet: DP ranks, restarts, an engine lost.

The same seeded requests (system prompts shared by everyone, multi-turn chats
whose every turn repeats the history) are routed, once per policy, over a fresh
fleet of `SimulatedEngine`: `engines` engines of
`ranks` data-parallel ranks each, all ranks of an engine under one origin
name. Policies:

* `index`: the stream with the best tier-weighted score (ties: the one that
  served fewest requests);
* `index-gpu`: the stream with the longest prefix on GPU alone (what an index
  that ignores offloaded tiers would answer);
* `random`: any live stream.

Along the way, every `restart_every` requests one rank restarts (an empty
cache, a new epoch), and a batch of its old epoch arrives late, as a replay
racing the new stream would; at mid-run one engine is lost (all its ranks stop
sending batches and heartbeats), which the index learns through `ttl`. A
request routed to a lost engine is counted as misrouted and sent to a random
live stream. Time is simulated: each request advances the clock by `tick`
seconds, and every live rank heartbeats each tick.

Scores: the engines' own GPU prefix hits (what a real engine reuses without
loading), and the *reusable* prefix: leading blocks on any of the chosen
engine's tiers when the request arrives (what an engine with an offloading
connector can load instead of recomputing).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from kvstream.errors import ConfigError
from kvstream.events import EventBatch
from kvstream.index._prefix import IndexStatistics, PrefixIndex, PrefixMatch
from kvstream.sim import Request, SimulatedEngine, Workload

__all__ = ["POLICIES", "RoutingResult", "compare_routing"]

POLICIES = ("index", "index-gpu", "random")


@dataclass
class RoutingResult:
    """One routing policy's outcome."""

    policy: str
    blocks_requested: int = 0
    #: prompt blocks found on the GPU of the engine that served the request
    blocks_hit: int = 0
    #: leading prompt blocks on any tier of that engine when the request arrived
    blocks_reusable: int = 0
    #: requests sent to a lost engine (re-sent to a random live one)
    misrouted: int = 0
    #: requests per stream
    load: list[int] = field(default_factory=list)
    #: seconds spent in PrefixIndex.match, and how many calls
    match_seconds: float = 0.0
    matches: int = 0
    index: IndexStatistics | None = None

    @property
    def hit_rate(self) -> float:
        return self.blocks_hit / self.blocks_requested if self.blocks_requested else 0.0

    @property
    def reusable_rate(self) -> float:
        return self.blocks_reusable / self.blocks_requested if self.blocks_requested else 0.0


class _Routed(Workload):
    """A workload that hands an engine exactly the requests routed to it."""

    def __init__(self, block_size: int) -> None:
        super().__init__(seed=0, block_size=block_size, system_prompts=1, conversations=1)
        self.pending: list[Request] = []

    def next_requests(self, n: int) -> list[Request]:
        out, self.pending = self.pending, []
        return out


class _Rank:
    """One data-parallel rank of a simulated engine, as the router sees it."""

    def __init__(self, origin: str, rank: int, make: SimulatedEngine, queue: _Routed) -> None:
        self.origin = origin
        self.rank = rank
        self.engine = make
        self.queue = queue
        self.epoch = 0
        self.seq = 0
        self.alive = True
        self.sent: list[EventBatch] = []


def _reusable(engine: SimulatedEngine, request: Request) -> int:
    tiers = (engine.gpu, engine.cpu.tier, engine.remote.tier)
    k = 0
    for block in engine._chunk(request):
        if not any(block.hash in t for t in tiers):
            break
        k += 1
    return k


def _run(
    policy: str,
    requests: list[Request],
    *,
    engines: int,
    ranks: int,
    block_size: int,
    gpu_blocks: int,
    seed: int,
    restart_every: int,
    ttl: float,
    tick: float,
) -> RoutingResult:
    rng = random.Random(seed)
    now = [0.0]
    index = PrefixIndex(block_size=block_size, ttl=ttl, clock=lambda: now[0])

    def new_engine(i: int, epoch: int) -> tuple[SimulatedEngine, _Routed]:
        queue = _Routed(block_size)
        engine = SimulatedEngine(
            seed=seed + 97 * i + epoch,
            block_size=block_size,
            gpu_blocks=gpu_blocks,
            cpu_blocks=4 * gpu_blocks,
            remote_blocks=8 * gpu_blocks,
            workload=queue,
            origin=f"engine-{i // ranks}",
        )
        return engine, queue

    fleet = []
    for i in range(engines * ranks):
        engine, queue = new_engine(i, 0)
        fleet.append(_Rank(engine.origin, i % ranks, engine, queue))
    by_stream: dict[tuple[str, int | None], int] = {
        (r.origin, r.rank): i for i, r in enumerate(fleet)
    }
    result = RoutingResult(policy, load=[0] * len(fleet))
    lose_at = len(requests) // 2 if engines > 1 else -1

    def live() -> list[int]:
        return [i for i, r in enumerate(fleet) if r.alive]

    for n, request in enumerate(requests):
        now[0] += tick
        for r in fleet:
            if r.alive:
                index.heartbeat(r.origin, r.rank)
        if n == lose_at:
            for r in fleet:
                if r.origin == "engine-0":
                    r.alive = False
        if restart_every and n and n % restart_every == 0:
            i = rng.choice(live())
            r = fleet[i]
            r.epoch += 1
            r.engine, r.queue = new_engine(i, r.epoch)
            stragglers = r.sent[-3:]
            r.sent = []
            # The new scheduler's first tick, then the old epoch's replay racing it.
            first = EventBatch(
                seq=0,
                ts=0.0,
                events=[],
                origin=r.origin,
                epoch=f"{r.origin}/{r.rank}/{r.epoch}",
                data_parallel_rank=r.rank,
            )
            r.seq = 1
            index.apply(first)
            for late in stragglers:
                index.apply(late)
        if policy == "random":
            target = rng.choice(live())
        else:
            started = time.perf_counter()
            matches = index.match(request.token_ids, request.lora_name)
            result.match_seconds += time.perf_counter() - started
            result.matches += 1
            ranked: list[tuple[float, PrefixMatch]]
            if policy == "index-gpu":
                ranked = [(float(m.tiers.get("GPU", 0)), m) for m in matches]
            else:
                ranked = [(m.score, m) for m in matches]
            best = max((s for s, _ in ranked), default=0)
            candidates = [
                by_stream[(m.origin, m.data_parallel_rank)] for s, m in ranked if s == best and s
            ] or live()
            target = min(candidates, key=lambda i: (result.load[i], i))
            if not fleet[target].alive:
                result.misrouted += 1
                target = rng.choice(live())
        r = fleet[target]
        result.load[target] += 1
        result.blocks_reusable += _reusable(r.engine, request)
        r.queue.pending.append(request)
        hits, requested = r.engine.prefix_hits, r.engine.blocks_requested
        events = r.engine.step_events()
        result.blocks_hit += r.engine.prefix_hits - hits
        result.blocks_requested += r.engine.blocks_requested - requested
        batch = EventBatch(
            seq=r.seq,
            ts=0.0,
            events=events,
            origin=r.origin,
            epoch=f"{r.origin}/{r.rank}/{r.epoch}",
            data_parallel_rank=r.rank,
        )
        r.seq += 1
        r.sent.append(batch)
        index.apply(batch)
    result.index = index.statistics()
    return result


def compare_routing(
    *,
    engines: int = 4,
    requests: int = 2000,
    seed: int = 0,
    block_size: int = 16,
    gpu_blocks: int = 1024,
    ranks: int = 2,
    restart_every: int | None = None,
    ttl: float = 2.0,
    tick: float = 0.05,
) -> list[RoutingResult]:
    """Route the same requests with each of `POLICIES`; see the module doc."""
    for name, value in (
        ("engines", engines),
        ("requests", requests),
        ("block_size", block_size),
        ("gpu_blocks", gpu_blocks),
        ("ranks", ranks),
    ):
        if type(value) is not int or value <= 0:
            raise ConfigError(f"{name}: expected a positive int, got {value!r}")
    workload = Workload(seed=seed, block_size=block_size)
    prompts = workload.next_requests(requests)
    every = max(requests // 5, 1) if restart_every is None else restart_every
    return [
        _run(
            policy,
            prompts,
            engines=engines,
            ranks=ranks,
            block_size=block_size,
            gpu_blocks=gpu_blocks,
            seed=seed,
            restart_every=every,
            ttl=ttl,
            tick=tick,
        )
        for policy in POLICIES
    ]
