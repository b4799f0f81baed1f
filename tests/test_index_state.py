"""PrefixIndex.dump() / load(): a restarted router is warm and resumes each stream."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import orjson
import pytest
from test_index import RecordingWorkload, _http, _post, _queries

from kvstream import PrefixIndex
from kvstream.codecs.json import JsonCodec
from kvstream.errors import ConfigError
from kvstream.events import BlockStored, EventBatch
from kvstream.index._http import QueryServer
from kvstream.sim import SimulatedEngine

B = 4


def _fleet_batches(
    seed: int, rounds: int, block_size: int = B
) -> tuple[list[EventBatch], RecordingWorkload]:
    workload = RecordingWorkload(
        seed=seed,
        block_size=B,
        system_prompts=3,
        system_prompt_blocks=(1, 4),
        turn_tokens=(4, 40),
        conversations=12,
    )
    engines = [
        SimulatedEngine(
            seed=seed + i,
            block_size=block_size,
            gpu_blocks=32,
            cpu_blocks=64,
            remote_blocks=128,
            workload=workload,
            origin=f"engine-{i // 2}",
        )
        for i in range(4)
    ]
    batches = [
        EventBatch(
            seq=r,
            ts=0.0,
            events=e.step_events(),
            origin=e.origin,
            epoch="e",
            data_parallel_rank=i % 2,
        )
        for r in range(rounds)
        for i, e in enumerate(engines)
    ]
    return batches, workload


def _comparable(index: PrefixIndex) -> dict[str, object]:
    stats = index.statistics()._asdict()
    del stats["memory_bytes"]
    stats["origins"] = {
        k: {**o._asdict(), "idle_seconds": None} for k, o in stats["origins"].items()
    }
    return stats


@pytest.mark.parametrize("max_blocks", [None, 150])
def test_dump_while_events_flow_then_resume_equals_never_stopping(max_blocks: int | None) -> None:
    batches, workload = _fleet_batches(3, 60)
    whole = PrefixIndex(block_size=B, max_blocks=max_blocks, keep_removed=64)
    first = PrefixIndex(block_size=B, max_blocks=max_blocks, keep_removed=64)
    cut = len(batches) // 2 + 1
    for batch in batches[:cut]:
        whole.apply(batch)
        first.apply(batch)
    data = first.dump()
    second = PrefixIndex(block_size=B, max_blocks=max_blocks, keep_removed=64)
    second.load(data)
    assert _comparable(second) == _comparable(first)
    # Each stream resumes from its next_seq; a replay from earlier is skipped as duplicates.
    resume = {
        (o.origin, o.data_parallel_rank): o.next_seq for o in second.statistics().origins.values()
    }
    applied: dict[tuple[str, int | None], int] = {}
    for batch in batches[:cut]:
        key = (batch.origin, batch.data_parallel_rank)
        applied[key] = applied.get(key, 0) + 1
    assert resume == applied
    for batch in batches[cut - 8 :]:
        second.apply(batch)
    for batch in batches[cut:]:
        whole.apply(batch)
    rng = random.Random(0)
    queries = 0
    for tokens, lora in _queries(workload, rng, B):
        assert second.match(tokens, lora) == whole.match(tokens, lora)
        queries += 1
    assert queries > 10
    assert any(whole.match(r.token_ids) for r in workload.served[-12:])
    got, want = _comparable(second), _comparable(whole)
    assert got["duplicate_batches"] == want["duplicate_batches"] + 8  # type: ignore[operator]
    for name in ("duplicate_batches",):
        got.pop(name)
        want.pop(name)
    assert got == want


def test_engine_blocks_of_a_multiple_size_and_orphans_survive_a_dump() -> None:
    index = PrefixIndex(block_size=B)
    tokens = list(range(100, 124))
    index.apply(
        EventBatch(
            seq=0,
            ts=0.0,
            origin="big",
            epoch="e",
            events=[
                BlockStored(
                    block_hashes=[1], parent_block_hash=None, token_ids=tokens[:8], block_size=8
                ),
                BlockStored(
                    block_hashes=[3], parent_block_hash=2, token_ids=tokens[16:24], block_size=8
                ),
            ],
        )
    )
    copy = PrefixIndex(block_size=B)
    copy.load(index.dump())
    assert copy.match(tokens) == index.match(tokens)
    assert copy.statistics().origins["big"].orphans == 1
    late = EventBatch(
        seq=1,
        ts=0.0,
        origin="big",
        epoch="e",
        events=[
            BlockStored(block_hashes=[2], parent_block_hash=1, token_ids=tokens[8:16], block_size=8)
        ],
    )
    index.apply(late)
    copy.apply(late)
    assert copy.match(tokens) == index.match(tokens)
    assert copy.match(tokens)[0].blocks == 6


def test_load_refuses_what_it_cannot_use() -> None:
    index = PrefixIndex(block_size=B, seed=1)
    index.apply(
        EventBatch(
            seq=0,
            ts=0.0,
            origin="a",
            epoch="e",
            events=[
                BlockStored(
                    block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=B
                )
            ],
        )
    )
    data = index.dump()
    with pytest.raises(ConfigError, match="empty"):
        index.load(data)
    with pytest.raises(ConfigError, match="seed"):
        PrefixIndex(block_size=B, seed=2).load(data)
    with pytest.raises(ConfigError, match="block_size"):
        PrefixIndex(block_size=8, seed=1).load(data)
    with pytest.raises(ConfigError, match="format"):
        PrefixIndex(block_size=B).load(b"\x01\x02")
    with pytest.raises(ConfigError, match="format"):
        PrefixIndex(block_size=B).load(msgspec.msgpack.encode({"format": "other"}))
    doc = msgspec.msgpack.decode(data)
    doc["version"] = 99
    with pytest.raises(ConfigError, match="version: expected 1, got 99"):
        PrefixIndex(block_size=B, seed=1).load(msgspec.msgpack.encode(doc))
    doc["version"] = 1
    doc["streams"][0]["masks"] = b""
    fresh = PrefixIndex(block_size=B, seed=1)
    with pytest.raises(ConfigError, match="malformed"):
        fresh.load(msgspec.msgpack.encode(doc))
    assert fresh.statistics().origins == {}  # nothing half-loaded


def _start(argv: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstream", "index", *argv, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert "http://127.0.0.1:" in line, line
    return proc, int(line.rsplit(":", 1)[1].split()[0].strip("/"))


def _matches(port: int, tokens: list[int], wait_for: int) -> list[Any]:
    async def query() -> list[Any]:
        with anyio.fail_after(30):
            while True:
                status, _, body = await _http(port, _post(orjson.dumps({"token_ids": tokens})))
                assert status == 200
                if len(body["matches"]) >= wait_for:
                    return body["matches"]  # type: ignore[no-any-return]
                await anyio.sleep(0.05)

    return anyio.run(query)


def test_cli_state_is_saved_on_shutdown_and_loaded_at_start(tmp_path: Path) -> None:
    tokens = list(range(100, 112))
    stream = tmp_path / "kv.jsonl"
    batch = EventBatch(
        seq=0,
        ts=0.0,
        origin="engine-0",
        epoch="e",
        data_parallel_rank=1,
        events=[
            BlockStored(
                block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=tokens, block_size=B
            )
        ],
    )
    stream.write_bytes(JsonCodec().encode(batch) + b"\n")
    state = tmp_path / "index.state"
    common = ["--block-size", str(B), "--state", str(state)]
    proc, port = _start([str(stream), *common])
    try:
        first = _matches(port, tokens, 1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    assert state.exists()
    assert b"saved" in err
    # A new run following an empty stream answers at once from the saved state.
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    proc, port = _start([str(empty), *common])
    try:
        assert _matches(port, tokens, 1) == first
        assert first[0]["data_parallel_rank"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    assert b"loaded" in err
    # A state file of another kind is refused with a clear error.
    state.write_bytes(b"not a state")
    done = subprocess.run(
        [sys.executable, "-m", "kvstream", "index", str(empty), *common, "--port", "0"],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"--state {state}: index state: format".encode() in done.stderr


def test_cli_state_is_saved_periodically_while_it_runs(tmp_path: Path) -> None:
    # Killed without a chance to save on shutdown: what a crash leaves is the last
    # periodic save, which holds what had been applied by then.
    tokens = list(range(100, 112))
    stream = tmp_path / "kv.jsonl"
    stored = BlockStored(
        block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=tokens, block_size=B
    )
    stream.write_bytes(
        JsonCodec().encode(EventBatch(seq=0, ts=0.0, origin="a", epoch="e", events=[stored]))
        + b"\n"
    )
    state = tmp_path / "index.state"
    argv = [str(stream), "--block-size", str(B), "--state", str(state), "--save-interval", "0.2"]
    proc, port = _start(argv)
    try:
        assert _matches(port, tokens, 1)[0]["blocks"] == 3

        async def wait_for_a_save() -> PrefixIndex:
            with anyio.fail_after(30):
                while True:
                    if state.exists():  # written to a temporary file, then renamed
                        loaded = PrefixIndex(block_size=B)
                        loaded.load(state.read_bytes())
                        if loaded.match(tokens):
                            return loaded
                    await anyio.sleep(0.05)

        saved = anyio.run(wait_for_a_save)
        assert proc.poll() is None  # saved while running, not on shutdown
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert [(m.origin, m.blocks) for m in saved.match(tokens)] == [("a", 3)]
    assert saved.statistics().origins["a"].next_seq == 1


async def test_http_binary_body_and_engine_hash_queries(no_leaked_tasks: None) -> None:
    index = PrefixIndex(block_size=B)
    tokens = list(range(100, 112))
    index.apply(
        EventBatch(
            seq=0,
            ts=0.0,
            origin="a",
            epoch="e",
            events=[
                BlockStored(
                    block_hashes=[1, 2, 3],
                    parent_block_hash=None,
                    token_ids=tokens,
                    block_size=B,
                    lora_name="L",
                    extra_keys=[["L"]] * 3,
                )
            ],
        )
    )
    data = b"".join(t.to_bytes(4, "little") for t in tokens)
    binary = "Content-Type: application/octet-stream\r\n"
    async with QueryServer(index, port=0) as server:
        status, _, body = await _http(server.port, _post(data, "/match?lora_name=L", binary))
        assert status == 200
        assert [(m["origin"], m["blocks"]) for m in body["matches"]] == [("a", 3)]
        status, _, body = await _http(server.port, _post(data, "/match", binary))
        assert (status, body["matches"]) == (200, [])  # without the adapter: nothing
        status, _, body = await _http(server.port, _post(data[:-1], "/match", binary))
        assert status == 400
        assert "multiple of 4" in body["error"]
        status, _, body = await _http(server.port, _post(data, "/match?colour=red", binary))
        assert status == 400
        assert "colour" in body["error"]
        query = orjson.dumps({"block_hashes": [1, 2], "origin": "a"})
        status, _, body = await _http(server.port, _post(query))
        assert status == 200
        assert [(m["origin"], m["blocks"]) for m in body["matches"]] == [("a", 2)]
        query = orjson.dumps({"block_hashes": [1], "token_ids": tokens})
        status, _, body = await _http(server.port, _post(query))
        assert status == 400
        assert "both" in body["error"]
        query = orjson.dumps({"token_ids": tokens, "lora_name": "L", "tier_weights": {"GPU": 2}})
        status, _, body = await _http(server.port, _post(query))
        assert body["matches"][0]["score"] == 6.0
        query = orjson.dumps({"token_ids": [*tokens[:4], True, 5, 6, 7]})
        status, _, body = await _http(server.port, _post(query))
        assert status == 400
        assert "true" in body["error"]


_IDLE_PUBLISHER = """
import sys, anyio
from kvstream import BlockStored, Scheduler
from kvstream.sinks.zmq import ZmqSink

async def main():
    sink = ZmqSink(sys.argv[1], bind=True, heartbeat=0.1, linger=0)
    async with Scheduler(sinks=[sink], origin="engine-0") as s:
        await sink.wait_subscribed()
        await anyio.sleep(0.3)
        s.emit(BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None,
                           token_ids=list(range(100, 112)), block_size=4))
        await s.tick()
        await anyio.sleep(60)  # idle from now on: heartbeats only

anyio.run(main)
"""


def test_cli_heartbeats_keep_an_idle_engine_alive_under_ttl() -> None:
    # The engine publishes once, then only heartbeats; --ttl 1 would expire it after a
    # second of silence, but `kvstream index` counts its heartbeats as signs of life.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    publisher = subprocess.Popen([sys.executable, "-c", _IDLE_PUBLISHER, endpoint])
    tokens = list(range(100, 112))
    try:
        url = f"zmq+{endpoint}?heartbeats=true"
        proc, http_port = _start([url, "--block-size", str(B), "--ttl", "1"])
        try:
            assert len(_matches(http_port, tokens, 1)) == 1
            anyio.run(anyio.sleep, 2.5)  # two and a half ttls of silence, heartbeats only
            status, _, body = anyio.run(
                _http, http_port, _post(orjson.dumps({"token_ids": tokens}))
            )
            assert status == 200
            assert [m["blocks"] for m in body["matches"]] == [3]
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=30)
    finally:
        publisher.kill()
        publisher.wait()
