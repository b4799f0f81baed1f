"""NATS JetStream: the sink, the subscriber and the broker rules they share.

Server tests run a real ``nats-server -js`` (see tests/servers.py).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from servers import (
    CuttingProxy,
    NatsServer,
    batch,
    free_port,
    nats_server,
    nats_servers,
    read_all,
    read_back_in_another_process,
    seqs,
    stored,
    tick_stored,
    wait_until,
)

from kvstream._wire.broker import (
    PayloadDecoder,
    check_subject,
    default_subject,
    key_from_headers,
    message_id,
    nats_headers,
    subject_covers,
    subject_token,
)
from kvstream.codecs.json import JsonCodec
from kvstream.config import open_sink, open_subscriber
from kvstream.consumers.base import Gap
from kvstream.consumers.nats import NatsSubscriber
from kvstream.errors import ClosedError, ConfigError, DecodeError, TransportError
from kvstream.events import BlockRemoved, EventBatch
from kvstream.scheduler import Scheduler
from kvstream.sinks.memory import MemorySink
from kvstream.sinks.nats import NatsSink

__all__ = ["nats_server", "nats_servers"]  # fixtures, imported for pytest

SERVER = pytest.mark.server


# -- rules (no server) ----------------------------------------------------------------


def test_subject_token_keeps_safe_characters_and_replaces_the_rest() -> None:
    assert subject_token("engine-0_a") == "engine-0_a"
    assert subject_token("node-1.example:0") == "node-1_example_0"
    assert subject_token("a b*c>d") == "a_b_c_d"
    assert subject_token("") == "_"
    assert default_subject("host.x") == "kv.events.host_x"


def test_subject_covers_handles_wildcards_on_both_sides() -> None:
    assert subject_covers("kv.events.>", "kv.events.a")
    assert subject_covers("kv.events.>", "kv.events.*")
    assert subject_covers("kv.events.>", "kv.events.>")
    assert subject_covers("kv.*.a", "kv.events.a")
    assert subject_covers(">", "kv.events.a")
    assert not subject_covers("kv.*.a", "kv.events.>")
    assert not subject_covers("kv.events.a", "kv.events.*")
    assert not subject_covers("kv.events.>", "kv.events")
    assert not subject_covers("kv.events.a", "kv.events.a.b")


@pytest.mark.parametrize(
    ("subject", "wildcards", "problem"),
    [
        ("", True, "empty"),
        ("kv..a", True, "empty token"),
        ("kv.a b", True, "white space"),
        ("kv.>.a", True, "mixes a wildcard"),
        ("kv.a*", True, "mixes a wildcard"),
        ("kv.*", False, "cannot be published"),
    ],
)
def test_check_subject_refuses_bad_subjects(subject: str, wildcards: bool, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        check_subject(subject, wildcards=wildcards, where="test")


def test_headers_carry_the_batch_name_and_message_id() -> None:
    b = batch(7, origin="host:1\r\nX-Evil: 1", epoch="ab")
    headers = nats_headers(b, "json")
    assert all("\r" not in v and "\n" not in v for v in headers.values())
    assert key_from_headers(headers) == ("host:1\r\nX-Evil: 1", "ab", 7)
    assert headers["Nats-Msg-Id"] == message_id(b) == "host%3A1%0D%0AX-Evil%3A%201:ab:7"
    assert message_id(batch(3, origin="engine-0.a", epoch="e1")) == "engine-0.a:e1:3"
    with pytest.raises(DecodeError, match="Kv-Seq"):
        key_from_headers({"Kv-Origin": "a", "Kv-Epoch": "b", "Kv-Seq": "x"})
    with pytest.raises(DecodeError, match="no headers"):
        key_from_headers(None)


def test_payload_decoder_checks_the_payload_against_the_headers() -> None:
    b = batch(4)
    data = JsonCodec().encode(b)
    decoder = PayloadDecoder()
    assert decoder.decode(data, b.key, "json") == b
    assert decoder.decode(data, b.key, None) == b
    with pytest.raises(DecodeError, match="headers name"):
        decoder.decode(data, ("engine-0", "e1", 5), "json")
    with pytest.raises(DecodeError, match="codec"):
        decoder.decode(data, b.key, "yaml")


def test_msgpack_payload_gets_its_name_from_the_headers() -> None:
    msgpack = pytest.importorskip("kvstream.codecs.msgpack")
    b = batch(9, origin="o", epoch="e")
    data = msgpack.MsgpackCodec().encode(b)
    assert PayloadDecoder().decode(data, b.key, "msgpack") == b


def test_urls_build_configured_sinks_and_subscribers() -> None:
    sink = open_sink(
        "nats://u:p@127.0.0.1:4333/kv.events.x?stream=S&create=true&max_age=60&policy=drop_oldest"
    )
    assert isinstance(sink, NatsSink)
    assert (sink.subject, sink.stream, sink.create, sink.policy) == (
        "kv.events.x",
        "S",
        True,
        "drop_oldest",
    )
    assert sink.url == "nats://u:p@127.0.0.1:4333"
    assert "p@" not in sink.name
    assert sink.shown == "nats://127.0.0.1:4333"
    assert open_sink("nats://127.0.0.1:4333").subject is None  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="cannot be published"):
        open_sink("nats://127.0.0.1:4333/kv.events.*")
    with pytest.raises(ConfigError, match="unknown option"):
        open_sink("nats://127.0.0.1:4333?strem=S")
    sub = open_subscriber("nats://127.0.0.1:4333/kv.events.>?durable=r1&deliver=new")
    assert isinstance(sub, NatsSubscriber)
    assert (sub.subject, sub.durable, sub.deliver, sub.follow) == ("kv.events.>", "r1", "new", True)
    # Live batches only unless the reader asks for a from_seq (as kvstream.subscribe says).
    assert open_subscriber("nats://127.0.0.1:4333").deliver == "new"  # type: ignore[attr-defined]
    assert open_subscriber("nats://127.0.0.1:4333", from_seq=3).deliver == "all"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="from_seq"):
        open_subscriber("nats://127.0.0.1:4333", from_seq=-1)
    with pytest.raises(ConfigError, match="deliver"):
        open_subscriber("nats://127.0.0.1:4333?deliver=first")


# -- with a server --------------------------------------------------------------------


@SERVER
async def test_round_trip_in_order_with_both_codecs(
    nats_server: NatsServer, no_leaked_tasks: None
) -> None:
    msgpack = pytest.importorskip("kvstream.codecs.msgpack")
    json_sink = NatsSink(nats_server.url, create=True)
    pack_sink = NatsSink(nats_server.url, codec=msgpack.MsgpackCodec())
    mem_a, mem_b = MemorySink(), MemorySink()
    async with Scheduler(sinks=[json_sink, mem_a], origin="engine-a") as a:
        for i in range(20):
            a.emit([stored(i, blocks=3), BlockRemoved(block_hashes=[i], medium="GPU")])
            await a.tick()
    async with Scheduler(sinks=[pack_sink, mem_b], origin="engine-b", data_parallel_rank=1) as b:
        for i in range(10):
            b.emit(stored(i))
            await b.tick()
    assert json_sink.stream_name == pack_sink.stream_name == "KV_EVENTS"
    items = await read_all(nats_server.url)
    by_origin = {
        origin: [i for i in items if isinstance(i, EventBatch) and i.origin == origin]
        for origin in ("engine-a", "engine-b")
    }
    assert by_origin == {"engine-a": mem_a.batches, "engine-b": mem_b.batches}
    assert len(items) == 30
    # from_seq per origin: engine-a from 15, the others (no "*") from their start.
    later = await read_all(nats_server.url, from_seq={"engine-a": 15})
    assert [(b.origin, b.seq) for b in later if isinstance(b, EventBatch)] == [
        *(("engine-a", n) for n in range(15, 20)),
        *(("engine-b", n) for n in range(10)),
    ]


@SERVER
async def test_subject_headers_and_msgid_dedup(nats_server: NatsServer) -> None:
    import nats

    sink = NatsSink(nats_server.url, create=True)
    first = batch(0, origin="node-1.example")
    async with sink:
        sink.offer(first)
        sink.offer(first)  # a resend of the same batch: the server drops it
        sink.offer(batch(1, origin="node-1.example"))
    assert sink.statistics().batches_out == 3
    assert sink.duplicates == 1
    client = await nats.connect(nats_server.url)
    try:
        info = await client.jsm().stream_info("KV_EVENTS")
        assert info.state.messages == 2
        msg = await client.jsm().get_msg("KV_EVENTS", 1)
        assert msg.subject == "kv.events.node-1_example"
        assert msg.headers is not None
        assert msg.headers["Nats-Msg-Id"] == "node-1.example:e1:0"
        assert msg.headers["Kv-Origin"] == "node-1.example"
        assert (msg.headers["Kv-Seq"], msg.headers["Kv-Codec"]) == ("0", "json")
        assert msg.data == JsonCodec().encode(first)
    finally:
        await client.close()


@SERVER
async def test_lost_ack_is_not_stored_twice(nats_server: NatsServer) -> None:
    async with CuttingProxy(nats_server.port) as proxy:
        sink = NatsSink(f"nats://127.0.0.1:{proxy.port}", create=True, retry_initial=0.01)
        async with sink:
            sink.offer(batch(0))
            await wait_until(lambda: sink.statistics().batches_out == 1)
            proxy.cut_next_reply(b'"seq":')  # the PubAck of the next publish
            for seq in range(1, 5):
                sink.offer(batch(seq))
        assert proxy.cut.is_set()
        assert proxy.connections >= 2
    assert sink.statistics().send_errors >= 1
    assert sink.duplicates == 1
    assert seqs(await read_all(nats_server.url)) == [0, 1, 2, 3, 4]


@SERVER
async def test_restart_mid_stream_loses_nothing_and_another_process_reads_in_order(
    nats_server: NatsServer,
) -> None:
    total = 120
    sink = NatsSink(nats_server.url, create=True, ack_timeout=2.0, retry_max=0.5)
    live: list[EventBatch | Gap] = []
    sub = NatsSubscriber(
        nats_server.url, durable="live", deliver="all", poll_interval=0.2, retry_max=0.5
    )

    async def follow(done: anyio.Event) -> None:
        async with sub:
            done.set()
            async for item in sub:
                live.append(item)
                if isinstance(item, EventBatch) and item.seq == total - 1:
                    return

    with anyio.fail_after(40):
        async with Scheduler(sinks=[sink], origin="engine-0") as sched:
            async with anyio.create_task_group() as tg:
                sched.emit(stored(0))
                await sched.tick()
                ready = anyio.Event()
                await wait_until(lambda: sink.statistics().batches_out == 1)
                tg.start_soon(follow, ready)
                await ready.wait()
                for i in range(1, total):
                    sched.emit(stored(i))
                    await sched.tick()
                    if i == 40:
                        await wait_until(lambda: sink.statistics().batches_out >= 30)
                        await nats_server.arestart(down_for=0.3)
                    await anyio.sleep(0.002)
            report = await sched.aclose()
    assert report.complete
    assert sink.statistics().send_errors >= 1  # the restart was noticed
    assert seqs(live) == list(range(total))
    assert sub.reconnects >= 1  # the subscriber lived through the restart too

    rows = await read_back_in_another_process(f"{nats_server.url}/kv.events.engine-0")
    assert {r[0] for r in rows} == {"batch"}
    assert {(r[1], r[2]) for r in rows} == {("engine-0", sched.epoch)}
    assert [int(r[3]) for r in rows] == list(range(total))


@SERVER
async def test_durable_consumer_resumes_where_it_left_off(nats_server: NatsServer) -> None:
    sink = NatsSink(nats_server.url, create=True)
    async with sink:
        for seq in range(12):
            sink.offer(batch(seq))
    url = f"{nats_server.url}?durable=reader"
    got: list[int] = []
    async with open_subscriber(url, from_seq=0) as sub:
        async for item in sub:
            assert isinstance(item, EventBatch)
            got.append(item.seq)
            if item.seq == 4:
                break
    assert got == [0, 1, 2, 3, 4]
    await sub.aclose()  # idempotent
    with pytest.raises(ClosedError):
        aiter(sub)
    assert seqs(await read_all(url)) == list(range(5, 12))
    # A different durable name reads everything from the start.
    assert seqs(await read_all(f"{nats_server.url}?durable=other")) == list(range(12))


@SERVER
async def test_oversized_batch_is_refused_counted_and_seen_as_a_gap(
    nats_servers: Callable[..., NatsServer],
) -> None:
    server = nats_servers(config="max_payload: 4096\n")
    sink = NatsSink(server.url, create=True)
    big = EventBatch(seq=1, ts=2.0, events=[stored(1, blocks=400)], origin="engine-0", epoch="e1")
    async with sink:
        assert sink.max_message_size == 4096
        sink.offer(batch(0))
        sink.offer(big)
        sink.offer(batch(2))
    stats = sink.statistics()
    assert (stats.batches_dropped, stats.events_dropped, sink.oversized) == (1, 1, 1)
    items = await read_all(server.url)
    assert [type(i).__name__ for i in items] == ["EventBatch", "Gap", "EventBatch"]
    gap = items[1]
    assert isinstance(gap, Gap)
    assert (gap.first_missing, gap.next_seq) == (1, 2)


@SERVER
async def test_start_errors_are_clear(nats_servers: Callable[..., NatsServer]) -> None:
    port = free_port()
    with pytest.raises(TransportError, match=rf"^cannot reach nats://127\.0\.0\.1:{port}: "):
        async with NatsSink(f"nats://127.0.0.1:{port}", create=True, retry_connect=False):
            pass
    with pytest.raises(TransportError, match=rf"^cannot reach nats://127\.0\.0\.1:{port}: "):
        async with NatsSubscriber(f"nats://127.0.0.1:{port}"):
            pass

    plain = nats_servers(jetstream=False)
    with pytest.raises(TransportError, match="JetStream is not enabled"):
        async with NatsSink(plain.url, create=True):
            pass

    server = nats_servers(config='authorization { user: "kv", password: "s3cret" }\n')
    with pytest.raises(TransportError, match="authorization violation"):
        async with NatsSink(server.url, create=True):
            pass
    authed = f"nats://kv:s3cret@127.0.0.1:{server.port}"
    with pytest.raises(ConfigError, match=r"add \?create=true"):
        async with NatsSink(authed):
            pass
    with pytest.raises(ConfigError, match="no JetStream stream covers"):
        async with NatsSubscriber(authed):
            pass
    async with NatsSink(authed, subject="kv.events.one", stream="ONE", create=True) as sink:
        sink.offer(batch(0))
    # An existing stream is never changed: not covering the subject, or other limits.
    with pytest.raises(ConfigError, match="never changes an existing stream"):
        async with NatsSink(authed, subject="kv.events.two", stream="ONE", create=True):
            pass
    with pytest.raises(ConfigError, match="max_age"):
        async with NatsSink(authed, subject="kv.events.one", create=True, max_age=60.0):
            pass


@SERVER
async def test_a_sink_whose_server_is_not_up_yet_enters_and_delivers_once_it_is(
    nats_servers: Callable[..., NatsServer],
) -> None:
    """The other sinks go on; batches wait in the outbox; the stream is created and
    every batch stored, in order, once the server is there."""
    port = free_port()
    memory = MemorySink()
    sink = NatsSink(f"nats://127.0.0.1:{port}", create=True, retry_max=0.2)
    async with Scheduler(sinks=[memory, sink], origin="engine-0") as sched:
        await tick_stored(sched, range(5))
        assert [b.seq for b in memory.batches] == list(range(5))
        st = sink.statistics()
        assert (st.healthy, st.batches_out, st.queued_batches) == (False, 0, 5)
        assert f"cannot reach nats://127.0.0.1:{port}" in (sink.connect_error or "")
        server = nats_servers(port=port)
        await wait_until(lambda: sink.statistics().batches_out == 5)
        assert sink.statistics().healthy
        assert sink.connect_error is None
        await tick_stored(sched, range(5, 8))
    assert sink.statistics().batches_out == 8
    assert seqs(await read_all(server.url)) == list(range(8))
    # A server that answers and refuses is not "not up yet": the entry fails.
    locked = nats_servers(config='authorization { user: "kv", password: "s3cret" }\n')
    with pytest.raises(TransportError, match="authorization violation"):
        async with NatsSink(f"nats://kv:wrong@127.0.0.1:{locked.port}", create=True):
            pass


@SERVER
async def test_cli_errors_and_demo_through_nats(nats_server: NatsServer) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    port = free_port()
    demo = [sys.executable, "-m", "kvstream", "demo", "--steps", "3", "--sink"]
    unreachable = f"nats://127.0.0.1:{port}?retry_connect=false"
    failed = await anyio.run_process([*demo, unreachable], check=False, env=env)
    assert failed.returncode == 2
    assert f"cannot reach nats://127.0.0.1:{port}" in failed.stderr.decode()
    assert "Traceback" not in failed.stderr.decode()

    url = f"{nats_server.url}?create=true"
    done = await anyio.run_process(
        [sys.executable, "-m", "kvstream", "demo", "--steps", "40", "--rate", "0", "--sink", url],
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr.decode()
    items = await read_all(nats_server.url)
    from kvstream.sim import check_consistency

    batches = [i for i in items if isinstance(i, EventBatch)]
    assert len(batches) > 0
    assert seqs(items) == list(range(len(batches)))
    check_consistency(batches)


@SERVER
async def test_a_fetch_whose_poll_runs_out_is_no_message_not_a_lost_connection(
    nats_server: NatsServer,
) -> None:
    """nats-py ends a fetch whose deadline ran out with asyncio's TimeoutError, not its
    own: that is an empty poll (it was read as a failure, and reconnected, every few)."""
    async with NatsSink(nats_server.url, create=True) as sink:
        sink.offer(batch(0))
    got: list[int] = []

    async def busy_loop() -> None:  # a host loop with other work: polls' deadlines run out
        while True:
            time.sleep(0.004)  # noqa: ASYNC251 - blocking the loop is the point
            await anyio.lowlevel.checkpoint()

    async with (
        NatsSubscriber(nats_server.url, deliver="all", poll_interval=0.002) as sub,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(busy_loop)
        with anyio.move_on_after(1.0):  # polls, a few hundred of them, on an idle stream
            async for item in sub:
                assert isinstance(item, EventBatch)
                got.append(item.seq)
        tg.cancel_scope.cancel()
        assert sub.reconnects == 0
    assert got == [0]


@SERVER
async def test_cli_waits_for_a_stream_not_created_yet_and_reads_it_from_its_start(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A relay (or index, or tail) started before the sink that creates its stream waits
    for the stream; once it exists, every batch in it is newer than the reader, so none
    is skipped (reading "new" messages would lose those stored before it was found)."""
    out = tmp_path / "out.jsonl"
    relay = [sys.executable, "-m", "kvstream", "relay", "--interval", "0.02"]
    args = [*relay, "--source", nats_server.url, "--sink", f"file:{out}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    refused = await anyio.run_process([*args, "--no-retry"], check=False, env=env)
    assert refused.returncode == 2
    assert "no JetStream stream covers subject" in refused.stderr.decode()
    proc = await anyio.open_process(args, env=env)
    try:
        assert proc.stderr is not None
        said = b""
        with anyio.fail_after(30):
            while b"retrying with backoff" not in said:
                said += await proc.stderr.receive()
        async with NatsSink(nats_server.url, create=True) as sink:
            for seq in range(5):
                sink.offer(batch(seq))

        def relayed() -> list[int]:  # the relay re-batches: its events, by first block
            data = out.read_bytes() if out.exists() else b""
            batches = JsonCodec().decode_lines(data[: data.rfind(b"\n") + 1])
            return [
                e.block_hashes[0] for b in batches for e in b.events if hasattr(e, "block_hashes")
            ]

        await wait_until(lambda: len(relayed()) == 5, "the five batches relayed")
        proc.terminate()
        async for chunk in proc.stderr:
            said += chunk
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.aclose()
    assert proc.returncode == 0, said.decode()
    assert relayed() == [seq * 1000 + 1 for seq in range(5)]
    assert b"Traceback" not in said
