"""Memory bounds count real bytes (issue 15, item 8; failures 5 and 6).

Outboxes and replay rings are bounded by what their batches really cost, the
encoded bytes as allocated plus their bookkeeping, not by an estimate per event
or by the length of a buffer the encoder over-allocated. The check is the
process's resident memory: a child process pushes far more than the bounds
through a stalled sink's outbox, a socket sink's ring and a ZMQ sink's ring,
with the batches that fooled the old accounting (1-event batches, whose JSON
orjson over-allocated 3x; long prompts, whose bytes per event dwarf the old
estimate), and reports how much its RSS grew.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

BOUND = 24 * 1024 * 1024

CHILD = textwrap.dedent(
    """
    import gc, json, sys
    import anyio

    from kvstream import BlockStored, JsonCodec, Scheduler
    from kvstream._bench.workload import event_pool
    from kvstream.sinks.socket import SocketSink
    from kvstream.sinks.zmq import ZmqSink
    from kvstream.testing import FaultySink

    BOUND = int(sys.argv[1])
    SHAPE = sys.argv[2]

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    if SHAPE == "small":
        pool = event_pool(2048)
        per_batch, steps = 1, 60_000  # about 150 MB of JSON
    else:  # long prompts: 512 blocks of 16 tokens per event
        pool = [
            BlockStored(
                block_hashes=list(range(i * 512, (i + 1) * 512)),
                parent_block_hash=None,
                token_ids=[(i * 7 + t) % 151_936 for t in range(512 * 16)],
                block_size=16,
                medium="GPU",
            )
            for i in range(16)
        ]
        per_batch, steps = 1, 4_000  # about 200 MB of JSON

    async def main():
        stalled = FaultySink(
            name="stalled", policy="drop_oldest", max_bytes=BOUND, codec=JsonCodec(), keep=False
        )
        socket_sink = SocketSink(host="127.0.0.1", port=0, ring_bytes=BOUND)
        zmq_sink = ZmqSink(
            "tcp://127.0.0.1:0", bind=True, replay_endpoint="tcp://127.0.0.1:0",
            replay_max_bytes=BOUND, linger=0.0,
        )
        async with Scheduler(sinks=[stalled, socket_sink, zmq_sink], origin="o") as s:
            stalled.stall()
            s.emit(pool[0])
            await s.tick()
            await stalled.wait_stalled()
            gc.collect()
            before = rss()
            n = len(pool)
            for i in range(steps):
                s.emit(pool[(i * per_batch) % n : (i * per_batch) % n + per_batch])
                await s.tick()
                if i % 64 == 0:
                    await anyio.sleep(0)
            gc.collect()
            grown = rss() - before
            st = stalled.statistics()
            print(json.dumps({
                "grown": grown,
                "stalled_queued": st.queued_bytes,
                "stalled_dropped": st.batches_dropped,
                "socket_ring": socket_sink.statistics().ring_bytes,
                "zmq_ring": zmq_sink.statistics().ring_bytes,
                "bytes_out": socket_sink.statistics().bytes_out,
            }))
            stalled.release()

    anyio.run(main)
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
@pytest.mark.parametrize("shape", ["small", "long"])
def test_rss_stays_within_the_bounds_of_outbox_and_rings(shape: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(BOUND), shape],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # Far more went through than the three bounds hold, and the bounds held.
    assert got["bytes_out"] > 4 * BOUND
    assert got["stalled_dropped"] > 0
    for key in ("stalled_queued", "socket_ring", "zmq_ring"):
        assert got[key] <= BOUND + 4 * 1024 * 1024, (key, got)
    # Resident memory: the three bounds, plus 32 MB (the allowance).
    assert got["grown"] <= 3 * BOUND + 32 * 1024 * 1024, got


REPLAY_CHILD = textwrap.dedent(
    """
    import dataclasses, gc, json, sys
    import anyio
    import zmq

    from kvstream import Scheduler
    from kvstream._bench.workload import event_pool
    from kvstream.sinks.zmq import ZmqSink
    from kvstream._wire.vllm_zmq import pack_seq

    BOUND = int(sys.argv[1])

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    async def main():
        pool = event_pool(1024)
        sink = ZmqSink(
            "tcp://127.0.0.1:0", bind=True, replay_endpoint="tcp://127.0.0.1:0",
            replay_max_bytes=BOUND, replay_timeout=0.2, linger=0.0,
        )
        ctx = zmq.Context()
        clients = []
        async with Scheduler(sinks=[sink], origin="o") as s:
            for i in range(60):  # 256-event batches: the ring is full and wraps
                s.emit(pool[(i * 256) % 1024 : (i * 256) % 1024 + 256])
                await s.tick()
            gc.collect()
            before = rss()
            for wave in range(3):
                for _ in range(8):
                    c = ctx.socket(zmq.DEALER)
                    c.setsockopt(zmq.RCVHWM, 1)
                    c.setsockopt(zmq.RCVBUF, 4096)
                    c.connect(sink.replay_endpoint)
                    c.send_multipart([b"", pack_seq(0)])
                    clients.append(c)  # never read, never closed: the attack
                with anyio.fail_after(30):
                    while True:
                        st = sink.statistics()
                        if st.replays_abandoned + st.replays_completed >= 8 * (wave + 1):
                            break
                        await anyio.sleep(0.05)
            gc.collect()
            grown = rss() - before
            print(json.dumps({"grown": grown, "stats": dataclasses.asdict(sink.statistics())}))
        for c in clients:
            c.close(linger=0)
        ctx.term()

    anyio.run(main)
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_replay_clients_that_never_read_pin_no_copies_of_the_ring() -> None:
    """Issue 15, failure 2: each never-reading client used to get the ring copied into
    ZMQ's queue (up to 1000 messages), kept for as long as it stayed connected."""
    ring = 8 * 1024 * 1024
    done = subprocess.run(
        [sys.executable, "-c", REPLAY_CHILD, str(ring)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    stats = got["stats"]
    assert stats["replays_abandoned"] + stats["replays_completed"] >= 24
    assert got["grown"] <= ring + 32 * 1024 * 1024, got
