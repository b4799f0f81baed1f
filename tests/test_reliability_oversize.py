"""A batch bigger than a subscriber reads is a counted gap, never a reconnect loop.

A socket subscriber says in its hello how large a message it reads
(`max_message_bytes`). The sink sends it a gap notice (reason `too_large`)
instead of any batch or snapshot over that size, counts it as dropped for that
subscriber, and goes on: the subscriber yields the batches before and after it
and one `Gap` for it, on one connection. Before, the subscriber dropped the
connection on the oversized message, reconnected, was sent it again, and never
got past it (48 reconnects in 15 s, no gap, no message).
"""

from __future__ import annotations

import logging

import anyio
import orjson
import pytest

from kvstream import EventBatch, JsonCodec, Scheduler
from kvstream._wire import socket_protocol as sp
from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.consumers.base import Gap
from kvstream.consumers.socket import SocketSubscriber
from kvstream.events import BlockStored
from kvstream.sinks.socket import SocketSink

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

CAP = 8 * 1024


def _blocks(n: int, start: int = 0) -> list[BlockStored]:
    """`n` one-block events of 16 tokens: about 190 bytes each in JSON."""
    return [
        BlockStored(
            block_hashes=[start + i + 1],
            parent_block_hash=None,
            token_ids=list(range(16)),
            block_size=16,
        )
        for i in range(n)
    ]


async def seqs_until(sub: SocketSubscriber, last: int) -> list[int]:
    """The seqs of the batches `sub` yields up to `last` (any other item fails)."""
    seqs = []
    with anyio.fail_after(20):
        async for item in sub:
            assert isinstance(item, EventBatch), item
            seqs.append(item.seq)
            if item.seq == last:
                break
    return seqs


def _port(sink: SocketSink) -> int:
    return int(sink.address.rsplit(":", 1)[1])


@pytest.mark.parametrize("codec", [JsonCodec(), MsgpackCodec()], ids=["lines", "frames"])
async def test_a_batch_over_the_subscribers_cap_becomes_one_gap_on_one_connection(
    codec: JsonCodec | MsgpackCodec, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    sink = SocketSink(port=0, codec=codec)
    sizes = [2, 400, 3, 400, 400, 1]  # batches 1, 3 and 4 are well over 8 KiB
    got: list[EventBatch | Gap] = []
    async with Scheduler(sinks=[sink], origin="eng") as scheduler:
        sub = SocketSubscriber(
            port=_port(sink), from_seq=0, max_message_bytes=CAP, retry_initial=0.01
        )
        async with sub:
            for i, n in enumerate(sizes):
                scheduler.emit(_blocks(n, start=1000 * i))
                await scheduler.tick()
            with anyio.fail_after(20):
                async for item in sub:
                    got.append(item)
                    if isinstance(item, EventBatch) and item.seq == len(sizes) - 1:
                        break
            stats = sub.statistics()
        report = await scheduler.aclose()
    assert report.complete
    shape = [
        ("batch", item.seq) if isinstance(item, EventBatch) else ("gap", item.first_missing)
        for item in got
    ]
    assert shape == [("batch", 0), ("gap", 1), ("batch", 2), ("gap", 3), ("gap", 4), ("batch", 5)]
    gaps = [item for item in got if isinstance(item, Gap)]
    assert all(g.reason == "too_large" and g.missing == 1 for g in gaps)
    assert stats.connections == 1  # no reconnect
    assert (stats.gaps, stats.missing_batches) == (3, 3)
    server = sink.statistics()
    assert server.too_large == 3
    assert server.subscriber_batches_dropped == 3
    assert server.gap_notices == 3
    # One clear error on the subscriber's side per skipped batch; the sink warns once per burst.
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 3, errors
    assert all("max_message_bytes 8192" in m for m in errors), errors
    sink_warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvstream.sinks.socket" and r.levelno == logging.WARNING
    ]
    assert len(sink_warnings) == 1, sink_warnings
    assert "sent a gap notice instead" in sink_warnings[0]


async def test_a_subscriber_with_the_default_cap_gets_every_batch_and_says_nothing_new() -> None:
    """The default cap is not said in the hello (a sink that predates the key takes it)."""
    assert b"max_message_bytes" not in sp.encode_hello(0)
    assert b'"max_message_bytes":4096' in sp.encode_hello(0, max_message_bytes=4096)
    sink = SocketSink(port=0)
    async with Scheduler(sinks=[sink], origin="eng") as scheduler:
        async with SocketSubscriber(port=_port(sink), from_seq=0, reconnect=False) as sub:
            for i in range(3):
                scheduler.emit(_blocks(400, start=1000 * i))
                await scheduler.tick()
            seqs = await seqs_until(sub, 2)
        await scheduler.aclose()
    assert seqs == [0, 1, 2]
    assert sink.statistics().too_large == 0


@pytest.mark.parametrize("value", [1023, -1, "big", 2.5, True])
def test_a_hello_with_a_bad_message_cap_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(sp.ProtocolError, match=r"hello\.max_message_bytes") as info:
        sp.parse_hello(orjson.dumps({"max_message_bytes": value}))
    assert info.value.code == "bad_hello"
    assert sp.parse_hello(b'{"max_message_bytes": 1024}').max_message_bytes == 1024
    assert sp.parse_hello(b"{}").max_message_bytes == sp.DEFAULT_MAX_MESSAGE_BYTES


async def test_a_snapshot_over_the_cap_becomes_a_gap_up_to_where_it_stood() -> None:
    """A snapshot part bigger than the subscriber reads is a gap to the snapshot's seq."""
    from kvstream.events import AllBlocksCleared

    def state() -> list[AllBlocksCleared | BlockStored]:
        return [AllBlocksCleared(), *_blocks(200)]  # one part of about 38 KB

    sink = SocketSink(port=0, ring_bytes=2048)  # holds only the last few batches
    sink.snapshot_provider = state
    got: list[EventBatch | Gap] = []
    async with Scheduler(sinks=[sink], origin="eng") as scheduler:
        for i in range(20):
            scheduler.emit(_blocks(1, start=10_000 + i))
            await scheduler.tick()
        sub = SocketSubscriber(port=_port(sink), from_seq=0, max_message_bytes=CAP)
        async with sub:
            with anyio.fail_after(20):
                while not got or not isinstance(got[-1], EventBatch):
                    scheduler.emit(_blocks(1, start=20_000 + len(got)))
                    await scheduler.tick()  # the snapshot is taken at a tick
                    with anyio.move_on_after(0.05):
                        got.append(await sub.__anext__())
            stats = sub.statistics()
        await scheduler.aclose()
    gap = got[0]
    assert isinstance(gap, Gap)
    assert (gap.first_missing, gap.reason) == (0, "too_large")
    assert got[-1].seq == gap.next_seq  # the next batch follows where the snapshot stood
    assert stats.connections == 1
    assert stats.snapshots == 0
    server = sink.statistics()
    assert (server.too_large, server.snapshots_sent) == (1, 0)
