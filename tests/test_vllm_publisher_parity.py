"""The drop-in EventPublisher passes vLLM's own publisher tests, over tcp, ipc and inproc.

vLLM's ``tests/distributed/test_events.py`` (Aug 2026) documents what its
``ZmqEventPublisher`` does; each case below is rewritten here from that
documented behaviour, against kvstream's drop-in, with a subscriber that does
what vLLM's test subscriber does: a SUB (and a DEALER for replay) in the
process's shared ZMQ context (``zmq.Context.instance()``), decoding each
payload as a vLLM consumer would (``tests/vllm_wire.py``). vLLM's cases publish
a toy event type; here the events are vLLM's ``BlockStored`` structs.

vLLM's tcp cases bind ``tcp://*:PORT``; here the publisher binds
``tcp://127.0.0.1:PORT`` (``bind=True``: the same socket on loopback only). ipc
and inproc endpoints are bound by the publisher by vLLM's rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import vllm_wire as vllm
import zmq
from servers import free_port

from kvstream._wire.vllm_zmq import offset_endpoint
from kvstream.publisher import EventPublisher

TRANSPORTS = ("tcp", "ipc", "inproc")


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def make_batch(count: int, start: int = 0) -> KVEventBatch:
    """``count`` events, ids from ``start`` (as vLLM's ``create_test_events``)."""
    events = [
        vllm.BlockStored(
            block_hashes=[start + i + 1],
            parent_block_hash=None,
            token_ids=[start + i, 7, 8, 9],
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=f"test-{start + i}",
        )
        for i in range(count)
    ]
    return KVEventBatch(ts=time.time(), events=events)


@dataclasses.dataclass
class Config:
    """vLLM's ``KVEventsConfig``, the fields its tests set."""

    enable_kv_cache_events: bool = True
    publisher: str | None = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


class Subscriber:
    """vLLM's test subscriber: SUB on the live stream(s), DEALER on the replay endpoint."""

    def __init__(
        self, endpoints: list[str], replay: str | None, topic: str, *, bind: bool = False
    ) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        # vLLM's subscriber keeps ZMQ's default receive bound (1000 messages), which a
        # loaded machine overruns in the high-volume case; this one buffers what
        # arrives, so drops (counted, unlike vLLM's) come from the publisher's bound.
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        for endpoint in endpoints:
            if bind:
                self.sub.bind(endpoint)
            else:
                self.sub.connect(endpoint)
        self.replay = None
        if replay is not None:
            self.replay = self.ctx.socket(zmq.DEALER)
            self.replay.connect(replay)
        self.topic = topic.encode()

    def receive_one(self, timeout: int = 1000) -> tuple[int, vllm.KVEventBatch] | None:
        if not self.sub.poll(timeout):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic
        return int.from_bytes(seq, "big"), vllm.decoder.decode(payload)

    def request_replay(self, start: int) -> None:
        assert self.replay is not None
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])

    def receive_replay(self) -> list[tuple[int, vllm.KVEventBatch]]:
        assert self.replay is not None
        out = []
        while self.replay.poll(2000):
            frames = self.replay.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) != 3 or not frames[-1]:
                break  # the end marker
            topic, seq, payload = frames
            assert topic == self.topic
            out.append((int.from_bytes(seq, "big"), vllm.decoder.decode(payload)))
        return out

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


@pytest.fixture
def short_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(dir="/tmp", prefix="kvp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def endpoints(transport: str, short_dir: str) -> tuple[str, str]:
    if transport == "tcp":
        # rank 1 binds each port + 1 (vLLM's offset): those must be free too, and apart
        pub = _port_with_free_offsets(0, 1)
        replay = _port_with_free_offsets(0, 1)
        while abs(replay - pub) < 2:
            replay = _port_with_free_offsets(0, 1)
        return f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    if transport == "ipc":
        return f"ipc://{short_dir}/pub", f"ipc://{short_dir}/replay"
    tag = f"{time.monotonic_ns()}"
    return f"inproc://test-{tag}", f"inproc://test-{tag}-replay"


def config_for(transport: str, short_dir: str, **changes: Any) -> Config:
    endpoint, replay = endpoints(transport, short_dir)
    fields: dict[str, Any] = {
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "buffer_steps": 100,
        "hwm": 1000,
        "topic": "test",
    }
    fields.update(changes)
    return Config(**fields)


def create(config: Config, rank: int = 0) -> EventPublisher:
    """What vLLM's factory does with a config: a publisher for one data-parallel rank."""
    bind = {"bind": True} if config.endpoint.startswith("tcp://") else {}
    return EventPublisher.from_kv_events_config(config, data_parallel_rank=rank, sink_options=bind)


def subscribe(config: Config, rank: int = 0, *, replay: bool = True) -> Subscriber:
    endpoint = offset_endpoint(config.endpoint, rank)
    replay_endpoint = config.replay_endpoint if replay else None
    if replay_endpoint is not None:
        replay_endpoint = offset_endpoint(replay_endpoint, rank)
    return Subscriber([endpoint], replay_endpoint, config.topic)


def wait_subscribed(publisher: EventPublisher, count: int = 1) -> None:
    """Instead of vLLM's sleeps: wait until the PUB side has seen the subscriptions."""
    sink: Any = publisher.scheduler.sinks[0]
    deadline = time.monotonic() + 10
    while sink.statistics().subscriptions < count:
        assert time.monotonic() < deadline, "the subscriber never subscribed"
        time.sleep(0.005)


@pytest.fixture(params=TRANSPORTS)
def setup(
    request: pytest.FixtureRequest, short_dir: str
) -> Iterator[tuple[EventPublisher, Subscriber, Config]]:
    config = config_for(request.param, short_dir)
    pub = create(config)  # bound first: a tcp connect to a free port can take it itself
    sub = subscribe(config)
    try:
        wait_subscribed(pub)
        yield pub, sub, config
    finally:
        pub.shutdown()
        sub.close()


def test_basic_publishing(setup: tuple[EventPublisher, Subscriber, Config]) -> None:
    pub, sub, _ = setup
    batch = make_batch(5)
    pub.publish(batch)
    got = sub.receive_one(timeout=5000)
    assert got is not None
    seq, received = got
    assert seq == 0
    assert received.ts == pytest.approx(batch.ts, abs=0.1)
    assert len(received.events) == 5
    for i, event in enumerate(received.events):
        assert isinstance(event, vllm.BlockStored)
        assert event.block_hashes == [i + 1]
        assert event.lora_name == f"test-{i}"
    assert received.data_parallel_rank == 0


def test_multiple_events(setup: tuple[EventPublisher, Subscriber, Config]) -> None:
    pub, sub, _ = setup
    for _ in range(10):
        pub.publish(make_batch(2))
    received = [sub.receive_one(timeout=5000) for _ in range(10)]
    assert [r[0] for r in received if r is not None] == list(range(10))


def test_replay_mechanism(setup: tuple[EventPublisher, Subscriber, Config]) -> None:
    pub, sub, _ = setup
    for i in range(19):
        pub.publish(make_batch(1, start=i))
    for _ in range(19):
        assert sub.receive_one(timeout=5000) is not None
    sub.request_replay(10)
    replayed = sub.receive_replay()
    assert [seq for seq, _ in replayed] == list(range(10, 19))
    assert replayed[0][1].events[0].block_hashes == [11]  # type: ignore[union-attr]


def test_replay_includes_topic(setup: tuple[EventPublisher, Subscriber, Config]) -> None:
    pub, sub, _ = setup
    for _ in range(5):
        pub.publish(make_batch(1))
    for _ in range(5):
        assert sub.receive_one(timeout=5000) is not None
    sub.request_replay(0)
    replayed = sub.receive_replay()  # asserts the topic frame of each reply
    assert [seq for seq, _ in replayed] == list(range(5))


def test_buffer_limit(setup: tuple[EventPublisher, Subscriber, Config]) -> None:
    pub, sub, config = setup
    for _ in range(config.buffer_steps + 10):
        pub.publish(make_batch(1))
    for _ in range(config.buffer_steps + 10):
        assert sub.receive_one(timeout=5000) is not None  # vLLM sleeps; this is sure
    sub.request_replay(0)
    replayed = sub.receive_replay()
    assert [seq for seq, _ in replayed] == list(range(10, config.buffer_steps + 10))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_topic_filtering(transport: str, short_dir: str) -> None:
    config = config_for(transport, short_dir, replay_endpoint=None, topic="foo")
    pub = create(config)
    foo = Subscriber([config.endpoint], None, "foo")
    bar = Subscriber([config.endpoint], None, "bar")
    try:
        wait_subscribed(pub, 2)
        for _ in range(3):
            pub.publish(make_batch(1))
        assert all(foo.receive_one(timeout=5000) is not None for _ in range(3))
        assert all(bar.receive_one(timeout=200) is None for _ in range(3))
    finally:
        pub.shutdown()
        foo.close()
        bar.close()


def test_high_volume(setup: tuple[EventPublisher, Subscriber, Config]) -> None:
    pub, sub, _ = setup
    batches, per_batch = 10_000, 100
    # vLLM's case publishes a toy two-field event; the lightest of vLLM's is a removal.
    made = [
        KVEventBatch(ts=time.time(), events=[vllm.BlockRemoved([i], "GPU")] * per_batch)
        for i in range(batches)
    ]

    def engine() -> None:
        for i, batch in enumerate(made):
            pub.publish(batch)
            if i % 100 == 0:
                time.sleep(0.01)  # as vLLM's test paces its publisher thread

    thread = threading.Thread(target=engine)
    thread.start()
    received: list[Any] = []
    deadline = time.monotonic() + 20
    quiet = 0
    while len(received) < batches and time.monotonic() < deadline and quiet < 10:
        got = sub.receive_one(timeout=100)
        if got is not None:
            received.append(got)
        elif not thread.is_alive():
            quiet += 1  # the engine is done and nothing came for a while: the rest dropped
    thread.join()
    assert len(received) >= batches * 0.9
    dropped = pub.scheduler.sinks[0].statistics().batches_dropped
    assert len(received) + dropped == batches  # nothing lost without being counted
    seqs = [seq for seq, _ in received]
    assert seqs == sorted(seqs)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_data_parallel_rank_tagging(transport: str, short_dir: str) -> None:
    config = config_for(transport, short_dir, topic="foo", replay_endpoint=None)
    pubs = [create(config, rank) for rank in (0, 1)]
    subs = [subscribe(config, rank, replay=False) for rank in (0, 1)]
    try:
        for pub in pubs:
            wait_subscribed(pub)
        pubs[0].publish(make_batch(2))
        pubs[1].publish(make_batch(3))
        got = [sub.receive_one(timeout=5000) for sub in subs]
        assert got[0] is not None
        assert got[1] is not None
        assert got[0][1].data_parallel_rank == 0
        assert got[1][1].data_parallel_rank == 1
        assert [len(g[1].events) for g in got if g is not None] == [2, 3]
    finally:
        for pub in pubs:
            pub.shutdown()
        for sub in subs:
            sub.close()


def _port_with_free_offsets(*offsets: int) -> int:
    """A port `p` such that every `p + offset` is free on 127.0.0.1 right now (a free
    port's neighbours may be taken: an ephemeral port of some connection, say)."""
    for _ in range(100):
        port = free_port()
        if port + max(offsets) > 65535:
            continue
        try:
            with contextlib.ExitStack() as held:
                for offset in offsets:
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port
    raise AssertionError(f"no port found with offsets {offsets} free")


def test_publisher_config_is_resolved_per_rank(short_dir: str) -> None:
    """vLLM's factory test: rank 1's resolved endpoints are offset, the config is left as is."""
    port = _port_with_free_offsets(1, 101)  # rank 1 binds port + 1 and port + 101
    config = Config(
        endpoint=f"ipc://{short_dir}/f{port}", replay_endpoint=f"ipc://{short_dir}/r{port}"
    )
    tcp = Config(
        endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{port + 100}"
    )
    for cfg, (want, want_replay) in (
        (config, (config.endpoint + "_dp1", config.replay_endpoint + "_dp1")),  # type: ignore[operator]
        (tcp, (f"tcp://127.0.0.1:{port + 1}", f"tcp://127.0.0.1:{port + 101}")),
    ):
        pub = create(cfg, 1)
        try:
            resolved = pub.get_publisher_config()
            assert (resolved.endpoint, resolved.replay_endpoint) == (want, want_replay)
            assert isinstance(resolved, Config)
        finally:
            pub.shutdown()
    assert config.endpoint == f"ipc://{short_dir}/f{port}"


def test_publish_after_shutdown_raises_as_vllms_does(short_dir: str) -> None:
    pub = create(config_for("inproc", short_dir))
    pub.shutdown()
    with pytest.raises(RuntimeError):
        pub.publish(make_batch(1))
