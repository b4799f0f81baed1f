"""The README's "Already running vLLM?" commands, run as pasted against a stand-in engine.

The stand-in is `kvstream demo --kv-events-config` with the config the README tells vLLM
users to start vLLM with: it binds the same endpoints and publishes vLLM's wire. The fixed
ports of the docs are mapped to free ones (the same mapping for the engine and the commands).
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import Process
from docs_blocks import ROOT, blocks, commands, map_ports

pytest.importorskip("zmq")

DEADLINE = 60.0
#: The config the README gives to `vllm serve --kv-events-config`.
VLLM_CONFIG = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5558",
}


def vllm_path_block(page: str) -> str:
    (block,) = [b for b in blocks(ROOT / page) if b.directive.startswith("vllm-path")]
    return block.code


def test_the_readme_and_the_quickstart_show_the_same_commands() -> None:
    assert vllm_path_block("README.md") == vllm_path_block("docs/quickstart.md")
    readme = (ROOT / "README.md").read_text()
    assert json.dumps(VLLM_CONFIG) in readme  # the engine's config, as the README shows it


def kvstream_argv(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[0] == "kvstream"
    return [sys.executable, "-m", "kvstream", *words[1:]]


@asynccontextmanager
async def running(argv: list[str]) -> AsyncIterator[Process]:
    process = await anyio.open_process(argv)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        with anyio.fail_after(DEADLINE):
            await process.wait()
        await process.aclose()


async def read_until(stream: Any, needle: bytes, count: int = 1) -> bytes:
    seen = b""
    with anyio.fail_after(DEADLINE):
        while seen.count(needle) < count:
            seen += await stream.receive()
    return seen


async def test_tail_relay_and_index_a_running_engine() -> None:
    ports: dict[str, int] = {}
    engine_config = map_ports(json.dumps(VLLM_CONFIG), ports)
    tail, relay, index = commands(map_ports(vllm_path_block("README.md"), ports))
    engine = [sys.executable, "-m", "kvstream", "demo", "--steps", "0", "--rate", "50"]
    async with running([*engine, "--kv-events-config", engine_config]):
        # 1. tail: one readable line per event, as they happen.
        async with running(kvstream_argv(tail)) as process:
            out = await read_until(process.stdout, b"\n", count=5)
        assert b"stored" in out or b"removed" in out
        assert process.returncode == 0

        # 2. relay, to a socket sink that subscribers read.
        async with running(kvstream_argv(relay)) as process:
            served = f"tcp://127.0.0.1:{ports['5600']}"
            read = await anyio.run_process(
                [sys.executable, "-m", "kvstream", "tail", served, "--count", "3"], check=False
            )
            assert read.returncode == 0, read.stderr
            assert b"vllm-0 #" in read.stdout  # the relay named the engine's origin
        assert process.returncode == 0

        # 3. index: /stats counts what it follows, /match answers.
        async with running(kvstream_argv(index)), httpx.AsyncClient() as client:
            url = f"http://127.0.0.1:{ports['5690']}"
            stats: dict[str, Any] = {}
            with anyio.fail_after(DEADLINE):
                while True:
                    try:
                        stats = (await client.get(f"{url}/stats")).json()
                    except httpx.TransportError:
                        stats = {}
                    if stats.get("batches", 0) > 0:
                        break
                    await anyio.sleep(0.2)
            match = await client.post(f"{url}/match", json={"token_ids": list(range(32))})
            assert match.status_code == 200, match.text
