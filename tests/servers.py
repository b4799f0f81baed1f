"""Real broker servers for tests: ``nats-server -js`` and ``redis-server --appendonly yes``.

The launcher is the package's (`kvstream._bench.servers`, which the benchmark
uses too); here are the fixtures around it. Each server runs on a free
127.0.0.1 port with its data in a short temporary folder, and can be stopped
and started again on the same port and data (a restart mid-test). When a
binary is missing the test skips with the reason, or fails when
``KVSTREAM_REQUIRE_SERVERS=1`` (CI installs both).

Also here: :class:`CuttingProxy`, a loopback TCP proxy that can drop one reply
from the server and cut the connection, to produce "the write happened but
the client never heard" for real.

Use in a test module::

    from servers import nats_server, redis_server  # fixtures (tests/ is on sys.path)

    @pytest.mark.server
    async def test_x(nats_server): ...
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import anyio
import anyio.abc
import pytest
from waiting import wait_until

from kvstream._bench.servers import NatsServer, RedisServer, free_port
from kvstream.config import open_subscriber
from kvstream.consumers.base import Gap
from kvstream.events import BlockStored, EventBatch
from kvstream.scheduler import Scheduler

__all__ = [
    "REQUIRE_ENV",
    "CuttingProxy",
    "NatsServer",
    "RedisServer",
    "free_port",
    "nats_server",
    "nats_servers",
    "redis_server",
    "redis_servers",
    "require_binary",
    "wait_until",
]

REQUIRE_ENV = "KVSTREAM_REQUIRE_SERVERS"


def require_binary(name: str, package: str) -> str:
    """The path of ``name``; skip (or fail under ``KVSTREAM_REQUIRE_SERVERS=1``) if missing."""
    path = shutil.which(name)
    if path is None:
        reason = f"{name} not found in PATH (install the Debian package {package})"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason}; {REQUIRE_ENV}=1 requires it", pytrace=False)
        pytest.skip(reason)
    return path


# -- fixtures ------------------------------------------------------------------------


ServerT = TypeVar("ServerT", "NatsServer", "RedisServer")


def _short_tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))


def _server_factory(kind: type[ServerT], binary: str) -> Iterator[Callable[..., ServerT]]:
    """Start servers of ``kind`` on demand, each in a short temporary folder; stop them all."""
    started: list[tuple[ServerT, Path]] = []

    def make(**kwargs: object) -> ServerT:
        folder = _short_tmp()
        server = kind(binary, folder, **kwargs)  # type: ignore[arg-type]
        started.append((server, folder))
        server.start()
        return server

    yield make
    for server, folder in started:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def nats_servers() -> Iterator[Callable[..., NatsServer]]:
    """A factory: ``nats_servers(jetstream=False, config=...)`` starts one more server."""
    yield from _server_factory(NatsServer, require_binary("nats-server", "nats-server"))


@pytest.fixture
def nats_server(nats_servers: Callable[..., NatsServer]) -> NatsServer:
    """A running ``nats-server -js`` of this test."""
    return nats_servers()


@pytest.fixture
def redis_servers() -> Iterator[Callable[..., RedisServer]]:
    """A factory: ``redis_servers(password=...)`` starts one more server."""
    yield from _server_factory(RedisServer, require_binary("redis-server", "redis-server"))


@pytest.fixture
def redis_server(redis_servers: Callable[..., RedisServer]) -> RedisServer:
    """A running ``redis-server --appendonly yes`` of this test."""
    return redis_servers()


# -- fault injection -----------------------------------------------------------------


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 to ``target_port`` that can lose one reply.

    After :meth:`cut_next_reply`, the first chunk the server sends back that
    contains ``marker`` (any chunk when ``marker`` is empty) is dropped and
    that client connection is closed: the request reached the server, the
    client never hears the answer. Later connections pass through untouched.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.connections = 0
        self.cut = anyio.Event()
        self._marker: bytes | None = None
        self._listener: anyio.abc.Listener[anyio.abc.SocketStream] | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> Self:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self._listener = listener
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(listener.serve, self._handle)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
        if self._listener is not None:
            await self._listener.aclose()

    def cut_next_reply(self, marker: bytes = b"") -> None:
        self._marker = marker
        self.cut = anyio.Event()

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        self.connections += 1
        async with client:
            try:
                upstream = await anyio.connect_tcp("127.0.0.1", self.target_port)
            except OSError:
                return
            async with upstream, anyio.create_task_group() as tg:

                async def up() -> None:
                    try:
                        async for chunk in client:
                            await upstream.send(chunk)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        pass
                    tg.cancel_scope.cancel()

                async def down() -> None:
                    try:
                        async for chunk in upstream:
                            marker = self._marker
                            if marker is not None and marker in chunk:
                                self._marker = None
                                self.cut.set()
                                break
                            await client.send(chunk)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(up)
                tg.start_soon(down)


_READ_BACK = textwrap.dedent(
    """
    import sys, anyio
    from kvstream.config import open_subscriber
    from kvstream.events import EventBatch

    async def main():
        async with open_subscriber(sys.argv[1], follow=False, from_seq=0) as sub:
            async for item in sub:
                kind = "batch" if isinstance(item, EventBatch) else "gap"
                print(kind, item.origin, item.epoch, getattr(item, "seq", -1), flush=True)

    anyio.run(main)
    """
)


async def read_back_in_another_process(url: str) -> list[list[str]]:
    """Read a stream from its start in a second Python process (as a router would).

    Returns one ``[kind, origin, epoch, seq]`` row per item, ``kind`` being
    ``batch`` or ``gap``. Fails the test when the process does not exit cleanly.
    """
    result = await anyio.run_process([sys.executable, "-c", _READ_BACK, url], check=False)
    assert result.returncode == 0, result.stderr.decode()
    words = result.stdout.decode().split()
    return [words[i : i + 4] for i in range(0, len(words), 4)]


# -- shared by the broker tests -----------------------------------------------------


def stored(i: int, blocks: int = 1) -> BlockStored:
    return BlockStored(
        block_hashes=[i * 1000 + b + 1 for b in range(blocks)],
        parent_block_hash=None,
        token_ids=list(range(4 * blocks)),
        block_size=4,
        medium="GPU",
    )


def batch(seq: int, origin: str = "engine-0", epoch: str = "e1") -> EventBatch:
    return EventBatch(seq=seq, ts=1.5 + seq, events=[stored(seq)], origin=origin, epoch=epoch)


async def tick_stored(scheduler: Scheduler, seqs: range) -> None:
    """One tick per number in `seqs`, each with `stored(number)`."""
    for i in seqs:
        scheduler.emit(stored(i))
        await scheduler.tick()


async def read_all(url: str, **kwargs: Any) -> list[EventBatch | Gap]:
    """Everything a subscriber yields from the stream's start until it has caught up."""
    kwargs.setdefault("from_seq", 0)
    items: list[EventBatch | Gap] = []
    with anyio.fail_after(20):
        async with open_subscriber(url, follow=False, **kwargs) as sub:
            async for item in sub:
                items.append(item)
    return items


def seqs(items: list[EventBatch | Gap]) -> list[int]:
    assert not [i for i in items if isinstance(i, Gap)], items
    return [i.seq for i in items if isinstance(i, EventBatch)]
