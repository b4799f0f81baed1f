"""A broker outage stays local: NATS JetStream or Redis goes down for a while.

Beside the broker sink runs a healthy local sink. While the broker is down the
engine keeps ticking: with ``drop_oldest`` on the broker sink no tick waits,
the local sink gets every batch, and the broker sink holds at most its outbox
and counts what it drops. When the broker is back the sink resumes by itself,
and a reader of the broker sees exactly the counted drops as one gap: nothing
else missing, nothing twice. (The restart with policy ``block``, where nothing
may be lost, is in ``test_nats.py`` / ``test_redis.py``.)
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from typing import Any

import anyio
import pytest
from servers import nats_server, nats_servers, redis_server, redis_servers, wait_until

from kvstream import EventBatch, Scheduler
from kvstream.config import open_subscriber
from kvstream.consumers.base import Gap
from kvstream.sinks.base import Sink
from kvstream.testing import FaultySink, SeededEvents, StreamVerifier

__all__ = ["nats_server", "nats_servers", "redis_server", "redis_servers"]  # fixtures

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("no_leaked_tasks")]

PER_BATCH = 5
OUTBOX = 20


def run_without_suspending(coro: Coroutine[Any, Any, EventBatch | None]) -> EventBatch | None:
    """Run ``coro`` to its end in one step; fail if it would wait for anything."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise AssertionError("tick() suspended")


def _broker_sink(broker: str, url: str) -> tuple[Sink, str]:
    """The broker's sink (drop_oldest, small outbox, quick retries) and a reader URL."""
    common: dict[str, Any] = {
        "policy": "drop_oldest",
        "max_batches": OUTBOX,
        "retry_initial": 0.01,
        "retry_max": 0.2,
        "name": broker,
    }
    if broker == "nats":
        from kvstream.sinks.nats import NatsSink

        sink: Sink = NatsSink(url, create=True, ack_timeout=1.0, connect_timeout=1.0, **common)
        return sink, f"{url}/kv.events.eng"
    from kvstream.sinks.redis import RedisSink

    return RedisSink(url, stream="kv:outage", connect_timeout=1.0, **common), f"{url}/kv:outage"


@pytest.mark.parametrize("broker", ["nats", "redis"])
async def test_a_broker_outage_stays_local_and_its_drops_are_the_gap_readers_see(
    broker: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstream.sinks")
    server = request.getfixturevalue(f"{broker}_server")
    stream = SeededEvents(41)
    local_seen = StreamVerifier(stream, origin="eng", events_per_batch=PER_BATCH)
    local = FaultySink(name="local", on_batch=local_seen.check)
    remote, reader_url = _broker_sink(broker, server.url)
    produced = 0
    with anyio.fail_after(90):
        async with Scheduler(sinks=[remote, local], origin="eng") as scheduler:

            async def produce(n: int, *, never_wait: bool = False) -> None:
                nonlocal produced
                for _ in range(n):
                    scheduler.emit(stream.events(produced * PER_BATCH, (produced + 1) * PER_BATCH))
                    if never_wait:
                        run_without_suspending(scheduler.tick())
                    else:
                        await scheduler.tick()
                    produced += 1
                    await anyio.sleep(0.001)

            async def delivered(n: int) -> None:
                def done() -> bool:
                    st = remote.statistics()
                    return st.batches_out >= n and not st.queued_batches

                await wait_until(done, timeout=60)

            await produce(50)
            await delivered(50)

            await server.astop()  # the broker goes away
            await produce(200, never_wait=True)  # ... and the engine never waits for it
            st = remote.statistics()
            assert not st.healthy
            assert st.send_errors >= 1
            assert st.queued_batches <= OUTBOX
            assert st.batches_dropped >= 200 - OUTBOX - 1  # all but the outbox and one in flight

            await server.astart()  # the broker is back: the sink resumes by itself
            await delivered(st.batches_out + 1)
            await produce(50)
            report = await scheduler.aclose(timeout=20)

    assert report.complete, report
    st = remote.statistics()
    assert st.batches_in == produced == 300
    assert st.batches_out + st.batches_dropped == produced
    # The local sink did not notice anything.
    assert (local_seen.batches, local_seen.gaps) == (produced, 0)

    # What the broker holds: every batch but the counted drops, in order, once each.
    seen = StreamVerifier(stream, origin="eng", events_per_batch=PER_BATCH)
    gaps: list[Gap] = []
    with anyio.fail_after(30):
        async with open_subscriber(reader_url, follow=False, from_seq=0) as sub:
            async for item in sub:
                if isinstance(item, Gap):
                    gaps.append(item)
                else:
                    assert isinstance(item, EventBatch)
                    seen.check(item)
    assert seen.batches == st.batches_out
    assert seen.missing_batches == st.batches_dropped == sum(g.missing for g in gaps)
    assert seen.gaps == len(gaps) == 1
    assert seen.next_seq == produced
    # One outage, one burst: logged once when it failed, once when it recovered.
    messages = [r.getMessage() for r in caplog.records if r.name == "kvstream.sinks"]
    assert sum(f"{broker}: send failed" in m for m in messages) == 1, messages
    assert sum(f"{broker}: send recovered" in m for m in messages) == 1, messages
    assert sum(f"{broker}: dropping batches" in m for m in messages) == 1, messages
