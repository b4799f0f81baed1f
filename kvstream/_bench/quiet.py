"""Silence kvstream's own logs while benchmarks provoke what they log about.

The memory benchmark stalls a sink on purpose (drops and undelivered batches
are logged at WARNING and ERROR); the benchmark reports those counts itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["quiet_logs"]


@contextmanager
def quiet_logs(name: str = "kvstream", level: int = logging.CRITICAL) -> Iterator[None]:
    """Raise `name`'s logger to `level` for the block (its children follow it)."""
    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)
