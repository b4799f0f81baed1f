"""A custom sink: every batch becomes a row of a SQLite table.

Run it: `python examples/sqlite_sink.py` prints the rows and removes its
temporary database; `python examples/sqlite_sink.py events.db` keeps it, for
`sqlite3 events.db 'select origin, seq, events from batches'`.
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
from contextlib import closing
from typing import Any

import anyio

from kvstream import BlockStored, EventBatch, JsonCodec, Scheduler, Sink

SCHEMA = """CREATE TABLE IF NOT EXISTS batches (
    origin TEXT, epoch TEXT, seq INTEGER, events INTEGER, line TEXT,
    PRIMARY KEY (origin, epoch, seq))"""


class SQLiteSink(Sink):
    """Every batch as one row: (origin, epoch, seq, number of events, its JSON line)."""

    def __init__(self, path: str, **options: Any) -> None:
        options.setdefault("codec", JsonCodec())  # the batch arrives as a JSON line
        super().__init__(**options)
        self.db = sqlite3.connect(path, check_same_thread=False)  # one thread at a time
        self.db.execute(SCHEMA)

    async def write(self, data: bytes, batch: EventBatch) -> None:
        row = (batch.origin, batch.epoch, batch.seq, len(batch.events), data.decode())
        await anyio.to_thread.run_sync(self._insert, row)  # the event loop stays free

    def _insert(self, row: tuple[Any, ...]) -> None:
        with self.db:  # one transaction per batch; a retry of the same batch is a no-op
            self.db.execute("INSERT OR IGNORE INTO batches VALUES (?, ?, ?, ?, ?)", row)

    async def aclose(self) -> None:
        try:
            await super().aclose()  # delivers what is still queued first
        finally:
            self.db.close()


async def main(path: str = "events.db") -> list[tuple[Any, ...]]:
    async with Scheduler(sinks=[SQLiteSink(path)], origin="engine-0") as kv:
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
    with closing(sqlite3.connect(path)) as db:
        rows = db.execute("SELECT origin, seq, events FROM batches ORDER BY seq").fetchall()
    for row in rows:
        print(*row)
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1:
        anyio.run(main, sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as scratch:
            anyio.run(main, f"{scratch}/events.db")
