"""Reading a JSON-lines file back: once, or following it as it grows (`tail -f`)."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator

import anyio

from kvstream._checks import flag, seconds
from kvstream._checks import path as checked_path
from kvstream._one_reader import OneReader, running
from kvstream._wire.from_seq import FromSeq, check_from_seq, start_seq
from kvstream.codecs.json import JsonCodec
from kvstream.consumers.base import Continuity, Gap, SequenceTracker, Subscriber, SubscriberItem
from kvstream.errors import ConfigError, DecodeError, TransportError
from kvstream.sinks.rotation import rotated_files

__all__ = ["FileSubscriber"]

log = logging.getLogger("kvstream.consumers")


class FileSubscriber(Subscriber):
    """Batches from a JSON-lines file, with gaps and restarts reported.

    `follow=True` keeps reading as the file grows, and across rotation: when
    the file is replaced it finishes the old one, then reads the files a
    [`FileSink`][kvstream.sinks.file.FileSink] rotated in between (`events.000042.jsonl`,
    found by [`rotated_files()`][kvstream.sinks.rotation.rotated_files]), then the new one.
    `from_seq` (an int, or `{origin: seq}` with `"*"` for the others) skips,
    in the first epoch seen of each origin, the batches below that number.
    A line that does not decode is skipped, counted in `bad_lines` and
    logged; it never stops the reader. One task reads it at a time (a second
    is refused with `ClosedError`); a loop that stopped and starts again goes
    on where it was.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        follow: bool = False,
        from_seq: FromSeq = None,
        poll_interval: float = 0.1,
        codec: JsonCodec | None = None,
    ) -> None:
        if codec is not None and not isinstance(codec, JsonCodec):
            raise ConfigError(f"FileSubscriber.codec: expected a JsonCodec, got {codec!r:.80}")
        self.path = checked_path("FileSubscriber.path", path)
        self.follow = flag("FileSubscriber.follow", follow)
        self.from_seq = check_from_seq(from_seq, "FileSubscriber")
        self.poll_interval = seconds("FileSubscriber.poll_interval", poll_interval)
        self.codec = codec or JsonCodec()
        self.tracker = SequenceTracker()
        self.bad_lines = 0
        self._closed = False
        self._reader: AsyncGenerator[SubscriberItem, None] | None = None

    async def aclose(self) -> None:
        """Stop reading and close the file, also under an iteration left suspended."""
        self._closed = True
        reader, self._reader = self._reader, None
        # A reader running right now (in another task) sees _closed and ends itself.
        if reader is not None and not running(reader):
            await reader.aclose()

    def __aiter__(self) -> AsyncIterator[SubscriberItem]:
        # One reading of the file for every loop: a loop that stopped and starts again
        # goes on where it was; two tasks reading at once are refused.
        if self._reader is None:
            self._reader = self._read()
        return OneReader(self._reader, f"FileSubscriber({self.path})", "FileSubscriber")

    async def _read(self) -> AsyncGenerator[SubscriberItem, None]:
        try:
            f = await anyio.open_file(self.path, "rb")
        except OSError as exc:
            raise TransportError(f"cannot read {self.path}: {exc}") from exc
        partial = b""
        lineno = 0
        inode = os.fstat(f.wrapped.fileno()).st_ino
        live = True  # reading self.path itself, not a rotated file
        try:
            while not self._closed:
                chunk = await f.read(1 << 20)
                if not chunk:
                    if not self.follow:
                        break
                    if live:
                        await anyio.sleep(self.poll_interval)
                        try:
                            rotated = os.stat(self.path).st_ino != inode
                        except FileNotFoundError:
                            rotated = False
                        except OSError as exc:
                            raise TransportError(f"cannot read {self.path}: {exc}") from exc
                        if not rotated:
                            continue
                        # Replaced: first read what the old file got before that.
                        chunk = await f.read(1 << 20)
                    if not chunk:
                        following = _after(self.path, inode)
                        try:
                            new = await anyio.open_file(following or self.path, "rb")
                        except FileNotFoundError:  # between two names: try again later
                            continue
                        except OSError as exc:  # a directory, no permission, ...
                            name = following or self.path
                            raise TransportError(f"cannot read {name}: {exc}") from exc
                        await f.aclose()
                        f = new
                        inode = os.fstat(f.wrapped.fileno()).st_ino
                        live = following is None
                        partial = b""
                        continue
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                items: list[SubscriberItem] = []
                for line in lines:
                    lineno += 1
                    if not line.strip():
                        continue
                    try:
                        batch = self.codec.decode(line)
                    except DecodeError as exc:
                        self.bad_lines += 1
                        log.warning("%s line %d skipped: %s", self.path, lineno, exc)
                        continue
                    if self.from_seq is not None and self.tracker.position(batch.origin) is None:
                        first = start_seq(self.from_seq, batch.origin)
                        if first is not None and batch.seq < first:
                            continue
                    state, gap = self.tracker.check(batch)
                    if state is Continuity.DUPLICATE:
                        continue
                    if gap is not None:
                        items.append(gap)
                    items.append(batch)
                for item in items:
                    yield item
            if partial.strip():
                try:
                    batch = self.codec.decode(partial)
                except DecodeError as exc:
                    self.bad_lines += 1
                    log.warning("%s: last line incomplete, skipped: %s", self.path, exc)
                else:
                    state, gap = self.tracker.check(batch)
                    if gap is not None:
                        yield gap
                    if state is not Continuity.DUPLICATE:
                        yield batch
        finally:
            with anyio.CancelScope(shield=True):
                await f.aclose()


def _after(path: str, inode: int) -> str | None:
    """The rotated file written after the one with `inode`; None: `path` itself.

    When the file with `inode` is not among the rotated files (rotated by
    another tool, or already deleted by retention), the reader goes on with
    `path`; what it missed shows as a gap.
    """
    names = [name for _, name in rotated_files(path)]
    for i, name in enumerate(names):
        try:
            if os.stat(name).st_ino == inode:
                return names[i + 1] if i + 1 < len(names) else None
        except FileNotFoundError:
            continue
    return None


def gap_text(gap: Gap) -> str:
    return (
        f"gap: {gap.origin} epoch {gap.epoch}: batches {gap.first_missing}..{gap.next_seq - 1} "
        f"missing ({gap.reason})"
    )
