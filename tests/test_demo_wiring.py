"""`kvstream demo` wires the simulated engine: its connectors into the scheduler, its
snapshot into the socket sinks (a subscriber from beyond the ring gets the engine's state)."""

from __future__ import annotations

import os
import signal
import sys

import anyio
from servers import free_port

from kvstream.consumers.socket import SnapshotBatch, SocketSubscriber
from kvstream.events import EventBatch
from kvstream.sim import check_consistency

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def test_a_subscriber_from_beyond_the_demo_ring_gets_the_engine_snapshot() -> None:
    port = free_port()
    # A 128 KiB ring holds a few of the demo's batches (up to about 30 kB each).
    url = f"tcp://127.0.0.1:{port}?ring_bytes=131072&subscriber_bytes=131072"
    argv = [sys.executable, "-m", "kvstream", "demo", "--steps", "0", "--rate", "200"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    async with await anyio.open_process([*argv, "--sink", url], env=env) as proc:
        try:
            with anyio.fail_after(60):
                async with SocketSubscriber(port=port) as live:  # from the next batch
                    async for item in live:
                        if isinstance(item, EventBatch) and item.seq >= 60:
                            break  # well over 128 KiB sealed: seq 0 has left the ring
                async with SocketSubscriber(port=port, from_seq=0) as sub:
                    items = [await sub.__anext__() for _ in range(6)]
        finally:
            proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(30):
                code = await proc.wait()
    assert code == 0
    snapshot = items[0]
    assert isinstance(snapshot, SnapshotBatch)
    assert snapshot.first_missing == 0
    batches = [i for i in items[1:] if isinstance(i, EventBatch)]
    assert [b.seq for b in batches] == list(range(snapshot.seq + 1, snapshot.seq + 6))
    check_consistency([snapshot, *batches], start_seq=None)
