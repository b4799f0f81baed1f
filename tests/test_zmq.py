"""vLLM's ZMQ wire: the sink against consumers written from WIRE.md, and the ZMQ ingest.

The consumers here are plain pyzmq plus msgspec structs declared (in tests/vllm_wire.py)
from ../shared/WIRE.md, not kvstream's own decoder, so a test passes only if
kvstream's bytes are what a vLLM consumer expects.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import anyio
import msgspec
import pytest
import vllm_wire as vllm
import zmq
import zmq.asyncio
from waiting import wait_until

import kvstream
from kvstream._cli import zmq_sink_from_kv_events_config
from kvstream._wire import vllm_zmq as wire
from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.config import open_sink, open_subscriber
from kvstream.consumers.base import Gap
from kvstream.consumers.zmq import PublisherStream, ZmqPublisher, ZmqSubscriber
from kvstream.errors import ConfigError, DecodeError
from kvstream.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvstream.publisher import EventPublisher
from kvstream.scheduler import Scheduler
from kvstream.sinks.zmq import ZmqSink

END = b"\xff" * 8


# -- vLLM's structs, declared in tests/vllm_wire.py from WIRE.md (independent of kvstream) -----

_vllm_decoder = vllm.decoder
as_vllm = vllm.to_vllm


def stored(i: int, blocks: int = 1, *, medium: str = "GPU", size: int = 4) -> BlockStored:
    return BlockStored(
        block_hashes=[(i * 1000 + b) * 7919 % 2**64 for b in range(blocks)],
        parent_block_hash=None if i % 3 == 0 else i,
        token_ids=list(range(blocks * size)),
        block_size=size,
        medium=medium,
    )


@pytest.fixture
def short_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(dir="/tmp", prefix="kvz")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Sockets:
    """A context whose sockets are all closed at the end of the test."""

    def __init__(self) -> None:
        self.context = zmq.asyncio.Context()
        self.sockets: list[zmq.asyncio.Socket] = []

    def socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.context.socket(kind)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.context.term()


@pytest.fixture
def ctx() -> Iterator[Sockets]:
    sockets = Sockets()
    try:
        yield sockets
    finally:
        sockets.close()


def bound_sink(ipc_dir: str | None = None, **kw: Any) -> ZmqSink:
    """A sink bound on free tcp ports, or on ipc paths (small socket buffers fill fast)."""
    if ipc_dir is None:
        kw.setdefault("replay_endpoint", "tcp://127.0.0.1:0")
        return ZmqSink("tcp://127.0.0.1:0", bind=True, **kw)
    kw.setdefault("replay_endpoint", f"ipc://{ipc_dir}/replay.sock")
    return ZmqSink(f"ipc://{ipc_dir}/live.sock", **kw)


async def recv(sock: zmq.asyncio.Socket, timeout: float = 10.0) -> list[bytes]:
    with anyio.fail_after(timeout):
        return await sock.recv_multipart()


async def subscribe(
    ctx: Sockets, sink: ZmqSink, topic: bytes = b"", rcvhwm: int | None = None
) -> zmq.asyncio.Socket:
    sub = ctx.socket(zmq.SUB)
    if rcvhwm is not None:
        sub.setsockopt(zmq.RCVHWM, rcvhwm)
        sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    before = sink.statistics().subscriptions
    sub.connect(sink.endpoint)
    with anyio.fail_after(10):
        await sink.wait_subscribed(before + 1)
    return sub


async def replay(
    ctx: Sockets, endpoint: str, start: int, rcvhwm: int | None = None
) -> zmq.asyncio.Socket:
    dealer = ctx.socket(zmq.DEALER)
    if rcvhwm is not None:
        dealer.setsockopt(zmq.RCVHWM, rcvhwm)
        dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.connect(endpoint)
    await dealer.send_multipart([b"", start.to_bytes(8, "big")])
    return dealer


async def read_replay(dealer: zmq.asyncio.Socket) -> list[tuple[bytes, int, bytes]]:
    """Every replayed message until the end marker, checking the topic layout."""
    out: list[tuple[bytes, int, bytes]] = []
    while True:
        frames = await recv(dealer)
        assert len(frames) == 4, frames
        assert frames[0] == b""
        if frames[2] == END:
            assert frames[1] == b""
            assert frames[3] == b""
            return out
        out.append((frames[1], int.from_bytes(frames[2], "big"), frames[3]))


# -- the wire rules ---------------------------------------------------------------------------


def test_seq_frames() -> None:
    assert wire.pack_seq(258) == b"\x00" * 6 + b"\x01\x02"
    assert wire.unpack_seq(wire.pack_seq(2**64 - 2)) == 2**64 - 2
    with pytest.raises(DecodeError, match="expected 8 bytes"):
        wire.unpack_seq(b"\x01\x02")
    with pytest.raises(ValueError, match="seq"):
        wire.pack_seq(-1)


def test_live_and_replay_frames() -> None:
    assert wire.parse_live([b"t", wire.pack_seq(5), b"p"]) == (b"t", 5, b"p")
    for bad, why in [
        ([b"t", wire.pack_seq(5)], "3 frames"),
        ([b"t", b"\x05", b"p"], "8 bytes"),
        ([b"t", END, b"p"], "end marker"),
    ]:
        with pytest.raises(DecodeError, match=why):
            wire.parse_live(bad)
    assert wire.parse_replay_request([b"id", b"", wire.pack_seq(9)]) == (b"id", 9)
    for bad in ([b"id", wire.pack_seq(9)], [b"id", b"x", wire.pack_seq(9)], [b"id", b"", b"9"]):
        with pytest.raises(DecodeError, match="replay request"):
            wire.parse_replay_request(bad)
    # Both reply layouts and both end markers, as the DEALER sees them.
    with_topic = wire.replay_reply(b"id", b"t", wire.pack_seq(3), b"p", "topic")[1:]
    legacy = wire.replay_reply(b"id", b"t", wire.pack_seq(3), b"p", "legacy")[1:]
    assert wire.parse_replay_reply(with_topic) == (b"t", 3, b"p")
    assert wire.parse_replay_reply(legacy) == (None, 3, b"p")
    assert wire.replay_end(b"id", "topic") == [b"id", b"", b"", END, b""]
    assert wire.replay_end(b"id", "legacy") == [b"id", b"", END, b""]
    assert wire.parse_replay_reply(wire.replay_end(b"id", "topic")[1:]) is None
    assert wire.parse_replay_reply(wire.replay_end(b"id", "legacy")[1:]) is None
    with pytest.raises(DecodeError, match="delimiter"):
        wire.parse_replay_reply([b"x", wire.pack_seq(3), b"p"])
    with pytest.raises(DecodeError, match="got 2 frames"):
        wire.parse_replay_reply([b"", b"p"])


def test_topics_and_endpoints() -> None:
    assert wire.llm_d_topic("pod-1", "llama-3") == "kv@pod-1@llama-3"
    assert wire.parse_llm_d_topic("kv@pod-1@llama-3") == ("pod-1", "llama-3")
    with pytest.raises(ConfigError, match="'@'"):
        wire.llm_d_topic("pod@1", "m")
    with pytest.raises(ConfigError, match="model"):
        wire.llm_d_topic("pod", "")
    with pytest.raises(DecodeError):
        wire.parse_llm_d_topic("kv@a@b@c")
    assert wire.should_bind("tcp://*:5557")
    assert wire.should_bind("tcp://[::]:5557")
    assert wire.should_bind("ipc:///run/kv.sock")
    assert wire.should_bind("inproc://kv")
    assert not wire.should_bind("tcp://10.0.0.5:5557")
    assert wire.offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert wire.offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert wire.offset_endpoint("tcp://*:5557", None) == "tcp://*:5557"
    assert wire.normalize_endpoint("zmq+tcp://h:1") == "tcp://h:1"
    with pytest.raises(ConfigError, match="endpoint"):
        wire.normalize_endpoint("http://h:1")
    with pytest.raises(ConfigError, match="port"):
        wire.normalize_endpoint("tcp://h")


def test_kv_events_config() -> None:
    config = wire.parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
        ' "replay_endpoint": "tcp://*:5558", "buffer_steps": 50, "hwm": 7,'
        ' "max_queue_size": 9, "topic": "kv@p@m"}'
    )
    assert config.enabled
    assert config.sink_settings(data_parallel_rank=1) == {
        "endpoint": "tcp://*:5558",
        "replay_endpoint": "tcp://*:5559",
        "topic": "kv@p@m",
        "hwm": 7,
        "buffer_steps": 50,
        "max_batches": 9,
    }
    assert not wire.parse_kv_events_config({"publisher": "null"}).enabled
    assert not wire.parse_kv_events_config({"enable_kv_cache_events": False}).enabled
    for text, why in [
        ("{", "expected JSON"),
        ("[]", "JSON object"),
        ('{"endpoit": "tcp://*:1"}', "unknown key 'endpoit'"),
        ('{"hwm": "10"}', "hwm: expected int"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"endpoint": "localhost:5557"}', "endpoint"),
    ]:
        with pytest.raises(ConfigError, match=why):
            wire.parse_kv_events_config(text)


def test_sink_and_subscriber_urls() -> None:
    sink = open_sink(
        "zmq+tcp://10.0.0.5:5557?replay=tcp://*:5558&topic=kv@{origin}@m&hwm=10"
        "&buffer_steps=5&replay_max_bytes=1MiB&profile=positional&policy=drop_newest"
    )
    assert isinstance(sink, ZmqSink)
    assert (sink.endpoint, sink.replay_endpoint, sink.bind) == (
        "tcp://10.0.0.5:5557",
        "tcp://*:5558",
        False,
    )
    assert (sink.hwm, sink.buffer_steps, sink.replay_max_bytes) == (10, 5, 1024 * 1024)
    assert sink.codec == MsgpackCodec(profile="positional")
    assert sink.per_origin_topics
    assert sink.policy == "drop_newest"
    assert open_sink("zmq+tcp://*:5557").bind  # type: ignore[attr-defined]
    assert open_sink("zmq+ipc:///tmp/kv.sock").endpoint == "ipc:///tmp/kv.sock"  # type: ignore[attr-defined]
    strict = open_sink("zmq+tcp://*:1?strict=refuse&model=llama")
    assert strict.codec == MsgpackCodec(strict="refuse")
    with pytest.raises(ConfigError, match="unknown option"):
        open_sink("zmq+tcp://*:1?replay_endpoint=tcp://*:2")
    with pytest.raises(ConfigError, match="port"):
        open_sink("zmq+tcp://somewhere")
    with pytest.raises(ConfigError, match="topic or model"):
        open_sink("zmq+tcp://*:1?topic=x&model=m")
    sub = open_subscriber(
        "zmq+tcp://127.0.0.1:5557?replay=tcp://127.0.0.1:5558&origin=a&from_seq=3"
    )
    assert isinstance(sub, ZmqSubscriber)
    (spec,) = sub.publishers
    assert (spec.endpoint, spec.replay_endpoint, spec.origin_name, spec.from_seq) == (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        "a",
        3,
    )
    assert not spec.binds
    by_origin = kvstream.subscribe("zmq+tcp://127.0.0.1:5557?origin=a", from_seq={"a": 7, "b": 1})
    assert by_origin.publishers[0].from_seq == 7  # type: ignore[attr-defined]
    assert open_subscriber("zmq+tcp://*:5557").publishers[0].binds  # type: ignore[attr-defined]
    assert open_subscriber("zmq+tcp://h:5557").publishers[0].origin_name == "h:5557"  # type: ignore[attr-defined]


def test_a_per_origin_from_seq_covers_the_publisher_through_the_star() -> None:
    """`"*"` stands for every origin not named, the ZMQ publisher's too (it was ignored)."""
    others = kvstream.subscribe("zmq+tcp://127.0.0.1:5557?origin=a", from_seq={"*": 4, "b": 1})
    assert others.publishers[0].from_seq == 4  # type: ignore[attr-defined]
    unnamed = kvstream.subscribe("zmq+tcp://h:5557", from_seq={"h:5557": 2, "*": 9})
    assert unnamed.publishers[0].from_seq == 2  # type: ignore[attr-defined]
    missing = kvstream.subscribe("zmq+tcp://127.0.0.1:5557?origin=a", from_seq={"b": 1})
    assert missing.publishers[0].from_seq is None  # type: ignore[attr-defined]
    with pytest.raises(
        ConfigError, match=r"zmq\+tcp://127.0.0.1:5557: from_seq: .*got entry 'a': -1"
    ):
        kvstream.subscribe("zmq+tcp://127.0.0.1:5557", from_seq={"a": -1})


def test_sink_from_kv_events_config() -> None:
    sink = ZmqSink.from_kv_events_config(
        '{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "buffer_steps": 5}',
        data_parallel_rank=2,
    )
    assert (sink.endpoint, sink.replay_endpoint, sink.buffer_steps) == (
        "tcp://*:5559",
        "tcp://*:5560",
        5,
    )
    assert sink.policy == "drop_newest"
    with pytest.raises(ConfigError, match="publishing is off"):
        ZmqSink.from_kv_events_config('{"publisher": "null"}')
    # The CLI helper other commands use.
    assert zmq_sink_from_kv_events_config(None) is None
    assert zmq_sink_from_kv_events_config('{"publisher": "null"}') is None
    built = zmq_sink_from_kv_events_config('{"endpoint": "tcp://*:6000", "hwm": 5}')
    assert isinstance(built, ZmqSink)
    assert (built.endpoint, built.hwm, built.replay_endpoint) == ("tcp://*:6000", 5, None)
    with pytest.raises(ConfigError, match="hwm"):
        zmq_sink_from_kv_events_config('{"hwm": -1}')


# -- the sink, read by an independent consumer ---------------------------------------------------


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_independent_subscriber_reads_the_sink(ctx: Sockets) -> None:
    sink = bound_sink(topic="kv@pod-0@llama")
    batches = [
        [stored(i, blocks=2), BlockRemoved(block_hashes=[i], medium="CPU")] for i in range(8)
    ]
    batches[3].append(AllBlocksCleared(metadata={"never": "on the wire"}))
    sent: list[EventBatch] = []
    async with Scheduler(sinks=[sink], origin="pod-0", data_parallel_rank=3) as scheduler:
        sub = await subscribe(ctx, sink, b"kv@pod-0@")
        for events in batches:
            scheduler.emit(events)
            batch = await scheduler.tick()
            assert batch is not None
            sent.append(batch)
        for want in sent:
            frames = await recv(sub)
            assert len(frames) == 3
            topic, seq, payload = frames
            assert topic == b"kv@pod-0@llama"
            assert len(seq) == 8
            assert int.from_bytes(seq, "big") == want.seq
            got = _vllm_decoder.decode(payload)
            assert payload[0] == 0x93  # always [ts, events, rank]
            assert got.ts == want.ts
            assert got.data_parallel_rank == 3
            assert got.events == [as_vllm(e) for e in want.events]
        # The replay endpoint serves the same bytes, with the topic frame.
        dealer = await replay(ctx, sink.replay_endpoint or "", 0)
        replayed = await read_replay(dealer)
        assert [s for _, s, _ in replayed] == [b.seq for b in sent]
        assert {t for t, _, _ in replayed} == {b"kv@pod-0@llama"}
        assert [_vllm_decoder.decode(p).events for _, _, p in replayed] == [
            [as_vllm(e) for e in b.events] for b in sent
        ]
    assert [b.seq for b in sent] == list(range(8))
    assert sink.statistics().batches_dropped == 0


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_sink_connects_to_a_central_consumer_over_ipc(ctx: Sockets, short_dir: str) -> None:
    """vLLM's rule: a tcp host connects; here the consumer binds ipc and the sink connects."""
    path = f"ipc://{short_dir}/central.sock"
    central = ctx.socket(zmq.SUB)
    central.setsockopt(zmq.SUBSCRIBE, b"")
    central.bind(path)
    sink = ZmqSink(path, bind=False, codec=MsgpackCodec(profile="positional"))
    async with Scheduler(sinks=[sink], origin="e") as scheduler:
        # A connecting publisher meets the slow-joiner: publish until the first lands.
        with anyio.fail_after(10):
            while True:
                scheduler.emit(stored(1))
                await scheduler.tick()
                try:
                    topic, seq, payload = await central.recv_multipart(flags=zmq.NOBLOCK)
                    break
                except zmq.Again:
                    await anyio.sleep(0.02)
        scheduler.emit(stored(2))
        await scheduler.tick()
        _, next_seq, _ = await recv(central)
    assert int.from_bytes(next_seq, "big") == int.from_bytes(seq, "big") + 1
    assert topic == b""
    assert len(seq) == 8
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][0] == "BlockStored"
    assert len(raw[1][0]) == 12  # positional: tag + 11 fields


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_replay_from_the_middle_and_from_before_the_ring(ctx: Sockets) -> None:
    sink = bound_sink(buffer_steps=10)
    async with Scheduler(sinks=[sink], origin="e") as scheduler:
        for i in range(25):
            scheduler.emit(stored(i))
            await scheduler.tick()
        with anyio.fail_after(10):
            await wait_until(lambda: not (sink.statistics().batches_out < 25))
        middle = await read_replay(await replay(ctx, sink.replay_endpoint or "", 20))
        assert [s for _, s, _ in middle] == [20, 21, 22, 23, 24]
        # Older than the ring: it silently starts later; the client checks the first seq.
        early = await read_replay(await replay(ctx, sink.replay_endpoint or "", 3))
        assert [s for _, s, _ in early] == list(range(15, 25))
        beyond = await read_replay(await replay(ctx, sink.replay_endpoint or "", 99))
        assert beyond == []
        st = sink.statistics()
        assert (st.ring_batches, st.replays_completed, st.replay_requests) == (10, 3, 3)


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_ring_is_bounded_in_bytes(ctx: Sockets) -> None:
    sink = bound_sink(replay_max_bytes=4096)
    async with Scheduler(sinks=[sink], origin="e") as scheduler:
        for i in range(40):
            scheduler.emit(stored(i, blocks=8))
            await scheduler.tick()
        with anyio.fail_after(10):
            await wait_until(lambda: not (sink.statistics().batches_out < 40))
        st = sink.statistics()
        assert 0 < st.ring_batches < 40
        assert st.ring_bytes <= 4096
        kept = await read_replay(await replay(ctx, sink.replay_endpoint or "", 0))
        assert [s for _, s, _ in kept] == list(range(40 - st.ring_batches, 40))


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_long_replay_to_a_slow_reader_loses_nothing_and_live_goes_on(
    ctx: Sockets, short_dir: str
) -> None:
    n = 400
    # Room for the live batches too: a ring that had to evict seq 0-4 for them
    # while the reply is still before them would skip those (the ring moved on).
    sink = bound_sink(short_dir, buffer_steps=n + 5, replay_hwm=4)
    async with Scheduler(sinks=[sink], origin="e") as scheduler:
        for i in range(n):
            scheduler.emit(stored(i, blocks=64))
            await scheduler.tick()
        await wait_until(lambda: sink.statistics().batches_out == n)
        live = await subscribe(ctx, sink)
        dealer = await replay(ctx, sink.replay_endpoint or "", 0, rcvhwm=4)
        got: list[int] = []

        async def slow_reader() -> None:
            while True:
                frames = await recv(dealer)
                if frames[2] == END:
                    return
                got.append(int.from_bytes(frames[2], "big"))
                await anyio.sleep(0.002)

        async with anyio.create_task_group() as tg:
            tg.start_soon(slow_reader)
            with anyio.fail_after(10):
                await wait_until(lambda: sink.statistics().replay_waits > 0)
            # While the reply is paced, live publishing is not held up.
            for i in range(n, n + 5):
                scheduler.emit(stored(i))
                await scheduler.tick()
            live_seqs = [int.from_bytes((await recv(live))[1], "big") for _ in range(5)]
            assert live_seqs == list(range(n, n + 5))
            assert sink.statistics().replays_active == 1  # the reply is still running
        assert got == list(range(n + 5))[: len(got)]
        assert len(got) >= n
    st = sink.statistics()
    assert st.replays_completed == 1
    assert st.replays_abandoned == 0
    assert st.replay_waits > 0


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_replay_to_a_client_that_went_away_is_abandoned(ctx: Sockets, short_dir: str) -> None:
    sink = bound_sink(short_dir, replay_hwm=2)
    async with Scheduler(sinks=[sink], origin="e") as scheduler:
        for i in range(400):
            scheduler.emit(stored(i, blocks=64))
            await scheduler.tick()
        dealer = await replay(ctx, sink.replay_endpoint or "", 0, rcvhwm=2)
        with anyio.fail_after(10):
            await wait_until(lambda: sink.statistics().replay_waits > 0)
        dealer.close(linger=0)
        with anyio.fail_after(10):
            await wait_until(lambda: sink.statistics().replays_abandoned > 0)
        # The server goes on serving others.
        assert len(await read_replay(await replay(ctx, sink.replay_endpoint or "", 395))) == 5


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_malformed_replay_requests_are_ignored_and_counted(ctx: Sockets) -> None:
    sink = bound_sink()
    async with Scheduler(sinks=[sink], origin="e") as scheduler:
        scheduler.emit(stored(0))
        await scheduler.tick()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(sink.replay_endpoint or "")
        await dealer.send_multipart([b"", b"\x00\x01"])  # short seq
        await dealer.send_multipart([b"", bytes(8), b"extra"])  # too many frames
        await dealer.send_multipart([bytes(8)])  # no delimiter
        await dealer.send_multipart([b"", bytes(8)])  # good
        assert [s for _, s, _ in await read_replay(dealer)] == [0]
        st = sink.statistics()
        assert (st.replay_malformed, st.replay_requests, st.replays_completed) == (3, 1, 1)


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_full_pipe_is_counted_as_drops_and_kept_for_replay(
    ctx: Sockets, short_dir: str
) -> None:
    n = 300
    sink = bound_sink(short_dir, hwm=2, policy="drop_newest", buffer_steps=n, linger=0)
    async with Scheduler(sinks=[sink], origin="e") as scheduler:
        stuck = await subscribe(ctx, sink, rcvhwm=2)  # never reads until the end
        for i in range(n):
            scheduler.emit(stored(i, blocks=64, size=16))
            await scheduler.tick()
        with anyio.fail_after(20):
            await wait_until(
                lambda: not (sink.statistics().batches_in - sink.statistics().queued_batches < n)
            )
            await wait_until(lambda: not (sink.statistics().queued_batches))
        st = sink.statistics()
        zst = sink.statistics()
        assert zst.pipe_full > 0
        assert st.batches_dropped >= zst.pipe_full
        assert zst.ring_batches == n  # dropped live, still replayable
        # Every batch was either sent or counted: the reader gets exactly the rest.
        received: list[int] = []
        with anyio.fail_after(15):
            while len(received) < n - st.batches_dropped:
                received.append(int.from_bytes((await stuck.recv_multipart())[1], "big"))
        assert received == sorted(received)
        with pytest.raises(zmq.Again):
            await stuck.recv_multipart(flags=zmq.NOBLOCK)


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_block_policy_waits_for_room_and_drops_nothing(ctx: Sockets, short_dir: str) -> None:
    n = 300
    sink = bound_sink(short_dir, hwm=2, policy="block", max_batches=8)
    async with Scheduler(sinks=[sink], origin="e") as scheduler:
        slow = await subscribe(ctx, sink, rcvhwm=2)
        got: list[int] = []

        async def read_slowly() -> None:
            while len(got) < n:
                got.append(int.from_bytes((await recv(slow))[1], "big"))
                if len(got) % 50 == 0:
                    await anyio.sleep(0.05)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read_slowly)
            for i in range(n):
                scheduler.emit(stored(i, blocks=64, size=16))
                await scheduler.tick()
    assert got == list(range(n))
    assert sink.statistics().batches_dropped == 0
    # Published from the tick while the pipe had room, by the writer once it had
    # none, and in order across the two.
    assert 0 < sink.batches_inline < n


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_topics_per_origin_and_fixed_topic_refusing_a_second_origin(
    ctx: Sockets,
) -> None:
    per_origin = bound_sink(model="llama")
    fixed = bound_sink(topic="only-one")
    async with Scheduler(sinks=[per_origin, fixed], origin="relay") as scheduler:
        sub = await subscribe(ctx, per_origin)
        for i in range(3):
            scheduler.emit(stored(i), origin="gpu-a")
            scheduler.emit(stored(i), origin="gpu-b")
            await scheduler.tick()
        seen: dict[bytes, list[int]] = {}
        for _ in range(6):
            topic, seq, _ = await recv(sub)
            seen.setdefault(topic, []).append(int.from_bytes(seq, "big"))
        assert seen == {b"kv@gpu-a@llama": [0, 1, 2], b"kv@gpu-b@llama": [0, 1, 2]}
        scheduler.emit(stored(9), origin="bad@origin")
        await scheduler.tick()
        with anyio.fail_after(10):
            await wait_until(lambda: not (per_origin.statistics().batches_unroutable < 1))
            await wait_until(lambda: not (fixed.statistics().batches_unroutable < 4))
    assert fixed.statistics().batches_dropped == 4  # gpu-b's three and bad@origin's
    assert per_origin.statistics().batches_dropped == 1


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_strict_sink_refuses_events_and_counts_them(ctx: Sockets) -> None:
    sink = bound_sink(codec=MsgpackCodec(strict="refuse"))
    good = stored(1)
    async with Scheduler(sinks=[sink], origin="e") as scheduler:
        sub = await subscribe(ctx, sink)
        scheduler.emit(
            [
                good,
                BlockStored(
                    block_hashes=[b"\x01" * 32],
                    parent_block_hash=None,
                    token_ids=[1, 2],
                    block_size=2,
                    medium="GPU",
                ),
                stored(2, medium="NVME"),
            ]
        )
        await scheduler.tick()
        scheduler.emit(stored(3, medium="MARS"))  # every event refused: the batch still goes
        await scheduler.tick()
        first = _vllm_decoder.decode((await recv(sub))[2])
        second = await recv(sub)
    assert first.events == [as_vllm(good)]
    assert int.from_bytes(second[1], "big") == 1
    assert _vllm_decoder.decode(second[2]).events == []
    assert sink.statistics().events_refused == 3
    assert sink.statistics().batches_dropped == 0


# -- ZMQ ingest ------------------------------------------------------------------------------------


async def collect(sub: ZmqSubscriber, n: int, timeout: float = 15.0) -> list[EventBatch | Gap]:
    items: list[EventBatch | Gap] = []
    with anyio.fail_after(timeout):
        async for item in sub:
            items.append(item)
            if sum(isinstance(i, EventBatch) for i in items) >= n:
                break
    return items


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_late_joiner_replays_from_seq_then_follows_live() -> None:
    sink = bound_sink()
    async with Scheduler(sinks=[sink], origin="e") as scheduler:
        for i in range(10):
            scheduler.emit(stored(i))
            await scheduler.tick()
        spec = ZmqPublisher(sink.endpoint, replay_endpoint=sink.replay_endpoint, from_seq=4)
        got: list[EventBatch | Gap] = []
        async with ZmqSubscriber(spec) as sub, anyio.create_task_group() as tg:

            async def read() -> None:
                got.extend(await collect(sub, 10))

            tg.start_soon(read)
            with anyio.fail_after(10):
                await sink.wait_subscribed()
            for i in range(10, 14):
                scheduler.emit(stored(i))
                await scheduler.tick()
        late = ZmqSubscriber(ZmqPublisher(sink.endpoint, join="live"))  # joins where it hears
        async with late, anyio.create_task_group() as tg:
            joined: list[EventBatch | Gap] = []

            async def read_late() -> None:
                joined.extend(await collect(late, 2))

            tg.start_soon(read_late)
            i = 14
            with anyio.fail_after(10):  # the slow joiner: publish until it hears one
                while not late.statistics()[0].batches:
                    scheduler.emit(stored(i))
                    await scheduler.tick()
                    i += 1
                    await anyio.sleep(0.02)
            scheduler.emit(stored(i))
            await scheduler.tick()
    assert all(isinstance(i, EventBatch) for i in got)
    assert [i.seq for i in got] == list(range(4, 14))  # type: ignore[union-attr]
    assert [i.events[0] for i in got] == [stored(i) for i in range(4, 14)]  # type: ignore[union-attr]
    assert all(isinstance(i, EventBatch) for i in joined)
    first = joined[0].seq  # type: ignore[union-attr]
    assert first >= 14  # joined live, where it joined
    assert [i.seq for i in joined] == [first, first + 1]  # type: ignore[union-attr]
    (st,) = sub.statistics()
    assert (st.replays_requested, st.replays_completed, st.gaps) == (1, 1, 0)
    # 4..9 came by replay; 10..13 live or, when the request was served after them, by
    # replay too (the live copies then dropped as duplicates).
    assert st.replayed >= 6
    assert st.replayed - 6 == st.duplicates


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_publisher_restart_is_a_new_epoch(short_dir: str) -> None:
    live = f"ipc://{short_dir}/live.sock"
    rep = f"ipc://{short_dir}/replay.sock"
    sub = ZmqSubscriber(ZmqPublisher(live, replay_endpoint=rep, origin="engine"))
    got: list[EventBatch | Gap] = []
    async with sub, anyio.create_task_group() as tg:

        async def read() -> None:
            got.extend(await collect(sub, 11))

        tg.start_soon(read)
        first = ZmqSink(live, replay_endpoint=rep)
        async with Scheduler(sinks=[first], origin="x") as scheduler:
            with anyio.fail_after(10):
                await first.wait_subscribed()
            for i in range(5):
                scheduler.emit(stored(i))
                await scheduler.tick()
            with anyio.fail_after(10):
                await wait_until(lambda: not (sub.statistics()[0].batches < 5))
        second = ZmqSink(live, replay_endpoint=rep)
        async with Scheduler(sinks=[second], origin="x") as scheduler:
            for i in range(3):  # possibly before the subscriber reconnects: replayed then
                scheduler.emit(stored(100 + i))
                await scheduler.tick()
            with anyio.fail_after(10):
                await second.wait_subscribed()
            for i in range(3, 6):
                scheduler.emit(stored(100 + i))
                await scheduler.tick()
            with anyio.fail_after(10):
                await wait_until(lambda: not (sum(isinstance(i, EventBatch) for i in got) < 11))
    batches = [i for i in got if isinstance(i, EventBatch)]
    assert not [i for i in got if isinstance(i, Gap)]
    assert [b.seq for b in batches] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]
    assert len({b.epoch for b in batches[:5]}) == 1
    assert len({b.epoch for b in batches[5:]}) == 1
    assert batches[0].epoch != batches[5].epoch
    assert {b.origin for b in batches} == {"engine"}
    assert [b.events[0] for b in batches[5:]] == [stored(100 + i) for i in range(6)]
    assert sub.statistics()[0].restarts == 1


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_malformed_frames_are_skipped_and_counted(ctx: Sockets) -> None:
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    codec = MsgpackCodec()

    def payload(i: int) -> bytes:
        return codec.encode(EventBatch(seq=i, ts=1.0, events=[stored(i)]))

    sub = ZmqSubscriber(ZmqPublisher(f"tcp://127.0.0.1:{port}", origin="raw"))
    async with sub, anyio.create_task_group() as tg:
        got: list[EventBatch | Gap] = []

        async def read() -> None:
            got.extend(await collect(sub, 3))

        tg.start_soon(read)
        with anyio.fail_after(10):  # the slow joiner: publish until the first batch lands
            while not sub.statistics()[0].batches:
                await pub.send_multipart([b"", wire.pack_seq(0), payload(0)])
                await anyio.sleep(0.02)
        await pub.send_multipart([b"", wire.pack_seq(1)])  # 2 frames
        await pub.send_multipart([b"", b"\x00\x02", payload(2)])  # short seq
        await pub.send_multipart([b"", wire.pack_seq(1), b"\xc1not msgpack"])  # bad payload
        await pub.send_multipart([b"", wire.pack_seq(2), payload(2)])
        await pub.send_multipart([b"", wire.pack_seq(3), payload(3)])
    batches = [i for i in got if isinstance(i, EventBatch)]
    gaps = [i for i in got if isinstance(i, Gap)]
    assert [b.seq for b in batches][-2:] == [2, 3]
    assert [(g.first_missing, g.next_seq) for g in gaps] == [(1, 2)]
    assert "undecodable" in gaps[0].reason
    assert sub.statistics()[0].malformed == 3


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_gap_without_replay_is_reported(ctx: Sockets) -> None:
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    codec = MsgpackCodec()
    sub = ZmqSubscriber(ZmqPublisher(f"tcp://127.0.0.1:{port}"))
    async with sub, anyio.create_task_group() as tg:
        got: list[EventBatch | Gap] = []

        async def read() -> None:
            got.extend(await collect(sub, 2))

        tg.start_soon(read)
        with anyio.fail_after(10):
            while not sub.statistics()[0].batches:
                await pub.send_multipart(
                    [b"", wire.pack_seq(5), codec.encode(EventBatch(seq=5, ts=1.0, events=[]))]
                )
                await anyio.sleep(0.02)
        await pub.send_multipart(
            [b"", wire.pack_seq(9), codec.encode(EventBatch(seq=9, ts=1.0, events=[]))]
        )
    # A fresh publisher first heard at seq 5: batches 0..4 are a gap, never silent (14.6).
    assert [(type(i).__name__, getattr(i, "seq", None)) for i in got] == [
        ("Gap", None),
        ("EventBatch", 5),
        ("Gap", None),
        ("EventBatch", 9),
    ]
    first, gap = got[0], got[2]
    assert isinstance(first, Gap)
    assert isinstance(gap, Gap)
    assert (first.first_missing, first.next_seq) == (0, 5)
    assert "before the subscriber heard" in first.reason
    assert (gap.first_missing, gap.next_seq) == (6, 9)
    assert "no replay endpoint" in gap.reason
    # The seq 5 the wait loop sent again and again: duplicates, never restarts (15.7).
    (st,) = sub.statistics()
    assert (st.restarts, st.batches) == (0, 2)


# -- the protocol state, without sockets -----------------------------------------------------------

_codec = MsgpackCodec()


def _p(seq: int) -> bytes:
    return _codec.encode(EventBatch(seq=seq, ts=1.0, events=[stored(seq)]))


def _seqs(items: list[Any]) -> list[Any]:
    return [
        i.seq if isinstance(i, EventBatch) else ("gap", i.first_missing, i.next_seq) for i in items
    ]


def _stream(**kw: Any) -> PublisherStream:
    kw.setdefault("has_replay", True)
    return PublisherStream("o", codec=_codec, **kw)


def test_stream_repairs_a_gap_by_replay_in_order() -> None:
    s = _stream()
    assert _seqs(s.on_live(0, _p(0), 0.0)) == [0]
    assert s.on_live(3, _p(3), 0.0) == []  # gap: held, replay asked
    assert s.requests == [1]
    assert s.on_live(4, _p(4), 0.0) == []
    out = s.on_replay(wire.ReplayBatch(b"", 1, _p(1)), 0.1)
    out += s.on_replay(wire.ReplayBatch(None, 2, _p(2)), 0.1)  # legacy layout too
    out += s.on_replay(wire.ReplayBatch(b"", 3, _p(3)), 0.1)  # also held: de-duplicated
    out += s.on_replay(None, 0.1)
    assert _seqs(out) == [1, 2, 3, 4]
    assert _seqs(s.on_live(5, _p(5), 0.2)) == [5]
    st = s.statistics()
    assert (st.gaps, st.replayed, st.duplicates, st.replays_completed) == (0, 3, 1, 1)


def test_stream_reports_what_the_ring_no_longer_has() -> None:
    s = _stream()
    s.on_live(0, _p(0), 0.0)
    s.on_live(10, _p(10), 0.0)
    out = s.on_replay(wire.ReplayBatch(b"", 7, _p(7)), 0.1)  # the ring starts at 7
    out += s.on_replay(wire.ReplayBatch(b"", 8, _p(8)), 0.1)
    out += s.on_replay(None, 0.1)  # 9 never came
    assert _seqs(out) == [("gap", 1, 7), 7, 8, ("gap", 9, 10), 10]


def test_stream_replays_again_for_what_was_lost_during_a_replay() -> None:
    s = _stream(max_reorder=2)
    s.on_live(0, _p(0), 0.0)
    s.on_live(2, _p(2), 0.0)
    s.on_live(3, _p(3), 0.0)
    s.on_live(4, _p(4), 0.0)  # reorder buffer full: dropped, counted
    assert s.statistics().reorder_overflow == 1
    out = s.on_replay(wire.ReplayBatch(b"", 1, _p(1)), 0.1) + s.on_replay(None, 0.1)
    assert _seqs(out) == [1, 2, 3]
    assert s.on_live(5, _p(5), 0.2) == []  # 4 is missing: a second replay
    assert s.requests == [1, 4]
    out = s.on_replay(wire.ReplayBatch(b"", 4, _p(4)), 0.3) + s.on_replay(None, 0.3)
    assert _seqs(out) == [4, 5]


def test_stream_gives_up_a_replay_that_times_out() -> None:
    s = _stream(replay_timeout=1.0)
    s.on_live(0, _p(0), 0.0)
    s.on_live(2, _p(2), 0.0)
    assert s.on_timer(0.5) == []
    out = s.on_timer(1.5)
    assert _seqs(out) == [("gap", 1, 2), 2]
    assert "timed out" in out[0].reason  # type: ignore[union-attr]
    assert s.reset_dealer
    assert s.on_replay(wire.ReplayBatch(b"", 1, _p(1)), 1.6) == []  # late reply: ignored
    # While suspended, gaps are reported at once instead of waiting again.
    assert _seqs(s.on_live(5, _p(5), 2.0)) == [("gap", 3, 5), 5]


def test_stream_restarted_by_seq_starts_over_when_its_first_heartbeat_announces_a_tail() -> None:
    # A restart told by the seq alone leaves the new publisher's epoch unknown. If its
    # first heartbeat announces batches never received, they may be another instance's
    # (it restarted again and its live batches were lost): a replay of that tail would
    # join two publishers' streams into one state, so the stream starts over.
    from kvstream._wire.broker import Heartbeat

    s = _stream()
    for q in range(5):
        s.on_live(q, _p(q), 0.0)
    assert _seqs(s.on_live(0, _p(0), 0.1) + s.on_live(1, _p(1), 0.1)) == [0, 1]
    restarted = s.epoch
    assert s.statistics().restarts == 1
    s.on_heartbeat(Heartbeat("o", "e9", 4, 0.5), 0.2)  # seq 2..4: never heard
    assert s.statistics().restarts == 2
    assert s.epoch == "e9" != restarted
    assert s.requests == [0]  # the new instance's batches, from its first
    out = [item for q in range(5) for item in s.on_replay(wire.ReplayBatch(b"", q, _p(q)), 0.3)]
    out += s.on_replay(None, 0.3)
    assert _seqs(out) == [0, 1, 2, 3, 4]
    assert {b.epoch for b in out} == {"e9"}


def test_stream_restarted_by_seq_learns_its_epoch_from_a_heartbeat_with_nothing_missing() -> None:
    from kvstream._wire.broker import Heartbeat

    s = _stream()
    for q in range(5):
        s.on_live(q, _p(q), 0.0)
    s.on_live(0, _p(0), 0.1)
    s.on_live(1, _p(1), 0.1)
    restarted = s.epoch
    assert s.on_heartbeat(Heartbeat("o", "e9", 1, 0.5), 0.2) == []  # all of it received
    assert (s.statistics().restarts, s.epoch, s.requests) == (1, restarted, [])
    # Known now: a later tail is the same publisher's, repaired by a replay.
    s.on_heartbeat(Heartbeat("o", "e9", 3, 0.5), 0.3)
    assert (s.statistics().restarts, s.requests) == (1, [2])


def test_stream_start_from_seq_and_topic_filter() -> None:
    s = _stream(topic=b"kv@a@")
    s.start(2, 0.0)
    assert s.requests == [2]
    s.on_live(6, _p(6), 0.0)
    out = s.on_replay(wire.ReplayBatch(b"kv@b@m", 2, _p(2)), 0.1)  # another origin's
    out += s.on_replay(wire.ReplayBatch(b"kv@a@m", 2, _p(2)), 0.1)
    out += s.on_replay(wire.ReplayBatch(b"kv@a@m", 3, _p(3)), 0.1)
    out += s.on_replay(None, 0.1)  # 4, 5 published after the ring was read: asked again
    assert _seqs(out) == [2, 3]
    assert s.requests == [2, 4]
    out = s.on_replay(None, 0.2)  # still not there: reported now
    assert _seqs(out) == [("gap", 4, 6), 6]


def test_stream_restart_and_undecodable() -> None:
    s = _stream(has_replay=False)
    assert _seqs(s.on_live(7, _p(7), 0.0)) == [7]
    old = s.epoch
    out = s.on_live(0, _p(0), 0.1)
    assert _seqs(out) == [0]
    assert out[0].epoch != old
    assert s.statistics().restarts == 1
    out = s.on_live(1, b"\xc1", 0.2)
    assert _seqs(out) == [("gap", 1, 2)]
    assert _seqs(s.on_live(2, _p(2), 0.3)) == [2]


# -- vLLM's EventPublisher shape -------------------------------------------------------------


def test_event_publisher_drop_in(short_dir: str) -> None:
    endpoint = f"ipc://{short_dir}/pub.sock"
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        publisher = EventPublisher.from_kv_events_config(
            {"endpoint": endpoint, "topic": "kv@p@m"}, origin="p", data_parallel_rank=0
        )
        try:
            sub.connect(endpoint)
            sink = publisher.scheduler.sinks[0]
            assert isinstance(sink, ZmqSink)
            for _ in range(1000):  # the publisher's loop runs in its own thread
                if sink.statistics().subscriptions:
                    break
                time.sleep(0.01)
            events: list[vllm.BlockStored | vllm.BlockRemoved | vllm.AllBlocksCleared] = [
                vllm.BlockStored([11], None, [1, 2, 3, 4], 4, None, "GPU", None),
                vllm.BlockRemoved([11], "GPU"),
            ]
            publisher.publish(vllm.KVEventBatch(ts=1.0, events=events, data_parallel_rank=0))
            publisher.publish([stored(5), "not an event"])  # the bad one is dropped, counted
            first = sub.recv_multipart()
            second = sub.recv_multipart()
        finally:
            publisher.shutdown()
            publisher.shutdown()  # idempotent
    finally:
        sub.close(linger=0)
        context.term()
    assert first[0] == b"kv@p@m"
    assert [int.from_bytes(f[1], "big") for f in (first, second)] == [0, 1]
    assert _vllm_decoder.decode(first[2]).events == events
    assert _vllm_decoder.decode(second[2]).events == [as_vllm(stored(5))]
    assert publisher.statistics() == (2, 3, 1)


# -- issue 14.6 / 15.7: no silent loss at the edge; a repeated seq is a duplicate ----------------


def test_stream_fresh_publisher_heard_late_is_replayed_from_zero() -> None:
    s = _stream()
    s.start(None, 0.0)
    assert s.on_live(3, _p(3), 0.0) == []  # held: batches 0..2 are asked first
    assert s.requests == [0]
    out = [item for k in range(3) for item in s.on_replay(wire.ReplayBatch(b"", k, _p(k)), 0.1)]
    out += s.on_replay(None, 0.1)
    assert _seqs(out) == [0, 1, 2, 3]
    assert s.statistics().gaps == 0


def test_stream_fresh_publisher_older_than_the_ring_is_a_gap() -> None:
    s = _stream()
    s.start(None, 0.0)
    s.on_live(50, _p(50), 0.0)
    out = s.on_replay(wire.ReplayBatch(b"", 48, _p(48)), 0.1)  # the ring starts at 48
    out += s.on_replay(wire.ReplayBatch(b"", 49, _p(49)), 0.1) + s.on_replay(None, 0.1)
    assert _seqs(out) == [("gap", 0, 48), 48, 49, 50]


def test_stream_join_live_starts_at_the_first_batch_heard() -> None:
    s = _stream(join="live")
    s.start(None, 0.0)
    assert _seqs(s.on_live(7, _p(7), 0.0)) == [7]
    assert s.requests == []


def test_stream_repeated_live_seq_is_a_duplicate_never_a_restart() -> None:
    s = _stream(has_replay=False)
    s.start(None, 0.0)
    assert _seqs(s.on_live(0, _p(0), 0.0)) == [0]
    assert _seqs(s.on_live(1, b"\xc1", 0.1)) == [("gap", 1, 2)]  # undecodable
    epoch = s.epoch
    assert s.on_live(1, _p(1), 0.2) == []  # resent: a duplicate, the epoch stays
    assert _seqs(s.on_live(2, _p(2), 0.3)) == [2]
    st = s.statistics()
    assert (st.restarts, st.duplicates, s.epoch) == (0, 1, epoch)
    # Going back is still a restart.
    assert _seqs(s.on_live(0, _p(0), 0.4)) == [0]
    assert s.statistics().restarts == 1


def test_stream_counts_refused_events_and_delivers_the_rest() -> None:
    s = _stream(has_replay=False)
    s.start(None, 0.0)
    payload = msgspec.msgpack.encode(
        [1.0, [["BlockRemoved", [1], "GPU"], ["BlockEvicted", [2]], ["AllBlocksCleared"]], 0]
    )
    (batch,) = s.on_live(0, payload, 0.0)
    assert isinstance(batch, EventBatch)
    assert batch.events == [BlockRemoved(block_hashes=[1], medium="GPU"), AllBlocksCleared()]
    assert s.statistics().events_refused == 1


# -- issue 14.8 / 15.8: fan-in on a bound endpoint -----------------------------------------------


@pytest.mark.usefixtures("no_leaked_tasks")
async def test_bound_subscriber_keeps_connecting_publishers_apart(ctx: Sockets) -> None:
    port = _free_port()
    spec = ZmqPublisher(f"tcp://127.0.0.1:{port}", bind=True, origin="central", join="live")
    sub = ZmqSubscriber(spec)
    codec = MsgpackCodec()
    pubs = []
    for _ in range(3):
        pub = ctx.socket(zmq.PUB)
        pub.connect(f"tcp://127.0.0.1:{port}")
        pubs.append(pub)
    # Publishers a and b share a topic but not a rank; c has its own topic. Each
    # counts from 0 and interleaves with the others: one stream would see seqs
    # going back (false restarts) and forward (false gaps).
    streams = [(pubs[0], b"kv@a@m", 0), (pubs[1], b"kv@a@m", 1), (pubs[2], b"kv@c@m", 0)]

    def frame(topic: bytes, rank: int, seq: int) -> list[bytes]:
        event = BlockRemoved(block_hashes=[seq], medium="GPU")
        batch = EventBatch(seq=seq, ts=1.0, events=[event], data_parallel_rank=rank)
        return [topic, wire.pack_seq(seq), codec.encode(batch)]

    got: list[EventBatch | Gap] = []
    async with sub, anyio.create_task_group() as tg:

        async def read() -> None:
            got.extend(await collect(sub, 3 + 3 * 10))

        tg.start_soon(read)
        with anyio.fail_after(10):  # the slow joiner: until each one's seq 0 is heard
            while len(sub.statistics()) < 3:
                for pub, topic, rank in streams:
                    await pub.send_multipart(frame(topic, rank, 0))
                await anyio.sleep(0.02)
        for seq in range(1, 11):
            for pub, topic, rank in streams:
                await pub.send_multipart(frame(topic, rank, seq))
    batches = [i for i in got if isinstance(i, EventBatch)]
    assert not [i for i in got if isinstance(i, Gap)]
    by_origin: dict[str, list[int]] = {}
    for b in batches:
        by_origin.setdefault(b.origin, []).append(b.seq)
    assert set(by_origin) == {"central/kv@a@m#dp0", "central/kv@a@m#dp1", "central/kv@c@m#dp0"}
    for seqs in by_origin.values():
        assert seqs == list(range(seqs[0], 11))
    stats = sub.statistics()
    assert sum(st.restarts for st in stats) == 0
    assert {st.origin for st in stats} == set(by_origin)
    for pub in pubs:
        pub.close(linger=0)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_bound_endpoint_keeps_at_most_max_fan_in_origins(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstream.consumers import zmq as ingest

    monkeypatch.setattr(ingest, "MAX_FAN_IN", 2)
    link = ingest._Link(
        ZmqPublisher("tcp://127.0.0.1:1", bind=True, origin="c"),
        lambda origin, topic, exact: _stream(),
    )
    payload = _p(0)
    first, fresh = link.stream_for(b"a", payload, 0.0)
    assert fresh
    assert link.stream_for(b"a", payload, 0.0) == (first, False)
    link.stream_for(b"b", payload, 0.0)
    with pytest.raises(DecodeError, match="the limit"):
        link.stream_for(b"c", payload, 0.0)


def test_fan_in_replies_from_a_shared_ring_go_to_the_origin_that_asked() -> None:
    from kvstream.consumers import zmq as ingest

    def make(origin: str, topic: bytes, exact: bool) -> PublisherStream:
        return PublisherStream(
            origin, codec=_codec, has_replay=True, topic=topic, exact_topic=exact
        )

    link = ingest._Link(
        ZmqPublisher("tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:2", bind=True),
        make,
    )

    def payload(seq: int) -> bytes:
        return _codec.encode(
            EventBatch(seq=seq, ts=1.0, events=[stored(seq)], data_parallel_rank=0)
        )

    a, _ = link.stream_for(b"kv@a@m", payload(0), 0.0)
    b, _ = link.stream_for(b"kv@b@m", payload(0), 0.0)
    for s in (a, b):
        s.start(None, 0.0)
        assert s.on_live(2, payload(2), 0.0) == []  # first heard at 2: replay from 0
        link.inflight.append(s)  # what _send_requests does once a request is sent
    ring = [(topic, seq) for seq in range(3) for topic in (b"kv@a@m", b"kv@b@m")]
    out: dict[str, list[Any]] = {a.origin: [], b.origin: []}
    for _ in range(2):  # each request is answered with the whole shared ring, then the end
        for topic, seq in ring:
            reply = wire.ReplayBatch(topic, seq, payload(seq))
            target = link.route_reply(reply)
            assert target is not None
            out[target.origin] += target.on_replay(reply, 0.1)
        target = link.route_reply(None)
        assert target is not None
        out[target.origin] += target.on_replay(None, 0.1)
    assert {k: _seqs(v) for k, v in out.items()} == {a.origin: [0, 1, 2], b.origin: [0, 1, 2]}
    assert not link.inflight
    assert {a.origin, b.origin} == {"127.0.0.1:1/kv@a@m#dp0", "127.0.0.1:1/kv@b@m#dp0"}
