"""Types for numeric options: a bad value is refused where it was typed, by its flag.

`type=positive_int` and friends make argparse answer `argument --ttl: expected
seconds > 0, got '0'` (status 2), naming the flag the user gave rather than the
parameter of the class it ends up in (`PrefixIndex.ttl`). A config file's
values go through the same functions (`kvstream._cli.configfile`), so both
places check alike.
"""

from __future__ import annotations

import argparse
import math

__all__ = [
    "EXPECTED",
    "non_negative_int",
    "non_negative_number",
    "non_negative_seconds",
    "positive_int",
    "positive_seconds",
]


def _int(text: str, minimum: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _number(text: str, *, zero: bool, unit: str) -> float:
    expected = f"{unit} >= 0" if zero else f"{unit} > 0"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int(text, 1, "an integer >= 1")


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int(text, 0, "an integer >= 0")


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    return _number(text, zero=False, unit="seconds")


def non_negative_seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    return _number(text, zero=True, unit="seconds")


def non_negative_number(text: str) -> float:
    """A finite number >= 0 (a rate, say)."""
    return _number(text, zero=True, unit="a number")


#: What each type expects, for values that never reach it (a config file's `true`).
EXPECTED: dict[object, str] = {
    positive_int: "an integer >= 1",
    non_negative_int: "an integer >= 0",
    positive_seconds: "seconds > 0",
    non_negative_seconds: "seconds >= 0",
    non_negative_number: "a number >= 0",
}
