"""Redis Streams: the sink, the subscriber and the entry layout they share.

Server tests run a real ``redis-server --appendonly yes`` (see tests/servers.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
from servers import (
    CuttingProxy,
    RedisServer,
    batch,
    free_port,
    read_all,
    read_back_in_another_process,
    redis_server,
    redis_servers,
    seqs,
    stored,
    tick_stored,
    wait_until,
)

from kvstream._wire.broker import key_from_fields, redis_fields
from kvstream.codecs.json import JsonCodec
from kvstream.config import open_sink, open_subscriber
from kvstream.consumers.base import Gap
from kvstream.consumers.redis import RedisSubscriber
from kvstream.errors import ClosedError, ConfigError, DecodeError, TransportError
from kvstream.events import BlockRemoved, EventBatch
from kvstream.scheduler import Scheduler
from kvstream.sinks.memory import MemorySink
from kvstream.sinks.redis import RedisSink, _next_id

__all__ = ["redis_server", "redis_servers"]  # fixtures, imported for pytest

SERVER = pytest.mark.server


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[object]:
    """A plain redis-py client of the test's server."""
    import redis.asyncio

    client = redis.asyncio.Redis(port=redis_server.port)
    yield client
    await client.aclose()


# -- rules (no server) ----------------------------------------------------------------


def test_fields_carry_the_batch_name() -> None:
    b = batch(3, origin="host:1 ü", epoch="ab")
    fields = redis_fields(b, b"payload-bytes", "json")
    assert list(fields) == [b"payload", b"origin", b"epoch", b"seq", b"codec"]
    assert fields[b"payload"] == b"payload-bytes"
    assert key_from_fields(fields) == ("host:1 ü", "ab", 3)
    with pytest.raises(DecodeError, match="seq"):
        key_from_fields({b"origin": b"a", b"epoch": b"b", b"seq": b"-1"})
    with pytest.raises(DecodeError, match="no fields"):
        key_from_fields(None)


def test_next_id_is_the_smallest_later_id() -> None:
    assert _next_id(b"1700000000000-0") == b"1700000000000-1"
    assert _next_id(b"0-0") == b"0-1"
    assert _next_id(b"5-41") == b"5-42"


def test_urls_build_configured_sinks_and_subscribers() -> None:
    sink = open_sink("redis://:pw@127.0.0.1:6390/kv:x?maxlen=1000&db=2&policy=drop_newest")
    assert isinstance(sink, RedisSink)
    assert (sink.stream, sink.maxlen, sink.db, sink.policy) == ("kv:x", 1000, 2, "drop_newest")
    assert sink.url == "redis://:pw@127.0.0.1:6390"
    assert sink.shown == "redis://127.0.0.1:6390"
    assert "pw" not in sink.name
    assert open_sink("redis://127.0.0.1:6390").stream == "kv:events"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="maxlen"):
        open_sink("redis://127.0.0.1:6390/s?maxlen=0")
    with pytest.raises(ConfigError, match="unknown option"):
        open_sink("redis://127.0.0.1:6390/s?max_len=10")
    sub = open_subscriber("redis://127.0.0.1:6390/kv:x?group=routers&consumer=r1&start=$")
    assert isinstance(sub, RedisSubscriber)
    assert (sub.stream, sub.group, sub.consumer, sub.start) == ("kv:x", "routers", "r1", "$")
    with pytest.raises(ConfigError, match="start"):
        open_subscriber("redis://127.0.0.1:6390/kv:x?start=yesterday")
    # New entries only unless the reader asks for a from_seq (as kvstream.subscribe says).
    assert open_subscriber("redis://127.0.0.1:6390").start == "$"  # type: ignore[attr-defined]
    assert open_subscriber("redis://127.0.0.1:6390", from_seq=0).start == "0"  # type: ignore[attr-defined]


# -- with a server --------------------------------------------------------------------


@SERVER
async def test_round_trip_plain_and_group_with_both_codecs(
    redis_server: RedisServer, raw: object, no_leaked_tasks: None
) -> None:
    msgpack = pytest.importorskip("kvstream.codecs.msgpack")
    url = f"{redis_server.url}/kv:test"
    mem_a, mem_b = MemorySink(), MemorySink()
    async with Scheduler(sinks=[open_sink(url), mem_a], origin="engine-a") as a:
        for i in range(20):
            a.emit([stored(i, blocks=3), BlockRemoved(block_hashes=[i], medium="GPU")])
            await a.tick()
    pack = RedisSink(redis_server.url, stream="kv:test", codec=msgpack.MsgpackCodec())
    async with Scheduler(sinks=[pack, mem_b], origin="engine-b", data_parallel_rank=1) as b:
        for i in range(10):
            b.emit(stored(i))
            await b.tick()
    expected = {"engine-a": mem_a.batches, "engine-b": mem_b.batches}
    for reader in (url, f"{url}?group=g1&consumer=c1"):
        items = await read_all(reader)
        by_origin = {
            origin: [i for i in items if isinstance(i, EventBatch) and i.origin == origin]
            for origin in expected
        }
        assert by_origin == expected
        assert len(items) == 30
    entries = await raw.xrange("kv:test", count=1)  # type: ignore[attr-defined]
    _, fields = entries[0]
    assert fields[b"origin"] == b"engine-a"
    assert (fields[b"seq"], fields[b"codec"]) == (b"0", b"json")
    assert fields[b"payload"] == JsonCodec().encode(mem_a.batches[0])
    # The group acknowledged everything it handed over.
    pending = await raw.xpending("kv:test", "g1")  # type: ignore[attr-defined]
    assert pending["pending"] == 0


@SERVER
async def test_trimming_and_pipelining(redis_server: RedisServer, raw: object) -> None:
    sink = RedisSink(redis_server.url, stream="kv:trim", maxlen=100)
    async with sink:
        for seq in range(600):  # queued at once: the writer sends them 64 per MULTI/EXEC
            sink.offer(batch(seq))
    assert sink.statistics().batches_out == 600
    length = await raw.xlen("kv:trim")  # type: ignore[attr-defined]
    assert 100 <= length < 600  # approximate trimming: whole nodes go
    stats = await raw.info("commandstats")  # type: ignore[attr-defined]
    assert stats["cmdstat_exec"]["calls"] >= 600 // 64
    items = await read_all(f"{redis_server.url}/kv:trim")
    assert seqs(items) == list(range(600 - len(items), 600))


@SERVER
@pytest.mark.parametrize("queued", [1, 20])
async def test_lost_reply_is_not_written_twice(
    redis_server: RedisServer, raw: object, queued: int
) -> None:
    async with CuttingProxy(redis_server.port) as proxy:
        sink = RedisSink(f"redis://127.0.0.1:{proxy.port}", stream="kv:cut", retry_initial=0.01)
        async with sink:
            sink.offer(batch(0))
            await wait_until(lambda: sink.statistics().batches_out == 1)
            proxy.cut_next_reply()  # the reply of the next XADD (or MULTI/EXEC) is lost
            for seq in range(1, 1 + queued):
                sink.offer(batch(seq))
            await wait_until(lambda: sink.statistics().batches_out == 1 + queued)
            sink.offer(batch(1 + queued))
        assert proxy.cut.is_set()
    assert sink.statistics().send_errors >= 1
    assert sink.duplicates >= 1
    assert await raw.xlen("kv:cut") == queued + 2  # type: ignore[attr-defined]
    assert seqs(await read_all(f"{redis_server.url}/kv:cut")) == list(range(queued + 2))


@SERVER
async def test_restart_mid_stream_loses_nothing_and_another_process_reads_in_order(
    redis_server: RedisServer, raw: Any
) -> None:
    total = 120
    sink = RedisSink(redis_server.url, stream="kv:restart", retry_max=0.5)
    live: list[EventBatch | Gap] = []
    sub = RedisSubscriber(
        redis_server.url, stream="kv:restart", group="live", start="0", block=0.2, retry_max=0.5
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
                ready = anyio.Event()
                tg.start_soon(follow, ready)
                await ready.wait()
                for i in range(total):
                    sched.emit(stored(i))
                    await sched.tick()
                    if i == 40:
                        await wait_until(lambda: sink.statistics().batches_out >= 30)
                        before = (await raw.info("server"))["run_id"]
                        await redis_server.arestart(down_for=0.3)
                    await anyio.sleep(0.002)
            report = await sched.aclose()
    assert report.complete
    # A new server process took the rest of the batches. The sink need not have seen
    # an error: redis-py's pool (7.4 and 8.2, not 8.1) checks a connection before each
    # command and reconnects one the server closed while it was idle, before anything
    # is sent. What matters holds either way: nothing lost, nothing repeated, in order.
    assert (await raw.info("server"))["run_id"] != before
    assert seqs(live) == list(range(total))
    assert sub.read_errors >= 1  # the subscriber lived through the restart too

    rows = await read_back_in_another_process(f"{redis_server.url}/kv:restart")
    assert {r[0] for r in rows} == {"batch"}
    assert {(r[1], r[2]) for r in rows} == {("engine-0", sched.epoch)}
    assert [int(r[3]) for r in rows] == list(range(total))


@SERVER
async def test_readers_resume(redis_server: RedisServer, raw: object) -> None:
    async with RedisSink(redis_server.url, stream="kv:resume") as sink:
        for seq in range(12):
            sink.offer(batch(seq))
    url = f"{redis_server.url}/kv:resume"
    # A group consumer resumes after what it acknowledged.
    got: list[int] = []
    async with open_subscriber(f"{url}?group=g&consumer=c", from_seq=0) as sub:
        async for item in sub:
            assert isinstance(item, EventBatch)
            got.append(item.seq)
            if item.seq == 4:
                break
    assert got == [0, 1, 2, 3, 4]
    await sub.aclose()  # idempotent
    with pytest.raises(ClosedError):
        aiter(sub)
    assert seqs(await read_all(f"{url}?group=g&consumer=c")) == list(range(5, 12))
    # Entries delivered to a consumer that died before acknowledging come back to it.
    await raw.xgroup_create("kv:resume", "g2", id="0")  # type: ignore[attr-defined]
    await raw.xreadgroup("g2", "c", {"kv:resume": ">"}, count=3)  # type: ignore[attr-defined]
    assert seqs(await read_all(f"{url}?group=g2&consumer=c")) == list(range(12))
    # A plain reader resumes from the last id it handed over.
    first = RedisSubscriber(redis_server.url, stream="kv:resume", follow=False, from_seq=0)
    async with first:
        async for item in first:
            assert isinstance(item, EventBatch)
            if item.seq == 6:
                break
    assert first.last_id is not None
    assert seqs(await read_all(f"{url}?start={first.last_id}")) == list(range(7, 12))


@SERVER
async def test_start_errors_are_clear(
    redis_servers: Callable[..., RedisServer], raw: object
) -> None:
    port = free_port()
    with pytest.raises(TransportError, match=rf"^cannot reach redis://127\.0\.0\.1:{port}: "):
        async with RedisSink(f"redis://127.0.0.1:{port}", retry_connect=False):
            pass
    with pytest.raises(TransportError, match=rf"^cannot reach redis://127\.0\.0\.1:{port}: "):
        async with RedisSubscriber(f"redis://127.0.0.1:{port}"):
            pass
    locked = redis_servers(password="s3cret")
    with pytest.raises(TransportError, match="authentication"):
        async with RedisSink(locked.url):
            pass
    with pytest.raises(TransportError, match="authentication"):
        async with RedisSink(f"redis://:wrong@127.0.0.1:{locked.port}"):
            pass
    async with RedisSink(f"redis://:s3cret@127.0.0.1:{locked.port}") as sink:
        sink.offer(batch(0))
    assert sink.statistics().batches_out == 1

    server_url = f"redis://127.0.0.1:{raw.connection_pool.connection_kwargs['port']}"  # type: ignore[attr-defined]
    await raw.set("not-a-stream", "x")  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="holds a string, expected a stream"):
        async with RedisSink(server_url, stream="not-a-stream"):
            pass
    with pytest.raises(ConfigError, match="holds a string"):
        async with RedisSubscriber(server_url, stream="not-a-stream"):
            pass


@SERVER
async def test_a_sink_whose_server_is_not_up_yet_enters_and_delivers_once_it_is(
    redis_servers: Callable[..., RedisServer],
) -> None:
    """Faults stay local at start too: the other sinks are not held up, batches wait in
    the outbox, and every one arrives, in order, once the server is there."""
    port = free_port()
    memory = MemorySink()
    sink = RedisSink(f"redis://127.0.0.1:{port}", stream="kv:late", retry_max=0.2)
    async with Scheduler(sinks=[memory, sink], origin="engine-0") as sched:
        await tick_stored(sched, range(5))
        assert [b.seq for b in memory.batches] == list(range(5))
        st = sink.statistics()
        assert (st.healthy, st.batches_out, st.queued_batches) == (False, 0, 5)
        assert f"cannot reach redis://127.0.0.1:{port}" in (sink.connect_error or "")
        server = redis_servers(port=port, appendonly=False)
        await wait_until(lambda: sink.statistics().batches_out == 5)
        assert sink.statistics().healthy
        assert sink.connect_error is None
        await tick_stored(sched, range(5, 8))
    assert sink.statistics().batches_out == 8
    assert seqs(await read_all(f"{server.url}/kv:late")) == list(range(8))
    # A server that answers and refuses is not "not up yet": the entry fails.
    locked = redis_servers(password="s3cret")
    with pytest.raises(TransportError, match="authentication"):
        async with RedisSink(f"redis://:wrong@127.0.0.1:{locked.port}"):
            pass


@SERVER
async def test_cli_errors_and_demo_through_redis(redis_server: RedisServer) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    port = free_port()
    demo = [sys.executable, "-m", "kvstream", "demo", "--sink"]
    failed = await anyio.run_process(
        [*demo, f"redis://127.0.0.1:{port}?retry_connect=false", "--steps", "3"],
        check=False,
        env=env,
    )
    assert failed.returncode == 2
    assert f"cannot reach redis://127.0.0.1:{port}" in failed.stderr.decode()
    assert "Traceback" not in failed.stderr.decode()

    url = f"{redis_server.url}/kv:demo"
    done = await anyio.run_process(
        [*demo, url, "--steps", "40", "--rate", "0"], check=False, env=env
    )
    assert done.returncode == 0, done.stderr.decode()
    from kvstream.sim import check_consistency

    items = await read_all(url)
    batches = [i for i in items if isinstance(i, EventBatch)]
    assert len(batches) > 0
    assert seqs(items) == list(range(len(batches)))
    check_consistency(batches)
