"""The event loop kvstream's own threads and the `kvstream` command run on (`loop=`, `--loop`).

uvloop is in the test extra, so "installed" is the case here; "not installed"
is made by marking the module unimportable (`sys.modules["uvloop"] = None`,
Python's own way to block an import), in this process or a child's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import vllm_wire as vllm
import zmq

from kvstream import FileSink, JsonCodec, Scheduler
from kvstream._bench.report import render_text
from kvstream._bench.suite import machine_info
from kvstream._bench.zmq_compare import free_tcp_port
from kvstream._cli.main import main
from kvstream._event_loop import resolve_event_loop, running_loop_name
from kvstream._threadsafe import run_in_thread
from kvstream.errors import ConfigError
from kvstream.events import BlockStored
from kvstream.publisher import EventPublisher
from kvstream.sim import check_consistency


@pytest.fixture
def no_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)


def stored(i: int) -> vllm.BlockStored:
    return vllm.BlockStored(
        block_hashes=[i * 4 + b for b in range(4)],
        parent_block_hash=None,
        token_ids=list(range(16)),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def loop_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvstream ")]


# -- choosing ----------------------------------------------------------------------------


def test_asyncio_and_uvloop_are_taken_as_named() -> None:
    assert resolve_event_loop("asyncio") == "asyncio"
    assert resolve_event_loop("uvloop") == "uvloop"


def test_auto_is_uvloop_when_installed_else_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_event_loop("auto") == "uvloop"
    monkeypatch.setitem(sys.modules, "uvloop", None)
    assert resolve_event_loop("auto") == "asyncio"


@pytest.mark.usefixtures("no_uvloop")
def test_uvloop_named_but_missing_is_an_error_that_says_how_to_install_it() -> None:
    with pytest.raises(ConfigError, match=r"EventPublisher\.loop: 'uvloop' is not installed") as e:
        EventPublisher([], loop="uvloop")
    assert "kvstream-events[uvloop]" in str(e.value)


@pytest.mark.parametrize("bad", ["trio", "", None, 1])
def test_an_unknown_loop_is_refused_by_field_and_value(bad: Any) -> None:
    expected = f"expected one of auto, asyncio, uvloop, got {bad!r}"
    with pytest.raises(ConfigError, match=re.escape(f"EventPublisher.loop: {expected}")):
        EventPublisher([], loop=bad)
    with (
        pytest.raises(ConfigError, match=re.escape(f"LoopThread.loop: {expected}")),
        run_in_thread(Scheduler(sinks=[]), loop=bad),
    ):
        pass


# -- the drop-in publisher's thread --------------------------------------------------------


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_publisher_runs_its_thread_on_the_loop_asked_for_and_vllms_wire_is_the_same(
    loop: Any,
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    before = loop_threads()
    pub = EventPublisher.from_kv_events_config(
        {"endpoint": endpoint}, origin="engine", sink_options={"bind": True}, loop=loop
    )
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        runner = pub._runner
        assert runner.loop_name == loop
        assert runner._loop is not None
        assert type(runner._loop).__module__.split(".")[0] == loop
        sink: Any = pub.scheduler.sinks[0]
        deadline = time.monotonic() + 10
        while sink.statistics().subscriptions < 1:
            assert time.monotonic() < deadline, "never subscribed"
            time.sleep(0.005)
        first: int | None = None
        for i in range(300):
            pub.publish(vllm.KVEventBatch(ts=float(i), events=[stored(i)], data_parallel_rank=0))
        got: list[tuple[int, float, Any]] = []
        while len(got) < 300:
            assert sub.poll(5000), f"only {len(got)} of 300 steps arrived"
            _topic, seq, payload = sub.recv_multipart()
            batch = vllm.decoder.decode(payload)
            if first is None:
                first = int.from_bytes(seq, "big")
            n = int.from_bytes(seq, "big") - first
            event: Any = batch.events[0]
            got.append((n, batch.ts, event.block_hashes[0]))
        assert got == [(i, float(i), i * 4) for i in range(300)]
    finally:
        pub.shutdown()
        sub.close(linger=0)
    assert loop_threads() == before  # the loop thread ended


def test_run_in_thread_on_uvloop_delivers_every_tick_in_order(tmp_path: Path) -> None:
    path = tmp_path / "kv.jsonl"
    scheduler = Scheduler(sinks=[FileSink(path)], origin="engine")
    before = loop_threads()
    with run_in_thread(scheduler, loop="uvloop") as kv:
        for i in range(200):
            event = BlockStored(
                block_hashes=[i], parent_block_hash=None, token_ids=[1, 2], block_size=2
            )
            kv.emit([event])
            kv.tick()
    assert loop_threads() == before
    batches = JsonCodec().decode_lines(path.read_bytes())
    assert [b.seq for b in batches] == list(range(200))
    assert check_consistency(batches).batches == 200


# -- the kvstream command ------------------------------------------------------------------


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "auto"])
def test_the_command_runs_a_demo_on_each_loop(tmp_path: Path, loop: str) -> None:
    out = tmp_path / "demo.jsonl"
    assert main(["--loop", loop, "demo", "--steps", "60", "--rate", "0", "--out", str(out)]) == 0
    batches = JsonCodec().decode_lines(out.read_bytes())
    assert check_consistency(batches).batches == len(batches) > 30


def test_the_command_names_a_missing_uvloop_in_one_line(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['uvloop'] = None\n"
        "from kvstream._cli.main import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    out = tmp_path / "demo.jsonl"
    args = ["--loop", "uvloop", "demo", "--steps", "5", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvstream demo: error: --loop: 'uvloop' is not installed "
        "(pip install 'kvstream-events[uvloop]'), or use 'asyncio' or 'auto'"
    ]
    assert not out.exists()


def test_a_bench_report_names_the_loop_it_ran_on() -> None:
    async def info() -> Any:
        return machine_info()["event_loop"]

    assert anyio.run(info) == "asyncio"
    assert anyio.run(info, backend_options={"use_uvloop": True}) == "uvloop"
    assert running_loop_name() is None
    report = {"machine": {"event_loop": "uvloop"}, "results": []}
    assert ", on uvloop," in render_text(report)
    assert " on " not in render_text({"machine": {"event_loop": "asyncio"}, "results": []})
