"""FileSink: JSON lines (or any codec's bytes) appended to a file, or stdout.

A batch is written inline, on the tick that sealed it, when nothing is queued
ahead of it and the target is a regular file or `/dev/null`: one `write`
into the page cache costs less than encoding the batch did, and it spares
the batch a thread hop (a wake-up per batch, and encoded batches piling up in
fresh memory while the thread waits for the GIL). An inline write that takes
longer than `inline_budget` seconds (a disk under writeback pressure, a
network filesystem) sends the writes of the next `inline_cooldown` seconds
to the worker thread, twice as long after each further slow one (up to five
minutes): a slow disk holds the event loop up for one write, and then ever
more rarely; `inline=False` (URL `?inline=false`) never writes on the loop.
Everything else (queued batches, standard output, FIFOs, devices) is written
by the worker thread, several queued batches per hop (at most 1024 batches
and 16 MiB: the base class bounds a hop).

Every batch is handed to the OS before it counts as sent (the file is
unbuffered: one `writev` per hop, straight from the encoded batches, never
concatenated into a new buffer). A write that fails half-way is rolled back
by truncating to where it began, so the retry neither loses nor repeats a
line. When the disk is full (`ENOSPC`, `EDQUOT`) the whole batches that did
fit are kept instead, and the retry writes only the rest: space that returns
a little at a time is used as it returns, and a batch is never torn.

With `rotate_bytes` and/or `rotate_seconds` the file is rotated between
writes (`events.jsonl` -> `events.000001.jsonl`, ...), keeping the newest
`keep` rotated files: see [`kvstream.sinks.rotation`][kvstream.sinks.rotation].

A regular file moved away or deleted by something else (logrotate's default
`create` mode, an operator's `rm`) is noticed at the first write after it,
at most a second late (a `stat` of the path, at most once a second), and a new file is
started at the path: the sink would otherwise write on, unseen, into the renamed
file (which logrotate then compresses and deletes) or into a deleted one.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Final

import anyio

from kvstream._checks import function
from kvstream._checks import path as checked_path
from kvstream.codecs.json import JsonCodec
from kvstream.errors import ConfigError, TransportError
from kvstream.events import EventBatch
from kvstream.sinks.base import Sink
from kvstream.sinks.rotation import RotationPolicy, Rotator

__all__ = ["DEFAULT_INLINE_BUDGET", "DEFAULT_INLINE_COOLDOWN", "FileSink"]

log = logging.getLogger("kvstream.sinks")

#: An inline write slower than this (seconds) sends writes to the worker thread.
DEFAULT_INLINE_BUDGET: Final = 0.01
#: For this long (seconds) after a slow inline write; doubled after each further
#: slow one, up to `_MAX_COOLDOWN`, and back to this after a quick one.
DEFAULT_INLINE_COOLDOWN: Final = 5.0
_MAX_COOLDOWN: Final = 300.0
#: Seconds between two checks that the path is still the file being written.
_PATH_CHECK_INTERVAL: Final = 1.0


class FileSink(Sink):
    """Append encoded batches to `path` (`"-"` for standard output).

    `rotate_bytes` (a size) and `rotate_seconds` rotate the file, `keep`
    bounds how many rotated files stay; `clock` (monotonic seconds) times
    `rotate_seconds` and the check that the file was not moved away (see the
    module doc). `inline`: write on the tick when nothing is queued
    (see the module doc); `inline_budget` / `inline_cooldown`: how slow an
    inline write may be (seconds), and for how long a slower one sends the
    writes to the worker thread.
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
        inline: bool = True,
        inline_budget: float = DEFAULT_INLINE_BUDGET,
        inline_cooldown: float = DEFAULT_INLINE_COOLDOWN,
        **options: Any,
    ) -> None:
        if type(inline) is not bool:
            raise ConfigError(f"FileSink: inline: expected a bool, got {inline!r}")
        checked_path("FileSink.path", path)
        function("FileSink.clock", clock)
        timings = (("inline_budget", inline_budget), ("inline_cooldown", inline_cooldown))
        for field, value in timings:
            if type(value) not in (int, float) or not value >= 0:
                raise ConfigError(f"FileSink: {field}: expected seconds >= 0, got {value!r}")
        options.setdefault("codec", JsonCodec())
        options.setdefault("name", f"file:{os.fspath(path)}")
        super().__init__(**options)
        if self.codec is None:
            raise ConfigError("FileSink: codec: expected a codec, got None")
        self.path = os.fspath(path)
        self._file: IO[bytes] | None = None
        self._clock = clock
        #: (device, inode) of the open file, when it is a regular file whose path is
        #: checked (see the module doc); None: not checked.
        self._identity: tuple[int, int] | None = None
        self._path_check_at = 0.0
        #: Times the file was found moved away or deleted and a new one started.
        self.reopened = 0
        #: the leading batches of a write that failed for want of space and are
        #: on disk already: the retry of that same write skips them
        self._written_ahead: list[bytes] = []
        self._limiter = anyio.CapacityLimiter(1)
        self.inline = inline
        self.inline_budget = float(inline_budget)
        self.inline_cooldown = float(inline_cooldown)
        #: Whether the open file takes inline writes (a regular file or /dev/null).
        self._inline_target = False
        #: Inline writes resume at this `time.perf_counter()` (after a slow one).
        self._inline_after = 0.0
        self._cooldown = self.inline_cooldown
        #: Inline writes that were slower than the budget.
        self.slow_inline_writes = 0
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
        st = os.fstat(fd)
        regular = stat.S_ISREG(st.st_mode)
        self._inline_target = self.inline and (regular or os.path.realpath(self.path) == os.devnull)
        self._identity = (st.st_dev, st.st_ino) if regular else None
        self._path_check_at = self._clock() + _PATH_CHECK_INTERVAL
        return f

    def _reopen_if_replaced(self) -> None:
        """Start a new file at the path if the open one was moved away or deleted."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            pass  # deleted (or moved, and nothing created in its place)
        except OSError:
            return  # cannot tell (permissions on the folder): keep writing
        else:
            if (st.st_dev, st.st_ino) == self._identity:
                return
        log.warning(
            "%s: %s was moved away or deleted by something else (logrotate?); "
            "the batches from here on go to a new %s",
            self.name,
            self.path,
            self.path,
        )
        f, self._file = self._file, None
        if f is not None:
            f.close()
        self._file = self._open_file()  # an OSError is retried by the writer, like a write's
        self.reopened += 1

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
        if self._identity is not None:
            if self._file is None:  # a new file could not be opened: try again
                self._file = self._open_file()
            elif (now := self._clock()) >= self._path_check_at:
                self._path_check_at = now + _PATH_CHECK_INTERVAL
                self._reopen_if_replaced()
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

    def write_nowait(self, data: bytes, batch: EventBatch) -> bool:
        """Write `batch` on the tick if the file takes inline writes (see the module doc)."""
        if not self._inline_target or self._file is None:
            return False
        start = time.perf_counter()
        if start < self._inline_after:
            return False
        rotation = self.rotation
        if rotation is not None and rotation.due(self._file.tell(), len(data)):
            return False  # renaming and pruning files: the worker thread does it
        self._write((data,))  # an OSError leaves the batch to write(), which retries
        took = time.perf_counter() - start
        if took > self.inline_budget:
            self.slow_inline_writes += 1
            self._inline_after = start + took + self._cooldown
            log.info(
                "%s: a write took %.1f ms on the event loop; writing from the worker "
                "thread for the next %.0f s",
                self.name,
                took * 1000,
                self._cooldown,
            )
            self._cooldown = min(self._cooldown * 2, max(_MAX_COOLDOWN, self.inline_cooldown))
        elif self._cooldown != self.inline_cooldown:
            self._cooldown = self.inline_cooldown
        return True

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

    def final_error(self, exc: Exception) -> str | None:
        """Standard output whose reader went away (`| head` is done) takes nothing more."""
        if self.path == "-" and isinstance(exc, BrokenPipeError):
            return "the reader of standard output went away"
        return None

    async def write(self, data: bytes, batch: EventBatch) -> None:
        await anyio.to_thread.run_sync(self._write, (data,), limiter=self._limiter)

    async def write_many(self, items: Sequence[tuple[bytes, EventBatch]]) -> None:
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
