"""Real broker servers for tests: ``nats-server -js`` and ``redis-server --appendonly yes``.

Each server runs on a free 127.0.0.1 port with its data in a short temporary
folder, and can be stopped and started again on the same port and data (a
restart mid-test). When a binary is missing the test skips with the reason,
or fails when ``KVSTREAM_REQUIRE_SERVERS=1`` (CI installs both).

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
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar

import anyio
import anyio.abc
import pytest

from kvstream.config import open_subscriber
from kvstream.consumers.base import Gap
from kvstream.events import BlockStored, EventBatch

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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def require_binary(name: str, package: str) -> str:
    """The path of ``name``; skip (or fail under ``KVSTREAM_REQUIRE_SERVERS=1``) if missing."""
    path = shutil.which(name)
    if path is None:
        reason = f"{name} not found in PATH (install the Debian package {package})"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason}; {REQUIRE_ENV}=1 requires it", pytrace=False)
        pytest.skip(reason)
    return path


class ServerProcess:
    """One server process; ``start``/``stop``/``restart`` keep its port and data folder."""

    name = "server"

    def __init__(self, binary: str, data_dir: Path, port: int | None = None) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.port = port or free_port()
        self.log_path = data_dir / f"{self.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    # -- what each server defines ---------------------------------------------------

    def argv(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    # -- lifetime ----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def start(self, timeout: float = 15.0) -> None:
        """Start the process and wait until it serves clients."""
        if self.running:
            raise RuntimeError(f"{self.name} already running on port {self.port}")
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        out = open(self.data_dir / f"{self.name}.out", "ab")  # noqa: SIM115 - the child owns it
        try:
            self._proc = subprocess.Popen(
                self.argv(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            out.close()
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise RuntimeError(
                    f"{self.name} exited with {code} at start:\n{self.log_text()[-2000:]}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} not ready after {timeout} s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the process gracefully (SIGTERM), killing it if it lingers."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    async def astop(self) -> None:
        await anyio.to_thread.run_sync(self.stop)

    async def astart(self) -> None:
        await anyio.to_thread.run_sync(self.start)

    async def arestart(self, down_for: float = 0.3) -> None:
        """Stop, stay down ``down_for`` seconds (the event loop keeps running), start."""
        await self.astop()
        await anyio.sleep(down_for)
        await self.astart()

    def _connectable(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False


class NatsServer(ServerProcess):
    """``nats-server -js`` (JetStream on, file storage under the data folder)."""

    name = "nats"

    def __init__(
        self,
        binary: str,
        data_dir: Path,
        port: int | None = None,
        *,
        jetstream: bool = True,
        config: str | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        super().__init__(binary, data_dir, port)
        self.jetstream = jetstream
        self.config_path: Path | None = None
        if config is not None:
            self.config_path = data_dir / "nats.conf"
            self.config_path.write_text(config)
        self.extra = extra

    def argv(self) -> list[str]:
        argv = [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-l", str(self.log_path)]
        if self.jetstream:
            argv += ["-js", "-sd", str(self.data_dir / "js")]
        if self.config_path is not None:
            argv += ["-c", str(self.config_path)]
        return argv + list(self.extra)

    def ready(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                started = b"Server is ready" in f.read()
        except FileNotFoundError:
            return False
        return started and self._connectable()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


class RedisServer(ServerProcess):
    """``redis-server --appendonly yes`` (AOF and data in the data folder)."""

    name = "redis"

    def __init__(
        self,
        binary: str,
        data_dir: Path,
        port: int | None = None,
        *,
        password: str | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        super().__init__(binary, data_dir, port)
        self.password = password
        self.extra = extra

    def argv(self) -> list[str]:
        argv = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.log_path),
        ]
        if self.password is not None:
            argv += ["--requirepass", self.password]
        return argv + list(self.extra)

    def ready(self) -> bool:
        # PING answers +PONG once the AOF is loaded (-LOADING before, -NOAUTH with a password).
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
        except OSError:
            return False
        return reply.startswith((b"+PONG", b"-NOAUTH"))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"


async def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout`` seconds."""
    with anyio.fail_after(timeout):
        while True:
            if predicate():
                return
            await anyio.sleep(0.01)


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
        self._listener: anyio.abc.SocketListener | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> Self:
        self._listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = self._listener.extra(anyio.abc.SocketAttribute.local_port)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._listener.serve, self._handle)
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


async def read_all(url: str, **kwargs: object) -> list[EventBatch | Gap]:
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
