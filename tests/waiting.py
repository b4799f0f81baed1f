"""The tests' one way to wait for state another task moves: ``wait_until``."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest

__all__ = ["wait_until"]


async def wait_until(
    predicate: Callable[[], object], what: str = "", timeout: float = 20.0
) -> None:
    """Poll ``predicate`` until it holds; fail the test, naming ``what``, after ``timeout`` s.

    Polls every 5 ms. The deadline only catches hangs: nothing is asserted about how
    long it takes.
    """
    try:
        with anyio.fail_after(timeout):
            while not predicate():  # noqa: ASYNC110 - polling another object's state
                await anyio.sleep(0.005)
    except TimeoutError:
        pytest.fail(f"timed out after {timeout} s waiting for {what or 'the condition'}")
