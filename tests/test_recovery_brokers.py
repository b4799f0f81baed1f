"""Whole again on NATS and Redis: snapshots, gaps past the stream's retention, restarts.

Real servers (tests/servers.py). A reference :class:`StateKeeper` is fed every
batch the publisher makes; consumers that start late, are killed and restarted at
random points, or fall behind what the stream still holds, must end with exactly
its state, from the snapshots the sink published and the stream after them.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson
import pytest
from servers import NatsServer, RedisServer, nats_servers, redis_servers, wait_until

from kvstream._wire.broker import (
    SnapshotInfo,
    redis_position,
    snapshot_envelope,
    snapshot_parts,
    snapshot_subjects,
)
from kvstream.config import open_sink, open_subscriber
from kvstream.consumers.base import (
    Gap,
    LivenessChange,
    LivenessTracker,
    Subscriber,
    SubscriberItem,
)
from kvstream.consumers.socket import SnapshotBatch
from kvstream.events import AllBlocksCleared, BlockStored, EventBatch
from kvstream.sim import SimulatedEngine
from kvstream.sinks.base import Sink
from kvstream.state import StateKeeper

__all__ = ["nats_servers", "redis_servers"]  # fixtures, imported for pytest

pytestmark = pytest.mark.server

ORIGINS = ("eng-a", "eng-b.1")
EVERY = 3  # snapshot every 3 batches of an origin
KEEP = 6  # the stream keeps at least this many batches of each origin (> EVERY)


@dataclass
class Broker:
    """One transport under test: URLs, and how to make the stream forget."""

    kind: str
    port: int
    raw: Any = None  # a plain client of the server
    trimmed: int = 0

    def sink_url(self, **opts: object) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"snapshot_every": EVERY, **opts}.items())
        if self.kind == "nats":
            return f"nats://127.0.0.1:{self.port}?{query}"
        return f"redis://127.0.0.1:{self.port}/kv:events?{query}"

    def sub_url(self, **opts: object) -> str:
        if self.kind == "nats":
            opts = {"poll_interval": 0.2, **opts}
            base = f"nats://127.0.0.1:{self.port}"
        else:
            opts = {"block": 0.2, **opts}
            base = f"redis://127.0.0.1:{self.port}/kv:events"
        return base + "?" + "&".join(f"{k}={v}" for k, v in opts.items())

    async def trim(self, rng: random.Random, *, always: bool = False) -> None:
        """Forget old batches, keeping at least KEEP of each origin (NATS does it itself)."""
        if self.kind == "nats":
            return  # max_msgs_per_subject=KEEP on the stream
        entries = await self.raw.xrange("kv:events")
        by_origin: dict[bytes, list[bytes]] = {}
        for entry_id, fields in entries:
            by_origin.setdefault(fields[b"origin"], []).append(entry_id)
        long_enough = [ids[-KEEP] for ids in by_origin.values() if len(ids) >= KEEP]
        # Entry ids compared as numbers: as bytes, b"...-16" sorts before b"...-9" (then the
        # cut took an origin's last batches, which no later batch shows a consumer missing).
        cut = (
            min(long_enough, key=lambda i: redis_position(i.decode()))
            if len(long_enough) == len(by_origin)
            else None
        )
        if cut is not None and (always or rng.random() < 0.8):
            self.trimmed += await self.raw.xtrim("kv:events", minid=cut)


@pytest.fixture(params=["nats", "redis"])
async def broker(
    request: pytest.FixtureRequest,
    nats_servers: Callable[..., NatsServer],
    redis_servers: Callable[..., RedisServer],
) -> AsyncIterator[Broker]:
    if request.param == "nats":
        import nats
        from nats.js.api import StreamConfig

        server = nats_servers()
        client = await nats.connect(server.url)
        # A short retention per origin subject: consumers fall past it.
        await client.jsm().add_stream(
            StreamConfig(name="KV_EVENTS", subjects=["kv.events.>"], max_msgs_per_subject=KEEP)
        )
        yield Broker("nats", server.port, client)
        await client.close()
    else:
        import redis.asyncio

        rserver = redis_servers()
        rclient = redis.asyncio.Redis(port=rserver.port)
        yield Broker("redis", rserver.port, rclient)
        await rclient.aclose()


class Publisher:
    """Simulated engines, one per origin, and the reference state of all they said."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.reference = StateKeeper()
        self.epoch = 0
        self.restart()

    def restart(self) -> None:
        """A new publisher process: new epochs, engines that start empty."""
        self.epoch += 1
        self.seq = dict.fromkeys(ORIGINS, 0)
        self.engines = {
            o: SimulatedEngine(
                seed=self.rng.randrange(2**16),
                block_size=4,
                gpu_blocks=self.rng.randint(6, 20),
                cpu_blocks=24,
                remote_blocks=32,
                requests_per_step=2,
                reset_every=self.rng.choice([None, 9]),
                origin=o,
            )
            for o in ORIGINS
        }

    def next_batch(self) -> EventBatch:
        origin = self.rng.choice(ORIGINS)
        events = self.engines[origin].step_events() or [AllBlocksCleared()]
        seq = self.seq[origin]
        self.seq[origin] += 1
        batch = EventBatch(
            seq=seq, ts=float(seq), events=events, origin=origin, epoch=f"{origin}-{self.epoch}"
        )
        self.reference.apply(batch)
        return batch


@dataclass
class Consumer:
    sub: Subscriber
    it: AsyncIterator[SubscriberItem]
    keeper: StateKeeper = field(default_factory=StateKeeper)
    snapshots: int = 0

    async def catch_up(self, reference: StateKeeper) -> None:
        """Read until every origin is where the reference is; then the states must agree."""

        def done() -> bool:
            return all(
                self.keeper.position(o) == reference.position(o) for o in reference.origins()
            )

        with anyio.fail_after(30):
            while not done():
                item = await anext(self.it)
                assert not isinstance(item, Gap), f"a gap was not repaired: {item}"
                if isinstance(item, SnapshotBatch):
                    self.snapshots += 1
                self.keeper.apply(item)
        for origin in reference.origins():
            assert self.keeper.held(origin) == reference.held(origin), origin


async def _open_consumer(broker: Broker) -> Consumer:
    sub = open_subscriber(broker.sub_url())
    await sub.__aenter__()
    return Consumer(sub, aiter(sub))


async def _publish(sink: Sink, publisher: Publisher, n: int) -> None:
    before = sink.statistics().batches_out
    for _ in range(n):
        await sink.put(publisher.next_batch())
    await wait_until(lambda: sink.statistics().batches_out >= before + n)


async def _orphan_parts(broker: Broker, publisher: Publisher) -> None:
    """What a NATS publisher that died mid-snapshot leaves: parts, no head."""
    if broker.kind != "nats":
        return  # Redis writes a snapshot with one SET: there is no half of one
    keeper = StateKeeper()
    keeper.apply(EventBatch(seq=0, ts=0.0, events=[AllBlocksCleared()], origin="eng-a", epoch="x"))
    snap = keeper.snapshot("eng-a")
    info = SnapshotInfo("eng-a", "x", 1, "1", "kv.events.eng-a", 0, 0.0)
    envelope = snapshot_envelope(info, list(snapshot_parts(snap)))
    await broker.raw.jetstream().publish(snapshot_subjects("eng-a")[1], envelope[:10])


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_consumers_killed_restarted_and_left_behind_end_whole(
    broker: Broker, seed: int
) -> None:
    rng = random.Random(seed)
    publisher = Publisher(rng)
    sink = open_sink(broker.sink_url())
    await sink.__aenter__()
    consumers: list[Consumer] = []
    try:
        await _publish(sink, publisher, rng.randint(1, 8))
        consumer = await _open_consumer(broker)
        consumers.append(consumer)
        for _phase in range(10):
            await _publish(sink, publisher, rng.randint(1, 20))
            await broker.trim(rng)
            action = rng.choice(["read", "read", "kill", "restart-publisher", "idle"])
            if action == "kill":  # the consumer process dies; a new one starts cold
                await consumer.sub.aclose()
                consumer = await _open_consumer(broker)
                consumers.append(consumer)
            elif action == "restart-publisher":  # dies mid-snapshot, comes back
                await sink.aclose()
                await sink.__aexit__(None, None, None)
                await _orphan_parts(broker, publisher)
                publisher.restart()
                sink = open_sink(broker.sink_url())
                await sink.__aenter__()
                await _publish(sink, publisher, rng.randint(1, 6))
            if action != "idle":
                await consumer.catch_up(publisher.reference)
        await _publish(sink, publisher, 3)
        await consumer.catch_up(publisher.reference)
        # And a consumer that starts now, long after the stream forgot the start.
        late = await _open_consumer(broker)
        consumers.append(late)
        await late.catch_up(publisher.reference)
        assert late.snapshots >= 1
    finally:
        for c in consumers:
            await c.sub.aclose()
        await sink.aclose()
        await sink.__aexit__(None, None, None)


async def test_a_late_consumer_gets_one_snapshot_per_origin_then_the_stream(
    broker: Broker,
) -> None:
    rng = random.Random(7)
    publisher = Publisher(rng)
    async with open_sink(broker.sink_url()) as sink:
        await _publish(sink, publisher, 40)
        await broker.trim(rng, always=True)
        assert broker.kind == "nats" or broker.trimmed > 0
        consumer = await _open_consumer(broker)
        try:
            first = [await anext(consumer.it) for _ in range(len(ORIGINS))]
            assert all(isinstance(i, SnapshotBatch) for i in first)
            assert sorted(i.origin for i in first) == sorted(ORIGINS)
            for item in first:
                consumer.keeper.apply(item)  # type: ignore[arg-type]
            await consumer.catch_up(publisher.reference)
            stats = sink.snapshots  # type: ignore[attr-defined]
            assert stats.published >= 40 // EVERY - len(ORIGINS)
            assert stats.failed == 0
        finally:
            await consumer.sub.aclose()


async def test_a_live_consumer_left_behind_the_retention_is_repaired_by_a_snapshot(
    broker: Broker,
) -> None:
    rng = random.Random(11)
    publisher = Publisher(rng)
    async with open_sink(broker.sink_url()) as sink:
        await _publish(sink, publisher, 4)
        consumer = await _open_consumer(broker)
        try:
            await consumer.catch_up(publisher.reference)
            cold = consumer.snapshots
            # The consumer does not read while the stream forgets what it has not read.
            await _publish(sink, publisher, 40)
            await broker.trim(rng, always=True)
            await consumer.catch_up(publisher.reference)
            assert consumer.snapshots > cold  # the gaps were filled by snapshots
            assert consumer.sub.tracker.gaps == 0  # type: ignore[attr-defined]
        finally:
            await consumer.sub.aclose()


# -- heartbeats ------------------------------------------------------------------------


def test_liveness_tracker_reports_gone_back_and_restarted() -> None:
    now = [0.0]
    tracker = LivenessTracker(lambda: now[0])
    assert tracker.heard("a", "e1", 0) == []  # a batch: no interval known yet
    now[0] = 100.0
    assert tracker.check() == []  # never announced an interval: never judged gone
    assert tracker.heard("a", "e1", 0, interval=1.0) == []
    now[0] = 101.9
    assert tracker.check() == []
    now[0] = 102.1
    assert tracker.check() == [LivenessChange("a", "e1", "gone")]
    assert tracker.check() == []  # reported once
    assert not tracker.snapshot()["a"].alive
    assert tracker.heard("a", "e1", 3, interval=1.0) == [LivenessChange("a", "e1", "back")]
    assert tracker.heard("a", "e2", -1, interval=1.0) == [LivenessChange("a", "e2", "restarted")]
    live = tracker.snapshot()["a"]
    assert (live.epoch, live.last_seq, live.interval, live.alive) == ("e2", -1, 1.0, True)


async def test_heartbeats_tell_an_idle_publisher_from_a_gone_one(broker: Broker) -> None:
    changes: list[LivenessChange] = []
    items: list[SubscriberItem] = []
    sub = open_subscriber(broker.sub_url(heartbeats="true"), on_liveness=changes.append)

    async def read() -> None:
        async for item in sub:
            items.append(item)

    publisher = Publisher(random.Random(5))
    async with sub, anyio.create_task_group() as tg:
        tg.start_soon(read)
        sink = open_sink(broker.sink_url(heartbeat=0.5))
        async with sink:
            await _publish(sink, publisher, 2)
            beats = sink._heartbeats  # type: ignore[attr-defined]
            await wait_until(lambda: beats.sent >= 4)  # idle, and heard from
            live = sub.liveness()  # type: ignore[attr-defined]
            assert {o for o in live if live[o].interval == 0.5} <= set(ORIGINS)
            assert any(v.interval == 0.5 for v in live.values())
        # The publisher is gone: within two intervals the subscriber says so.
        await wait_until(lambda: any(c.change == "gone" for c in changes))
        gone = {c.origin for c in changes if c.change == "gone"}
        assert gone <= set(ORIGINS)
        assert all(not sub.liveness()[o].alive for o in gone)  # type: ignore[attr-defined]
        # It comes back as a new process: a new epoch.
        publisher.restart()
        async with open_sink(broker.sink_url(heartbeat=0.5)) as sink:
            await _publish(sink, publisher, 4)
            await wait_until(lambda: any(c.change == "restarted" for c in changes))
        tg.cancel_scope.cancel()


async def test_a_scheduler_publishing_through_a_snapshotting_sink(broker: Broker) -> None:
    """The whole path: a scheduler's batches, snapshots and heartbeats, a late reader."""
    from kvstream.scheduler import Scheduler

    engine = SimulatedEngine(seed=3, block_size=4, gpu_blocks=12, cpu_blocks=24, remote_blocks=32)
    reference = StateKeeper()
    sink = open_sink(broker.sink_url(heartbeat=0.2))
    async with Scheduler(sinks=[sink], origin="sched-0") as scheduler:
        for _ in range(12):
            events = engine.step_events()
            if events:
                scheduler.emit(events)
            await scheduler.tick()
        await wait_until(lambda: sink.statistics().batches_out >= 1)
        await wait_until(lambda: sink._heartbeats.sent >= 1)  # type: ignore[attr-defined]
    assert sink.snapshots.published >= 2  # type: ignore[attr-defined]
    consumer = await _open_consumer(broker)
    try:
        first = await anext(consumer.it)
        assert isinstance(first, SnapshotBatch)
        assert first.origin == "sched-0"
        consumer.keeper.apply(first)
        # The reference: the snapshot's own epoch fed the same engine's steps again.
        replay = SimulatedEngine(
            seed=3, block_size=4, gpu_blocks=12, cpu_blocks=24, remote_blocks=32
        )
        seq = 0
        for _ in range(12):
            events = replay.step_events()
            if events:
                reference.apply(
                    EventBatch(seq=seq, ts=0.0, events=events, origin="sched-0", epoch=first.epoch)
                )
                seq += 1
        await consumer.catch_up(reference)
    finally:
        await consumer.sub.aclose()


async def test_a_snapshot_that_fails_half_way_leaves_the_last_one_whole(
    nats_servers: Callable[..., NatsServer],
) -> None:
    """NATS: the snapshot stream runs out of room in the middle of a snapshot (some parts
    stored, no head): readers keep the previous snapshot; the failure is counted."""
    import nats
    from nats.js.api import DiscardPolicy, StreamConfig

    server = nats_servers()
    client = await nats.connect(server.url)
    try:
        await client.jsm().add_stream(
            StreamConfig(
                name="KV_SNAPSHOTS",
                subjects=["kv.snapshot.>"],
                allow_rollup_hdrs=True,
                max_bytes=3_000_000,
                discard=DiscardPolicy.NEW,
            )
        )
        publisher = Publisher(random.Random(9))
        url = f"nats://127.0.0.1:{server.port}?create=true&snapshot_every=1"
        async with open_sink(url) as sink:
            await _publish(sink, publisher, 2)
            snaps = sink.snapshots  # type: ignore[attr-defined]
            assert snaps.failed == 0
            # Big batches (each below max_payload): soon a snapshot does not fit in what
            # the snapshot stream has left.
            for k in range(12):
                seq = publisher.seq["eng-a"]
                publisher.seq["eng-a"] += 1
                first = 10**9 + k * 10**6
                big = EventBatch(
                    seq=seq,
                    ts=0.0,
                    events=[
                        BlockStored(
                            block_hashes=list(range(first + i * 1000, first + (i + 1) * 1000)),
                            parent_block_hash=None,
                            token_ids=list(range(4000)),
                            block_size=4,
                            medium="DISK",
                        )
                        for i in range(15)
                    ],
                    origin="eng-a",
                    epoch=f"eng-a-{publisher.epoch}",
                )
                publisher.reference.apply(big)
                await sink.put(big)
            await wait_until(lambda: sink.statistics().batches_out >= 14)
            assert snaps.failed >= 1
            info = await client.jsm().stream_info("KV_SNAPSHOTS")
            assert info.state.messages > 4  # parts of the failed ones are there
            head = await client.jsm().get_last_msg("KV_SNAPSHOTS", snapshot_subjects("eng-a")[0])
            resume = orjson.loads(head.data)["info"]["resume_seq"]  # type: ignore[arg-type]
            assert resume < publisher.seq["eng-a"]  # ... and the head is an older, whole one
            await _publish(sink, publisher, 3)  # the stream goes on
        consumer = await _open_consumer(Broker("nats", server.port))
        try:
            await consumer.catch_up(publisher.reference)
            assert consumer.snapshots >= 1
        finally:
            await consumer.sub.aclose()
    finally:
        await client.close()
