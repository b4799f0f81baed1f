"""The socket sink, its subscriber and the protocol between them, over real sockets."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import random
import shutil
import socket
import stat
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.abc
import anyio.lowlevel
import orjson
import pytest
from waiting import wait_until

import kvstream
from kvstream import BlockRemoved, BlockStored, EventBatch, Scheduler
from kvstream._wire.socket_protocol import (
    MAX_HELLO_BYTES,
    BatchMessage,
    ControlMessage,
    MessageReader,
    ProtocolError,
    batch_message,
    control_message,
    encode_hello,
    parse_hello,
    token_matches,
)
from kvstream._wire.socket_security import client_ssl_context, server_ssl_context
from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.config import open_sink, open_subscriber
from kvstream.consumers.base import Gap, Subscriber, SubscriberItem
from kvstream.consumers.socket import SnapshotBatch, SocketSubscriber
from kvstream.errors import ConfigError, DecodeError, TransportError
from kvstream.sim import SimulatedEngine, check_consistency
from kvstream.sinks.socket import SocketSink

DEADLINE = 20.0


# -- helpers --------------------------------------------------------------------------


def removed(i: int, size: int = 1) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(range(i * size, (i + 1) * size)), medium="GPU")


async def produce(s: Scheduler, first: int, n: int, size: int = 1) -> None:
    for i in range(first, first + n):
        s.emit(removed(i, size))
        await s.tick()


async def take(sub: Subscriber, n_batches: int) -> list[SubscriberItem]:
    """Items until ``n_batches`` batches (snapshots count) have arrived."""
    items: list[SubscriberItem] = []
    got = 0
    with anyio.fail_after(DEADLINE):
        async for item in sub:
            items.append(item)
            if isinstance(item, EventBatch):
                got += 1
                if got >= n_batches:
                    break
    return items


async def take_until(sub: SocketSubscriber, last_seq: int) -> list[SubscriberItem]:
    """Items until the batch with ``last_seq`` has arrived."""
    items: list[SubscriberItem] = []
    with anyio.fail_after(DEADLINE):
        async for item in sub:
            items.append(item)
            if isinstance(item, EventBatch) and item.seq >= last_seq:
                break
    return items


def seqs(items: list[SubscriberItem]) -> list[int]:
    return [i.seq for i in items if isinstance(i, EventBatch)]


def port_of(sink: SocketSink) -> int:
    return int(sink.address.rsplit(":", 1)[1])


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = tempfile.mkdtemp(dir="/tmp", prefix="kvs-")
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Proxy:
    """A loopback TCP proxy whose connections the test can cut, all at once."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.connections = 0
        self._scopes: set[anyio.CancelScope] = set()
        self._tg: anyio.abc.TaskGroup | None = None
        self._listener: anyio.abc.Listener[Any] | None = None

    async def __aenter__(self) -> Self:
        self._listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = self._listener.extra(anyio.abc.SocketAttribute.local_port)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._listener.serve, self._handle)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
        if self._listener is not None:
            await self._listener.aclose()

    def cut(self) -> None:
        for scope in list(self._scopes):
            scope.cancel()

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        self.connections += 1
        with anyio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                async with (
                    client,
                    await anyio.connect_tcp("127.0.0.1", self.target_port) as up,
                    anyio.create_task_group() as tg,
                ):

                    async def pump(a: anyio.abc.ByteStream, b: anyio.abc.ByteStream) -> None:
                        try:
                            async for chunk in a:
                                await b.send(chunk)
                        except (anyio.BrokenResourceError, OSError):
                            pass
                        tg.cancel_scope.cancel()

                    tg.start_soon(pump, client, up)
                    tg.start_soon(pump, up, client)
            except OSError:
                pass
            finally:
                self._scopes.discard(scope)


def stalled_client(port: int, hello: bytes) -> socket.socket:
    """A subscriber that says hello and never reads (small receive buffer, so it fills).

    A plain socket: an event loop's transport could read ahead into memory.
    """
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    raw.connect(("127.0.0.1", port))
    raw.sendall(hello)
    return raw


async def raw_exchange(port: int, data: bytes) -> list[dict[str, Any]]:
    """Send ``data`` on a fresh connection; return every JSON line until EOF."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(data)
        buf = b""
        with anyio.fail_after(DEADLINE):
            try:
                async for chunk in stream:
                    buf += chunk
            except (anyio.BrokenResourceError, OSError):
                pass
    return [orjson.loads(line) for line in buf.splitlines() if line.strip()]


# -- the protocol, sans IO ----------------------------------------------------------------


def test_hello_is_validated_strictly() -> None:
    assert parse_hello(b"{}") == parse_hello(b'{"version": 1}')
    h = parse_hello(b'{"from_seq": {"a": 3, "*": 0}, "epoch": {"a": "e1"}, "token": "t"}')
    assert h.start_for("a") == 3
    assert h.start_for("b") == 0
    assert h.epoch_for("a") == "e1"
    assert h.epoch_for("b") is None
    assert parse_hello(b'{"from_seq": 7}').start_for("x") == 7
    assert parse_hello(b"{}").start_for("x") is None
    bad = {
        b"not json": "invalid JSON",
        b"[1]": "expected a JSON object",
        b'{"from": 1}': "unknown key",
        b'{"from_seq": -1}': "from_seq",
        b'{"from_seq": true}': "from_seq",
        b'{"from_seq": 1.5}': "from_seq",
        b'{"from_seq": {"a": "1"}}': "from_seq",
        b'{"from_seq": {"": 1}}': "from_seq key",
        b'{"epoch": 5}': "epoch",
        b'{"token": 5}': "token",
        b'{"version": 0}': "version",
    }
    for line, expected in bad.items():
        with pytest.raises(ProtocolError, match=expected) as info:
            parse_hello(line)
        assert info.value.code == "bad_hello", line
    with pytest.raises(ProtocolError) as info:
        parse_hello(b'{"version": 2}')
    assert info.value.code == "version"
    with pytest.raises(ProtocolError, match="at most"):
        parse_hello(b"{" + b" " * MAX_HELLO_BYTES + b"}")
    line = encode_hello({"a": 1}, epoch={"a": "e"}, token="t")
    assert line.endswith(b"\n")
    assert parse_hello(line) == parse_hello(b'{"from_seq":{"a":1},"epoch":{"a":"e"},"token":"t"}')


def test_token_comparison() -> None:
    assert token_matches(b"s3cret", "s3cret")
    assert not token_matches(b"s3cret", "s3cre")
    assert not token_matches(b"s3cret", None)
    assert not token_matches(b"s3cret", "")


def test_reader_caps_lines_and_frames_before_buffering() -> None:
    reader = MessageReader(max_message_bytes=4096)
    reader.use("frames", MsgpackCodec())
    reader.feed(b"\xff\xff\xff\xff")  # claims a 4 GB frame
    with pytest.raises(ProtocolError, match="length 4294967295"):
        reader.next_message()
    lines = MessageReader(max_message_bytes=4096)
    lines.use("lines", kvstream.JsonCodec())
    lines.feed(b"x" * 5000)
    with pytest.raises(ProtocolError, match="without a newline"):
        lines.next_message()
    header_too_long = struct.pack(">IH", 3, 9) + b"\x80"
    frames = MessageReader(max_message_bytes=4096)
    frames.use("frames", MsgpackCodec())
    frames.feed(header_too_long)
    with pytest.raises(ProtocolError, match="header length"):
        frames.next_message()


@pytest.mark.parametrize("codec", [kvstream.JsonCodec(), MsgpackCodec()], ids=["json", "msgpack"])
def test_batches_and_control_messages_round_trip(codec: Any) -> None:
    framing = "lines" if codec.name == "json" else "frames"
    batch = EventBatch(seq=5, ts=1.5, events=[removed(1)], origin="o", epoch="e")
    gap = {"type": "gap", "origin": "o", "epoch": "e", "first_missing": 1, "next_seq": 5}
    wire = control_message(gap, framing) + batch_message(codec.encode(batch), batch, framing)
    reader = MessageReader()
    reader.use(framing, codec)
    for i in range(0, len(wire), 7):  # arrives in pieces
        reader.feed(wire[i : i + 7])
    first = reader.next_message()
    assert isinstance(first, ControlMessage)
    assert first.type == "gap"
    assert first.fields["next_seq"] == 5
    second = reader.next_message()
    assert isinstance(second, BatchMessage)
    assert second.batch == batch
    assert reader.next_message() is None
    with pytest.raises(ValueError, match="no seq"):
        control_message({"type": "gap", "seq": 1}, framing)


def test_a_bad_message_is_skipped_not_fatal() -> None:
    reader = MessageReader()
    reader.use("lines", kvstream.JsonCodec())
    reader.feed(b'{"seq": 1, "events": "nope"}\n{"type": "end"}\n')
    with pytest.raises(DecodeError) as info:
        reader.next_message()
    assert not isinstance(info.value, ProtocolError)
    end = reader.next_message()
    assert isinstance(end, ControlMessage)
    assert end.type == "end"


# -- configuration -------------------------------------------------------------------------


def test_secure_defaults_and_url_options(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="without a token"):
        SocketSink(host="0.0.0.0", port=0)
    with pytest.raises(ConfigError, match="without a token"):
        open_sink("tcp://*:5600")
    with pytest.raises(ConfigError, match="token_env=NAME"):
        open_sink("tcp://127.0.0.1:0?token=hunter2")
    with pytest.raises(ConfigError, match="token_env"):
        open_subscriber("tcp://127.0.0.1:5600?token=hunter2")
    with pytest.raises(ConfigError, match="KVS_UNSET_TOKEN"):
        open_sink("tcp://0.0.0.0:0?token_env=KVS_UNSET_TOKEN")
    monkeypatch.setenv("KVS_TEST_TOKEN", "hunter2")
    sink = open_sink("tcp://0.0.0.0:0?token_env=KVS_TEST_TOKEN&slow=drop&ring_bytes=1MiB")
    assert isinstance(sink, SocketSink)
    assert sink.slow == "drop"
    assert sink.ring_bytes == 1024 * 1024
    assert sink.subscriber_bytes == 512 * 1024
    assert "hunter2" not in repr(sink)
    assert "hunter2" not in sink.name
    default = open_sink("tcp://:0")
    assert isinstance(default, SocketSink)
    assert default.host == "127.0.0.1"
    with pytest.raises(ConfigError, match="subscriber_bytes"):
        open_sink("tcp://127.0.0.1:0?ring_bytes=1MiB&subscriber_bytes=2MiB")
    with pytest.raises(ConfigError, match="HOST:PORT"):
        open_sink("tcp://127.0.0.1")
    with pytest.raises(ConfigError, match="unknown option"):
        open_sink("unix:/tmp/x.sock?bogus=1")
    sub = kvstream.subscribe("unix:///tmp/kv.sock", from_seq=3)
    assert isinstance(sub, SocketSubscriber)
    assert sub.path == "/tmp/kv.sock"
    assert sub.from_seq == 3


# -- serving -----------------------------------------------------------------------------


async def test_many_subscribers_get_every_batch_in_order(no_leaked_tasks: None) -> None:
    sink = SocketSink(port=0)
    async with Scheduler(sinks=[sink], origin="o") as s:
        await produce(s, 0, 20)
        subs = [SocketSubscriber(port=port_of(sink), from_seq=0) for _ in range(6)]
        for sub in subs:
            await sub.__aenter__()
        late = SocketSubscriber(port=port_of(sink))  # live only: from seq 20
        await late.__aenter__()
        try:
            await produce(s, 20, 30)
            for sub in subs:
                assert seqs(await take(sub, 50)) == list(range(50))
            assert seqs(await take(late, 30)) == list(range(20, 50))
            assert sink.statistics().subscribers == 7
        finally:
            for sub in [*subs, late]:
                await sub.aclose()


async def test_from_seq_per_origin_with_a_default() -> None:
    sink = SocketSink(port=0)
    async with Scheduler(sinks=[sink], origin="a") as s:
        for i in range(5):
            s.emit(removed(i))
            s.emit(removed(i), origin="b")
            s.emit(removed(i), origin="c")
            await s.tick()
        await wait_until(lambda: sink.statistics().batches_out == 15, "all in the ring")
        port = port_of(sink)
        async with SocketSubscriber(port=port, from_seq={"a": 3, "*": 4}) as both:
            items = await take(both, 4)
        assert sorted((b.origin, b.seq) for b in items if isinstance(b, EventBatch)) == [
            ("a", 3),
            ("a", 4),
            ("b", 4),
            ("c", 4),
        ]
        async with SocketSubscriber(port=port, from_seq={"b": 2}) as only_b:
            assert only_b.welcome is not None
            assert set(only_b.welcome.origins) == {"a", "b", "c"}
            s.emit(removed(9))  # live: a gets seq 5
            await s.tick()
            items = await take(only_b, 4)
        assert [(b.origin, b.seq) for b in items if isinstance(b, EventBatch)] == [
            ("b", 2),
            ("b", 3),
            ("b", 4),
            ("a", 5),
        ]


async def test_unix_socket_is_private_and_removed_at_close(short_dir: Path) -> None:
    path = short_dir / "kv.sock"
    sink = open_sink(f"unix:{path}")
    async with Scheduler(sinks=[sink], origin="o") as s:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_ISSOCK(path.stat().st_mode)
        await produce(s, 0, 5)
        async with kvstream.subscribe(f"unix:{path}", from_seq=0) as sub:
            assert isinstance(sub, SocketSubscriber)
            assert seqs(await take(sub, 5)) == [0, 1, 2, 3, 4]
        # A second sink on a path in use is refused, and the first keeps it.
        with pytest.raises(TransportError, match="another process is listening"):
            async with SocketSink(path=path):
                pass
        assert path.exists()
    assert not path.exists()


async def test_a_stale_socket_file_is_replaced_but_other_files_are_not(short_dir: Path) -> None:
    stale = short_dir / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # the file stays, nobody listens
    async with SocketSink(path=stale):
        assert stat.S_IMODE(stale.stat().st_mode) == 0o600
    regular = short_dir / "file"
    regular.write_text("keep me")
    with pytest.raises(TransportError, match="not a socket"):
        async with SocketSink(path=regular):
            pass
    assert regular.read_text() == "keep me"


async def test_a_slow_subscriber_is_disconnected_and_never_slows_the_others() -> None:
    # ~55 KB batches; the stalled subscriber never reads, so its socket fills up.
    sink = SocketSink(port=0, ring_bytes=64 * 1024 * 1024, subscriber_bytes=2 * 1024 * 1024)
    async with Scheduler(sinks=[sink], origin="o") as s:
        stalled = stalled_client(port_of(sink), b'{"from_seq": 0}\n')
        async with SocketSubscriber(port=port_of(sink), from_seq=0) as fast:
            await wait_until(lambda: sink.statistics().subscribers == 2, "both joined")
            got: list[int] = []
            async with anyio.create_task_group() as tg:

                async def read() -> None:
                    got.extend(seqs(await take(fast, 200)))

                tg.start_soon(read)
                with anyio.fail_after(DEADLINE):  # the ticks never wait for the stalled one
                    for i in range(200):
                        s.emit(removed(i, 8000))
                        await s.tick()
                        await anyio.sleep(0.001)  # the fast reader's pace
            assert got == list(range(200))
            assert fast.statistics().connections == 1  # never disconnected
            stats = sink.statistics()
            assert stats.slow_disconnects == 1
            assert stats.subscribers == 1
        # The stalled one was closed: what its socket held, then the end of the stream.
        stalled.settimeout(DEADLINE)
        with stalled:
            while stalled.recv(1 << 20):
                pass


async def test_slow_drop_skips_batches_with_a_gap_notice_and_counts_them() -> None:
    sink = SocketSink(port=0, ring_bytes=32 * 1024 * 1024, subscriber_bytes=512 * 1024, slow="drop")
    async with Scheduler(sinks=[sink], origin="o") as s:
        async with SocketSubscriber(port=port_of(sink), from_seq=0) as slow:
            # Not iterating: nothing reads its socket until all is produced.
            await produce(s, 0, 300, size=4000)
            await wait_until(lambda: sink.statistics().subscriber_batches_dropped > 0, "drops")
            await produce(s, 300, 1)
            items = await take_until(slow, 300)
        gaps = [i for i in items if isinstance(i, Gap)]
        assert gaps
        assert all(g.reason == "dropped" for g in gaps)
        # Every batch arrived or was announced missing, in order, once.
        covered: list[int] = []
        for item in items:
            if isinstance(item, Gap):
                covered.extend(range(item.first_missing, item.next_seq))
            else:
                covered.append(item.seq)
        assert covered == list(range(301))
        assert sink.statistics().subscriber_batches_dropped == sum(g.missing for g in gaps)


async def test_resume_after_a_disconnect_loses_nothing_within_the_ring() -> None:
    sink = SocketSink(port=0)
    async with Scheduler(sinks=[sink], origin="o") as s, Proxy(0) as proxy:
        proxy.target_port = port_of(sink)
        async with SocketSubscriber(port=proxy.port, from_seq=0, retry_initial=0.01) as sub:
            await produce(s, 0, 10)
            first = seqs(await take(sub, 10))
            proxy.cut()
            await produce(s, 10, 10)  # while it is away
            rest = await take(sub, 10)
        assert first + seqs(rest) == list(range(20))
        assert not [i for i in rest if isinstance(i, Gap)]
        assert proxy.connections >= 2
        assert sub.statistics().connections >= 2


async def test_resume_beyond_the_ring_gets_a_gap_notice() -> None:
    sink = SocketSink(port=0, ring_bytes=4096)
    async with Scheduler(sinks=[sink], origin="o") as s:
        await produce(s, 0, 100)
        async with SocketSubscriber(port=port_of(sink), from_seq=0) as sub:
            assert sub.welcome is not None
            info = sub.welcome.origins["o"]
            assert info.newest == 99
            assert info.oldest is not None
            assert info.oldest > 0
            items = await take(sub, 100 - info.oldest)
        assert items[0] == Gap("o", s.epoch, 0, info.oldest, "evicted")
        assert seqs(items) == list(range(info.oldest, 100))
        assert sink.statistics().gap_notices == 1


async def test_from_seq_ahead_of_the_stream_is_refused() -> None:
    sink = SocketSink(port=0)
    async with Scheduler(sinks=[sink], origin="o") as s:
        await produce(s, 0, 3)
        sub = SocketSubscriber(port=port_of(sink), from_seq=50)
        with pytest.raises(TransportError, match="ahead"):
            await sub.__aenter__()


async def _run_engine(
    engine: SimulatedEngine, s: Scheduler, steps: int, stop: anyio.Event | None = None
) -> None:
    for _ in range(steps):
        s.emit(engine.run_step())
        await engine.handed_over()
        await s.tick()
        await anyio.lowlevel.checkpoint()
        if stop is not None and stop.is_set():
            return


def small_engine() -> SimulatedEngine:
    return SimulatedEngine(
        seed=3, gpu_blocks=48, cpu_blocks=96, remote_blocks=128, requests_per_step=2
    )


async def test_resume_beyond_the_ring_with_a_snapshot_is_consistent() -> None:
    engine = small_engine()
    sink = SocketSink(port=0, ring_bytes=64 * 1024, subscriber_bytes=60 * 1024)
    sink.snapshot_provider = engine.snapshot
    async with Scheduler(sinks=[sink], origin=engine.origin) as s:
        for source, name in engine.inputs():
            s.add_source(source, name=name)
        await _run_engine(engine, s, 150)
        sealed = s.statistics().next_seq[s.origin]
        await wait_until(lambda: sink.statistics().batches_out == sealed, "all in the ring")
        assert sink.statistics().ring_batches < sealed  # seq 0 is gone from the ring
        items: list[SubscriberItem] = []
        async with (
            SocketSubscriber(port=port_of(sink), from_seq=0) as sub,
            anyio.create_task_group() as tg,
        ):
            assert sub.welcome is not None
            assert sub.welcome.snapshot

            async def read() -> None:
                items.extend(await take(sub, 21))

            tg.start_soon(read)
            for _ in range(40):  # the snapshot is taken at the next tick
                await _run_engine(engine, s, 1)
                await anyio.sleep(0.002)
        engine.close()
        assert sub.statistics().connections == 1
    assert not [i for i in items if isinstance(i, Gap)]
    snapshot = items[0]
    assert isinstance(snapshot, SnapshotBatch)
    assert snapshot.first_missing == 0
    # Taken at the first tick after the subscriber joined: it stands for every
    # batch sealed up to and including that tick's, and the next batch follows it.
    assert snapshot.seq in (sealed - 1, sealed)
    assert type(snapshot.events[0]).__name__ == "AllBlocksCleared"
    batches = [i for i in items[1:] if isinstance(i, EventBatch)]
    assert [b.seq for b in batches] == list(range(snapshot.seq + 1, snapshot.seq + 21))
    report = check_consistency([snapshot, *batches], start_seq=None)
    assert report.batches == len(items)
    assert sink.statistics().snapshots_sent == 1


async def test_without_a_tick_the_snapshot_falls_back_to_a_gap() -> None:
    engine = small_engine()
    sink = SocketSink(port=0, ring_bytes=16 * 1024, snapshot_timeout=0.2)
    sink.snapshot_provider = engine.snapshot
    async with Scheduler(sinks=[sink], origin=engine.origin) as s:
        for source, name in engine.inputs():
            s.add_source(source, name=name)
        await _run_engine(engine, s, 60)
        sealed = s.statistics().next_seq[s.origin]
        await wait_until(lambda: sink.statistics().batches_out == sealed, "all in the ring")
        async with SocketSubscriber(port=port_of(sink), from_seq=0) as sub:
            with anyio.fail_after(DEADLINE):
                first = await sub.__anext__()
        engine.close()
    assert isinstance(first, Gap)
    assert first.first_missing == 0
    assert first.reason == "evicted"


async def test_bad_hellos_get_one_error_line_and_never_crash_the_sink() -> None:
    sink = SocketSink(port=0, hello_timeout=0.5)
    async with Scheduler(sinks=[sink], origin="o") as s:
        port = port_of(sink)
        for data, code in [
            (b"garbage\n", "bad_hello"),
            (b'{"from_seq": -3}\n', "bad_hello"),
            (b'{"unknown": 1}\n', "bad_hello"),
            (b'{"version": 9}\n', "version"),
            (b"{" + b" " * (MAX_HELLO_BYTES + 10), "bad_hello"),  # never ends
            (b'{}\n{"more": "data"}\n', "bad_hello"),
            (b"", "bad_hello"),  # says nothing: times out
        ]:
            lines = await raw_exchange(port, data)
            assert len(lines) == 1, (data[:40], lines)
            assert lines[0]["type"] == "error"
            assert lines[0]["code"] == code
        assert sink.statistics().connections_refused == 7
        await produce(s, 0, 3)
        async with SocketSubscriber(port=port, from_seq=0) as sub:
            assert seqs(await take(sub, 3)) == [0, 1, 2]


async def test_a_wrong_or_missing_token_is_refused_and_never_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, short_dir: Path
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "correct horse battery staple"
    token_file = short_dir / "token"
    token_file.write_text(secret + "\n")
    token_file.chmod(0o600)
    sink = open_sink(f"tcp://127.0.0.1:0?token_file={token_file}")
    assert isinstance(sink, SocketSink)
    async with Scheduler(sinks=[sink], origin="o") as s:
        port = port_of(sink)
        await produce(s, 0, 2)
        lines = await raw_exchange(port, b'{"token": "guess"}\n')
        assert [line["code"] for line in lines] == ["unauthorized"]
        with pytest.raises(TransportError, match="unauthorized"):
            async with SocketSubscriber(port=port, from_seq=0):
                pass
        monkeypatch.setenv("KVS_TOKEN", secret)
        async with kvstream.subscribe(
            f"tcp://127.0.0.1:{port}?token_env=KVS_TOKEN", from_seq=0
        ) as sub:
            assert seqs(await take(sub, 2)) == [0, 1]
    assert secret not in caplog.text
    assert "guess" not in caplog.text


def _self_signed(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstream test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path = directory / "cert.pem"
    key_path = directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def test_tls_with_a_throwaway_certificate(short_dir: Path) -> None:
    cert, key = _self_signed(short_dir)
    sink = open_sink(f"tcp://127.0.0.1:0?tls_cert={cert}&tls_key={key}")
    assert isinstance(sink, SocketSink)
    async with Scheduler(sinks=[sink], origin="o") as s:
        port = port_of(sink)
        await produce(s, 0, 4)
        async with kvstream.subscribe(f"tcp://127.0.0.1:{port}?tls_ca={cert}", from_seq=0) as sub:
            assert seqs(await take(sub, 4)) == [0, 1, 2, 3]
        # Without TLS the hello is not a TLS handshake: the sink drops it.
        plain = SocketSubscriber(port=port, from_seq=0, reconnect=False)
        with pytest.raises(TransportError):
            await plain.__aenter__()
        # A client that does not trust the certificate refuses the sink.
        untrusting = SocketSubscriber(
            port=port, reconnect=False, ssl_context=client_ssl_context(None, where="test")
        )
        with pytest.raises(TransportError):
            await untrusting.__aenter__()
        assert server_ssl_context(str(cert), str(key), where="t") is not None


async def test_msgpack_framing_carries_names_beside_vllm_batches() -> None:
    sink = SocketSink(port=0, codec=MsgpackCodec(), ring_bytes=4096)
    async with Scheduler(sinks=[sink], origin="o") as s:
        stored = BlockStored(
            block_hashes=[2**64 - 1], parent_block_hash=None, token_ids=[1, 2], block_size=2
        )
        s.emit(stored)
        first = await s.tick()
        await produce(s, 1, 60)
        async with SocketSubscriber(port=port_of(sink), from_seq=0) as sub:
            assert sub.welcome is not None
            assert (sub.welcome.codec, sub.welcome.framing) == ("msgpack", "frames")
            items = await take_until(sub, 60)
        gap = items[0]
        assert isinstance(gap, Gap)  # frames carry gap notices too
        assert gap.first_missing == 0
        batches = [i for i in items if isinstance(i, EventBatch)]
        assert all(b.origin == "o" and b.epoch == s.epoch for b in batches)
        assert [b.seq for b in batches] == list(range(gap.next_seq, 61))
        assert first is not None
        assert first.events == [stored]


async def test_close_ends_subscribers_cleanly_and_leaks_nothing(
    no_leaked_tasks: None, short_dir: Path
) -> None:
    before = open_fds()
    sink = SocketSink(path=short_dir / "s.sock")
    received: list[int] = []
    async with Scheduler(sinks=[sink], origin="o") as s:
        sub = SocketSubscriber(path=short_dir / "s.sock", from_seq=0, reconnect=False)
        await sub.__aenter__()
        stalled = await anyio.connect_unix(short_dir / "s.sock")  # says nothing
        await produce(s, 0, 25)
        async with anyio.create_task_group() as tg:

            async def read() -> None:
                async for item in sub:  # ends when the sink says "end"
                    assert isinstance(item, EventBatch)
                    received.append(item.seq)

            tg.start_soon(read)
            await s.aclose()
        await stalled.aclose()
        await sub.aclose()
    assert received == list(range(25))
    assert sink.statistics().subscribers == 0
    assert open_fds() <= before


async def test_a_new_epoch_is_noticed_and_replayed_from_its_start(short_dir: Path) -> None:
    path = short_dir / "e.sock"
    sub = SocketSubscriber(path=path, from_seq=0, retry_initial=0.01, retry_max=0.05)
    try:
        async with Scheduler(sinks=[SocketSink(path=path)], origin="o") as s1:
            await produce(s1, 0, 5)
            await sub.__aenter__()
            first = await take(sub, 5)
        async with Scheduler(sinks=[SocketSink(path=path)], origin="o") as s2:
            await produce(s2, 0, 3)  # sealed before the subscriber is back
            second = await take(sub, 3)
    finally:
        await sub.aclose()
    assert [(b.epoch, b.seq) for b in first if isinstance(b, EventBatch)] == [
        (s1.epoch, i) for i in range(5)
    ]
    assert [(b.epoch, b.seq) for b in second if isinstance(b, EventBatch)] == [
        (s2.epoch, i) for i in range(3)
    ]
    assert not [i for i in second if isinstance(i, Gap)]
    assert sub.statistics().restarts == 1


@pytest.mark.parametrize("seed", [4, 5, 6])
async def test_done_random_disconnects_see_every_batch_exactly_once_in_order(seed: int) -> None:
    """The issue's done criterion: cut at random, resumed within the ring, nothing
    lost, nothing repeated, in order. The consumer is sometimes slow, so cuts also
    land while a backlog is in flight."""
    rng = random.Random(seed)
    total = 500
    sink = SocketSink(port=0)
    got: list[tuple[str, int]] = []
    gaps: list[Gap] = []
    async with Scheduler(sinks=[sink], origin="o") as s, Proxy(0) as proxy:
        proxy.target_port = port_of(sink)
        async with (
            SocketSubscriber(
                port=proxy.port, from_seq=0, retry_initial=0.005, retry_max=0.05
            ) as sub,
            anyio.create_task_group() as tg,
        ):

            async def consume() -> None:
                with anyio.fail_after(DEADLINE * 2):
                    async for item in sub:
                        if isinstance(item, Gap):
                            gaps.append(item)
                        else:
                            got.append((item.epoch, item.seq))
                            if item.seq == total - 1:
                                return
                        if rng.random() < 0.05:
                            await anyio.sleep(rng.uniform(0, 0.01))

            async def chaos() -> None:
                while True:
                    await anyio.sleep(rng.uniform(0.0, 0.03))
                    proxy.cut()

            tg.start_soon(consume)
            tg.start_soon(chaos)
            for i in range(total):
                s.emit(removed(i, rng.randint(1, 300)))
                await s.tick()
                if rng.random() < 0.2:
                    await anyio.sleep(rng.uniform(0, 0.005))
            await wait_until(lambda: len(got) >= total, "everything")
            tg.cancel_scope.cancel()
        assert proxy.connections > 5  # it really was cut, many times
    assert gaps == []
    assert got == [(s.epoch, i) for i in range(total)]
