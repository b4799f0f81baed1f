"""FileSink: JSON lines (or any codec's bytes) appended to a file, or stdout.

Writes run in a worker thread, several queued batches per hop, so a slow disk
never blocks the event loop; every batch is flushed to the OS before it counts
as sent. A write that fails half-way (disk full) is rolled back by truncating
to where it began, so the retry neither loses nor repeats a line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import anyio

from kvstream.codecs.json import JsonCodec
from kvstream.errors import ConfigError, TransportError
from kvstream.events import EventBatch
from kvstream.sinks.base import Sink

__all__ = ["FileSink"]


class FileSink(Sink):
    """Append encoded batches to ``path`` (``"-"`` for standard output)."""

    max_coalesce = 256

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        options.setdefault("codec", JsonCodec())
        options.setdefault("name", f"file:{os.fspath(path)}")
        super().__init__(**options)
        if self.codec is None:
            raise ConfigError("FileSink: codec: expected a codec, got None")
        self.path = os.fspath(path)
        self._file: IO[bytes] | None = None
        self._limiter = anyio.CapacityLimiter(1)

    async def open(self) -> None:
        if self.path == "-":
            self._file = sys.stdout.buffer
            return
        try:
            self._file = await anyio.to_thread.run_sync(self._open_file)
        except OSError as exc:
            raise TransportError(f"cannot open {self.path} for appending: {exc}") from exc

    def _open_file(self) -> IO[bytes]:
        parent = Path(self.path).parent
        if not parent.exists():
            raise FileNotFoundError(f"folder {parent} does not exist")
        return open(self.path, "ab")

    def _write(self, chunk: bytes | bytearray) -> None:
        f = self._file
        if f is None:
            raise TransportError(f"{self.name}: the file is not open")
        start = f.tell() if f.seekable() else None
        try:
            f.write(chunk)
            f.flush()
        except OSError:
            if start is not None:
                # Undo a partial write so the retry starts from a clean line.
                try:
                    f.truncate(start)
                    f.seek(start)
                except OSError:
                    pass
            raise

    async def send(self, data: bytes, batch: EventBatch) -> None:
        await anyio.to_thread.run_sync(self._write, data, limiter=self._limiter)

    async def send_many(self, items: Sequence[tuple[bytes, EventBatch]]) -> None:
        chunk = bytearray()
        for data, _ in items:
            chunk += data
        await anyio.to_thread.run_sync(self._write, chunk, limiter=self._limiter)

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            f, self._file = self._file, None
            if f is not None and self.path != "-":
                f.close()
