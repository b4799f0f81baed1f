"""Checks of constructor arguments: a wrong one is a `ConfigError` naming it, at once.

A value of the wrong type taken as it is fails later and far from its cause (a
timeout of `"5"` breaks a close, a stream name of `7` a reconnect), or not at
all. Each check returns the value, so a constructor reads
`self.timeout = seconds("Sink.timeout", timeout)`; each message names the
field, the value and what was expected. A bool is not taken for a number.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, TypeVar, overload

from kvstream.errors import ConfigError

__all__ = ["count", "flag", "function", "path", "seconds", "text"]

T = TypeVar("T")


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


@overload
def seconds(where: str, value: float, *, zero: bool = ..., infinite: bool = ...) -> float: ...
@overload
def seconds(
    where: str, value: float | None, *, zero: bool = ..., infinite: bool = ...
) -> float | None: ...
def seconds(
    where: str, value: float | None, *, zero: bool = False, infinite: bool = False
) -> float | None:
    """A duration: a number > 0 (`zero`: >= 0; `infinite`: may be `inf`), or None
    where the parameter's default is None."""
    if value is None:
        return None
    if (
        not _number(value)
        or value < 0
        or (value == 0 and not zero)
        or (math.isinf(value) and not infinite)
    ):
        bound = ">= 0" if zero else "> 0"
        raise ConfigError(f"{where}: expected seconds {bound}, got {value!r:.80}")
    return float(value)


@overload
def count(where: str, value: int, *, minimum: int = ...) -> int: ...
@overload
def count(where: str, value: int | None, *, minimum: int = ...) -> int | None: ...
def count(where: str, value: int | None, *, minimum: int = 1) -> int | None:
    """An int >= `minimum`, or None where the parameter's default is None."""
    if value is None:
        return None
    if type(value) is not int or value < minimum:
        raise ConfigError(f"{where}: expected an int >= {minimum}, got {value!r:.80}")
    return value


def flag(where: str, value: bool) -> bool:
    """True or False (not a truthy value: `"false"` is a str, and would read as True)."""
    if type(value) is not bool:
        raise ConfigError(f"{where}: expected True or False, got {value!r:.80}")
    return value


@overload
def text(where: str, value: str) -> str: ...
@overload
def text(where: str, value: str | None) -> str | None: ...
def text(where: str, value: str | None) -> str | None:
    """A non-empty str, or None where the parameter's default is None."""
    if value is None:
        return None
    if type(value) is not str or not value:
        raise ConfigError(f"{where}: expected a non-empty str, got {value!r:.80}")
    return value


def path(where: str, value: str | os.PathLike[str]) -> str:
    """A file path (a str or an `os.PathLike`), as a str."""
    if not isinstance(value, str | os.PathLike):
        raise ConfigError(f"{where}: expected a str or a path, got {value!r:.80}")
    return os.fspath(value)


def function(where: str, value: Callable[..., T] | None) -> Any:
    """A callable, or None where the parameter's default is None."""
    if value is not None and not callable(value):
        raise ConfigError(f"{where}: expected a callable, got {value!r:.80}")
    return value
