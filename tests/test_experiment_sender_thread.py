"""benchmarks/experiment_sender_thread.py: what it measured was a working sink.

Both variants of its sender thread deliver every batch, in order, with the bytes
kvstream's own sink sends, those still handed over when the sink closes
included; they keep the ring; and the thread ends when the sink closes.
"""

from __future__ import annotations

from types import ModuleType

import anyio
import pytest
import zmq
from benchmark_scripts import load_script

from kvstream import BlockStored, Scheduler
from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.errors import ConfigError


def _script() -> ModuleType:
    return load_script("experiment_sender_thread")


def _event(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=[i],
        parent_block_hash=None,
        token_ids=list(range(i, i + 16)),
        block_size=16,
        medium="GPU",
    )


@pytest.mark.parametrize("mode", ["send", "encode"])
async def test_both_variants_deliver_every_batch_in_order_and_end_their_thread(
    mode: str,
) -> None:
    experiment = _script()
    sink = experiment.ThreadedZmqSink(
        "tcp://127.0.0.1:0",
        mode=mode,
        bind=True,
        replay_endpoint="tcp://127.0.0.1:0",
        # Closed without waiting: what the thread sends last must get to leave.
        linger=5.0,
        hwm=0,
        name="threaded",
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    steps = 200
    sent = []
    try:
        async with Scheduler(sinks=[sink], origin="e", epoch="x") as scheduler:
            sub.connect(sink.endpoint)
            with anyio.fail_after(10):
                await sink.wait_subscribed()
            for i in range(steps):
                scheduler.emit(_event(i))
                batch = await scheduler.tick()
                assert batch is not None
                sent.append(batch)
                await anyio.lowlevel.checkpoint()
            thread = sink._thread
        # Closed without waiting: the close lets the thread send what it still holds.
        assert thread is not None
        assert not thread.is_alive()
        assert sink.drained
        assert len(sink._ring) == steps
        codec = MsgpackCodec()
        for batch in sent:
            assert sub.poll(5000), f"batch {batch.seq} never arrived"
            topic, seq_frame, payload = sub.recv_multipart()
            assert topic == b""
            assert int.from_bytes(seq_frame, "big") == batch.seq
            assert payload == codec.encode(batch)
        assert not sub.poll(50)
    finally:
        sub.close(linger=0)
        ctx.term()


def test_an_unknown_mode_is_refused_by_name() -> None:
    experiment = _script()
    with pytest.raises(ConfigError, match="mode: expected 'send' or 'encode', got 'both'"):
        experiment.ThreadedZmqSink("tcp://127.0.0.1:0", mode="both", bind=True)
