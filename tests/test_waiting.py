"""The tests' one ``wait_until``: it returns once the condition holds, and fails naming it."""

from __future__ import annotations

import anyio
import pytest
from waiting import wait_until


async def test_wait_until_returns_once_another_task_makes_it_true() -> None:
    state = {"done": False}

    async def later() -> None:
        await anyio.sleep(0.01)
        state["done"] = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        await wait_until(lambda: state["done"], "the flag")
    assert state["done"]


async def test_wait_until_fails_the_test_naming_what_it_waited_for() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"after 0\.05 s waiting for the ring"):
        await wait_until(lambda: False, "the ring", timeout=0.05)
