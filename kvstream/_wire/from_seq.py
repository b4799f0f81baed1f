"""Where a reader starts: `from_seq`, one seq for every origin or one per origin.

`from_seq` is `None` (live batches only, or a file's start), an int (every
origin from that seq), or a mapping `{origin: seq}` in which the key `"*"`
gives the seq of every origin the mapping does not name. Every subscriber,
and the socket sink reading a subscriber's hello, checks it with
`check_from_seq()` and asks `start_seq()` where an origin starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias

from kvstream.errors import ConfigError, shorten

__all__ = ["ANY_ORIGIN", "FromSeq", "check_from_seq", "start_seq"]

#: What `from_seq` may be: one value for every origin, per origin, or None (live only).
FromSeq: TypeAlias = int | Mapping[str, int] | None

#: The key of a per-origin `from_seq` that stands for every origin not named.
ANY_ORIGIN = "*"


def check_from_seq(from_seq: object, where: str) -> FromSeq:
    """Return `from_seq` if it is a valid `FromSeq`, else raise `ConfigError`.

    `where` names the owner in the message (`"tcp://host:5600"`,
    `"SocketSubscriber"`).
    """
    if from_seq is None:
        return None
    if type(from_seq) is int:
        if from_seq < 0:
            raise ConfigError(f"{where}: from_seq: expected an int >= 0, got {from_seq}")
        return from_seq
    if isinstance(from_seq, Mapping):
        for origin, seq in from_seq.items():
            if type(origin) is not str or not origin or type(seq) is not int or seq < 0:
                raise ConfigError(
                    f"{where}: from_seq: expected {{origin: seq >= 0}} (origin {ANY_ORIGIN!r} "
                    f"for the others), got entry {shorten(origin)}: {shorten(seq)}"
                )
        return from_seq
    raise ConfigError(
        f"{where}: from_seq: expected an int >= 0, {{origin: seq >= 0}} or None, "
        f"got {shorten(from_seq)}"
    )


def start_seq(from_seq: FromSeq, origin: str) -> int | None:
    """The first seq of `origin` a reader wants (None: no lower bound, or live only)."""
    if from_seq is None or isinstance(from_seq, int):
        return from_seq
    n = from_seq.get(origin)
    return from_seq.get(ANY_ORIGIN) if n is None else n
