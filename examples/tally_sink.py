"""A custom sink with a task of its own: it tallies events, the task reports the tally.

Run it: `python examples/tally_sink.py` prints the tally each time the report
task wakes up, and once more after the scheduler (and so the sink) closed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
from anyio.abc import TaskGroup

from kvstream import BlockStored, EventBatch, Scheduler, Sink


class TallySink(Sink):
    """Counts events per origin; a task of its own prints the tally every `interval` s."""

    def __init__(self, interval: float = 1.0, **options: Any) -> None:
        super().__init__(**options)
        self.interval = interval
        self.tally: Counter[str] = Counter()

    async def write(self, data: bytes, batch: EventBatch) -> None:
        self.tally[batch.origin] += len(batch.events)

    def start_tasks(self, tg: TaskGroup) -> None:
        tg.start_soon(self._report)  # cancelled when the sink closes, after the last write

    async def _report(self) -> None:
        while True:
            await anyio.sleep(self.interval)
            print(f"{self.name}: {dict(self.tally)}", flush=True)


async def main(interval: float = 0.05) -> Counter[str]:
    sink = TallySink(interval, name="tally")
    async with Scheduler(sinks=[sink], origin="engine-0") as kv:
        for step in range(5):
            kv.emit(
                BlockStored(
                    block_hashes=[step + 1],
                    parent_block_hash=step or None,
                    token_ids=[7] * 16,
                    block_size=16,
                    medium="GPU",
                )
            )
            await kv.tick()
            await anyio.sleep(interval)
    print(f"closed: {dict(sink.tally)}")
    return sink.tally


if __name__ == "__main__":
    anyio.run(main)
