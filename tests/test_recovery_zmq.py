"""Whole again on ZMQ: kvstream's snapshot endpoint and heartbeats beside vLLM's wire.

Real sockets (ipc under a short temporary directory, so a restarted publisher
binds the same endpoints). A reference `StateKeeper` is fed every batch the
publisher makes; consumers that start late, are killed and restarted at random
points (some after the replay ring forgot what they missed), or whose publisher
is killed in the middle of a snapshot, must end with exactly its state.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import pytest
import zmq
import zmq.asyncio
from servers import wait_until

from kvstream._wire.broker import Heartbeat
from kvstream._wire.zmq_recovery import (
    HEARTBEAT_TOPIC,
    SnapshotHead,
    heartbeat_frames,
    parse_heartbeat,
    parse_snapshot_message,
    parse_snapshot_request,
    snapshot_message,
    snapshot_request,
)
from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.config import open_subscriber
from kvstream.consumers.base import Gap, LivenessChange, Subscriber, SubscriberItem
from kvstream.consumers.socket import SnapshotBatch
from kvstream.consumers.zmq import ZmqPublisher, ZmqSubscriber
from kvstream.errors import ConfigError, DecodeError
from kvstream.events import AllBlocksCleared, BlockStored, EventBatch
from kvstream.sim import SimulatedEngine
from kvstream.sinks.zmq import ZmqSink
from kvstream.state import StateKeeper

ORIGIN = "eng"
RING = 5  # the publisher's replay ring keeps this many batches


@pytest.fixture
def short_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(dir="/tmp", prefix="kvr")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class Endpoints:
    live: str
    replay: str
    snapshot: str

    def sink(self, **kw: Any) -> ZmqSink:
        kw.setdefault("buffer_steps", RING)
        kw.setdefault("policy", "block")
        return ZmqSink(
            self.live, replay_endpoint=self.replay, snapshot_endpoint=self.snapshot, **kw
        )

    def url(self, **opts: object) -> str:
        query = {"replay": self.replay, "snapshot": self.snapshot, "origin": ORIGIN, **opts}
        return f"zmq+{self.live}?" + "&".join(f"{k}={v}" for k, v in query.items())


@pytest.fixture
def endpoints(short_dir: str) -> Endpoints:
    return Endpoints(
        f"ipc://{short_dir}/live", f"ipc://{short_dir}/replay", f"ipc://{short_dir}/snap"
    )


class Publisher:
    """A simulated engine and the reference state of all it said."""

    def __init__(self, seed: int, epoch: str = "e1") -> None:
        self.engine = SimulatedEngine(
            seed=seed,
            block_size=4,
            gpu_blocks=16,
            cpu_blocks=24,
            remote_blocks=32,
            requests_per_step=2,
            reset_every=11,
            origin=ORIGIN,
        )
        self.epoch = epoch
        self.seq = 0
        self.reference = StateKeeper()

    def next_batch(self) -> EventBatch:
        events = self.engine.step_events() or [AllBlocksCleared()]
        batch = EventBatch(
            seq=self.seq, ts=float(self.seq), events=events, origin=ORIGIN, epoch=self.epoch
        )
        self.seq += 1
        self.reference.apply(batch)
        return batch


@dataclass
class Consumer:
    sub: Subscriber
    it: AsyncIterator[SubscriberItem]
    keeper: StateKeeper = field(default_factory=StateKeeper)
    snapshots: list[SnapshotBatch] = field(default_factory=list)

    async def catch_up(
        self, reference: StateKeeper, next_seq: int | None = None, *, not_epoch: str = ""
    ) -> None:
        """Read until at the reference's position (or `next_seq`), in an epoch other
        than `not_epoch` (the publisher restarted); then the states must agree."""
        if next_seq is None:
            target = reference.position(ORIGIN)
            assert target is not None
            next_seq = target[1]

        def done() -> bool:
            pos = self.keeper.position(ORIGIN)
            return pos is not None and pos[1] == next_seq and pos[0] != not_epoch

        with anyio.fail_after(30):
            while not done():
                item = await anext(self.it)
                assert not isinstance(item, Gap), f"a gap was not repaired: {item}"
                if isinstance(item, SnapshotBatch):
                    self.snapshots.append(item)
                self.keeper.apply(item)
        assert self.keeper.known(ORIGIN)
        assert self.keeper.held(ORIGIN) == reference.held(ORIGIN)


async def _open(endpoints: Endpoints, **opts: object) -> Consumer:
    sub = open_subscriber(endpoints.url(replay_timeout=2, **opts))
    await sub.__aenter__()
    return Consumer(sub, aiter(sub))


async def _publish(sink: ZmqSink, publisher: Publisher, n: int) -> None:
    before = sink.statistics().batches_out
    for _ in range(n):
        await sink.put(publisher.next_batch())
    await wait_until(lambda: sink.statistics().batches_out >= before + n)


# -- the frames ----------------------------------------------------------------------


def test_the_frames_round_trip_and_refuse_what_they_are_not() -> None:
    assert snapshot_request(b"kv") == [b"", b"KVSNAP1", b"kv"]
    assert parse_snapshot_request([b"id", *snapshot_request(b"kv")]) == (b"id", b"kv")
    with pytest.raises(DecodeError, match="snapshot request"):
        parse_snapshot_request([b"id", b"", b"\x00" * 8])  # a replay request
    head = SnapshotHead(ORIGIN, "e1", 7, 3, 1, None, 1.5)
    frames = snapshot_message(b"id", "head", b"kv", head.to_json())
    message = parse_snapshot_message(frames[1:])
    assert (message.kind, message.topic) == ("head", b"kv")
    assert SnapshotHead.from_json(message.body) == head
    with pytest.raises(DecodeError, match="unknown kind"):
        parse_snapshot_message([b"", b"KVSNAP1", b"what", b"kv", b""])
    with pytest.raises(DecodeError, match="wrong type"):
        SnapshotHead.from_json(head._replace(resume_seq=0).to_json())
    beat = Heartbeat(ORIGIN, "e1", 4, 0.5, 2)
    assert parse_heartbeat(heartbeat_frames(b"kv", beat)) == (b"kv", beat)
    with pytest.raises(DecodeError, match="heartbeat"):
        parse_heartbeat([b"kv", b"\x00" * 8, b"payload"])


def test_bad_recovery_options_are_refused_naming_them() -> None:
    with pytest.raises(ConfigError, match="heartbeat: expected seconds > 0, got 0"):
        ZmqSink("tcp://127.0.0.1:0", heartbeat=0)
    with pytest.raises(ConfigError, match="snapshot_max_bytes"):
        ZmqSink("tcp://127.0.0.1:0", snapshot_endpoint="tcp://127.0.0.1:0", snapshot_max_bytes=0)
    with pytest.raises(ConfigError, match="snapshot"):
        ZmqPublisher("tcp://*:5557", snapshot_endpoint="tcp://127.0.0.1:1")


# -- vLLM-wire consumers see the same bytes -------------------------------------------


async def test_the_live_bytes_are_the_same_with_recovery_off_and_on(short_dir: str) -> None:
    publisher = Publisher(3)
    batches = [publisher.next_batch() for _ in range(6)]
    seen: dict[str, list[list[bytes]]] = {}
    beats: list[list[bytes]] = []
    ctx = zmq.asyncio.Context()
    try:
        for mode in ("off", "on"):
            extra: dict[str, Any] = {}
            if mode == "on":
                extra = {"snapshot_endpoint": f"ipc://{short_dir}/s", "heartbeat": 0.05}
            sink = ZmqSink(f"ipc://{short_dir}/{mode}", topic="kv", policy="block", **extra)
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")  # a vLLM-wire consumer of its topic
            watcher = ctx.socket(zmq.SUB)
            watcher.setsockopt(zmq.SUBSCRIBE, HEARTBEAT_TOPIC)
            try:
                async with sink:
                    sub.connect(sink.endpoint)
                    watcher.connect(sink.endpoint)
                    with anyio.fail_after(10):
                        await sink.wait_subscribed(2)
                    for batch in batches:
                        await sink.put(batch)
                    got: list[list[bytes]] = []
                    with anyio.fail_after(10):
                        while len(got) < len(batches):
                            got.append(await sub.recv_multipart())
                    if mode == "on":
                        with anyio.fail_after(10):
                            while len(beats) < 2:
                                beats.append(await watcher.recv_multipart())
                    seen[mode] = got
                    await anyio.sleep(0.2)  # heartbeats go on meanwhile (mode "on")
                    assert not await sub.poll(0)  # ... and none reached the topic's consumer
            finally:
                sub.close(linger=0)
                watcher.close(linger=0)
    finally:
        ctx.term()
    codec = MsgpackCodec()
    assert seen["on"] == seen["off"]
    assert seen["on"] == [[b"kv", b.seq.to_bytes(8, "big"), codec.encode(b)] for b in batches]
    topic, beat = parse_heartbeat(beats[-1])
    assert (topic, beat.origin, beat.epoch, beat.seq) == (b"kv", ORIGIN, "e1", 5)


# -- snapshots ----------------------------------------------------------------------------


async def test_a_late_consumer_starts_from_a_snapshot_long_after_the_ring_forgot(
    endpoints: Endpoints,
) -> None:
    publisher = Publisher(1)
    async with endpoints.sink() as sink:
        await _publish(sink, publisher, 30)  # six times the ring
        consumer = await _open(endpoints)
        try:
            first = await anext(consumer.it)
            assert isinstance(first, SnapshotBatch)
            assert (first.origin, first.epoch, first.next_seq) == (ORIGIN, "e1", 30)
            assert type(first.events[0]) is AllBlocksCleared
            consumer.keeper.apply(first)
            assert consumer.keeper.held(ORIGIN) == publisher.reference.held(ORIGIN)
            await _publish(sink, publisher, 8)
            await consumer.catch_up(publisher.reference)
            stats = consumer.sub.statistics()[0]  # type: ignore[attr-defined]
            assert (stats.snapshots, stats.gaps, stats.epoch) == (1, 0, "e1")
            served = sink.statistics().snapshots
            assert served is not None
            assert served.served == 1
        finally:
            await consumer.sub.aclose()


async def test_a_publisher_without_a_snapshot_yet_leaves_the_consumer_as_before(
    endpoints: Endpoints,
) -> None:
    publisher = Publisher(2)
    async with endpoints.sink() as sink:
        consumer = await _open(endpoints)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(consumer.catch_up, publisher.reference, 4)
                with anyio.fail_after(10):
                    await sink.wait_subscribed(2)  # the stream, and its heartbeats
                await wait_until(lambda: sink.statistics().snapshots.requests >= 1)  # type: ignore[union-attr]
                await _publish(sink, publisher, 4)
            assert consumer.snapshots == []
            stats = consumer.sub.statistics()[0]  # type: ignore[attr-defined]
            assert (stats.snapshots_failed, stats.gaps) == (1, 0)
        finally:
            await consumer.sub.aclose()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_consumers_killed_restarted_and_left_behind_end_whole(
    endpoints: Endpoints, seed: int
) -> None:
    rng = random.Random(seed)
    publisher = Publisher(seed)
    # Heartbeats tell a restart the sequence cannot (a publisher that restarts after
    # its seq 0 sends a seq 0 again: on vLLM's wire, a duplicate).
    sink = endpoints.sink(heartbeat=0.1)
    await sink.__aenter__()
    consumers: list[Consumer] = []
    beyond = 0
    try:
        await _publish(sink, publisher, rng.randint(1, 8))
        consumer = await _open(endpoints, heartbeats="true")
        consumers.append(consumer)
        await consumer.catch_up(publisher.reference)
        for _phase in range(10):
            action = rng.choice(["read", "kill", "kill-and-wait", "restart-publisher"])
            before = consumer.keeper.position(ORIGIN)
            assert before is not None
            not_epoch = before[0] if action == "restart-publisher" else ""
            if action.startswith("kill"):  # the consumer dies; a new one starts cold
                await consumer.sub.aclose()
                if action == "kill-and-wait":  # ... after the ring forgot where it was
                    await _publish(sink, publisher, RING + rng.randint(1, 6))
                    beyond += 1
                consumer = await _open(endpoints, heartbeats="true")
                consumers.append(consumer)
            elif action == "restart-publisher":  # a new process: new epoch, empty state
                await sink.aclose()
                await sink.__aexit__(None, None, None)
                publisher = Publisher(rng.randrange(1000), epoch=f"e{_phase + 2}")
                sink = endpoints.sink(heartbeat=0.1)
                await sink.__aenter__()
                with anyio.fail_after(10):
                    await sink.wait_subscribed(2)
            # (At least 2: a publisher that restarts after its seq 0 alone and
            # sends seq 0 again looks like a duplicate until its heartbeat.)
            await _publish(sink, publisher, rng.randint(2, 12))
            await consumer.catch_up(publisher.reference, not_epoch=not_epoch)
        late = await _open(endpoints)
        consumers.append(late)
        await _publish(sink, publisher, 2)
        await late.catch_up(publisher.reference)
        await consumer.catch_up(publisher.reference)
        if publisher.seq > 2:
            assert late.snapshots, "a consumer started this late needs a snapshot"
        if beyond:
            assert any(c.snapshots for c in consumers[1:])
    finally:
        for c in consumers:
            await c.sub.aclose()
        await sink.aclose()
        await sink.__aexit__(None, None, None)


async def test_a_running_consumer_past_the_ring_is_repaired_by_a_snapshot(
    endpoints: Endpoints,
) -> None:
    """Live batches lost to the consumer (its reorder buffer overflowed while a
    snapshot was in flight) that the ring no longer has, and the publisher idle
    after them: its heartbeat tells the last seq, and a second snapshot fills it."""
    publisher = Publisher(4)
    async with endpoints.sink(heartbeat=0.1) as sink:
        await _publish(sink, publisher, 10)
        sub = ZmqSubscriber(
            ZmqPublisher(
                endpoints.live,
                replay_endpoint=endpoints.replay,
                snapshot_endpoint=endpoints.snapshot,
                origin=ORIGIN,
            ),
            max_reorder=2,
        )
        consumer = Consumer(sub, aiter(sub))
        await sub.__aenter__()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(consumer.catch_up, publisher.reference, 10 + 3 * RING)
                with anyio.fail_after(10):
                    await sink.wait_subscribed(2)
                # Published before the subscriber reads its first reply: held, overflowing.
                await _publish(sink, publisher, 3 * RING)
            stats = sub.statistics()[0]
            assert stats.reorder_overflow > 0
            assert stats.gaps == 0
            assert len(consumer.snapshots) >= 1
        finally:
            await sub.aclose()


# -- heartbeats ---------------------------------------------------------------------------


async def test_heartbeats_tell_an_idle_publisher_from_a_gone_or_restarted_one(
    endpoints: Endpoints,
) -> None:
    changes: list[LivenessChange] = []
    sub = open_subscriber(
        endpoints.url(heartbeats="true", replay_timeout=2), on_liveness=changes.append
    )
    items: list[SubscriberItem] = []

    async def read() -> None:
        async for item in sub:
            items.append(item)

    publisher = Publisher(5)
    async with sub, anyio.create_task_group() as tg:
        tg.start_soon(read)
        async with endpoints.sink(heartbeat=0.1) as sink:
            with anyio.fail_after(10):
                await sink.wait_subscribed(2)
            await _publish(sink, publisher, 3)
            await wait_until(lambda: sub.statistics()[0].heartbeats >= 2)  # type: ignore[attr-defined]
            assert changes == []  # idle is not gone
            live = sub.liveness()[ORIGIN]  # type: ignore[attr-defined]
            assert (live.epoch, live.last_seq, live.interval, live.alive) == ("e1", 2, 0.1, True)
        await wait_until(lambda: LivenessChange(ORIGIN, "e1", "gone") in changes)
        publisher = Publisher(6, epoch="e2")
        async with endpoints.sink(heartbeat=0.1) as sink:
            await _publish(sink, publisher, 2)
            # Published before the subscriber reconnected (the usual case): the new
            # publisher's heartbeat alone tells the restart, under its epoch, and the
            # batches missed are asked from the ring. Published after (a race this test
            # does not control): the live batches tell it (their seq went back), under an
            # epoch of the subscriber's own, and the heartbeat then names the publisher's
            # without a second restart (each path alone: tests/test_zmq.py).
            await wait_until(lambda: any(c.change == "restarted" for c in changes))
            restarted = [c for c in changes if c.change == "restarted"]
            assert len(restarted) == 1
            epoch = restarted[0].epoch
            assert epoch != "e1"
            await wait_until(
                lambda: any(
                    isinstance(i, EventBatch) and (i.epoch, i.seq) == (epoch, 1) for i in items
                )
            )
            await wait_until(lambda: sub.liveness()[ORIGIN].epoch == "e2")  # type: ignore[attr-defined]
            assert sub.statistics()[0].restarts == 1  # type: ignore[attr-defined]
        tg.cancel_scope.cancel()
    batches = [i for i in items if isinstance(i, EventBatch)]
    assert not [i for i in items if isinstance(i, Gap)]
    assert [(b.epoch, b.seq) for b in batches[-2:]] == [(epoch, 0), (epoch, 1)]
    assert changes[0] == LivenessChange(ORIGIN, "e1", "gone")
    assert [c.change for c in changes] == ["gone", "restarted"]


# -- a publisher killed in the middle of a snapshot (a real process) -----------------------

_PUBLISHER_SCRIPT = """
import sys, anyio
from kvstream.sinks.zmq import ZmqSink
from kvstream.events import BlockStored, EventBatch

live, replay, snap, epoch, batches, blocks, second = sys.argv[1:8]

async def main():
    extra = {"heartbeat": 0.2} if second == "1" else {}
    sink = ZmqSink(live, replay_endpoint=replay, snapshot_endpoint=snap, policy="block",
                   buffer_steps=4, **extra)
    async with sink:
        if second == "1":
            await sink.wait_subscribed(2)
        per = int(blocks) // int(batches)
        parent = None
        for seq in range(int(batches)):
            hashes: list[int | bytes] = list(range(seq * per + 1, (seq + 1) * per + 1))
            event = BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                token_ids=list(range(4 * per)), block_size=4)
            parent = hashes[-1]
            await sink.put(EventBatch(seq=seq, ts=0.0, events=[event], origin="eng", epoch=epoch))
        while sink.statistics().batches_out < int(batches):
            await anyio.sleep(0.01)
        print("published", flush=True)
        while True:
            stats = sink.statistics().snapshots
            if stats.requests > 0:
                print("requested", flush=True)
                break
            await anyio.sleep(0.001)
        while True:
            await anyio.sleep(0.001)

anyio.run(main)
"""


def _reference(epoch: str, batches: int, blocks: int) -> StateKeeper:
    keeper = StateKeeper()
    per = blocks // batches
    parent = None
    for seq in range(batches):
        hashes: list[int | bytes] = list(range(seq * per + 1, (seq + 1) * per + 1))
        event = BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=list(range(4 * per)),
            block_size=4,
        )
        parent = hashes[-1]
        keeper.apply(EventBatch(seq=seq, ts=0.0, events=[event], origin=ORIGIN, epoch=epoch))
    return keeper


class _Process:
    def __init__(
        self, endpoints: Endpoints, epoch: str, batches: int, blocks: int, *, second: bool
    ) -> None:
        args = [endpoints.live, endpoints.replay, endpoints.snapshot, epoch, str(batches)]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PUBLISHER_SCRIPT, *args, str(blocks), str(int(second))],
            stdout=subprocess.PIPE,
            env=os.environ.copy(),
        )

    async def wait_for(self, line: str) -> None:
        assert self.proc.stdout is not None
        stdout = self.proc.stdout

        def read() -> None:
            while True:
                got = stdout.readline().decode().strip()
                assert got, "the publisher process ended"
                if got == line:
                    return

        with anyio.fail_after(60):
            await anyio.to_thread.run_sync(read, abandon_on_cancel=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


async def test_a_publisher_killed_mid_snapshot_then_restarted_leaves_consumers_whole(
    endpoints: Endpoints,
) -> None:
    blocks = 200_000  # a snapshot of 98 parts: the kill lands while it is made or sent
    first = _Process(endpoints, "p1", 40, blocks, second=False)
    consumers: list[Consumer] = []
    second: _Process | None = None
    reference = _reference("p2", 30, 3_000)
    try:
        await first.wait_for("published")
        # Cold start: the subscriber asks for a snapshot as soon as it starts, and
        # the process is killed once the request has arrived.
        consumer = await _open(endpoints, heartbeats="true")
        consumers.append(consumer)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(consumer.catch_up, reference, 30, not_epoch="p1"))
            await first.wait_for("requested")
            first.kill()
            # A new process with a new epoch, on the same endpoints, with heartbeats.
            second = _Process(endpoints, "p2", 30, 3_000, second=True)
            await second.wait_for("published")
        stats = consumer.sub.statistics()[0]  # type: ignore[attr-defined]
        assert stats.epoch != "p1"
        # And a consumer that starts now takes the new process's snapshot.
        late = await _open(endpoints)
        consumers.append(late)
        await late.catch_up(reference)
        assert [s.epoch for s in late.snapshots] == ["p2"]
    finally:
        for c in consumers:
            await c.sub.aclose()
        first.kill()
        if second is not None:
            second.kill()


# -- the relay gives an engine without snapshots a snapshot endpoint -----------------------


async def _held_like(consumer: Consumer, origin: str, reference: StateKeeper) -> None:
    """Read until `consumer` holds for `origin` what `reference` holds for ORIGIN."""
    with anyio.fail_after(30):
        while not (
            consumer.keeper.known(origin) and consumer.keeper.held(origin) == reference.held(ORIGIN)
        ):
            item = await anext(consumer.it)
            assert not isinstance(item, Gap), f"a gap was not repaired: {item}"
            if isinstance(item, SnapshotBatch):
                consumer.snapshots.append(item)
            consumer.keeper.apply(item)


async def test_a_relay_serves_snapshots_and_heartbeats_for_an_engine_without_them(
    short_dir: str,
) -> None:
    from kvstream.relay import Relay
    from kvstream.scheduler import Scheduler

    codec = MsgpackCodec()
    engine_endpoint = f"ipc://{short_dir}/engine"
    ctx = zmq.asyncio.Context()
    engine = ctx.socket(zmq.XPUB)  # an old engine: vLLM's frames, no replay, no snapshots
    engine.bind(engine_endpoint)
    downstream = Endpoints(
        f"ipc://{short_dir}/out", f"ipc://{short_dir}/out-replay", f"ipc://{short_dir}/out-snap"
    )
    relay_sink = ZmqSink(
        downstream.live,
        replay_endpoint=downstream.replay,
        snapshot_endpoint=downstream.snapshot,
        topic="{origin}",
        buffer_steps=RING,
        heartbeat=0.1,
        policy="block",
    )
    upstream = ZmqSubscriber(ZmqPublisher(engine_endpoint, origin="gpu-0"))
    publisher = Publisher(9)

    async def engine_publishes(n: int) -> None:
        for _ in range(n):
            batch = publisher.next_batch()
            await engine.send_multipart([b"", batch.seq.to_bytes(8, "big"), codec.encode(batch)])

    consumers: list[Consumer] = []
    try:
        async with Scheduler(sinks=[relay_sink], tick_interval=0.01) as scheduler:
            relay = Relay(scheduler, [upstream])
            async with upstream, anyio.create_task_group() as tg:
                tg.start_soon(relay.run)
                with anyio.fail_after(10):
                    assert (await engine.recv())[:1] == b"\x01"  # the relay subscribed
                await engine_publishes(30)  # six times the relay's ring
                await wait_until(lambda: relay.statistics().batches_in >= 30)
                await wait_until(lambda: relay_sink.statistics().batches_out >= 1)
                # A router that starts now: the relay's snapshot of the engine's state.
                late = ZmqSubscriber(
                    ZmqPublisher(
                        downstream.live,
                        replay_endpoint=downstream.replay,
                        snapshot_endpoint=downstream.snapshot,
                        topic="gpu-0",
                        origin="gpu-0",
                    ),
                    heartbeats=True,
                )
                await late.__aenter__()
                consumer = Consumer(late, aiter(late))
                consumers.append(consumer)
                await _held_like(consumer, "gpu-0", publisher.reference)
                assert consumer.snapshots
                await wait_until(lambda: relay_sink.heartbeats_sent >= 1)  # for the idle engine
                # The engine restarts (counts from 0 again, empty): the relay forwards
                # one AllBlocksCleared and counts it; the router follows.
                publisher = Publisher(10, epoch="e2")
                await engine_publishes(4)
                await _held_like(consumer, "gpu-0", publisher.reference)
                await wait_until(lambda: relay.statistics().restarts == 1)
                relay.stop()
    finally:
        for c in consumers:
            await c.sub.aclose()
        engine.close(linger=0)
        ctx.term()
    assert relay.statistics().restarts == 1


async def test_a_relay_carries_an_upstream_snapshot_under_a_new_epoch_as_no_restart() -> None:
    """A ZMQ subscriber names batches by its own epoch until a snapshot tells it the
    publisher's: the relay forwards the snapshot's one clear and counts no restart."""
    from kvstream.consumers._broker import as_snapshot_batch
    from kvstream.relay import Relay
    from kvstream.scheduler import Scheduler
    from kvstream.sinks.memory import MemorySink

    publisher = Publisher(12)
    first = publisher.next_batch()
    snapshot = publisher.reference.snapshot(ORIGIN)
    items = [
        first.replace(epoch="invented"),
        as_snapshot_batch(snapshot.to_batch(), 1),
    ]

    class Upstream(Subscriber):
        def __aiter__(self) -> AsyncIterator[SubscriberItem]:
            async def gen() -> AsyncIterator[SubscriberItem]:
                for item in items:
                    yield item

            return gen()

        async def aclose(self) -> None:
            pass

    sink = MemorySink()
    async with Scheduler(sinks=[sink], tick_interval=0.01) as scheduler:
        relay = Relay(scheduler, [Upstream()])
        await relay.run()
    out = [e for b in sink.batches for e in b.events]
    assert relay.statistics().restarts == 0
    assert sum(type(e) is AllBlocksCleared for e in out) == 1 + sum(
        type(e) is AllBlocksCleared for e in first.events
    )


async def test_the_snapshot_endpoint_refuses_what_it_cannot_answer(short_dir: str) -> None:
    """A malformed request is counted; an unknown topic, or a state past its bound,
    gets `none` with the reason (a consumer then goes on from the ring)."""
    publisher = Publisher(13)
    sink = ZmqSink(
        f"ipc://{short_dir}/live",
        snapshot_endpoint=f"ipc://{short_dir}/snap",
        topic="kv",
        snapshot_max_bytes=4096,  # a few blocks
        policy="block",
    )
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        async with sink:
            for _ in range(5):
                await sink.put(publisher.next_batch())
            dealer.connect(f"ipc://{short_dir}/snap")
            await dealer.send_multipart([b"", b"\x00" * 8])  # a replay request, not ours
            replies = []
            for topic in (b"other", b"kv"):
                await dealer.send_multipart(snapshot_request(topic))
                with anyio.fail_after(10):
                    replies.append(parse_snapshot_message(await dealer.recv_multipart()))
            stats = sink.statistics().snapshots
    finally:
        dealer.close(linger=0)
        ctx.term()
    assert [(r.kind, r.topic) for r in replies] == [("none", b"other"), ("none", b"kv")]
    assert b"no stream has this topic" in replies[0].body
    assert b"unknown" in replies[1].body  # the bound made the state unknown
    assert stats is not None
    assert (stats.malformed, stats.requests, stats.unavailable, stats.served) == (1, 2, 2, 0)
