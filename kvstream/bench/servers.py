"""Broker servers for the per-sink benchmark: `nats-server -js` and `redis-server`.

Each runs on a free loopback port with its data in a temporary folder, for the
length of a `with` block. Both keep their data in memory (JetStream memory
storage is chosen by the sink; Redis runs without AOF or snapshots), so the
benchmark measures the sink and the protocol, not the disk.
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

__all__ = ["BrokerServer", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class BrokerServer:
    """`BrokerServer("nats")` or `BrokerServer("redis")`; `url` once entered."""

    def __init__(self, kind: str) -> None:
        if kind not in ("nats", "redis"):
            raise ValueError(f"BrokerServer: expected nats or redis, got {kind!r}")
        self.kind = kind
        self.binary = shutil.which("nats-server" if kind == "nats" else "redis-server")
        self.port = free_port()
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def available(self) -> bool:
        return self.binary is not None

    @property
    def url(self) -> str:
        return f"{self.kind}://127.0.0.1:{self.port}"

    def _argv(self, folder: Path) -> list[str]:
        assert self.binary is not None
        if self.kind == "nats":
            return [
                self.binary,
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(folder / "js"),
            ]
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(folder),
            "--appendonly",
            "no",
            "--save",
            "",
            "--daemonize",
            "no",
        ]

    def _ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                if self.kind == "redis":
                    s.sendall(b"PING\r\n")
                    return s.recv(64).startswith(b"+PONG")
                return s.recv(4) == b"INFO"
        except OSError:
            return False

    def __enter__(self) -> Self:
        if self.binary is None:
            raise FileNotFoundError(f"{self.kind} server binary not found in PATH")
        self._dir = Path(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"))
        self._proc = subprocess.Popen(
            self._argv(self._dir),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while not self._ready():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"{self.kind} server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
