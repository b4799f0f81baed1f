"""Every file in examples/ runs, as the docs show it (the docs include these files)."""

from __future__ import annotations

import importlib.util
import socket
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from waiting import wait_until

from kvstream import BlockRemoved, BlockStored, JsonCodec, Scheduler
from kvstream.consumers.base import SequenceTracker
from kvstream.lifetime import LifetimeState

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str) -> ModuleType:
    """Import examples/<name>.py as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"kvstream_example_{name}", EXAMPLES / f"{name}.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, cwd: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_example_has_a_test() -> None:
    tested = {"quickstart", "sqlite_sink", "tally_sink", "wrap_connector", "asgi_app"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


def test_quickstart_leaves_nothing_behind_without_a_path(tmp_path: Path) -> None:
    out = run_script("quickstart", tmp_path)
    assert out.count("batch seq=") == 3
    assert list(tmp_path.iterdir()) == []


def test_quickstart_writes_one_line_per_step(tmp_path: Path) -> None:
    out = run_script("quickstart", tmp_path, "events.jsonl")
    assert out.count("batch seq=") == 3
    assert "wrote events.jsonl" in out
    batches = JsonCodec().decode_lines((tmp_path / "events.jsonl").read_bytes())
    assert [b.seq for b in batches] == [0, 1, 2]
    assert [len(b.events) for b in batches] == [1, 1, 2]
    assert isinstance(batches[2].events[1], BlockRemoved)
    assert {b.origin for b in batches} == {"engine-0"}


async def test_sqlite_sink_stores_every_batch(tmp_path: Path) -> None:
    example = load("sqlite_sink")
    rows = await example.main(str(tmp_path / "events.db"))
    assert rows == [("engine-0", seq, 1) for seq in range(5)]
    # Delivery is idempotent per (origin, epoch, seq): a retried batch is not a second row.
    with closing(sqlite3.connect(tmp_path / "events.db")) as db:
        line = db.execute("SELECT line FROM batches WHERE seq = 3").fetchone()[0]
    batch = JsonCodec().decode(line)
    assert batch.seq == 3
    assert isinstance(batch.events[0], BlockStored)


def test_sqlite_sink_runs_as_a_script_and_leaves_nothing_behind(tmp_path: Path) -> None:
    out = run_script("sqlite_sink", tmp_path)
    assert out.splitlines() == [f"engine-0 {seq} 1" for seq in range(5)]
    assert list(tmp_path.iterdir()) == []


def test_sqlite_sink_keeps_the_database_it_is_given(tmp_path: Path) -> None:
    run_script("sqlite_sink", tmp_path, "kept.db")
    with closing(sqlite3.connect(tmp_path / "kept.db")) as db:
        assert db.execute("SELECT count(*) FROM batches").fetchone() == (5,)


async def test_tally_sink_runs_its_own_task_until_it_closes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    example = load("tally_sink")
    sink = example.TallySink(0.001, name="tally")
    printed: list[str] = []

    def reported(line: str) -> bool:
        printed.extend(capsys.readouterr().out.splitlines())
        return line in printed

    async with Scheduler(sinks=[sink], origin="o") as kv:
        assert sink.state is LifetimeState.RUNNING
        kv.emit(BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=1))
        await kv.tick()
        await wait_until(lambda: reported("tally: {'o': 1}"), "the sink's task to report")
    assert sink.state.name == "CLOSED"
    assert sink.statistics().events_out == 1
    # Its task ended with the sink: nothing prints any more (the leak check sees no task).
    capsys.readouterr()
    await anyio.sleep(0.01)
    assert capsys.readouterr().out == ""


def test_tally_sink_runs_as_a_script() -> None:
    out = run_script("tally_sink", EXAMPLES)
    assert out.splitlines()[-1] == "closed: {'engine-0': 5}"
    assert "tally: {'engine-0': 1}" in out


async def test_wrapped_connectors_join_the_step_batch() -> None:
    example = load("wrap_connector")
    batches = await example.main()
    assert [b.seq for b in batches] == [0, 1, 2, 3]
    for step, batch in enumerate(batches):
        media = [getattr(e, "medium", None) for e in batch.events]
        # The cache manager's event first, then the connectors in the order they were added.
        assert media[0] == "GPU"
        assert media[1] == "EXTERNAL"
        assert media[-1] == "CPU"
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert {tuple(e.block_hashes) for e in stored} == {(100 + step,)}
    assert isinstance(batches[3].events[2], BlockRemoved)


@asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Run ``app`` under a real uvicorn on 127.0.0.1 (a free port); yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_level="warning",
        ws="none",
        http="h11",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        with anyio.fail_after(30):
            while True:  # uvicorn offers no event for "started"
                if server.started:
                    break
                await anyio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
    sock.close()


async def read_sse(response: httpx.Response, n: int) -> list[dict[str, str]]:
    """The first ``n`` server-sent events of a streaming response."""
    events: list[dict[str, str]] = []
    current: dict[str, str] = {}
    async for line in response.aiter_lines():
        if not line:
            if current:
                events.append(current)
                current = {}
                if len(events) == n:
                    break
            continue
        field, _, value = line.partition(":")
        current[field] = value.removeprefix(" ")
    return events


async def test_asgi_app_serves_batches_and_server_sent_events(tmp_path: Path) -> None:
    example = load("asgi_app")
    sqlite = load("sqlite_sink")
    db = tmp_path / "events.db"
    app = example.create_app(sinks=[sqlite.SQLiteSink(str(db))], steps_per_second=200.0)
    codec = JsonCodec()
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        with anyio.fail_after(30):
            async with client.stream("GET", "/events") as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                events = await read_sse(response, 10)
        tracker = SequenceTracker()
        for event in events:
            assert event["event"] == "batch"
            batch = codec.decode(event["data"].encode())
            assert event["id"] == f"{batch.origin}/{batch.epoch}/{batch.seq}"
            tracker.check(batch)
        assert tracker.gaps == 0
        assert tracker.duplicates == 0

        recent = await client.get("/batches", params={"limit": 5})
        assert recent.status_code == 200
        batches = codec.decode_lines(recent.content)
        assert len(batches) == 5
        assert [b.seq for b in batches] == list(range(batches[0].seq, batches[0].seq + 5))

        stats = (await client.get("/stats")).json()
        assert stats["origin"] == "sim-0"
        assert stats["batches_sealed"] >= 10
        assert {s["name"] for s in stats["sinks"]} == {"RecentBatches", "SQLiteSink"}

        metrics = (await client.get("/metrics/")).text
        assert 'kvstream_sink_batches_out_total{sink="SQLiteSink"}' in metrics
    # The app has shut down: the scheduler delivered every batch to the SQLite sink too.
    with closing(sqlite3.connect(db)) as conn:
        seqs = [row[0] for row in conn.execute("SELECT seq FROM batches ORDER BY seq")]
    assert seqs == list(range(len(seqs)))
    assert len(seqs) >= stats["batches_sealed"]


def test_examples_extra_is_installed() -> None:
    # The examples' own dependencies, from the 'examples' extra.
    for name in ("starlette", "uvicorn", "httpx", "prometheus_client"):
        assert importlib.util.find_spec(name) is not None, name
