"""Whole again on the socket transport: cold starts from snapshots by default, resumes
past the ring, heartbeats.

A real `SocketSink` on loopback, its `snapshot_provider` a `StateKeeper` the host
feeds with every step it emits (so the snapshot taken at the tick barrier is exactly
the batches sealed). Consumers started late, killed and restarted at random points
(some after the ring forgot where they were), or left behind until the sink cut them
off, must end with exactly the state of a reference keeper that saw everything.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import pytest
from servers import wait_until

from kvstream._wire.broker import Heartbeat
from kvstream._wire.socket_protocol import heartbeat_message, parse_heartbeat
from kvstream.consumers.base import Gap, LivenessChange, SubscriberItem
from kvstream.consumers.socket import SnapshotBatch, SocketSubscriber
from kvstream.events import AllBlocksCleared, EventBatch, KVCacheEvent
from kvstream.scheduler import Scheduler
from kvstream.sim import SimulatedEngine
from kvstream.sinks.socket import SocketSink
from kvstream.state import StateKeeper

ORIGIN = "eng"


class Host:
    """An engine emitting into a scheduler, and the keeper of everything it said."""

    def __init__(self, scheduler: Scheduler, seed: int) -> None:
        self.scheduler = scheduler
        self.engine = SimulatedEngine(
            seed=seed,
            block_size=4,
            gpu_blocks=24,
            cpu_blocks=32,
            remote_blocks=48,
            requests_per_step=2,
            reset_every=13,
            origin=ORIGIN,
        )
        self.keeper = StateKeeper()
        self._n = 0

    def snapshot(self) -> list[KVCacheEvent]:
        """The sink's `snapshot_provider`: called at the tick barrier."""
        return list(self.keeper.snapshot_events(ORIGIN))

    async def emit(self, steps: int) -> None:
        """`steps` steps, each its own batch (emitted, then ticked)."""
        for _ in range(steps):
            events = self.engine.step_events() or [AllBlocksCleared()]
            self.scheduler.emit(events)
            self.keeper.apply(
                EventBatch(seq=self._n, ts=0.0, events=events, origin=ORIGIN, epoch="host")
            )
            self._n += 1
            await self.scheduler.tick()

    @property
    def next_seq(self) -> int:
        return self.scheduler.statistics().next_seq.get(ORIGIN, 0)


@dataclass
class Consumer:
    sub: SocketSubscriber
    it: AsyncIterator[SubscriberItem]
    keeper: StateKeeper = field(default_factory=StateKeeper)
    snapshots: int = 0

    async def catch_up(self, host: Host) -> None:
        await wait_until(lambda: host.scheduler.statistics().pending_events == 0)
        target = host.next_seq

        def done() -> bool:
            pos = self.keeper.position(ORIGIN)
            return pos is not None and pos[1] == target

        with anyio.fail_after(30):
            while not done():
                item = await anext(self.it)
                assert not isinstance(item, Gap), f"a gap was not repaired: {item}"
                if isinstance(item, SnapshotBatch):
                    self.snapshots += 1
                self.keeper.apply(item)
        assert self.keeper.held(ORIGIN) == host.keeper.held(ORIGIN)


async def _open(sink: SocketSink, **kw: object) -> Consumer:
    port = int(sink.address.rsplit(":", 1)[1])
    sub = SocketSubscriber(port=port, retry_initial=0.01, retry_max=0.05, **kw)  # type: ignore[arg-type]
    await sub.__aenter__()
    return Consumer(sub, aiter(sub))


def test_a_heartbeat_control_message_is_no_batch_and_reads_back() -> None:
    beat = Heartbeat(ORIGIN, "e1", 41, 5.0, 7)
    fields = heartbeat_message(beat)
    assert "seq" not in fields  # a `seq` key makes a batch, by the protocol's rule
    assert fields["type"] == "heartbeat"
    assert parse_heartbeat(fields) == beat


async def test_a_cold_start_begins_whole_from_the_snapshot_by_default() -> None:
    sink = SocketSink(port=0, ring_bytes=64 * 1024)
    async with Scheduler(sinks=[sink], origin=ORIGIN, tick_interval=0.01) as s:
        host = Host(s, 1)
        sink.snapshot_provider = host.snapshot
        await host.emit(100)
        await wait_until(lambda: s.statistics().pending_events == 0)
        assert sink.statistics().ring_batches < host.next_seq  # seq 0 is gone
        consumer = await _open(sink)
        consumers: list[Consumer] = []
        try:
            await consumer.catch_up(host)
            assert consumer.snapshots == 1
            await host.emit(3)
            await consumer.catch_up(host)
            late_live = await _open(sink, snapshots=False)  # the old behaviour, asked for
            consumers.append(late_live)
            await host.emit(1)
            first = await anext(late_live.it)
            assert not isinstance(first, SnapshotBatch)  # live only
            assert first.seq == host.next_seq - 1  # type: ignore[union-attr]
        finally:
            await consumer.sub.aclose()
            for c in consumers:
                await c.sub.aclose()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_socket_consumers_killed_restarted_and_left_behind_end_whole(seed: int) -> None:
    rng = random.Random(seed)
    # A small ring, and a subscriber cut off once it is 8 KiB behind.
    sink = SocketSink(port=0, ring_bytes=48 * 1024, subscriber_bytes=24 * 1024)
    consumers: list[Consumer] = []
    async with Scheduler(sinks=[sink], origin=ORIGIN, tick_interval=0.01) as s:
        host = Host(s, seed)
        sink.snapshot_provider = host.snapshot
        try:
            await host.emit(rng.randint(1, 10))
            consumer = await _open(sink)
            consumers.append(consumer)
            await consumer.catch_up(host)
            for _phase in range(10):
                action = rng.choice(["read", "kill", "kill-and-wait", "fall-behind"])
                if action.startswith("kill"):  # the consumer dies; a new one starts cold
                    await consumer.sub.aclose()
                    if action == "kill-and-wait":
                        await host.emit(rng.randint(20, 60))  # the ring forgets meanwhile
                    consumer = await _open(sink)
                    consumers.append(consumer)
                elif action == "fall-behind":  # not reading: the sink cuts it off
                    await host.emit(rng.randint(40, 80))
                await host.emit(rng.randint(1, 10))
                await consumer.catch_up(host)
            late = await _open(sink)
            consumers.append(late)
            await late.catch_up(host)
            assert late.snapshots == 1
        finally:
            for c in consumers:
                await c.sub.aclose()
    assert sink.statistics().snapshots_sent >= 1


async def test_heartbeats_tell_an_idle_sink_from_a_gone_one() -> None:
    changes: list[LivenessChange] = []
    sink = SocketSink(port=0, heartbeat=0.1)
    items: list[SubscriberItem] = []
    async with Scheduler(sinks=[sink], origin=ORIGIN, tick_interval=0.01) as s:
        host = Host(s, 4)
        consumer = await _open(sink, heartbeats=True, on_liveness=changes.append)

        async def read() -> None:
            async for item in consumer.sub:
                items.append(item)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await host.emit(2)
            await wait_until(lambda: sink.heartbeats_sent >= 3)
            live = consumer.sub.liveness()[ORIGIN]
            assert (live.interval, live.alive) == (0.1, True)
            assert live.last_seq == host.next_seq - 1
            assert changes == []  # idle is not gone
            await s.aclose()
            await sink.aclose()
            await wait_until(lambda: LivenessChange(ORIGIN, s.epoch, "gone") in changes)
            tg.cancel_scope.cancel()
        await consumer.sub.aclose()
    assert [i for i in items if isinstance(i, EventBatch)]


async def test_kvstream_tail_starts_from_the_snapshot_by_default() -> None:
    import sys

    import orjson

    sink = SocketSink(port=0, ring_bytes=64 * 1024)
    async with Scheduler(sinks=[sink], origin=ORIGIN, tick_interval=0.01) as s:
        host = Host(s, 5)
        sink.snapshot_provider = host.snapshot
        await host.emit(100)
        await wait_until(lambda: s.statistics().pending_events == 0)
        assert sink.statistics().ring_batches < host.next_seq
        tail = ["tail", sink.address, "--count", "1", "--format", "json"]
        with anyio.fail_after(60):
            result = await anyio.run_process([sys.executable, "-m", "kvstream", *tail], check=False)
    assert result.returncode == 0, result.stderr
    line = orjson.loads(result.stdout.splitlines()[0])
    assert (line["type"], line["next_seq"]) == ("snapshot", 100)
    assert b"gap" not in result.stderr
