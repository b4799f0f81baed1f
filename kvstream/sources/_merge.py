"""The one module that uses aiostream (GPL-3.0-or-later; see the README's license section).

aiostream's `flatten` over a channel of sources drives every async source
concurrently, one task each, and lets sources be added while it runs. Each
source's driver appends what the source yields to the source's own buffer in the
task that pulled it (`SourceHandle.pump()`), and yields to the merge only
once, when the source has ended. So the merge's per-item cost, its ordering by
position, its cancel-all-on-error and its loss of items it had pulled when left
early cannot touch the events: they are already in the buffers when the merge
sees anything, and a source that raises is reported by its own driver.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from aiostream import stream

from kvstream.sources._base import SourceHandle

__all__ = ["SourceMerger"]


async def _drive(handle: SourceHandle) -> AsyncIterator[SourceHandle]:
    # Nothing is yielded inside a cancel scope: pump() enters and leaves its own.
    await handle.pump()
    yield handle


class SourceMerger:
    """Runs async sources under aiostream's merge; `add` works while running.

    Sources added before `run()` wait in a queue (of handles: one per source,
    not per event). It holds no resource, so a scheduler that is never started
    leaves nothing to close.
    """

    def __init__(self) -> None:
        self._added: deque[SourceHandle] = deque()
        self._closed = False
        self._wakeup: anyio.Event | None = None

    def add(self, handle: SourceHandle) -> None:
        self._added.append(handle)
        self._wake()

    def close(self) -> None:
        """No more sources: `run()` returns once the running ones have ended."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.set()

    async def _drivers(self) -> AsyncIterator[AsyncIterator[SourceHandle]]:
        added = self._added
        while True:
            while added:
                yield _drive(added.popleft())
            if self._closed:
                return
            wakeup = self._wakeup = anyio.Event()
            await wakeup.wait()

    async def run(self, on_done: Callable[[SourceHandle], None]) -> None:
        """Drive every source until `close()` and all sources have ended."""
        merged: Any = stream.flatten(self._drivers(), task_limit=None)  # type: ignore[arg-type]
        async with merged.stream() as streamer:
            async for handle in streamer:
                on_done(handle)
