"""One reader at a time for an object iterated with `async for`.

A subscriber or a `QueueSink` hands each item out once: two tasks reading the same
one would each get part of the stream, and neither would know. `OneReader` wraps the
object's async generator and refuses a second task that asks for an item while the
first is still waiting for one, with a `ClosedError` saying what to do instead. One
task may stop (`break`) and read on later: the items continue where they stopped.

    def __aiter__(self) -> AsyncIterator[Item]:
        if self._gen is None:
            self._gen = self._read()
        return OneReader(self._gen, "FileSubscriber(kv.jsonl)", "FileSubscriber")

`__anext__` hands out the generator's own awaitable: reading costs no extra frame.
"""

from __future__ import annotations

import types
from collections.abc import AsyncGenerator, Awaitable
from typing import Generic, Self, TypeVar

from kvstream.errors import ClosedError

__all__ = ["OneReader", "busy_error", "running"]

T = TypeVar("T")


class OneReader(Generic[T]):
    """`gen`, read by one task at a time; `name` and `kind` go into the refusal."""

    __slots__ = ("_gen", "_kind", "_name")

    def __init__(self, gen: AsyncGenerator[T, None], name: str, kind: str) -> None:
        self._gen = gen
        self._name = name
        self._kind = kind

    def __aiter__(self) -> Self:
        return self

    def __anext__(self) -> Awaitable[T]:
        if running(self._gen):
            raise busy_error(self._name, self._kind)
        return self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()


def busy_error(name: str, kind: str) -> ClosedError:
    """The refusal of a second reader (`kind`: what to give each reader instead)."""
    return ClosedError(
        f"{name}: already being read by another task; each item goes to one reader "
        f"only, so give every reader a {kind} of its own"
    )


def running(gen: AsyncGenerator[object, None]) -> bool:
    """Whether `gen` is inside a step right now (in some task, waiting or not)."""
    return isinstance(gen, types.AsyncGeneratorType) and gen.ag_running
