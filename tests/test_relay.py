"""``kvstream relay``: a vLLM-style publisher's stream, gaps repaired by replay, into a file.

The publisher is written here from WIRE.md with plain pyzmq (a PUB and a ROUTER
replay in a thread) and msgspec structs declared in tests/vllm_wire.py; the relay runs
as a real subprocess, so SIGTERM is a real signal.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import vllm_wire as vllm
import zmq
from servers import RedisServer, free_port, redis_servers

import kvstream.relay as relay_module
from kvstream._cli.main import main
from kvstream.codecs.json import JsonCodec
from kvstream.consumers.file import FileSubscriber
from kvstream.events import AllBlocksCleared, BlockRemoved, EventBatch, KVCacheEvent
from kvstream.relay import Relay, RelayStatistics
from kvstream.scheduler import Scheduler
from kvstream.sim import SimulatedEngine, check_consistency
from kvstream.sinks.memory import MemorySink
from kvstream.sinks.redis import RedisSink

__all__ = ["redis_servers"]  # a fixture, imported for pytest

END = b"\xff" * 8


# -- vLLM's map-profile structs: tests/vllm_wire.py, declared from WIRE.md -------------------


class VllmStylePublisher(threading.Thread):
    """A PUB for the live stream and a ROUTER replaying its ring, as WIRE.md describes."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.commands: queue.Queue[tuple[int, bytes, bool]] = queue.Queue()
        self.ring: list[tuple[int, bytes]] = []
        #: start_seq of every replay request, recorded once its reply is sent.
        self.requests: list[int] = []
        self.pub_port = 0
        self.replay_port = 0

    def publish(self, seq: int, events: list[KVCacheEvent], *, live: bool = True) -> None:
        payload = msgspec.msgpack.encode(
            vllm.KVEventBatch(1767225600.0 + seq, [vllm.to_vllm(e) for e in events], 0)
        )
        self.commands.put((seq, payload, live))

    def publish_raw(self, seq: int, payload: bytes, *, live: bool = True) -> None:
        """Publish a payload frame as it is (another dialect's bytes)."""
        self.commands.put((seq, payload, live))

    def run(self) -> None:
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        router = ctx.socket(zmq.ROUTER)
        try:
            self.pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
            self.replay_port = router.bind_to_random_port("tcp://127.0.0.1")
            self.ready.set()
            poller = zmq.Poller()
            poller.register(router, zmq.POLLIN)
            while not self.stopping.is_set():
                while True:
                    try:
                        seq, payload, live = self.commands.get_nowait()
                    except queue.Empty:
                        break
                    if not (self.ring and self.ring[-1][0] == seq):  # a resend is not kept twice
                        self.ring.append((seq, payload))
                    if live:
                        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
                if poller.poll(5):
                    frames = router.recv_multipart()
                    if len(frames) != 3:
                        continue
                    identity, _, start_frame = frames
                    start = int.from_bytes(start_frame, "big")
                    for seq, payload in self.ring:
                        if seq >= start:
                            router.send_multipart(
                                [identity, b"", b"", seq.to_bytes(8, "big"), payload]
                            )
                    router.send_multipart([identity, b"", b"", END, b""])
                    self.requests.append(start)
        finally:
            pub.close(linger=0)
            router.close(linger=0)
            ctx.term()


@pytest.fixture
def publisher() -> Iterator[VllmStylePublisher]:
    pub = VllmStylePublisher()
    pub.start()
    assert pub.ready.wait(10)
    try:
        yield pub
    finally:
        pub.stopping.set()
        pub.join(10)


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = tempfile.mkdtemp(dir="/tmp", prefix="kvr")
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def engine_steps(n: int) -> list[list[KVCacheEvent]]:
    engine = SimulatedEngine(seed=11, gpu_blocks=48, cpu_blocks=96, remote_blocks=128)
    steps: list[list[KVCacheEvent]] = []
    while len(steps) < n:
        events = engine.step_events()
        if events:
            steps.append(events)
    return steps


def start_relay(publisher: VllmStylePublisher, out: Path, *extra: str) -> subprocess.Popen[str]:
    source = (
        f"zmq+tcp://127.0.0.1:{publisher.pub_port}"
        f"?replay=tcp://127.0.0.1:{publisher.replay_port}&origin=vllm-0&from_seq=0"
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstream",
            "relay",
            "--source",
            source,
            "--sink",
            f"file:{out}",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def read_out(out: Path) -> list[EventBatch]:
    if not out.exists():
        return []
    data = out.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    return JsonCodec().decode_lines(complete)


def wait_for(condition: Any, proc: subprocess.Popen[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"relay exited early ({proc.returncode}): {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out; relay stderr: {proc.communicate()[1]}")
        time.sleep(0.02)


def stop(proc: subprocess.Popen[str], sig: signal.Signals = signal.SIGTERM) -> tuple[int, str]:
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"relay did not stop on {sig.name}: {err}")
    return proc.returncode, err


def test_relay_carries_a_vllm_stream_with_a_gap_repaired_by_replay(
    publisher: VllmStylePublisher, workdir: Path
) -> None:
    steps = engine_steps(60)
    dropped = 30
    for seq in range(10):  # before the relay runs: only the ring has them
        publisher.publish(seq, steps[seq], live=False)
    out = workdir / "out.jsonl"
    proc = start_relay(publisher, out, "--interval", "0.02")
    try:
        wait_for(lambda: publisher.requests, proc)  # the relay asked for 0.. and got it
        for seq in range(10, 60):
            # Batch 30 never goes out live: only a replay can bring it.
            publisher.publish(seq, steps[seq], live=seq != dropped)
            time.sleep(0.002)
        want = [e for step in steps for e in step]
        wait_for(lambda: sum(len(b) for b in read_out(out)) >= len(want), proc)
    finally:
        code, err = stop(proc)
    assert code == 0, err
    batches = read_out(out)
    assert [e for b in batches for e in b.events] == want  # nothing lost, in order
    assert {b.origin for b in batches} == {"vllm-0"}
    assert [b.seq for b in batches] == list(range(len(batches)))  # the relay's own numbering
    check_consistency(batches)
    # The first request was the start (from 0); a later one repaired the gap at 30.
    assert publisher.requests[0] == 0
    assert any(start <= dropped for start in publisher.requests[1:])
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("kvstream relay: 60 batches")
    assert "0 upstream gap(s)" in summary
    assert "stopped by SIGTERM" in err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])  # SIGHUP: a closed terminal
def test_a_stop_signal_flushes_what_the_relay_holds(
    publisher: VllmStylePublisher, workdir: Path, sig: signal.Signals
) -> None:
    steps = engine_steps(20)
    for seq, events in enumerate(steps):
        publisher.publish(seq, events, live=False)
    out = workdir / "out.jsonl"
    # A tick every minute: nothing reaches the file unless the signal flushes it.
    proc = start_relay(publisher, out, "--interval", "60")
    try:
        wait_for(lambda: publisher.requests, proc)
    finally:
        code, err = stop(proc, sig)
    assert code == 0, err
    assert f"stopped by {sig.name}" in err
    batches = read_out(out)
    assert [e for b in batches for e in b.events] == [e for step in steps for e in step]
    assert len(batches) == 1  # one tick: the flush
    assert "kvstream relay: 20 batches" in err.strip().splitlines()[-1]


def test_relay_keeps_the_origins_of_a_kvstream_upstream(workdir: Path) -> None:
    codec = JsonCodec()
    source = workdir / "in.jsonl"
    lines = []
    for seq in range(3):
        for origin in ("gpu-a", "gpu-b"):
            event = BlockRemoved(block_hashes=[seq], medium="GPU")
            lines.append(
                codec.encode(EventBatch(seq=seq, ts=1.0, events=[event], origin=origin, epoch="e1"))
            )
    # gpu-a restarts upstream: the relay forwards AllBlocksCleared for it.
    restarted = EventBatch(
        seq=0,
        ts=2.0,
        events=[BlockRemoved(block_hashes=[9], medium="GPU")],
        origin="gpu-a",
        epoch="e2",
    )
    source.write_bytes(b"".join(lines) + codec.encode(restarted))
    out = workdir / "out.jsonl"
    assert (
        main(["relay", "--source", f"file:{source}", "--sink", f"file:{out}", "--interval", "0.01"])
        == 0
    )
    batches = read_out(out)
    by_origin: dict[str, list[KVCacheEvent]] = {}
    for b in batches:
        by_origin.setdefault(b.origin, []).extend(b.events)
    assert by_origin["gpu-b"] == [BlockRemoved(block_hashes=[s], medium="GPU") for s in range(3)]
    assert by_origin["gpu-a"] == [
        *[BlockRemoved(block_hashes=[s], medium="GPU") for s in range(3)],
        AllBlocksCleared(),
        BlockRemoved(block_hashes=[9], medium="GPU"),
    ]


@pytest.mark.server
def test_a_source_not_up_yet_is_relayed_once_it_is(
    workdir: Path, redis_servers: Callable[..., RedisServer]
) -> None:
    """The other sources are relayed meanwhile; the late one is reached with backoff."""
    codec = JsonCodec()
    local = workdir / "in.jsonl"
    event = BlockRemoved(block_hashes=[1], medium="GPU")
    local.write_bytes(codec.encode(EventBatch(seq=0, ts=1.0, events=[event], origin="gpu-a")))
    port = free_port()
    out = workdir / "out.jsonl"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    relay = [sys.executable, "-m", "kvstream", "relay", "--interval", "0.02"]
    proc = subprocess.Popen(
        [
            *relay,
            *("--source", f"redis://127.0.0.1:{port}/kv?start=0"),
            *("--source", f"file:{local}?follow=1"),
            *("--sink", f"file:{out}"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    wait_for(lambda: {b.origin for b in read_out(out)} == {"gpu-a"}, proc)
    server = redis_servers(port=port, appendonly=False)

    async def publish() -> None:
        async with RedisSink(server.url, stream="kv") as sink:
            sink.offer(EventBatch(seq=0, ts=1.0, events=[event], origin="gpu-b", epoch="e"))

    anyio.run(publish)
    wait_for(lambda: {b.origin for b in read_out(out)} == {"gpu-a", "gpu-b"}, proc)
    code, err = stop(proc)
    assert code == 0, err
    assert f"cannot reach redis://127.0.0.1:{port}" in err
    assert "retrying with backoff" in err
    assert "Traceback" not in err
    # --no-retry: the old behaviour, a one-line error.
    server.stop()
    refused = subprocess.run(
        [*relay, "--no-retry", "--source", f"redis://127.0.0.1:{port}/kv", "--sink", "memory:"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert f"cannot reach redis://127.0.0.1:{port}" in refused.stderr


def test_relay_refuses_a_shared_topic_for_several_sources(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        [
            "relay",
            "--source",
            "zmq+tcp://127.0.0.1:1?origin=a",
            "--source",
            "zmq+tcp://127.0.0.1:2?origin=b",
            "--sink",
            "zmq+tcp://127.0.0.1:3?topic=fixed",
        ]
    )
    assert code == 2
    assert "topic per origin" in capsys.readouterr().err
    assert main(["relay", "--sink", "-"]) == 2
    assert main(["relay", "--source", "file:x", "--kv-events-config", '{"hwm": "x"}']) == 2


def test_publishers_connecting_to_one_bound_relay_endpoint_stay_apart(workdir: Path) -> None:
    """Issue 15.8: vLLM engines connect to a central endpoint; each keeps its own stream."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = workdir / "out.jsonl"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    source = f"zmq+tcp://127.0.0.1:{port}?bind=true&origin=central"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvstream", "relay", "--interval", "0.02"),
            *("--source", source, "--sink", f"file:{out}"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    ctx = zmq.Context()
    # Two engines on one topic (DP ranks 0 and 1) and one on another: three seq spaces.
    engines = [(b"kv@pod-a@m", 0), (b"kv@pod-a@m", 1), (b"kv@pod-b@m", 0)]
    pubs = [ctx.socket(zmq.PUB) for _ in engines]
    names = ["central/kv@pod-a@m#dp0", "central/kv@pod-a@m#dp1", "central/kv@pod-b@m#dp0"]

    def send(i: int, seq: int) -> None:
        topic, rank = engines[i]
        event = vllm.BlockRemoved([1000 * i + seq], "GPU")
        payload = msgspec.msgpack.encode(vllm.KVEventBatch(1.0 + seq, [event], rank))
        pubs[i].send_multipart([topic, seq.to_bytes(8, "big"), payload])

    try:
        for pub in pubs:
            pub.connect(f"tcp://127.0.0.1:{port}")

        def heard_all() -> bool:
            seen = {b.origin for b in read_out(out)}
            if len(seen) < 3:
                for i in range(3):  # the slow joiner: seq 0 again is a duplicate
                    send(i, 0)
            return len(seen) == 3

        wait_for(heard_all, proc)
        for seq in range(1, 21):
            for i in range(3):
                send(i, seq)
        wait_for(lambda: sum(len(b) for b in read_out(out)) >= 3 * 21, proc)
    finally:
        code, err = stop(proc)
        for pub in pubs:
            pub.close(linger=0)
        ctx.term()
    assert code == 0, err
    by_origin: dict[str, list[KVCacheEvent]] = {}
    for b in read_out(out):
        by_origin.setdefault(b.origin, []).extend(b.events)
    assert sorted(by_origin) == names
    for i, name in enumerate(names):
        assert by_origin[name] == [
            BlockRemoved(block_hashes=[1000 * i + s], medium="GPU") for s in range(21)
        ]
    summary = err.strip().splitlines()[-1]
    assert "0 upstream gap(s)" in summary
    assert "0 restart(s)" in summary


async def _relay_conflicting_files(workdir: Path) -> RelayStatistics:
    codec = JsonCodec()
    paths = []
    for name in ("one", "two"):
        path = workdir / f"{name}.jsonl"
        path.write_bytes(
            b"".join(
                codec.encode(
                    EventBatch(
                        seq=seq,
                        ts=0.0,
                        events=[BlockRemoved(block_hashes=[seq])],
                        origin="a",
                        epoch=name,
                    )
                )
                for seq in range(3)
            )
        )
        paths.append(path)
    sink = MemorySink()
    async with Scheduler(sinks=[sink]) as scheduler:
        relay = Relay(scheduler, [FileSubscriber(p) for p in paths], names=["one", "two"])
        await relay.run()
    return relay.statistics()


@pytest.mark.parametrize(("burst", "errors"), [(10.0, 1), (0.0, 3)])
async def test_an_origin_two_upstreams_claim_is_logged_once_per_burst(
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    burst: float,
    errors: int,
) -> None:
    """The conflict was logged once per process; now once per burst (a burst can end)."""
    monkeypatch.setattr(relay_module, "CONFLICT_BURST", burst)
    caplog.set_level(logging.DEBUG, logger="kvstream.relay")
    stats = await _relay_conflicting_files(workdir)
    assert stats.conflicts == 3  # every refused batch is counted
    logged = [
        r
        for r in caplog.records
        if r.levelno == logging.ERROR and "both carry origin" in r.getMessage()
    ]
    assert len(logged) == errors  # the rest of a burst goes to DEBUG
