"""A small, real prefix-cache engine: the demo's and the benchmarks' workload.

* The **GPU block pool** (the cache manager) chunks each prompt into blocks of
  `block_size` tokens, chains their hashes (sha256, low 64 bits), reuses the
  longest cached prefix, stores the new full blocks (`BlockStored`, medium
  `GPU`) and evicts least recently used leaves when full (`BlockRemoved`).
  `reset_every` steps it is reset (`AllBlocksCleared`; every tier empties).
* The **CPU offload connector** receives the blocks the GPU evicts and keeps
  them (with the ancestors it lacks) in a larger CPU tier. It is written as an
  async generator, the way a connector doing real copies would be.
* The **remote store connector** writes every newly computed block through to
  a remote store (medium `EXTERNAL`); it is written vLLM-style, with
  `take_events()`, and polled by the scheduler once per tick.

The engine produces events and connectors; whoever hosts it wires them (as
`kvstream demo` does): add `SimulatedEngine.inputs()` to a scheduler once,
then per step emit what `run_step()` returns (the cache manager's own events),
`await handed_over()` (the CPU offload stream has yielded that step's blocks)
and tick:

    for source, name in engine.inputs():
        scheduler.add_source(source, name=name)
    while running:
        scheduler.emit(engine.run_step())
        await engine.handed_over()
        await scheduler.tick()
    engine.close()

Or take each step's events synchronously with `step_events()` (for
pre-generating benchmark input).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import NamedTuple

import anyio

from kvstream.errors import ConfigError
from kvstream.events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from kvstream.sim._tiers import BlockInfo, BlockRegistry, Tier, block_hash
from kvstream.sim._workload import Request, Workload
from kvstream.sources._base import PolledConnector, from_take_events

__all__ = ["CpuOffloadConnector", "EngineInput", "RemoteStoreConnector", "SimulatedEngine"]


class EngineInput(NamedTuple):
    """One of the engine's connectors as a scheduler input.

    `scheduler.add_source(source, name=name)`; `name` None lets the scheduler
    name it after the source.
    """

    source: AsyncIterator[list[KVCacheEvent]] | PolledConnector
    name: str | None = None


class RemoteStoreConnector:
    """Write-through to a remote KV store, vLLM-style: events via `take_events()`."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self._pending: list[KVCacheEvent] = []

    def on_computed(self, last: BlockInfo) -> None:
        """Called by the engine with the last block of a request it computed."""
        chain = self.tier.chain_to(last.hash)
        if chain:
            self._pending.extend(self.tier.store_chain(chain))

    def take_events(self) -> list[KVCacheEvent]:
        events, self._pending = self._pending, []
        return events


class CpuOffloadConnector:
    """Keeps what the GPU evicts in a CPU tier; its events come from an async generator."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self._queue: deque[list[BlockInfo]] = deque()
        self._sent = 0
        self._done = 0
        self._closed = False
        self._wakeup: anyio.Event | None = None
        self._idle: anyio.Event | None = None

    def offload(self, blocks: list[BlockInfo]) -> None:
        """Queue blocks the GPU evicted (called by the engine, no await)."""
        if blocks:
            self._sent += 1
            self._queue.append(blocks)
            self._wake()

    def _wake(self) -> None:
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.set()

    def process(self, blocks: list[BlockInfo]) -> list[KVCacheEvent]:
        """Store evicted blocks (and the ancestors the CPU tier lacks)."""
        events: list[KVCacheEvent] = []
        evicted = {b.hash: b for b in blocks}
        for info in blocks:
            chain = self.tier.chain_to(info.hash, evicted)
            if chain:
                events.extend(self.tier.store_chain(chain))
        return events

    def process_pending(self) -> list[KVCacheEvent]:
        """Process everything queued, synchronously (no scheduler involved)."""
        events: list[KVCacheEvent] = []
        while self._queue:
            events.extend(self.process(self._queue.popleft()))
            self._done += 1
        return events

    async def events(self) -> AsyncIterator[list[KVCacheEvent]]:
        """The connector's event stream: add it to a scheduler as an async source."""
        while True:
            while self._queue:
                events = self.process(self._queue.popleft())
                self._done += 1
                if self._done == self._sent and self._idle is not None:
                    self._idle.set()
                if events:
                    yield events
            if self._closed:
                return
            wakeup = self._wakeup = anyio.Event()
            await wakeup.wait()

    async def wait_idle(self) -> None:
        """Wait until every offload queued so far has been handed to the scheduler."""
        while self._done < self._sent:
            idle = self._idle = anyio.Event()
            await idle.wait()

    def close(self) -> None:
        """End the event stream once what is queued has been processed."""
        self._closed = True
        self._wake()


class SimulatedEngine:
    """One engine: a GPU block pool, a CPU offload tier and a remote store."""

    def __init__(
        self,
        *,
        seed: int = 0,
        block_size: int = 16,
        gpu_blocks: int = 1024,
        cpu_blocks: int = 4096,
        remote_blocks: int = 8192,
        requests_per_step: int = 4,
        reset_every: int | None = None,
        workload: Workload | None = None,
        origin: str = "sim-0",
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("gpu_blocks", gpu_blocks),
            ("cpu_blocks", cpu_blocks),
            ("remote_blocks", remote_blocks),
            ("requests_per_step", requests_per_step),
        ):
            if type(value) is not int or value <= 0:
                raise ConfigError(f"SimulatedEngine.{name}: expected a positive int, got {value!r}")
        if reset_every is not None and reset_every <= 0:
            raise ConfigError(f"SimulatedEngine.reset_every: expected > 0, got {reset_every!r}")
        if workload is not None and workload.block_size != block_size:
            raise ConfigError(
                f"SimulatedEngine.block_size {block_size} differs from the workload's "
                f"{workload.block_size}"
            )
        self.origin = origin
        self.block_size = block_size
        self.requests_per_step = requests_per_step
        self.reset_every = reset_every
        self.workload = workload or Workload(seed=seed, block_size=block_size)
        self.registry = BlockRegistry()
        self.gpu = Tier("GPU", gpu_blocks, block_size, self.registry)
        self.cpu = CpuOffloadConnector(Tier("CPU", cpu_blocks, block_size, self.registry))
        self.remote = RemoteStoreConnector(
            Tier("EXTERNAL", remote_blocks, block_size, self.registry)
        )
        self.steps_done = 0
        self.prefix_hits = 0
        self.blocks_requested = 0
        self._gpu_events: list[KVCacheEvent] = []

    # -- one engine step -------------------------------------------------------------

    def _chunk(self, request: Request) -> list[BlockInfo]:
        size = self.block_size
        tokens = request.token_ids
        blocks: list[BlockInfo] = []
        parent: int | None = None
        for start in range(0, len(tokens) - size + 1, size):
            chunk = tokens[start : start + size]
            h = block_hash(parent, chunk, request.lora_name)
            blocks.append(BlockInfo(h, parent, tuple(chunk), request.lora_name))
            parent = h
        return blocks

    def serve(self, requests: list[Request]) -> None:
        """Run one engine step over `requests`; the events wait to be taken."""
        self.steps_done += 1
        if self.reset_every and self.steps_done % self.reset_every == 0:
            self.reset()
        gpu = self.gpu
        evicted: list[BlockInfo] = []
        pinned: list[int] = []
        for request in requests:
            blocks = self._chunk(request)
            if not blocks:
                continue
            self.blocks_requested += len(blocks)
            hit = 0
            while hit < len(blocks) and blocks[hit].hash in gpu:
                hit += 1
            self.prefix_hits += hit
            for b in blocks[:hit]:
                gpu.touch(b.hash)
                gpu.pin(b.hash)
                pinned.append(b.hash)
            new = blocks[hit:]
            room = gpu.capacity - len(gpu)
            if room < len(new):
                victims = gpu.evict(len(new) - room, {b.hash for b in blocks})
                if victims:
                    self._gpu_events.append(
                        BlockRemoved(block_hashes=[v.hash for v in victims], medium="GPU")
                    )
                    evicted.extend(victims)
            # Blocks pinned by this step's requests cannot be evicted: store what fits.
            new = new[: max(gpu.capacity - len(gpu), 0)]
            if new:
                self._gpu_events.extend(gpu.store_chain(new))
                for b in new:
                    gpu.pin(b.hash)
                    pinned.append(b.hash)
                self.remote.on_computed(new[-1])
        # The step ends: requests release their blocks (tail first becomes evictable).
        for h in reversed(pinned):
            gpu.unpin(h)
        self.cpu.offload(evicted)

    def step(self) -> None:
        """One step over the workload's next `requests_per_step` requests."""
        self.serve(self.workload.next_requests(self.requests_per_step))

    def take_gpu_events(self) -> list[KVCacheEvent]:
        events, self._gpu_events = self._gpu_events, []
        return events

    def reset(self) -> None:
        """The engine's cache is reset: every tier empties (one AllBlocksCleared)."""
        self.gpu.clear()
        self.cpu.tier.clear()
        self.remote.tier.clear()
        self.remote._pending.clear()
        self._gpu_events.append(AllBlocksCleared())

    # -- what a host wires into a scheduler -------------------------------------------

    def step_events(self) -> list[KVCacheEvent]:
        """Run `step()` and return all its events in batch order, synchronously."""
        self.step()
        events = self.take_gpu_events()
        events.extend(self.cpu.process_pending())
        events.extend(self.remote.take_events())
        return events

    def iter_steps(self, n: int) -> Iterator[list[KVCacheEvent]]:
        for _ in range(n):
            yield self.step_events()

    def inputs(self) -> list[EngineInput]:
        """The engine's connectors as scheduler inputs; add each once, for one run.

        The CPU offload's async event stream (`cpu-offload`) and the remote
        store's `take_events()`, polled once per tick (`remote-store`).
        """
        return [
            EngineInput(self.cpu.events(), "cpu-offload"),
            EngineInput(from_take_events(self.remote, name="remote-store")),
        ]

    def run_step(self, requests: list[Request] | None = None) -> list[KVCacheEvent]:
        """One step (the workload's next requests, or `requests`): the GPU pool's events.

        Those are the cache manager's own events, for the host to emit ahead of
        the connectors'; the connectors' events reach the scheduler through
        `inputs()`.
        """
        if requests is None:
            self.step()
        else:
            self.serve(requests)
        return self.take_gpu_events()

    async def handed_over(self) -> None:
        """Wait until the CPU offload stream has yielded every block evicted so far.

        After it, a tick puts the step's offload events in the step's batch.
        """
        await self.cpu.wait_idle()

    def close(self) -> None:
        """End the CPU offload stream (its source then finishes)."""
        self.cpu.close()

    # -- state ---------------------------------------------------------------------------

    def snapshot(self) -> list[KVCacheEvent]:
        """AllBlocksCleared, then BlockStored events (parents first) per tier: the
        events that rebuild the engine's current state from nothing."""
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        for tier in (self.gpu, self.cpu.tier, self.remote.tier):
            events.extend(tier.snapshot())
        return events

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.blocks_requested if self.blocks_requested else 0.0
