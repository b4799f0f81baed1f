"""Hostile and vanishing peers on real sockets: the socket sink and the ZMQ sink.

* The socket sink's listener meets garbage hellos, oversized lines, silent
  clients, chatter after the hello, and subscribers that vanish mid-write (a TCP
  reset): each is refused or dropped, counted, logged once per burst, and a
  well-behaved subscriber beside them receives every batch.
* Replay cannot make a sink send more than its ring, nor hold up live
  publishing: stalled replaying peers never make the tick wait.
* The ZMQ sink's replay ROUTER meets malformed requests and clients that leave
  mid-reply; live publishing and well-formed replays go on, bounded by the ring.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import msgspec
import orjson
import pytest
from anyio.abc import SocketAttribute
from servers import wait_until

from kvstream import EventBatch, JsonCodec, Scheduler
from kvstream.consumers.base import Gap
from kvstream.consumers.socket import SocketSubscriber
from kvstream.sinks.socket import SocketSink
from kvstream.testing import SeededEvents, StreamVerifier

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

PER_BATCH = 10


def run_without_suspending(coro: Coroutine[Any, Any, EventBatch | None]) -> EventBatch | None:
    """Run ``coro`` to its end in one step; fail if it would wait for anything."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise AssertionError("tick() suspended")


def _port(sink: SocketSink) -> int:
    return int(sink.address.rsplit(":", 1)[1])


async def read_until_closed(stream: anyio.abc.ByteStream) -> bytes:
    """Everything the peer sends until it closes the connection (at most 20 s)."""
    got = bytearray()
    with anyio.fail_after(20):
        try:
            while True:
                got += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    return bytes(got)


async def _talk(port: int, data: bytes, *, then_wait: bool = True) -> bytes:
    """Connect, send ``data``, and read until the sink closes the connection."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        if data:
            await stream.send(data)
        if not then_wait:
            return b""
        return await read_until_closed(stream)


def _error_code(reply: bytes) -> str:
    first = orjson.loads(reply.split(b"\n", 1)[0])
    assert first["type"] == "error", first
    return str(first["code"])


# -- the socket sink ---------------------------------------------------------------------


async def test_hostile_socket_peers_are_refused_and_the_subscriber_misses_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="kvstream.sinks.socket")
    stream = SeededEvents(21)
    seen = StreamVerifier(stream, origin="eng", events_per_batch=PER_BATCH)
    sink = SocketSink(port=0, hello_timeout=1.0)
    total = 300
    replies: dict[str, bytes] = {}
    async with Scheduler(sinks=[sink], origin="eng") as scheduler:
        port = _port(sink)
        async with SocketSubscriber(port=port, from_seq=0, reconnect=False) as sub:

            async def consume() -> None:
                async for item in sub:
                    assert isinstance(item, EventBatch), item
                    seen.check(item)
                    if seen.batches == total:
                        return

            async def hostile(name: str, data: bytes) -> None:
                replies[name] = await _talk(port, data)

            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                tg.start_soon(hostile, "binary", b"\x00\xff\xfe garbage\n")
                tg.start_soon(hostile, "not-an-object", b"[1, 2, 3]\n")
                tg.start_soon(hostile, "no-newline", b"{" * (70 * 1024))
                tg.start_soon(hostile, "silent", b"")
                tg.start_soon(hostile, "trailing", b'{"from_seq": 0}\n{"more": 1}\n')
                tg.start_soon(hostile, "ahead", b'{"from_seq": 999999999}\n')
                tg.start_soon(hostile, "future-version", b'{"version": 99}\n')
                tg.start_soon(hostile, "unknown-key", b'{"from_seq": 0, "evil": true}\n')
                tg.start_soon(hostile, "negative", b'{"from_seq": -1}\n')
                for n in range(total):
                    scheduler.emit(stream.events(n * PER_BATCH, (n + 1) * PER_BATCH))
                    await scheduler.tick()
                    if n % 10 == 0:
                        await anyio.sleep(0.001)
                # A client that says hello and then talks is dropped (after the welcome).
                async with await anyio.connect_tcp("127.0.0.1", port) as chatty:
                    await chatty.send(b"{}\n")
                    await chatty.receive()  # the welcome
                    await chatty.send(b"unexpected chatter\n")
                    with anyio.fail_after(10):
                        try:
                            while True:
                                await chatty.receive()
                        except (anyio.EndOfStream, anyio.BrokenResourceError):
                            pass
            report = await scheduler.aclose()

    assert report.complete
    assert (seen.batches, seen.gaps) == (total, 0)
    codes = {name: _error_code(reply) for name, reply in replies.items()}
    assert codes == {
        "binary": "bad_hello",
        "not-an-object": "bad_hello",
        "no-newline": "bad_hello",
        "silent": "bad_hello",
        "trailing": "bad_hello",
        "ahead": "from_seq_ahead",
        "future-version": "version",
        "unknown-key": "bad_hello",
        "negative": "bad_hello",
    }
    stats = sink.statistics()
    assert stats.connections_refused == 9
    # Nine refusals in one burst: one warning, the rest at debug level.
    warnings = [
        r for r in caplog.records if r.levelno >= logging.WARNING and "refused" in r.getMessage()
    ]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0): the peer vanishes, unread data and all."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def test_a_subscriber_vanishing_mid_write_costs_the_others_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    stream = SeededEvents(22)
    seen = StreamVerifier(stream, origin="eng", events_per_batch=PER_BATCH)
    sink = SocketSink(port=0, ring_bytes=64 << 20)
    async with Scheduler(sinks=[sink], origin="eng") as scheduler:
        port = _port(sink)
        # Fill the ring first, so a replay from 0 keeps the sink writing for a while.
        for n in range(2000):
            scheduler.emit(stream.events(n * PER_BATCH, (n + 1) * PER_BATCH))
            await scheduler.tick()
        async with SocketSubscriber(port=port, from_seq=0, reconnect=False) as sub:
            vanished = 0
            for _ in range(5):
                peer = await anyio.connect_tcp("127.0.0.1", port)
                raw = peer.extra(SocketAttribute.raw_socket)
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                await peer.send(b'{"from_seq": 0}\n')
                with anyio.fail_after(10):
                    assert await peer.receive(1024)  # the sink has started writing to it
                    await peer.receive(1024)
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                await peer.aclose()  # ... and it is gone, mid-write (a TCP reset)
                vanished += 1
            for n in range(2000, 2300):
                scheduler.emit(stream.events(n * PER_BATCH, (n + 1) * PER_BATCH))
                run_without_suspending(scheduler.tick())
                await anyio.lowlevel.checkpoint()
            with anyio.fail_after(30):
                async for item in sub:
                    assert isinstance(item, EventBatch), item
                    seen.check(item)
                    if seen.batches == 2300:
                        break
            await wait_until(lambda: sink.statistics().subscribers == 1, timeout=10)
        report = await scheduler.aclose()
    assert report.complete
    assert vanished == 5
    assert (seen.batches, seen.gaps) == (2300, 0)
    assert sink.statistics().send_errors == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_replay_is_bounded_by_the_ring_and_never_holds_up_live_publishing() -> None:
    stream = SeededEvents(23)
    ring = 128 * 1024
    sink = SocketSink(port=0, ring_bytes=ring)
    live_seen = StreamVerifier(stream, origin="eng", events_per_batch=PER_BATCH)
    produced = 0
    async with Scheduler(sinks=[sink], origin="eng") as scheduler:

        def produce(n: int) -> None:
            nonlocal produced
            for _ in range(n):
                scheduler.emit(stream.events(produced * PER_BATCH, (produced + 1) * PER_BATCH))
                run_without_suspending(scheduler.tick())
                produced += 1

        port = _port(sink)
        for _ in range(10):
            produce(100)
            await anyio.lowlevel.checkpoint()
        # Stalled replayers: each asks for everything and reads nothing.
        stalled = []
        for _ in range(10):
            raw = socket.create_connection(("127.0.0.1", port))
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            raw.sendall(b'{"from_seq": 0}\n')
            stalled.append(raw)
        async with SocketSubscriber(port=port, reconnect=False) as live:  # live only
            first_live = produced
            for _ in range(50):
                produce(10)  # never waits, whatever the replayers do
                await anyio.lowlevel.checkpoint()
            with anyio.fail_after(30):
                async for item in live:
                    assert isinstance(item, EventBatch)
                    if live_seen.batches == 0:
                        live_seen.next_seq = live_seen.next_event = 0
                        assert item.seq == first_live
                        live_seen.next_seq = item.seq
                        live_seen.next_event = item.seq * PER_BATCH
                    live_seen.check(item)
                    if item.seq == produced - 1:
                        break
        # A replay from 0 gets what the ring holds, announced as a gap before it.
        replayed: list[EventBatch] = []
        gaps: list[Gap] = []
        async with SocketSubscriber(port=port, from_seq=0, reconnect=False) as late:
            with anyio.fail_after(30):
                async for item in late:
                    if isinstance(item, Gap):
                        gaps.append(item)
                    else:
                        replayed.append(item)
                        if item.seq == produced - 1:
                            break
        for raw in stalled:
            _reset(raw)
        report = await scheduler.aclose()

    assert report.complete
    assert live_seen.batches == 500
    assert live_seen.gaps == 0
    assert len(gaps) == 1
    assert gaps[0].first_missing == 0
    assert [b.seq for b in replayed] == list(range(gaps[0].next_seq, produced))
    codec_bytes = sum(len(sink.codec.encode(b)) for b in replayed)  # type: ignore[union-attr, misc]
    assert codec_bytes <= ring  # never more than the ring holds
    assert len(replayed) < produced / 5
    # Whatever the stalled replayers cost, it was theirs: nothing dropped at the sink
    # (a replayer that falls behind is cut off and can resume from the ring).
    assert sink.statistics().batches_dropped == 0


async def test_a_socket_subscriber_skips_a_hostile_sinks_junk_and_logs_it_once_per_burst(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A raw TCP server plays a broken sink: after its welcome it sends 100 lines
    that are not batches, then good batches, then more junk, then good batches. The
    subscriber yields every good batch, counts every bad line, and logs each burst
    of junk once, not once per line."""
    caplog.set_level(logging.WARNING, logger="kvstream.consumers.socket")
    stream = SeededEvents(24)
    codec = JsonCodec()

    def line(seq: int) -> bytes:
        return codec.encode(
            EventBatch(seq=seq, ts=1.0, events=stream.events(seq, seq + 2), origin="o", epoch="e")
        )

    # 100 lines that are JSON objects with a seq, but not batches.
    junk = b"".join(b'{"seq": %d, "ts": "x", "events": []}\n' % i for i in range(100))
    served = anyio.Event()

    async def serve(client: anyio.abc.SocketStream) -> None:
        async with client:
            await client.receive()  # the hello
            welcome = {"type": "welcome", "version": 1, "codec": "json", "framing": "lines"}
            await client.send(orjson.dumps(welcome) + b"\n")
            await client.send(junk + line(0) + line(1) + junk + line(2) + line(3))
            await served.wait()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_address)[1]
    got: list[int] = []
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        async with SocketSubscriber(port=port, reconnect=False) as sub:  # type: ignore[arg-type]
            with anyio.fail_after(20):
                async for item in sub:
                    assert isinstance(item, EventBatch), item
                    got.append(item.seq)
                    if item.seq == 3:
                        break
            stats = sub.statistics()
        served.set()
        tg.cancel_scope.cancel()
    assert got == [0, 1, 2, 3]
    assert stats.bad_messages == 200
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 2, [r.getMessage() for r in skipped]  # two bursts, two records


# -- ZMQ -------------------------------------------------------------------------------

zmq = pytest.importorskip("zmq")
zmq_asyncio = pytest.importorskip("zmq.asyncio")
if TYPE_CHECKING:
    from zmq.asyncio import Socket as AsyncSocket

from kvstream._wire import vllm_zmq as vz  # noqa: E402
from kvstream.codecs.msgpack import MsgpackCodec  # noqa: E402
from kvstream.consumers.zmq import ZmqPublisher, ZmqSubscriber  # noqa: E402
from kvstream.sinks.zmq import ZmqSink  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _replay(dealer: AsyncSocket, start: int, *, timeout: float = 20) -> list[vz.ReplayBatch]:
    """Ask for a replay from ``start``; every reply up to the end marker."""
    await dealer.send_multipart(vz.replay_request(start))
    out: list[vz.ReplayBatch] = []
    with anyio.fail_after(timeout):
        while True:
            reply = vz.parse_replay_reply(await dealer.recv_multipart())
            if reply is None:
                return out
            out.append(reply)


async def test_the_zmq_replay_router_survives_malformed_requests_and_leaving_clients(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstream.sinks")
    stream = SeededEvents(31)
    replay_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    sink = ZmqSink(
        f"tcp://127.0.0.1:{_free_port()}",
        bind=True,
        replay_endpoint=replay_endpoint,
        buffer_steps=50,
        replay_timeout=0.5,
        linger=0,
    )
    ctx = zmq_asyncio.Context()
    produced = 0
    try:
        async with Scheduler(sinks=[sink], origin="eng") as scheduler:

            def produce(n: int) -> None:
                nonlocal produced
                for _ in range(n):
                    scheduler.emit(stream.events(produced * PER_BATCH, (produced + 1) * PER_BATCH))
                    run_without_suspending(scheduler.tick())
                    produced += 1

            for _ in range(30):
                produce(10)
                await anyio.lowlevel.checkpoint()
            await wait_until(lambda: not sink.statistics().queued_batches, timeout=10)

            # Malformed requests: a raw ROUTER peer sends what it likes.
            hostile = ctx.socket(zmq.DEALER)
            hostile.setsockopt(zmq.LINGER, 0)
            hostile.connect(replay_endpoint)
            malformed = [
                [b"", b"\x00\x01\x02"],  # seq frame not 8 bytes
                [b"not empty", vz.pack_seq(0)],  # no empty delimiter
                [b""],  # nothing asked
                [b"", vz.pack_seq(0), b"extra"],  # one frame too many
                [b"\xff" * 4096],  # noise
            ]
            for frames in malformed:
                await hostile.send_multipart(frames)
            # One burst: all of it arrives before any valid request.
            await wait_until(lambda: sink.statistics().replay_malformed == len(malformed))

            # A well-formed request still gets exactly what the ring holds, in order.
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(replay_endpoint)
            replies = await _replay(dealer, 0)
            assert [r.seq for r in replies] == list(range(produced - 50, produced))
            codec = MsgpackCodec()
            for r in replies:
                batch = codec.decode(r.payload, seq=r.seq, origin="eng")
                sent = stream.events(r.seq * PER_BATCH, (r.seq + 1) * PER_BATCH)
                # vLLM's wire carries no metadata; everything else is the same.
                assert batch.events == [msgspec.structs.replace(e, metadata=None) for e in sent]
            assert await _replay(dealer, produced + 5) == []  # ahead of the ring: nothing

            # Clients that ask for everything and never read, then vanish.
            for _ in range(5):
                leaver = ctx.socket(zmq.DEALER)
                leaver.setsockopt(zmq.LINGER, 0)
                leaver.setsockopt(zmq.RCVHWM, 1)
                leaver.connect(replay_endpoint)
                await leaver.send_multipart(vz.replay_request(0))
                leaver.close()
            for _ in range(20):  # live publishing never waits for any of it
                produce(10)
                await anyio.sleep(0.01)
            replies = await _replay(dealer, 0)
            assert [r.seq for r in replies] == list(range(produced - 50, produced))
            await wait_until(lambda: not sink.statistics().replays_active, timeout=20)
            stats = sink.statistics()
            hostile.close()
            dealer.close()
            report = await scheduler.aclose()
    finally:
        ctx.destroy(linger=0)

    assert report.complete
    assert stats.replay_malformed == len(malformed)
    assert stats.ring_batches == 50
    assert stats.replay_batches_sent <= 50 * (stats.replay_requests - stats.replay_busy)
    # Every request that arrived was answered to its end, or given up and counted.
    assert stats.replay_requests == (
        stats.replays_completed + stats.replays_abandoned + stats.replay_busy
    )
    base = sink.statistics()
    assert (base.batches_out, base.batches_dropped) == (produced, 0)
    malformed_logs = [r for r in caplog.records if "malformed replay request" in r.getMessage()]
    assert len(malformed_logs) == 1  # one burst, one record


async def test_a_zmq_subscriber_survives_a_hostile_publisher_that_goes_away_and_restarts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A raw XPUB plays a broken vLLM publisher: malformed frames, an undecodable
    payload, then it dies and a new instance restarts at seq 0. The subscriber
    skips and counts the junk, reports the batch it lost as a gap, and treats
    the restart as a new epoch."""
    caplog.set_level(logging.WARNING)
    stream = SeededEvents(32)
    codec = MsgpackCodec()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    ctx = zmq_asyncio.Context()

    def message(seq: int) -> list[bytes]:
        events = [msgspec.structs.replace(e, metadata=None) for e in stream.events(seq, seq + 3)]
        payload = codec.encode(EventBatch(seq=seq, ts=1.0, events=events))
        return vz.live_frames(b"", vz.pack_seq(seq), payload)

    async def open_publisher() -> AsyncSocket:
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        with anyio.fail_after(20):
            while True:  # the closed instance releases the port in ZMQ's I/O thread
                try:
                    pub.bind(endpoint)
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EADDRINUSE:
                        raise
                    await anyio.sleep(0.05)
            assert (await pub.recv())[:1] == b"\x01"  # the subscriber is subscribed
        return pub  # type: ignore[no-any-return]

    items: list[Any] = []
    got_all = anyio.Event()
    sub = ZmqSubscriber(ZmqPublisher(endpoint, origin="hostile"), poll_interval=0.02)
    try:
        async with sub, anyio.create_task_group() as tg:

            async def consume() -> None:
                async for item in sub:
                    items.append(item)
                    if isinstance(item, EventBatch) and item.seq == 1 and len(items) > 4:
                        got_all.set()

            tg.start_soon(consume)
            pub = await open_publisher()
            for frames in [
                message(0),
                [b"", vz.pack_seq(1)],  # two frames
                [b"", b"\x01\x02\x03", b"\x93"],  # a seq frame of 3 bytes
                [b"", vz.pack_seq(1), b"\xc1\xc1 not msgpack"],  # seq 1 undecodable
                message(2),
                [b"", vz.END_SEQ, b""],  # the replay end marker on the live stream
                [b"a", b"b", b"c", b"d"],  # four frames
                message(3),
            ]:
                await pub.send_multipart(frames)
            await wait_until(lambda: sum(isinstance(i, EventBatch) for i in items) == 3, timeout=20)
            pub.close()  # the publisher goes away ...
            pub = await open_publisher()  # ... and a new instance starts over at seq 0
            await pub.send_multipart(message(0))
            await pub.send_multipart(message(1))
            with anyio.fail_after(20):
                await got_all.wait()
            pub.close()
            sub.stop(grace=0)
    finally:
        ctx.destroy(linger=0)

    batches = [i for i in items if isinstance(i, EventBatch)]
    gaps = [i for i in items if isinstance(i, Gap)]
    assert [b.seq for b in batches] == [0, 2, 3, 0, 1]
    assert [(g.first_missing, g.next_seq) for g in gaps] == [(1, 2)]
    assert len({b.epoch for b in batches[:3]}) == 1
    assert batches[3].epoch != batches[0].epoch  # the restart is a new epoch
    (st,) = sub.statistics()
    assert st.malformed == 5
    assert st.restarts == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
