"""Counting the events a decoder refused, and logging them once per burst.

Decoding is per event: an event no dialect reads is left out of its batch and
the rest is delivered. A decoder's plain `decode()` notes what it left out
here, so the count is never lost; a consumer that wants the refusals
themselves calls `decode_screened()` instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["RefusalLog"]

log = logging.getLogger("kvstream.codecs")


class RefusalLog:
    """A counter of refused events and a once-per-burst warning.

    A burst is a run of batches each with at least one refusal; the first batch
    without one ends it, so the next refusal is logged again.
    """

    __slots__ = ("burst", "count", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self.burst = False

    def note(self, refused: Sequence[Any], seq: int, origin: str) -> None:
        if not refused:
            self.burst = False
            return
        self.count += len(refused)
        if not self.burst:
            self.burst = True
            first = refused[0]
            log.warning(
                "%s: %d event(s) of %s seq %d refused, the rest delivered (first: events[%d] "
                "%s: %s); further refusals in this burst are counted only",
                self.what,
                len(refused),
                origin or "batch",
                seq,
                first.position,
                first.event_type,
                first.reason,
            )
