"""Reading a JSON-lines file back: once, or following it as it grows (``tail -f``)."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator

import anyio

from kvstream.codecs.json import JsonCodec
from kvstream.consumers.base import Continuity, Gap, SequenceTracker, Subscriber, SubscriberItem
from kvstream.errors import DecodeError, TransportError

__all__ = ["FileSubscriber"]

log = logging.getLogger("kvstream.consumers")


class FileSubscriber(Subscriber):
    """Batches from a JSON-lines file, with gaps and restarts reported.

    ``follow=True`` keeps reading as the file grows (and reopens it when it is
    replaced, as by rotation). ``from_seq`` skips batches of the first epoch seen
    below that sequence number. A line that does not decode is skipped, counted
    in :attr:`bad_lines` and logged; it never stops the reader.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        follow: bool = False,
        from_seq: int | None = None,
        poll_interval: float = 0.1,
        codec: JsonCodec | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.follow = follow
        self.from_seq = from_seq
        self.poll_interval = poll_interval
        self.codec = codec or JsonCodec()
        self.tracker = SequenceTracker()
        self.bad_lines = 0
        self._closed = False

    async def aclose(self) -> None:
        self._closed = True

    def __aiter__(self) -> AsyncIterator[SubscriberItem]:
        return self._read()

    async def _read(self) -> AsyncIterator[SubscriberItem]:
        try:
            f = await anyio.open_file(self.path, "rb")
        except OSError as exc:
            raise TransportError(f"cannot read {self.path}: {exc}") from exc
        partial = b""
        lineno = 0
        inode = os.fstat(f.wrapped.fileno()).st_ino
        try:
            while not self._closed:
                chunk = await f.read(1 << 20)
                if not chunk:
                    if not self.follow:
                        break
                    await anyio.sleep(self.poll_interval)
                    try:
                        if os.stat(self.path).st_ino != inode:  # rotated: reopen
                            await f.aclose()
                            f = await anyio.open_file(self.path, "rb")
                            inode = os.fstat(f.wrapped.fileno()).st_ino
                            partial = b""
                    except FileNotFoundError:
                        pass
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
                    if (
                        self.from_seq is not None
                        and batch.seq < self.from_seq
                        and self.tracker.position(batch.origin) is None
                    ):
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


def gap_text(gap: Gap) -> str:
    return (
        f"gap: {gap.origin} epoch {gap.epoch}: batches {gap.first_missing}..{gap.next_seq - 1} "
        f"missing ({gap.reason})"
    )
