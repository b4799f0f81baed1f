"""Quickstart: an engine's step loop publishing KV cache events to a JSON-lines file.

Run it: `python examples/quickstart.py` writes into a temporary directory and
removes it at the end; `python examples/quickstart.py events.jsonl` keeps the
file, one line per batch, one batch per step.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import anyio

from kvstream import BlockRemoved, BlockStored, FileSink, Scheduler


async def main(path: str = "events.jsonl") -> None:
    async with Scheduler(sinks=[FileSink(path)], origin="engine-0") as kv:
        parent = None
        for step in range(3):
            block = 1000 + step
            # What the cache manager does during a step: no await, no I/O.
            kv.emit(
                BlockStored(
                    block_hashes=[block],
                    parent_block_hash=parent,
                    token_ids=list(range(16)),
                    block_size=16,
                    medium="GPU",
                )
            )
            if step == 2:
                kv.emit(BlockRemoved(block_hashes=[1000], medium="GPU"))
            parent = block
            batch = await kv.tick()  # seals this step's events into one numbered batch
            assert batch is not None
            print(f"batch seq={batch.seq} epoch={batch.epoch} events={len(batch.events)}")
    # Leaving the block delivered every batch to every sink.


if __name__ == "__main__":
    if len(sys.argv) > 1:
        anyio.run(main, sys.argv[1])
        print(f"wrote {sys.argv[1]}")
    else:
        with tempfile.TemporaryDirectory() as scratch:
            anyio.run(main, str(Path(scratch) / "events.jsonl"))
