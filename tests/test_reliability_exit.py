"""A process whose code forgets to close its publisher or sink still exits.

One subprocess per kind of sink (file, TCP and Unix socket, ZMQ, NATS, Redis)
and per owner: an `EventPublisher` never shut down, and a `Scheduler` entered
by hand and never closed inside `asyncio.run`. Each script uses the sink
(50 batches) and returns; a process still running after the timeout is a
failure. What each owner delivers at such an exit is in docs/reliability.md
(*Exit without close*): the publisher flushes at interpreter exit; an
abandoned scheduler's tasks are cancelled by `asyncio.run`, and what was
still queued is reported in a log record, never dropped in silence.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from servers import NatsServer, RedisServer, nats_server, nats_servers, redis_server, redis_servers

__all__ = ["nats_server", "nats_servers", "redis_server", "redis_servers"]  # fixtures

BATCHES = 50

_ABANDONED_SCHEDULER = """
import asyncio, sys
from kvstream import BlockRemoved, Scheduler
from kvstream.config import open_sink

async def main() -> None:
    scheduler = Scheduler(sinks=[open_sink(sys.argv[1])], origin="forgetful")
    await scheduler.__aenter__()
    for i in range(int(sys.argv[2])):
        scheduler.emit([BlockRemoved(block_hashes=[i + 1], medium="GPU")])
        await scheduler.tick()
    print("used", flush=True)
    # no aclose(), no __aexit__: the owner forgot

asyncio.run(main())
"""

_FORGOTTEN_PUBLISHER = """
import sys
from kvstream import BlockRemoved
from kvstream.publisher import EventPublisher

pub = EventPublisher([sys.argv[1]], origin="forgetful")
for i in range(int(sys.argv[2])):
    pub.publish([BlockRemoved(block_hashes=[i + 1], medium="GPU")])
print("used", flush=True)
# no shutdown()
"""


# Python 3.12.0 and 3.12.1 refuse to start threads once the interpreter exits, atexit
# callbacks included (CPython gh-113964, lifted in 3.12.2). This script makes any
# Python do the same: its own atexit callback, registered after the publisher's (atexit
# runs them last in, first out), makes every later Thread.start() raise what those
# versions raise. The TCP sink resolves its address through the loop's default
# executor, which asyncio's runner then shuts down with a new thread.
_PUBLISHER_WHERE_EXIT_REFUSES_THREADS = """
import atexit, logging, sys, threading
from kvstream import BlockRemoved
from kvstream.publisher import EventPublisher

logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
pub = EventPublisher(["tcp://127.0.0.1:0", "file:" + sys.argv[1]], origin="forgetful")
for i in range(int(sys.argv[2])):
    pub.publish([BlockRemoved(block_hashes=[i + 1], medium="GPU")])

def refuse(self, *args, **kwargs):
    raise RuntimeError("can't create new thread at interpreter shutdown")

atexit.register(lambda: setattr(threading.Thread, "start", refuse))
print("used", flush=True)
# no shutdown()
"""


def test_a_publisher_closed_where_exit_refuses_threads_delivers_without_a_failure(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kv.jsonl"
    result = subprocess.run(
        [sys.executable, "-c", _PUBLISHER_WHERE_EXIT_REFUSES_THREADS, str(path), str(BATCHES)],
        capture_output=True,
        timeout=60,
        check=False,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    assert result.stdout.decode().strip() == "used"
    # The refusal happened (the loop thread says so at debug level) and is not a failure.
    assert "ended at interpreter exit: can't create new thread" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert "failed" not in stderr, stderr
    seqs = [json.loads(line)["seq"] for line in path.read_text().splitlines()]
    assert seqs == list(range(BATCHES))


def _url(kind: str, tmp_path: Path, broker: Callable[[], str]) -> str:
    if kind == "file":
        return f"file:{tmp_path / 'kv.jsonl'}"
    if kind == "tcp":
        return "tcp://127.0.0.1:0"
    if kind == "unix":
        return f"unix:{tmp_path / 'kv.sock'}"
    if kind == "zmq":
        return "zmq+tcp://127.0.0.1:0?bind=1&replay=tcp://127.0.0.1:0"
    return broker()


KINDS = ["file", "tcp", "unix", "zmq", "nats", "redis"]


@pytest.fixture
def broker_url(request: pytest.FixtureRequest) -> Callable[[], str]:
    def start() -> str:
        kind = request.node.callspec.params["kind"]
        if kind == "nats":
            nats: NatsServer = request.getfixturevalue("nats_server")
            return f"{nats.url}/kv.forgetful?create=1&connect_timeout=2"
        redis: RedisServer = request.getfixturevalue("redis_server")
        return f"{redis.url}/kv:forgetful?connect_timeout=2"

    return start


@pytest.mark.parametrize("owner", ["publisher", "scheduler"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_process_that_never_closes_its_sink_exits(
    kind: str, owner: str, tmp_path: Path, broker_url: Callable[[], str]
) -> None:
    url = _url(kind, tmp_path, broker_url)
    script = _FORGOTTEN_PUBLISHER if owner == "publisher" else _ABANDONED_SCHEDULER
    try:
        result = subprocess.run(
            [sys.executable, "-c", script, url, str(BATCHES)],
            capture_output=True,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{owner} with a {kind} sink, never closed: the process did not exit")
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    assert result.stdout.decode().strip() == "used"
    assert "Traceback" not in stderr, stderr
    if kind != "file":
        return
    path = tmp_path / "kv.jsonl"
    written = path.read_text().splitlines() if path.exists() else []
    seqs = [json.loads(line)["seq"] for line in written]
    assert seqs == list(range(len(seqs)))
    if owner == "publisher":
        assert len(seqs) == BATCHES  # flushed at interpreter exit
    elif len(seqs) < BATCHES:
        # Not flushed, never silently: the close report names what was not delivered.
        assert f"{BATCHES - len(seqs)} batches" in stderr, stderr
        assert "not delivered" in stderr, stderr
