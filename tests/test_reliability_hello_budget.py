"""Connections that never say hello cannot keep a subscriber out of the socket sink.

Before, every connection counted against `max_subscribers` from the moment it
was accepted, so 64 connections that sent nothing held every slot for
`hello_timeout` (10 s) and a well-behaved subscriber was refused `busy`. Now
connections without a hello have a budget of their own (`max_pending_hellos`);
a newer connection closes the oldest still waiting (refused `busy`, counted),
and only subscribers that said hello count against `max_subscribers`.
"""

from __future__ import annotations

import anyio
import anyio.abc
import orjson
import pytest
from servers import wait_until
from test_reliability_oversize import seqs_until
from test_reliability_peers import read_until_closed

from kvstream import Scheduler
from kvstream.consumers.socket import SocketSubscriber
from kvstream.errors import ConfigError, TransportError
from kvstream.sinks.socket import DEFAULT_MAX_PENDING_HELLOS, SocketSink
from kvstream.testing import SeededEvents

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


def _port(sink: SocketSink) -> int:
    return int(sink.address.rsplit(":", 1)[1])


async def test_64_connections_without_a_hello_do_not_keep_a_subscriber_out() -> None:
    events = SeededEvents(31)
    sink = SocketSink(port=0, hello_timeout=60.0)  # the defaults: 64 subscribers, 16 pending
    idle: list[anyio.abc.SocketStream] = []
    async with Scheduler(sinks=[sink], origin="eng") as scheduler:
        port = _port(sink)
        try:
            for _ in range(64):
                idle.append(await anyio.connect_tcp("127.0.0.1", port))
            evicted = 64 - DEFAULT_MAX_PENDING_HELLOS
            await wait_until(lambda: sink.statistics().hellos_evicted == evicted)
            async with SocketSubscriber(port=port, from_seq=0, reconnect=False) as sub:
                for n in range(5):
                    scheduler.emit(events.events(n * 4, (n + 1) * 4))
                    await scheduler.tick()
                assert await seqs_until(sub, 4) == [0, 1, 2, 3, 4]
            stats = sink.statistics()
            assert stats.hellos_evicted == evicted + 1  # the subscriber made room too
            assert stats.connections_accepted == 1
            # The oldest idle connection was told why, in one error line, and closed.
            reply = await read_until_closed(idle[0])
            first = orjson.loads(reply.split(b"\n", 1)[0])
            assert first["type"] == "error"
            assert first["code"] == "busy"
            assert "max_pending_hellos" in first["message"]
        finally:
            for stream in idle:
                await stream.aclose()
        await scheduler.aclose()
    assert sink.statistics().connections_refused >= evicted + 1


async def test_only_subscribers_that_said_hello_count_against_max_subscribers() -> None:
    sink = SocketSink(port=0, max_subscribers=1, max_pending_hellos=2)
    async with sink:
        port = _port(sink)
        async with SocketSubscriber(port=port, reconnect=False):
            with pytest.raises(TransportError, match="max_subscribers"):
                async with SocketSubscriber(port=port, reconnect=False):
                    pass
        await wait_until(lambda: sink.statistics().subscribers == 0)
        async with SocketSubscriber(port=port, reconnect=False):  # the slot is free again
            pass
    assert sink.statistics().hellos_evicted == 0


@pytest.mark.parametrize("value", [0, -1, 2.0, "4"])
def test_a_bad_pending_hello_budget_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(ConfigError, match="max_pending_hellos"):
        SocketSink(port=0, max_pending_hellos=value)  # type: ignore[arg-type]
