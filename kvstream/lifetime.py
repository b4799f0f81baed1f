"""One lifetime for every object that owns tasks: sinks, the scheduler, the servers.

An owner is an async context manager that can be entered once. Entering it
calls `TaskOwner.open_lifetime()` with an `AsyncExitStack`: the owner opens
what it holds there (a listener, a task group, another owner) and registers
how each is released (`stack.push_async_callback(...)`). Leaving it closes that
stack, in reverse order, whether the body ended normally, raised or was
cancelled; a failure while entering closes what was already on the stack and
re-raises the failure itself (never wrapped in an exception group).

The lifetime is one explicit `LifetimeState`:

    NEW --enter--> OPENING --> RUNNING --aclose()/drain--> CLOSING --> CLOSED

`open_task_group()` gives an owner a task group whose cancellation stops the
owner's tasks and nothing else: the owner's `async with` body does not run
inside that group's scope, so an owner closed early (`await owner.aclose()`
inside its own `async with`) does not cancel the code that closed it.
"""

from __future__ import annotations

import enum
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Self

import anyio
from anyio.abc import TaskGroup, TaskStatus

from kvstream.errors import ClosedError

__all__ = ["LifetimeState", "TaskOwner", "open_task_group"]


class LifetimeState(enum.Enum):
    """Where an owner is in its one lifetime."""

    #: Built, never entered.
    NEW = "new"
    #: Being entered: resources opening, tasks starting.
    OPENING = "opening"
    #: Entered and working.
    RUNNING = "running"
    #: Closing: takes nothing new, finishes (drains) what it holds.
    CLOSING = "closing"
    #: Done; every resource released or being released by the exit stack.
    CLOSED = "closed"


class TaskOwner:
    """Base of objects with tasks: enter once, close idempotently, release everything.

    Subclasses implement `open_lifetime(stack)`, registering their own
    idempotent `aclose()` on the stack (shielded), and never write
    `__aenter__` or `__aexit__`. `state` is the one record of where the
    object is.
    """

    #: Set by subclasses' `__init__` through `TaskOwner.__init__`.
    _state: LifetimeState = LifetimeState.NEW
    _exit_stack: AsyncExitStack | None = None

    def __init__(self) -> None:
        self._state = LifetimeState.NEW
        self._exit_stack = None

    @property
    def state(self) -> LifetimeState:
        return self._state

    def _set_state(self, state: LifetimeState) -> None:
        """Move to `state` (subclasses that cache a view of the state override it)."""
        self._state = state

    def reentry_error(self) -> ClosedError:
        """The error for a second `async with` on the same object."""
        return ClosedError(f"{type(self).__name__}: can be entered only once")

    async def open_lifetime(self, stack: AsyncExitStack) -> None:
        """Open what the object holds, registering on `stack` how to release it."""

    async def __aenter__(self) -> Self:
        if self._state is not LifetimeState.NEW:
            raise self.reentry_error()
        self._set_state(LifetimeState.OPENING)
        # An exit stack needs no entering: on failure it is closed here, with no
        # exception handed to what it holds (a task group would wrap it in a group).
        stack = AsyncExitStack()
        try:
            await self.open_lifetime(stack)
        except BaseException:
            try:
                await stack.aclose()
            finally:
                self._set_state(LifetimeState.CLOSED)
            raise
        self._exit_stack = stack
        self._opened()
        return self

    def _opened(self) -> None:
        # Closed while opening (a hook called `aclose()`): it stays closing.
        if self._state is LifetimeState.OPENING:
            self._set_state(LifetimeState.RUNNING)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._exit_stack = self._exit_stack, None
        try:
            if stack is not None:
                await stack.aclose()
        finally:
            self._set_state(LifetimeState.CLOSED)


async def open_task_group(stack: AsyncExitStack, name: str) -> TaskGroup:
    """A task group on `stack` that can be cancelled without cancelling the owner's body.

    The group is held open by a task of its own (in a group entered on the
    stack), so cancelling the returned group's scope stops its tasks only. On
    exit the stack cancels it and waits for its tasks to end.
    """
    host = await stack.enter_async_context(anyio.create_task_group())
    stack.callback(host.cancel_scope.cancel)
    group: TaskGroup = await host.start(_hold_task_group, name=name)
    return group


async def _hold_task_group(*, task_status: TaskStatus[TaskGroup]) -> None:
    """Hold a task group open, in a task of its own, until its scope is cancelled."""
    async with anyio.create_task_group() as tg:
        task_status.started(tg)
        await anyio.sleep_forever()
