"""File rotation for [`FileSink`][kvstream.sinks.file.FileSink]: by size or age, with retention.

The sink always writes to its own path (`events.jsonl`). When the next write
would take the file past `rotate_bytes`, or the file has been written for
`rotate_seconds`, the file is renamed to the next numbered name and a new
one is started:

    events.jsonl            the file being written
    events.000001.jsonl     the oldest kept
    events.000002.jsonl
    ...

Numbers only grow (a restarted sink continues after the highest number it
finds), so sorting the rotated files by their number is their order in time,
and a reader following `events.jsonl` sees the file replaced, as after
logrotate. With `keep=N` only the newest `N` rotated files are kept.

Rotation happens between writes, never inside one, so a line is never split
across files. A file exceeds `rotate_bytes` only when one write alone is
larger (up to the sink's coalesced batches). Nothing rotates while nothing is
written: idle periods leave no empty files.

Everything here runs in the sink's writer thread.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from kvstream.errors import ConfigError

__all__ = ["RotationPolicy", "Rotator", "rotated_files", "rotated_name"]

log = logging.getLogger("kvstream.sinks")

_WIDTH = 6


@dataclass(frozen=True, slots=True)
class RotationPolicy:
    """When to rotate and how many rotated files to keep (None: no limit)."""

    max_bytes: int | None = None
    max_seconds: float | None = None
    keep: int | None = None

    def __post_init__(self) -> None:
        if self.max_bytes is not None and (type(self.max_bytes) is not int or self.max_bytes <= 0):
            raise ConfigError(f"rotate_bytes: expected a positive size, got {self.max_bytes!r}")
        if self.max_seconds is not None and (
            not isinstance(self.max_seconds, int | float)
            or isinstance(self.max_seconds, bool)
            or not math.isfinite(self.max_seconds)
            or self.max_seconds <= 0
        ):
            raise ConfigError(f"rotate_seconds: expected seconds > 0, got {self.max_seconds!r}")
        if self.keep is not None and (type(self.keep) is not int or self.keep < 0):
            raise ConfigError(f"keep: expected an integer >= 0, got {self.keep!r}")
        if self.keep is not None and self.max_bytes is None and self.max_seconds is None:
            raise ConfigError(
                f"keep={self.keep}: expected rotate_bytes or rotate_seconds too "
                "(keep counts rotated files)"
            )

    @property
    def rotates(self) -> bool:
        return self.max_bytes is not None or self.max_seconds is not None


def _split(path: str) -> tuple[str, str]:
    """`/d/events.jsonl` -> (`/d/events`, `.jsonl`); a dot-file has no suffix."""
    folder, base = os.path.split(path)
    stem, suffix = os.path.splitext(base)
    return os.path.join(folder, stem), suffix


def rotated_name(path: str, number: int) -> str:
    """The name of rotated file `number`: `events.jsonl`, 3 -> `events.000003.jsonl`."""
    stem, suffix = _split(path)
    return f"{stem}.{number:0{_WIDTH}d}{suffix}"


def rotated_files(path: str) -> list[tuple[int, str]]:
    """The rotated files of `path` that exist, as `(number, name)`, oldest first."""
    stem, suffix = _split(path)
    folder = os.path.dirname(path) or "."
    pattern = re.compile(
        re.escape(os.path.basename(stem)) + r"\.(\d{6,})" + re.escape(suffix) + "$"
    )
    found: list[tuple[int, str]] = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    for name in names:
        m = pattern.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(os.path.dirname(path), name)))
    found.sort()
    return found


class Rotator:
    """Decides when the current file rotates, renames it, prunes old ones."""

    def __init__(self, path: str, policy: RotationPolicy, clock: Callable[[], float]) -> None:
        self.path = path
        self.policy = policy
        self.clock = clock
        existing = rotated_files(path)
        self.next_number = existing[-1][0] + 1 if existing else 1
        #: When the current file got its first byte from this sink (None: empty).
        self.started: float | None = None
        self.rotations = 0

    def opened(self, size: int) -> None:
        """The current file was (re)opened holding `size` bytes."""
        # An existing file's age is unknown: it is counted from now.
        self.started = self.clock() if size > 0 else None

    def due(self, size: int, incoming: int) -> bool:
        """True when the file (`size` bytes) must rotate before `incoming` more."""
        if size <= 0:
            return False
        policy = self.policy
        if policy.max_bytes is not None and size + incoming > policy.max_bytes:
            return True
        return (
            policy.max_seconds is not None
            and self.started is not None
            and self.clock() - self.started >= policy.max_seconds
        )

    def wrote(self) -> None:
        """Bytes reached the current file."""
        if self.started is None:
            self.started = self.clock()

    def rotate(self) -> str:
        """Rename the current file to the next number; prune. Returns the new name.

        The caller closes the file first and opens `path` afresh after.
        """
        target = rotated_name(self.path, self.next_number)
        os.replace(self.path, target)
        self.next_number += 1
        self.rotations += 1
        self.started = None
        self.prune()
        return target

    def prune(self) -> None:
        """Delete the oldest rotated files beyond `keep`."""
        keep = self.policy.keep
        if keep is None:
            return
        existing = rotated_files(self.path)
        for _, name in existing[: max(len(existing) - keep, 0)]:
            try:
                os.remove(name)
            except FileNotFoundError:
                pass
            except OSError as exc:  # retention must not stop the stream
                log.warning("%s: cannot remove old rotated file %s: %s", self.path, name, exc)
