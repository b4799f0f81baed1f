"""Which asyncio event loop a thread kvstream starts for itself runs on.

kvstream owns the event loop in two places: the loop thread behind
[`EventPublisher`][kvstream.publisher.EventPublisher] and
[`run_in_thread()`][kvstream._threadsafe.run_in_thread], and the `kvstream`
command. Either can run on asyncio's own loop or on uvloop (libuv, the loop
vLLM's and uvicorn's servers run on; `pip install 'kvstream-events[uvloop]'`).
`"auto"` picks uvloop when it is installed. A host that runs kvstream on a
loop of its own chooses that loop itself; nothing here touches it.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any, Literal, get_args

from kvstream.errors import ConfigError

__all__ = ["EventLoopName", "backend_options", "resolve_event_loop", "running_loop_name"]

#: The loops kvstream can start: `"auto"` is uvloop when installed, else asyncio.
EventLoopName = Literal["auto", "asyncio", "uvloop"]

_NAMES: tuple[str, ...] = get_args(EventLoopName)


def _uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def resolve_event_loop(loop: object, *, field: str = "loop") -> Literal["asyncio", "uvloop"]:
    """`"asyncio"` or `"uvloop"` for `loop`; a `ConfigError` naming `field` otherwise.

    `"uvloop"` asked for by name and not installed is an error, not a quiet
    fall-back to asyncio: whoever named it measured or relies on it.
    """
    if loop not in _NAMES:
        raise ConfigError(f"{field}: expected one of {', '.join(_NAMES)}, got {loop!r}")
    if loop == "asyncio":
        return "asyncio"
    if _uvloop_installed():
        return "uvloop"
    if loop == "uvloop":
        raise ConfigError(
            f"{field}: 'uvloop' is not installed "
            "(pip install 'kvstream-events[uvloop]'), or use 'asyncio' or 'auto'"
        )
    return "asyncio"


def backend_options(loop: Literal["asyncio", "uvloop"]) -> dict[str, Any]:
    """`anyio.run(..., backend="asyncio", backend_options=...)` for a resolved loop."""
    return {"use_uvloop": loop == "uvloop"}


def running_loop_name() -> str | None:
    """The running event loop's kind (`"asyncio"`, `"uvloop"`, ...), None outside one."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return type(loop).__module__.split(".")[0]
