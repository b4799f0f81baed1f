"""Real broker servers on loopback: `nats-server -js` and `redis-server`.

The one launcher of the project: the per-sink benchmark runs its brokers with
it, and the test suite's fixtures (tests/servers.py) wrap the same classes.
Each server runs on a free 127.0.0.1 port with its data in a folder the
caller gives, and can be stopped and started again on the same port and data
(a restart mid-test).

`BrokerServer` is the benchmark's form: one server in a temporary folder for
the length of a `with` block, its data in memory (JetStream memory storage is
chosen by the sink; Redis runs without AOF or snapshots), so the benchmark
measures the sink and the protocol, not the disk.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import anyio

__all__ = ["BrokerServer", "NatsServer", "RedisServer", "ServerProcess", "free_port"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ServerProcess:
    """One server process; `start`/`stop`/`restart` keep its port and data folder."""

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
        """Stop, stay down `down_for` seconds (the event loop keeps running), start."""
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
    """`nats-server -js` (JetStream on, file storage under the data folder)."""

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
    """`redis-server`, with its AOF in the data folder unless `appendonly=False`."""

    name = "redis"

    def __init__(
        self,
        binary: str,
        data_dir: Path,
        port: int | None = None,
        *,
        password: str | None = None,
        appendonly: bool = True,
        extra: tuple[str, ...] = (),
    ) -> None:
        super().__init__(binary, data_dir, port)
        self.password = password
        self.appendonly = appendonly
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
            "yes" if self.appendonly else "no",
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


class BrokerServer:
    """`BrokerServer("nats")` or `BrokerServer("redis")`; `url` once entered."""

    def __init__(self, kind: str) -> None:
        if kind not in ("nats", "redis"):
            raise ValueError(f"BrokerServer: expected nats or redis, got {kind!r}")
        self.kind = kind
        self.binary = shutil.which("nats-server" if kind == "nats" else "redis-server")
        self.port = free_port()
        self._dir: Path | None = None
        self._server: ServerProcess | None = None

    @property
    def available(self) -> bool:
        return self.binary is not None

    @property
    def url(self) -> str:
        return f"{self.kind}://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        if self.binary is None:
            raise FileNotFoundError(f"{self.kind} server binary not found in PATH")
        self._dir = Path(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"))
        if self.kind == "nats":
            server: ServerProcess = NatsServer(self.binary, self._dir, self.port)
        else:
            server = RedisServer(self.binary, self._dir, self.port, appendonly=False)
        try:
            server.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self._server = server
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
