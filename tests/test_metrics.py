"""The Prometheus exporter: a collector over statistics(), served on a real socket."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from prometheus_client.parser import text_string_to_metric_families

from kvstream import BlockStored, ConfigError, EventBatch, MemorySink, Scheduler, TransportError
from kvstream.metrics import MetricsServer, StatisticsCollector, metric_for_field, parse_address
from kvstream.sinks.base import SinkStatistics


def stored(h: int) -> BlockStored:
    return BlockStored(
        block_hashes=[h], parent_block_hash=None, token_ids=[1, 2], block_size=2, medium="GPU"
    )


async def http_get(port: int, path: str = "/metrics", method: str = "GET") -> tuple[int, bytes]:
    """One HTTP request over a real TCP connection; returns (status, body)."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        with anyio.fail_after(10):
            while True:
                try:
                    data += await stream.receive()
                except anyio.EndOfStream:
                    break
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, body


def samples(text: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[s.name, frozenset(s.labels.items())] = s.value
    return out


def value(found: dict[Any, float], metric: str, /, **labels: str) -> float:
    return found[metric, frozenset(labels.items())]


async def test_scrape_a_running_pipeline_over_http() -> None:
    sink = MemorySink(name="mem")

    async def connector() -> Any:
        yield [stored(10), stored(11)]

    async with Scheduler(sinks=[sink], origin="engine-0") as scheduler:
        scheduler.add_source(connector(), name="offload")
        for i in range(3):
            scheduler.emit(stored(i + 1))
            await scheduler.tick()
        with anyio.fail_after(10):
            while sink.statistics().events_out < 5 or scheduler.statistics().pending_events:
                await anyio.sleep(0.01)
                await scheduler.tick()
        async with MetricsServer(StatisticsCollector(scheduler), "127.0.0.1:0") as server:
            status, body = await http_get(server.port)
            assert server.scrapes == 1
        stats = scheduler.statistics()
    assert status == 200
    found = samples(body)
    assert value(found, "kvstream_scheduler_events_accepted_total", origin="engine-0") == 5
    assert value(found, "kvstream_scheduler_ticks_total", origin="engine-0") == stats.ticks
    assert value(found, "kvstream_sink_batches_out_total", sink="mem") == stats.sinks[0].batches_out
    assert value(found, "kvstream_sink_events_out_total", sink="mem") == 5
    assert value(found, "kvstream_sink_batches_dropped_total", sink="mem") == 0
    assert value(found, "kvstream_sink_queued_bytes", sink="mem") == 0
    assert value(found, "kvstream_sink_healthy", sink="mem") == 1
    assert value(found, "kvstream_origin_next_seq", origin="engine-0") == stats.next_seq["engine-0"]
    assert (
        value(found, "kvstream_source_events_accepted_total", source="offload", origin="engine-0")
        == 2
    )
    assert value(found, "kvstream_source_failed", source="offload", origin="engine-0") == 0
    assert value(found, "kvstream_scheduler_info", origin="engine-0", epoch=scheduler.epoch) == 1
    assert any(name.startswith("process_") for name, _ in found)


async def test_names_follow_prometheus_conventions() -> None:
    sink = MemorySink(name="mem", policy="drop_newest", max_batches=1)
    async with Scheduler(sinks=[sink], origin="o") as scheduler:
        scheduler.emit(stored(1))
        await scheduler.tick()
        families = list(StatisticsCollector(scheduler).collect())
    assert families
    for family in families:
        assert re.match(r"^kvstream_[a-z0-9_]+$", family.name), family.name
        for s in family.samples:
            if family.type == "counter":
                assert s.name.endswith("_total") or s.name.endswith("_created"), s.name
            else:
                assert not s.name.endswith("_total"), s.name
            assert "bytes" not in s.name or s.name.endswith(("_bytes", "_bytes_total")), s.name


class ReplayStatistics(NamedTuple):
    """A sink's own statistics record: the base fields plus its transport's."""

    name: str
    policy: str
    batches_in: int
    batches_out: int
    bytes_out: int
    queued_bytes: int
    replay_hits: int
    replay_misses: int
    reconnects: int
    gaps: int
    subscribers: int
    connected: bool
    last_error: str | None


class ReplaySink(MemorySink):
    def statistics(self) -> Any:
        base = super().statistics()
        return ReplayStatistics(
            base.name, base.policy, base.batches_in, base.batches_out, base.bytes_out,
            base.queued_bytes, replay_hits=7, replay_misses=1, reconnects=2, gaps=3,
            subscribers=4, connected=True, last_error=None,
        )  # fmt: skip


async def test_fields_a_sink_adds_are_exported() -> None:
    sink = ReplaySink(name="replay")
    async with (
        sink,
        MetricsServer(StatisticsCollector(sink), "127.0.0.1:0", process_metrics=False) as server,
    ):
        _, body = await http_get(server.port)
    found = samples(body)
    assert value(found, "kvstream_sink_replay_hits_total", sink="replay") == 7
    assert value(found, "kvstream_sink_replay_misses_total", sink="replay") == 1
    assert value(found, "kvstream_sink_reconnects_total", sink="replay") == 2
    assert value(found, "kvstream_sink_gaps_total", sink="replay") == 3
    assert value(found, "kvstream_sink_subscribers", sink="replay") == 4
    assert value(found, "kvstream_sink_connected", sink="replay") == 1
    assert value(found, "kvstream_sink_sent_bytes_total", sink="replay") == 0
    assert not any("last_error" in name or "policy" in name for name, _ in found)


def test_metric_for_field() -> None:
    def kind_and_name(field: str, value: object = 0) -> tuple[str, str]:
        spec = metric_for_field(field, value)
        return spec.type, spec.name

    assert kind_and_name("replay_hits") == ("counter", "replay_hits")
    assert kind_and_name("bytes_in") == ("counter", "in_bytes")
    assert kind_and_name("reconnects") == ("counter", "reconnects")
    assert kind_and_name("gap_notices") == ("counter", "gap_notices")
    assert kind_and_name("blocks_stored") == ("counter", "blocks_stored")
    assert kind_and_name("requests_total") == ("counter", "requests")
    assert kind_and_name("queued_batches") == ("gauge", "queued_batches")
    assert kind_and_name("pending_events") == ("gauge", "pending_events")
    assert kind_and_name("ring_bytes") == ("gauge", "ring_bytes")
    assert kind_and_name("memory_bytes") == ("gauge", "memory_bytes")
    assert kind_and_name("subscribers") == ("gauge", "subscribers")
    assert kind_and_name("replays_active") == ("gauge", "replays_active")
    assert kind_and_name("block_size") == ("gauge", "block_size")
    assert kind_and_name("connected", True) == ("gauge", "connected")
    assert kind_and_name("ratio", 0.5) == ("gauge", "ratio")


class Snapshots(NamedTuple):
    requests: int
    batches_out: int  # also a sink field: the sink's own value wins


class Peer(NamedTuple):
    peer: str
    batches_sent: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServingStatistics(SinkStatistics):
    """A transport's record: every SinkStatistics field, then its own."""

    address: str
    subscribers: int
    slow_disconnects: int
    gap_notices: int
    ring_bytes: int
    snapshots: Snapshots
    peers: tuple[Peer, ...]  # one per peer: not exported


class ServingSink(MemorySink):
    """A sink whose statistics() extends the base record, like the socket sink's."""

    def statistics(self) -> ServingStatistics:
        base = super().statistics()
        return ServingStatistics(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
            address="tcp://127.0.0.1:1",
            subscribers=3,
            slow_disconnects=2,
            gap_notices=5,
            ring_bytes=4096,
            snapshots=Snapshots(requests=7, batches_out=999),
            peers=(Peer("a", 1), Peer("b", 2)),
        )


async def test_a_sinks_transport_record_is_exported() -> None:
    sink = ServingSink(name="serve")
    async with Scheduler(sinks=[sink], origin="o") as scheduler:
        scheduler.emit(stored(1))
        await scheduler.tick()
        with anyio.fail_after(10):
            while True:
                if sink.statistics().batches_out == 1:
                    break
                await anyio.sleep(0.01)
        families = {f.name: f for f in StatisticsCollector(scheduler).collect()}
    samples_of = {name: [s.value for s in f.samples] for name, f in families.items()}
    assert families["kvstream_sink_slow_disconnects"].type == "counter"
    assert samples_of["kvstream_sink_slow_disconnects"] == [2]
    assert families["kvstream_sink_gap_notices"].type == "counter"
    assert families["kvstream_sink_subscribers"].type == "gauge"
    assert samples_of["kvstream_sink_subscribers"] == [3]
    assert families["kvstream_sink_ring_bytes"].type == "gauge"
    assert samples_of["kvstream_sink_batches_out"] == [1]
    assert samples_of["kvstream_sink_requests"] == [7]
    assert not any("peer" in name or "batches_sent" in name for name in families)


class Reader:
    """Something with statistics() that is neither a scheduler nor a sink."""

    name = "tcp://127.0.0.1:1"

    def __init__(self) -> None:
        self.calls = 0

    def statistics(self) -> dict[str, Any]:
        self.calls += 1
        return {"batches_in": 12, "gaps": 1, "missing": 4, "duplicates": 0, "origins": 2}


async def test_other_objects_need_a_kind_and_are_read_only_at_scrape_time() -> None:
    reader = Reader()
    collector = StatisticsCollector()
    with pytest.raises(ConfigError, match="kind"):
        collector.add(reader)
    with pytest.raises(ConfigError, match="statistics"):
        collector.add(object(), kind="thing")
    collector.add(reader, kind="subscriber")
    assert reader.calls == 0
    async with MetricsServer(collector, "127.0.0.1:0", process_metrics=False) as server:
        _, body = await http_get(server.port)
        assert reader.calls == 1
        _, body = await http_get(server.port)
        assert reader.calls == 2
    found = samples(body)
    labels = {"name": reader.name}
    assert value(found, "kvstream_subscriber_batches_in_total", **labels) == 12
    assert value(found, "kvstream_subscriber_gaps_total", **labels) == 1
    assert value(found, "kvstream_subscriber_missing_total", **labels) == 4
    assert value(found, "kvstream_subscriber_origins", **labels) == 2


async def test_a_failing_target_does_not_break_the_scrape() -> None:
    class Broken:
        def statistics(self) -> Any:
            raise RuntimeError("boom")

    sink = MemorySink(name="ok")
    collector = StatisticsCollector(sink)
    collector.add(Broken(), kind="broken")
    names = {f.name for f in collector.collect()}
    assert "kvstream_sink_batches_out" in names
    collector.remove(sink)
    assert list(collector.collect()) == []


async def test_duplicate_sink_names_stay_distinct() -> None:
    a, b = MemorySink(name="same"), MemorySink(name="same")
    found = {
        s.labels["sink"]
        for f in StatisticsCollector(a, b).collect()
        if f.name == "kvstream_sink_batches_out"
        for s in f.samples
    }
    assert found == {"same", "same#2"}


async def test_http_errors_and_head() -> None:
    async with MetricsServer(StatisticsCollector(), "127.0.0.1:0") as server:
        assert (await http_get(server.port, "/nope"))[0] == 404
        assert (await http_get(server.port, "/metrics", "POST"))[0] == 405
        status, body = await http_get(server.port, "/metrics", "HEAD")
        assert (status, body) == (200, b"")
        assert server.scrapes == 1
    assert len(asyncio.all_tasks()) == 1  # nothing left behind


async def test_a_taken_port_is_a_transport_error() -> None:
    async with MetricsServer(StatisticsCollector(), "127.0.0.1:0") as first:
        with pytest.raises(TransportError, match="cannot listen"):
            async with MetricsServer(StatisticsCollector(), f"127.0.0.1:{first.port}"):
                pass


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_address(":9464") == ("127.0.0.1", 9464)
    assert parse_address("9464") == ("127.0.0.1", 9464)
    assert parse_address("[::1]:0") == ("::1", 0)
    assert parse_address("0.0.0.0:80") == ("0.0.0.0", 80)
    for bad in ("host:port", "1.2.3.4:70000", ""):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_address(bad)


async def test_demo_serves_metrics_while_it_runs(tmp_path: Path) -> None:
    out = tmp_path / "demo.jsonl"
    command = [sys.executable, "-m", "kvstream", "demo", "--steps", "0", "--rate", "200",
               "--sink", f"file:{out}", "--metrics", "127.0.0.1:0"]  # fmt: skip
    async with await anyio.open_process(command, stdout=None) as proc:
        assert proc.stderr is not None
        stderr = BufferedByteReceiveStream(proc.stderr)
        try:
            with anyio.fail_after(30):
                line = (await stderr.receive_until(b"\n", 4096)).decode()
            m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
            assert m, line
            port = int(m.group(1))
            key = ("kvstream_sink_batches_out_total", frozenset({("sink", f"file:{out}")}))
            with anyio.fail_after(30):
                while True:
                    status, body = await http_get(port)
                    assert status == 200
                    if samples(body).get(key, 0) >= 5:
                        break
                    await anyio.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            rest = b""
            with anyio.fail_after(60):
                while True:
                    try:
                        rest += await stderr.receive()
                    except anyio.EndOfStream:
                        break
                code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
    assert code == 0, rest
    assert b"stopped by SIGINT" in rest
    assert b"batches" in rest  # the summary


def test_statistics_record_shape_is_known() -> None:
    # Every SinkStatistics field is mapped explicitly (a new field needs a decision).
    from kvstream.metrics import SINK_FIELDS

    assert {f.name for f in dataclasses.fields(SinkStatistics)} - {"name", "policy"} == set(
        SINK_FIELDS
    )
    batch = EventBatch(seq=0, ts=1.0, events=[stored(1)], origin="o", epoch="e")
    assert batch.seq == 0


async def _scrape_subprocess_until(
    command: list[str], metric: str, target: float
) -> dict[Any, float]:
    """Run a CLI command with --metrics, scrape until ``metric`` reaches ``target``."""
    async with await anyio.open_process(command, stdout=subprocess.DEVNULL) as proc:
        pipe = proc.stderr
        assert pipe is not None
        reader = BufferedByteReceiveStream(pipe)
        try:
            port = None
            with anyio.fail_after(30):
                while port is None:
                    line = (await reader.receive_until(b"\n", 65536)).decode()
                    m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
                    port = int(m.group(1)) if m else None
            with anyio.fail_after(30):
                while True:
                    status, body = await http_get(port)
                    assert status == 200
                    found = samples(body)
                    if any(k[0] == metric and v >= target for k, v in found.items()):
                        return found
                    await anyio.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGTERM)
            with anyio.move_on_after(20):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()


async def test_tail_and_index_serve_metrics(tmp_path: Path) -> None:
    out = tmp_path / "demo.jsonl"
    demo = [sys.executable, "-m", "kvstream", "demo", "--steps", "30", "--rate", "0",
            "--sink", f"file:{out}"]  # fmt: skip
    proc = await anyio.run_process(demo)
    assert proc.returncode == 0
    found = await _scrape_subprocess_until(
        [
            sys.executable,
            "-m",
            "kvstream",
            "tail",
            f"file:{out}",
            "--format",
            "json",
            "--metrics",
            "127.0.0.1:0",
        ],
        "kvstream_tail_batches_total",
        30,
    )
    assert value(found, "kvstream_tail_gaps_total", url=f"file:{out}") == 0
    found = await _scrape_subprocess_until(
        [
            sys.executable,
            "-m",
            "kvstream",
            "index",
            f"file:{out}",
            "--port",
            "0",
            "--metrics",
            "127.0.0.1:0",
        ],
        "kvstream_index_batches_total",
        30,
    )
    assert any(k[0] == "kvstream_index_distinct_blocks" and v > 0 for k, v in found.items())
