"""The one broker launcher, `kvstream._bench.servers`: the benchmark's and the tests' servers."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import servers

from kvstream._bench import servers as launcher
from kvstream._bench.servers import BrokerServer


def _answers(port: int, request: bytes, prefix: bytes) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        if request:
            s.sendall(request)
        return s.recv(64).startswith(prefix)


@pytest.mark.parametrize(
    ("kind", "binary", "request_", "prefix"),
    [("redis", "redis-server", b"PING\r\n", b"+PONG"), ("nats", "nats-server", b"", b"INFO")],
)
def test_a_broker_server_serves_in_its_block_and_leaves_nothing(
    kind: str, binary: str, request_: bytes, prefix: bytes
) -> None:
    servers.require_binary(binary, binary)
    server = BrokerServer(kind)
    with server:
        assert server.url == f"{kind}://127.0.0.1:{server.port}"
        assert _answers(server.port, request_, prefix)
        folder = server._dir
        assert folder is not None
        assert folder.is_dir()
        process = server._server
        assert process is not None
        running_inside = process.running
    assert running_inside
    assert not folder.exists()
    assert not process.running
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


def test_the_benchmark_redis_keeps_no_aof_and_the_tests_redis_does(tmp_path: Path) -> None:
    for kwargs, expected in (({"appendonly": False}, "no"), ({}, "yes")):
        argv = launcher.RedisServer("redis-server", tmp_path, 1, **kwargs).argv()  # type: ignore[arg-type]
        assert argv[argv.index("--appendonly") + 1] == expected


def test_the_tests_use_the_package_launcher() -> None:
    assert servers.NatsServer is launcher.NatsServer
    assert servers.RedisServer is launcher.RedisServer
    assert servers.free_port is launcher.free_port


def test_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="expected nats or redis, got 'kafka'"):
        BrokerServer("kafka")
