"""kvstream.lifetime: one lifetime (an exit stack, one state) for every object that owns tasks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import anyio.lowlevel
import pytest
from anyio.abc import TaskGroup

from kvstream import ClosedError, EventBatch, MemorySink, QueueSink, Scheduler, Sink
from kvstream._wire.http import HttpServer, Request, Response
from kvstream.index._http import QueryServer
from kvstream.index._prefix import PrefixIndex
from kvstream.lifetime import LifetimeState, TaskOwner, open_task_group
from kvstream.metrics import MetricsServer, StatisticsCollector
from kvstream.sinks.file import FileSink
from kvstream.sinks.nats import NatsSink
from kvstream.sinks.redis import RedisSink
from kvstream.sinks.socket import SocketSink
from kvstream.sinks.zmq import ZmqSink
from kvstream.testing import FaultySink


class Owner(TaskOwner):
    """A task owner that records what it opened and released, in order."""

    def __init__(self, fail: BaseException | None = None) -> None:
        super().__init__()
        self.fail = fail
        self.log: list[str] = []
        self.tasks: TaskGroup | None = None

    async def open_lifetime(self, stack: AsyncExitStack) -> None:
        stack.callback(self.log.append, "released")
        self.tasks = await open_task_group(stack, "owner")
        self.tasks.start_soon(anyio.sleep_forever)
        self.log.append("opened")
        if self.fail is not None:
            raise self.fail
        stack.push_async_callback(self.aclose)

    async def aclose(self) -> None:
        self.log.append("aclose")
        if self.tasks is not None:
            self.tasks.cancel_scope.cancel()


async def test_an_owner_goes_from_new_to_running_to_closed_and_enters_once() -> None:
    owner = Owner()
    assert owner.state.name == "NEW"
    async with owner:
        assert owner.state is LifetimeState.RUNNING
        with pytest.raises(ClosedError, match="Owner: can be entered only once"):
            async with owner:
                pass
    assert owner.state.name == "CLOSED"
    assert owner.log == ["opened", "aclose", "released"]  # released in reverse order
    with pytest.raises(ClosedError, match="only once"):
        async with owner:
            pass


async def test_a_failed_enter_releases_what_it_opened_and_raises_the_error_itself() -> None:
    owner = Owner(fail=ValueError("no such transport"))
    with pytest.raises(ValueError, match="no such transport"):  # not an exception group
        async with owner:
            pytest.fail("the body must not run")
    assert owner.log == ["opened", "released"]
    assert owner.state is LifetimeState.CLOSED


async def test_cancelling_an_owners_task_group_leaves_the_owners_body_running() -> None:
    owner = Owner()
    steps = []
    async with owner:
        await owner.aclose()  # cancels its tasks
        await anyio.sleep(0.001)
        steps.append("body went on")
    assert steps == ["body went on"]


async def test_a_socket_sink_closed_inside_its_async_with_leaves_the_body_running() -> None:
    # Its server's task group used to be entered around the owner's body: stopping
    # the server cancelled the body that had called aclose().
    steps = []
    async with SocketSink(host="127.0.0.1", port=0) as sink:
        await sink.aclose()
        await anyio.lowlevel.checkpoint()
        steps.append("body went on")
    assert steps == ["body went on"]
    assert sink.state is LifetimeState.CLOSED


class ContextSink(MemorySink):
    """A sink that holds a context of its own and starts a task of its own."""

    def __init__(self, log: list[str], fail_tasks: bool = False) -> None:
        super().__init__(name="ctx")
        self.log = log
        self.fail_tasks = fail_tasks

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        self.log.append("context entered")
        try:
            yield
        finally:
            self.log.append("context exited")

    async def enter_contexts(self, stack: AsyncExitStack) -> None:
        await stack.enter_async_context(self.held())

    def start_tasks(self, tg: TaskGroup) -> None:
        if self.fail_tasks:
            raise RuntimeError("cannot start the heartbeat")
        tg.start_soon(anyio.sleep_forever)

    async def aclose(self) -> None:
        self.log.append("aclose")
        await super().aclose()


def batch(seq: int) -> EventBatch:
    return EventBatch(seq=seq, ts=0.0, events=[], origin="o", epoch="e")


async def test_a_sinks_contexts_are_exited_after_aclose_delivered_what_was_queued() -> None:
    log: list[str] = []
    sink = ContextSink(log)
    async with sink:
        sink.offer(batch(0))
    assert log == ["context entered", "aclose", "context exited"]
    assert sink.batches == [batch(0)]


async def test_a_sink_whose_tasks_fail_to_start_is_closed_and_raises_the_error() -> None:
    log: list[str] = []
    sink = ContextSink(log, fail_tasks=True)
    with pytest.raises(RuntimeError, match="cannot start the heartbeat"):
        async with sink:
            pytest.fail("the body must not run")
    assert log == ["context entered", "aclose", "context exited"]
    assert sink.closed
    with pytest.raises(ClosedError, match="closed"):
        sink.offer(batch(0))


def test_no_sink_or_server_writes_its_own_aenter_or_aexit() -> None:
    owners: list[type[TaskOwner]] = [
        MemorySink,
        QueueSink,
        FileSink,
        SocketSink,
        ZmqSink,
        NatsSink,
        RedisSink,
        FaultySink,
        Scheduler,
        HttpServer,
        MetricsServer,
        QueryServer,
    ]
    for cls in owners:
        assert issubclass(cls, TaskOwner), cls
        for klass in cls.__mro__:
            if klass is TaskOwner:
                break
            assert "__aenter__" not in vars(klass), klass
            assert "__aexit__" not in vars(klass), klass
    assert issubclass(Sink, TaskOwner)


async def _ok(request: Request) -> Response:
    return Response(200, b"ok\n")


async def test_the_servers_refuse_a_second_enter_and_close_idempotently() -> None:
    http = HttpServer(_ok, name="probe")
    metrics = MetricsServer(StatisticsCollector(), "127.0.0.1:0", process_metrics=False)
    index = QueryServer(PrefixIndex(block_size=16))
    servers: list[tuple[HttpServer | MetricsServer | QueryServer, str]] = [
        (http, "probe"),
        (metrics, "metrics"),
        (index, "kvstream index"),
    ]
    for server, name in servers:
        async with server:
            assert server.state is LifetimeState.RUNNING
            with pytest.raises(ClosedError, match=f"{name}: a server can be entered only once"):
                async with server:
                    pass
            await server.aclose()
            await server.aclose()
        assert server.state.name == "CLOSED"


async def test_a_sink_closed_before_it_was_entered_refuses_to_open() -> None:
    sink = ContextSink([])
    await sink.aclose()
    assert sink.closed
    with pytest.raises(ClosedError, match="ctx: the sink was closed before it was entered"):
        async with sink:
            pytest.fail("the body must not run")
    assert sink.log == ["aclose"]  # nothing was opened, so nothing is released
