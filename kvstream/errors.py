"""The exceptions kvstream raises.

Every error kvstream raises on purpose derives from `KVStreamError`, so
`except KVStreamError` catches them all. Where a built-in category fits, the
error is also an instance of it, so code written against plain Python keeps
working:

    KVStreamError
    ├── InvalidEventError (ValueError)     an event or batch failed validation
    │   └── InvalidEventTypeError (TypeError)   ... because a field has the wrong type
    ├── DecodeError (ValueError)           bytes that do not decode to a valid batch
    ├── ConfigError (ValueError)           a bad URL, option or configuration value
    │   └── MissingStreamError             ... naming a broker stream that does not exist (yet)
    ├── MissingDependencyError (ImportError)   an optional extra is not installed
    ├── ClosedError (RuntimeError)         the object was used after `aclose()`
    └── TransportError (OSError)           a sink or source cannot reach its peer

Messages name the field, the value and what was expected. Foreign errors
(`OSError`, `zmq.ZMQError`, ...) are translated at the boundary with
`raise ... from exc` so the original stays attached.
"""

from __future__ import annotations

import reprlib
from typing import Final

import orjson

__all__ = [
    "ClosedError",
    "ConfigError",
    "DecodeError",
    "InvalidEventError",
    "InvalidEventTypeError",
    "KVStreamError",
    "MissingDependencyError",
    "MissingStreamError",
    "TransportError",
    "shorten",
]


class KVStreamError(Exception):
    """Root of every error kvstream raises on purpose."""


class InvalidEventError(KVStreamError, ValueError):
    """An event (or batch) failed validation; the message names the field and value."""


class InvalidEventTypeError(InvalidEventError, TypeError):
    """An event field has the wrong type."""


class DecodeError(KVStreamError, ValueError):
    """Bytes that do not decode to a valid batch."""


class ConfigError(KVStreamError, ValueError):
    """A bad URL, option or configuration value."""


class MissingStreamError(ConfigError):
    """The broker stream a subscriber reads does not exist (yet).

    A configuration error to the library (nothing is read until someone creates
    the stream), but one that a start order explains: a reader started before the
    sink that creates its stream (`?create=true`). The command line waits for it,
    as for a server not up yet; a program can catch this error and do the same.
    """


class MissingDependencyError(KVStreamError, ImportError):
    """An optional integration is used but its extra is not installed."""

    @classmethod
    def for_extra(cls, module: str, extra: str, exc: ImportError) -> MissingDependencyError:
        err = cls(
            f"{module} is not installed; install it with: pip install 'kvstream-events[{extra}]'"
        )
        err.__cause__ = exc
        return err


class ClosedError(KVStreamError, RuntimeError):
    """An object was used after it was closed."""


class TransportError(KVStreamError, OSError):
    """A sink or source cannot reach its peer (connection refused, auth, TLS, ...)."""


# Error messages show the bad value, shortened: a plain repr() of a deeply nested
# value (as a decoder can be handed) would raise RecursionError instead.
_REPR: Final = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 80


def shorten(value: object, *, as_json: bool = False) -> str:
    """A repr of `value` short enough for an error message, whatever its depth.

    The one rule for showing a bad value in an error or a log line.
    `as_json=True` shows it as JSON instead (for answers to a JSON request:
    `true`, `null`), anything JSON cannot write by its repr.
    """
    if as_json:
        try:
            shown = orjson.dumps(value, default=repr).decode()
        except (TypeError, orjson.JSONEncodeError):  # too deep, or not a str key
            shown = _REPR.repr(value)
    else:
        shown = _REPR.repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."
