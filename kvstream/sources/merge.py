"""The one module that uses aiostream (GPL-3.0-or-later; see the README's license section).

aiostream's ``flatten`` over a channel of sources drives every async source
concurrently, one task each, and lets sources be added while it runs. Each
source's driver appends what the source yields to the source's own buffer in the
task that pulled it (:meth:`SourceHandle.pump`), and yields to the merge only
once, when the source has ended. So the merge's per-item cost, its ordering by
position, its cancel-all-on-error and its loss of items it had pulled when left
early cannot touch the events: they are already in the buffers when the merge
sees anything, and a source that raises is reported by its own driver.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from aiostream import stream

from kvstream.sources.base import SourceHandle

__all__ = ["SourceMerger"]


async def _drive(handle: SourceHandle) -> AsyncIterator[SourceHandle]:
    # Nothing is yielded inside a cancel scope: pump() enters and leaves its own.
    await handle.pump()
    yield handle


class SourceMerger:
    """Runs async sources under aiostream's merge; ``add`` works while running."""

    def __init__(self) -> None:
        self._send, self._receive = anyio.create_memory_object_stream[SourceHandle](math.inf)

    def add(self, handle: SourceHandle) -> None:
        self._send.send_nowait(handle)

    def close(self) -> None:
        """No more sources: :meth:`run` returns once the running ones have ended."""
        self._send.close()

    async def _drivers(self) -> AsyncIterator[AsyncIterator[SourceHandle]]:
        async with self._receive:
            async for handle in self._receive:
                yield _drive(handle)

    async def run(self, on_done: Callable[[SourceHandle], None]) -> None:
        """Drive every source until :meth:`close` and all sources have ended."""
        merged: Any = stream.flatten(self._drivers(), task_limit=None)  # type: ignore[arg-type]
        async with merged.stream() as streamer:
            async for handle in streamer:
                on_done(handle)
