"""Wrap your connector: a vLLM-style `take_events()` connector and an async one.

A KV connector (CPU offload, a remote KV store) learns about blocks the cache
manager never sees. kvstream takes its events in either of two shapes:

* a synchronous connector with `take_events()`, as vLLM's connectors have:
  adapt it with `kvstream.from_take_events()`; the scheduler polls it at
  every tick, so what it recorded during a step is in that step's batch;
* an async generator, for a connector whose work is asynchronous (copies,
  network writes): each event is accepted the moment it is yielded and is in
  the batch of the next tick.

Run it: `python examples/wrap_connector.py`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream

from kvstream import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    MemorySink,
    Scheduler,
    from_take_events,
)
from kvstream.events import BlockHash

BLOCK_SIZE = 16


def stored(hashes: list[BlockHash], parent: int | None, medium: str) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=[1] * (BLOCK_SIZE * len(hashes)),
        block_size=BLOCK_SIZE,
        medium=medium,
    )


# --8<-- [start:take_events]
class RemoteStoreConnector:
    """A vLLM-style connector writing blocks through to a remote KV store."""

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []

    def save(self, hashes: list[BlockHash], parent: int | None) -> None:
        """Called by the engine during a step: the blocks are now in the store."""
        self._events.append(stored(hashes, parent, medium="EXTERNAL"))

    def evict(self, hashes: list[BlockHash]) -> None:
        self._events.append(BlockRemoved(block_hashes=hashes, medium="EXTERNAL"))

    def take_events(self) -> list[KVCacheEvent]:
        """Return, and forget, the events since the last call (vLLM's contract)."""
        events, self._events = self._events, []
        return events


# --8<-- [end:take_events]


# --8<-- [start:async_gen]
async def cpu_offload_events(
    copies: MemoryObjectReceiveStream[tuple[list[BlockHash], anyio.Event]],
) -> AsyncIterator[list[KVCacheEvent]]:
    """An offload connector as an async generator: one chunk of events per finished copy."""
    async with copies:
        async for hashes, done in copies:
            await anyio.lowlevel.checkpoint()  # a real connector awaits its copy here
            yield [stored(hashes, None, medium="CPU")]  # accepted the moment it is yielded
            done.set()  # runs when the scheduler pulls again: the chunk is in its buffer


# --8<-- [end:async_gen]


async def main() -> list[EventBatch]:
    sink = MemorySink()
    # --8<-- [start:wire]
    remote = RemoteStoreConnector()
    send_copy, copies = anyio.create_memory_object_stream[tuple[list[BlockHash], anyio.Event]](16)
    async with Scheduler(sinks=[sink], origin="engine-0") as kv:
        kv.add_source(from_take_events(remote, name="remote-store"))  # polled per tick
        kv.add_source(cpu_offload_events(copies), name="cpu-offload")  # pulled as it yields
        parent = None
        for step in range(4):
            block = 100 + step
            kv.emit(stored([block], parent, medium="GPU"))  # the cache manager's event
            remote.save([block], parent)  # the connector records its own
            copied = anyio.Event()
            await send_copy.send(([block], copied))  # offload the block to CPU...
            await copied.wait()  # ...and wait for it, so it joins this step's batch
            if step == 3:
                remote.evict([100])
            parent = block
            batch = await kv.tick()
            assert batch is not None
            print(f"seq {batch.seq}:", ", ".join(f"{type(e).__name__}" for e in batch.events))
        send_copy.close()
    # --8<-- [end:wire]
    return sink.batches


if __name__ == "__main__":
    anyio.run(main)
