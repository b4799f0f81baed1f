"""ZMQ ingest caps the size of a message, and the replay ROUTER logs once per burst.

* Before, the ZMQ subscriber took any message: one 512 MiB frame took the relay
  to 904 MB. Now its SUB and DEALER sockets carry `ZMQ_MAXMSGSIZE`
  (`max_message_bytes`, 64 MiB by default): libzmq drops the connection that
  sends a bigger message before allocating it, the subscriber counts it
  (`dropped_connections`), logs it once per burst and connects again (libzmq
  does not, after such a refusal), and the batches lost meanwhile arrive as a gap.
* The ZMQ sink's replay ROUTER logged "replies already running" for every refused
  request (5,000 warnings in a flood); it now logs once per burst.
"""

from __future__ import annotations

import logging

import anyio
import pytest
import zmq
import zmq.asyncio
from servers import wait_until
from test_reliability_peers import _free_port

from kvstream import Scheduler
from kvstream._wire import vllm_zmq as wire
from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.config import open_subscriber
from kvstream.consumers.base import Gap
from kvstream.consumers.zmq import DEFAULT_MAX_MESSAGE_BYTES, ZmqPublisher, ZmqSubscriber
from kvstream.errors import ConfigError
from kvstream.events import BlockRemoved, BlockStored, EventBatch
from kvstream.sinks.zmq import ZmqSink

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


def _payload(seq: int) -> bytes:
    return MsgpackCodec().encode(
        EventBatch(seq=seq, ts=1.0, events=[BlockRemoved(block_hashes=[seq + 1])])
    )


async def test_a_message_over_the_cap_is_refused_counted_and_the_subscriber_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstream.consumers")
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    try:
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        sub = ZmqSubscriber(
            ZmqPublisher(f"tcp://127.0.0.1:{port}", origin="raw"), max_message_bytes=64 * 1024
        )
        got: list[EventBatch | Gap] = []
        async with sub, anyio.create_task_group() as tg:

            async def read() -> None:
                async for item in sub:
                    got.append(item)
                    if isinstance(item, EventBatch) and item.seq >= 2:
                        return

            tg.start_soon(read)
            with anyio.fail_after(10):  # the slow joiner: publish until batch 0 lands
                while not got:
                    await pub.send_multipart([b"", wire.pack_seq(0), _payload(0)])
                    await anyio.sleep(0.02)
            # 4 MiB, far over the 64 KiB cap: refused before it is allocated.
            await pub.send_multipart([b"", wire.pack_seq(1), b"\x00" * (4 << 20)])
            seq = 2
            with anyio.fail_after(20):  # the subscriber connects again and hears the rest
                while not any(isinstance(i, EventBatch) and i.seq >= 2 for i in got):
                    await pub.send_multipart([b"", wire.pack_seq(seq), _payload(seq)])
                    seq += 1
                    await anyio.sleep(0.02)
        stats = sub.statistics()[0]
    finally:
        pub.close(linger=0)
        ctx.term()
    assert sub.dropped_connections >= 1
    assert stats.malformed == 0  # the big message never reached the decoder
    batches = [i.seq for i in got if isinstance(i, EventBatch)]
    gaps = [i for i in got if isinstance(i, Gap)]
    assert batches[0] == 0
    assert batches[-1] >= 2
    # Seq 1 (and what was sent while reconnecting) is one reported gap, never hidden.
    assert len(gaps) == 1
    assert gaps[0].first_missing == 1
    assert gaps[0].next_seq == batches[-1]
    drops = [r for r in caplog.records if "max_message_bytes 65536" in r.getMessage()]
    assert len(drops) == 1


async def test_the_cap_is_a_url_option_and_a_bad_one_is_refused() -> None:
    sub = open_subscriber("zmq+tcp://127.0.0.1:5599?max_message_bytes=1MiB")
    assert isinstance(sub, ZmqSubscriber)
    assert sub.max_message_bytes == 1 << 20
    default = open_subscriber("zmq+tcp://127.0.0.1:5599")
    assert isinstance(default, ZmqSubscriber)
    assert default.max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES == 64 << 20
    with pytest.raises(ConfigError, match="max_message_bytes"):
        ZmqSubscriber(ZmqPublisher("tcp://127.0.0.1:5599"), max_message_bytes=10)


async def test_displaced_or_refused_replay_requests_are_logged_once_per_burst(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="kvstream.sinks")
    sink, replay_endpoint = await _full_replay_sink(replay_timeout=30.0)
    ctx = zmq.asyncio.Context()
    try:
        async with Scheduler(sinks=[sink], origin="eng") as scheduler:
            await _fill(scheduler, sink)
            # One client takes the only reply slot and never reads; 40 more ask too, each
            # displacing the stalled one before it (or refused while none is stalled).
            clients = [_stalled_dealer(ctx, replay_endpoint) for _ in range(41)]
            await clients[0].send_multipart(wire.replay_request(0))
            await wait_until(lambda: sink.statistics().replays_active == 1)
            for dealer in clients[1:]:
                await dealer.send_multipart(wire.replay_request(0))

            def answered() -> int:
                st = sink.statistics()
                return st.replays_abandoned + st.replay_busy

            await wait_until(lambda: answered() == 40)
            for dealer in clients:
                dealer.close()
            await scheduler.aclose()
    finally:
        ctx.destroy(linger=0)
    records = [
        r
        for r in caplog.records
        if "replies already running" in r.getMessage() or "displaced" in r.getMessage()
    ]
    assert len(records) == 40  # every one is a record ...
    assert [r.levelno for r in records].count(logging.WARNING) <= 2  # ... a warning a kind


async def _full_replay_sink(
    replay_timeout: float,
) -> tuple[ZmqSink, str]:
    replay_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    sink = ZmqSink(
        f"tcp://127.0.0.1:{_free_port()}",
        bind=True,
        replay_endpoint=replay_endpoint,
        buffer_steps=200,
        max_replay_clients=1,
        replay_timeout=replay_timeout,
        linger=0,
    )
    return sink, replay_endpoint


async def _fill(scheduler: Scheduler, sink: ZmqSink, n: int = 200) -> None:
    """`n` batches of about 100 KB: a client that stops reading fills its pipes."""
    tokens = list(range(100_000, 101_024))
    for i in range(n):
        scheduler.emit(
            [
                BlockStored(
                    block_hashes=[i * 10_000 + j * 64 + b for b in range(64)],
                    parent_block_hash=None,
                    token_ids=tokens,
                    block_size=16,
                )
                for j in range(20)
            ]
        )
        await scheduler.tick()
    await wait_until(lambda: not sink.statistics().queued_batches)


def _stalled_dealer(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.connect(endpoint)
    return dealer


async def _read_replay(dealer: zmq.asyncio.Socket) -> list[int]:
    """The seqs of one whole replay, up to its end marker."""
    seqs: list[int] = []
    with anyio.fail_after(10):
        while True:
            frames = await dealer.recv_multipart()
            if frames[-2] == wire.END_SEQ:
                return seqs
            seqs.append(wire.unpack_seq(frames[-2]))


async def test_a_stalled_replay_gives_its_slot_to_a_new_request() -> None:
    # The only slot is held by a client that stopped reading (its pipe is full): a
    # new request takes its place at once, and is served whole.
    sink, endpoint = await _full_replay_sink(replay_timeout=30.0)
    ctx = zmq.asyncio.Context()
    try:
        async with Scheduler(sinks=[sink], origin="eng") as scheduler:
            await _fill(scheduler, sink)
            stalled = _stalled_dealer(ctx, endpoint)
            await stalled.send_multipart(wire.replay_request(0))
            await wait_until(lambda: sink.statistics().replay_waits > 0)
            reader = ctx.socket(zmq.DEALER)
            reader.setsockopt(zmq.LINGER, 0)
            reader.connect(endpoint)
            await reader.send_multipart(wire.replay_request(0))
            assert await _read_replay(reader) == list(range(200))
            st = sink.statistics()
            assert (st.replay_busy, st.replays_abandoned) == (0, 1)
            stalled.close()
            reader.close()
            await scheduler.aclose()
    finally:
        ctx.destroy(linger=0)
