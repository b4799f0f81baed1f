"""Shared fixtures. Keep this small: helpers a single test file needs live in that file."""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncIterator, Callable, Mapping

import pytest

from kvstream._event_loop import resolve_event_loop
from kvstream.errors import ConfigError


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every async test gets the leak check (no asyncio task may outlive it)."""
    for item in items:
        function = getattr(item, "function", None)
        names = getattr(item, "fixturenames", None)
        if (
            inspect.iscoroutinefunction(function)
            and names is not None
            and "no_leaked_tasks" not in names
        ):
            names.append("no_leaked_tasks")


_TEST_LOOP = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """KVSTREAM_TEST_LOOP, resolved once: a name that is not a loop stops the run."""
    name = os.environ.get("KVSTREAM_TEST_LOOP", "asyncio")
    try:
        config.stash[_TEST_LOOP] = resolve_event_loop(name, field="KVSTREAM_TEST_LOOP")
    except ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The loop every async test runs on: asyncio's own, or uvloop's with
    KVSTREAM_TEST_LOOP=uvloop (CI runs the whole suite on both)."""
    if config.stash[_TEST_LOOP] == "uvloop":
        import uvloop

        return {"uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture
def anyio_backend() -> str:
    """aiostream is asyncio-only: tests using anyio's plugin run on asyncio."""
    return "asyncio"


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fail the test if it leaves asyncio tasks running on the loop (every async test).

    Lets the loop run a few rounds first, so tasks that are finishing (a
    cancelled writer running its ``finally``) get to finish.
    """
    before = asyncio.all_tasks()
    yield
    leaked: set[asyncio.Task[object]] = set()
    for _ in range(20):
        leaked = asyncio.all_tasks() - before - {asyncio.current_task()}
        if not leaked:
            return
        await asyncio.sleep(0)
    names = sorted(t.get_name() for t in leaked)
    pytest.fail(f"{len(leaked)} task(s) still running after the test: {names}")
