"""FileSink: JSON lines (or any codec's bytes) appended to a file, or stdout.

Writes run in a worker thread, several queued batches per hop (at most 1024
batches and 16 MiB: the base class bounds a hop), so a slow disk
never blocks the event loop; every batch is handed to the OS before it counts
as sent (the file is unbuffered: one `writev` per hop, straight from the
encoded batches, never concatenated into a new buffer). A write that fails
half-way is rolled back by truncating to where it began, so the retry
neither loses nor repeats a line. When the disk is full (`ENOSPC`, `EDQUOT`)
the whole batches that did fit are kept instead, and the retry writes only the
rest: space that returns a little at a time is used as it returns, and a batch
is never torn.

With `rotate_bytes` and/or `rotate_seconds` the file is rotated between
writes (`events.jsonl` -> `events.000001.jsonl`, ...), keeping the newest
`keep` rotated files: see [`kvstream.sinks.rotation`][kvstream.sinks.rotation].
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Final

import anyio

from kvstream.codecs.json import JsonCodec
from kvstream.errors import ConfigError, TransportError
from kvstream.events import EventBatch
from kvstream.sinks.base import Sink
from kvstream.sinks.rotation import RotationPolicy, Rotator

__all__ = ["FileSink"]

log = logging.getLogger("kvstream.sinks")


class FileSink(Sink):
    """Append encoded batches to `path` (`"-"` for standard output).

    `rotate_bytes` (a size) and `rotate_seconds` rotate the file, `keep`
    bounds how many rotated files stay; `clock` (monotonic seconds) times
    `rotate_seconds`.
    """

    max_coalesce = 1024

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        rotate_bytes: int | None = None,
        rotate_seconds: float | None = None,
        keep: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        **options: Any,
    ) -> None:
        options.setdefault("codec", JsonCodec())
        options.setdefault("name", f"file:{os.fspath(path)}")
        super().__init__(**options)
        if self.codec is None:
            raise ConfigError("FileSink: codec: expected a codec, got None")
        self.path = os.fspath(path)
        self._file: IO[bytes] | None = None
        #: the leading batches of a write that failed for want of space and are
        #: on disk already: the retry of that same write skips them
        self._written_ahead: list[bytes] = []
        self._limiter = anyio.CapacityLimiter(1)
        policy = RotationPolicy(rotate_bytes, rotate_seconds, keep)
        if policy.rotates and self.path == "-":
            raise ConfigError(
                "FileSink: rotate_bytes/rotate_seconds: standard output cannot rotate"
            )
        self.rotation: Rotator | None = (
            Rotator(self.path, policy, clock) if policy.rotates else None
        )

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
        # Unbuffered: a buffered writer keeps what a failed write left over and
        # writes it again on the next flush, which would defeat the rollback.
        # New files are private (0600): events carry prompt token ids.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        f = open(fd, "ab", buffering=0)  # noqa: SIM115 - lives as long as the sink
        self._end_torn_line(f)
        if self.rotation is not None:
            self.rotation.opened(f.tell())
        return f

    def _end_torn_line(self, f: IO[bytes]) -> None:
        """End a torn last line (a writer killed mid-line) before appending to it.

        Otherwise this sink's first batch would be glued to the torn line and
        both lost to every reader. The torn line stays, on a line of its own,
        which readers skip and report (`kvstream verify`, `kvstream tail`).
        """
        codec = self.codec
        if codec is None or not codec.self_delimiting or self.path == "-":
            return
        try:
            size = os.fstat(f.fileno()).st_size
            if size == 0 or not os.path.isfile(self.path):
                return
            with open(self.path, "rb") as tail:
                tail.seek(size - 1)
                last = tail.read(1)
        except OSError:
            return  # not readable back (a FIFO, permissions): nothing to repair
        if last != b"\n":
            f.write(b"\n")
            log.warning(
                "%s: %s ended in a torn line (a writer stopped mid-line); it is kept as a "
                "line of its own, which readers skip, and new batches start on the next line",
                self.name,
                self.path,
            )

    def _rotate_if_due(self, incoming: int) -> None:
        rotation = self.rotation
        assert rotation is not None
        if self._file is None:  # a rotation failed after closing the file: reopen
            self._file = self._open_file()
        if rotation.due(self._file.tell(), incoming):
            f, self._file = self._file, None
            f.close()
            rotation.rotate()  # an OSError here is retried: the file is reopened above
            self._file = self._open_file()

    def _write(self, chunks: Sequence[bytes]) -> None:
        """Write `chunks` in order, all of them or (rolled back) none.

        After a full disk, the whole chunks that fit stay written and a retry of
        the same write skips them (`_skip_written_ahead`).
        """
        if self._written_ahead:
            chunks = self._skip_written_ahead(chunks)
        if self.rotation is not None:
            self._rotate_if_due(sum(map(len, chunks)))
        f = self._file
        if f is None:
            raise TransportError(f"{self.name}: the file is not open")
        if self.path == "-":  # buffered, usually a pipe: nothing to roll back
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            return
        start = f.tell() if f.seekable() else None  # a FIFO or a device cannot roll back
        try:
            _writev_all(f.fileno(), chunks)
        except OSError as exc:
            if start is not None:
                keep = 0
                if exc.errno in _NO_SPACE:
                    keep = self._keep_whole_chunks(f, start, chunks)
                # Undo a partial write (past the whole chunks kept) so the retry
                # starts from a clean line.
                try:
                    f.truncate(start + keep)
                    f.seek(start + keep)
                except OSError:
                    pass
            raise
        self._written_ahead.clear()
        if self.rotation is not None:
            self.rotation.wrote()

    def _skip_written_ahead(self, chunks: Sequence[bytes]) -> Sequence[bytes]:
        """`chunks` without the leading ones a failed attempt of this same write
        (the writer retries the very same batches) left on disk."""
        ahead = self._written_ahead
        n = len(ahead)
        if len(chunks) >= n and all(chunks[i] is ahead[i] for i in range(n)):
            return chunks[n:]
        # Not a retry of that write (cannot happen with the base class's writer).
        log.warning(
            "%s: %d batches written before a full disk are not retried as expected",
            self.name,
            n,
        )
        ahead.clear()
        return chunks

    def _keep_whole_chunks(self, f: IO[bytes], start: int, chunks: Sequence[bytes]) -> int:
        """After a full disk cut a write short: remember the whole chunks on disk
        (from `start`), and return their size; the torn rest is cut off."""
        try:
            written = os.fstat(f.fileno()).st_size - start
        except OSError:
            return 0
        kept = 0
        for chunk in chunks:
            if kept + len(chunk) > written:
                break
            kept += len(chunk)
            self._written_ahead.append(chunk)
        return kept

    async def send(self, data: bytes, batch: EventBatch) -> None:
        await anyio.to_thread.run_sync(self._write, (data,), limiter=self._limiter)

    async def send_many(self, items: Sequence[tuple[bytes, EventBatch]]) -> None:
        chunks = [data for data, _ in items]
        await anyio.to_thread.run_sync(self._write, chunks, limiter=self._limiter)

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            f, self._file = self._file, None
            if f is not None and self.path != "-":
                f.close()


#: The errors of a full disk (or quota): what fits of a write is kept.
_NO_SPACE: Final = frozenset({errno.ENOSPC, errno.EDQUOT})

#: The most buffers one writev() takes (POSIX guarantees 16; Linux takes 1024).
_IOV_MAX: Final = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16


def _writev_all(fd: int, chunks: Sequence[bytes]) -> None:
    """Write every chunk, in order, with as few `writev` calls as the OS allows."""
    pending: list[bytes | memoryview] = list(chunks)
    while pending:
        written = os.writev(fd, pending[:_IOV_MAX])
        # A write may be partial: drop what went, keep the rest of a cut chunk.
        i = 0
        while i < len(pending) and written >= len(pending[i]):
            written -= len(pending[i])
            i += 1
        del pending[:i]
        if written:
            pending[0] = memoryview(pending[0])[written:]
