"""What the NATS and Redis client modules share: the extra check, shown URLs, cleanup.

`kvstream._wire.nats_client` and `kvstream._wire.redis_client` wrap
two different client libraries; the rules they have in common are written
here once:

* a missing client library says which `pip install 'kvstream-events[...]'` fixes it;
* a URL in a message never shows its credentials or path;
* a client opened for a set-up step that fails (or is cancelled) is closed
  before the failure goes on.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import ModuleType
from urllib.parse import urlsplit

import anyio

from kvstream.errors import MissingDependencyError

__all__ = ["closed_on_error", "import_extra", "shown_url"]


def import_extra(package: str, extra: str, *modules: str) -> ModuleType:
    """Import `modules` (the first is returned) or raise `MissingDependencyError`.

    `package` is what pip installs, `extra` the kvstream extra that pulls it in.
    """
    try:
        found = [importlib.import_module(name) for name in modules]
    except ImportError as exc:
        raise MissingDependencyError.for_extra(package, extra, exc) from exc
    return found[0]


def shown_url(url: str) -> str:
    """`url` without credentials or path, for messages: `nats://127.0.0.1:4222`."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return f"{parts.scheme}://{host}{port}"


@asynccontextmanager
async def closed_on_error(close: Callable[[], Awaitable[object]]) -> AsyncIterator[None]:
    """Run the block; if it raises (cancellation included), `await close()`, then re-raise.

    `close` runs shielded, so a cancelled set-up still releases its client.
    """
    try:
        yield
    except BaseException:
        with anyio.CancelScope(shield=True):
            await close()
        raise
