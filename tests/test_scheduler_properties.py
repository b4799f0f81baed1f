"""The scheduler's guarantees as properties, over random programs (hypothesis).

A program is a random sequence of host operations (emit, tick, letting the loop
run, feeding a ``take_events()`` connector, adding, failing and removing
sources) run against random async sources (yielding single events and chunks,
sometimes awaiting, sometimes held back by ``max_pending_events``), sometimes
with a ticker ticking concurrently and a sink whose full outbox makes ticks
wait. Afterwards:

* the barrier, in its strongest form: every event is sealed by the first tick
  that starts after it was accepted. So an event accepted before ``tick()`` was
  called is in that tick's batch or an earlier one, and the host's emits before
  ``tick()`` are in that tick's batch (unless the ticker ticked in between);
* order: every source's events arrive in the order it yielded them; in a batch
  the host's events come first, then each input's in the order they were added;
* sequence numbers run 0, 1, 2, ... per origin, in one epoch;
* nothing is lost or duplicated: exactly the accepted events are delivered, to
  every sink, and ``aclose`` reports no loss.

The batch timestamp comes from a clock that counts ticks, so each batch says
which tick sealed it. Every run is deterministic (asyncio without time), so
hypothesis can shrink a failure to a short program.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream import BlockRemoved, EventBatch, KVCacheEvent, MemorySink, Scheduler, SourceHandle

OWN = "own"
RELAY = "relay"
CONNECTOR_IDS = 900_000_000


def event(event_id: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[event_id])


def event_id(e: KVCacheEvent) -> int:
    assert isinstance(e, BlockRemoved)
    h = e.block_hashes[0]
    assert isinstance(h, int)
    return h


class TickClock:
    """The clock the scheduler stamps batches with: the number of the tick."""

    def __init__(self) -> None:
        self.ticks = 0

    def __call__(self) -> float:
        self.ticks += 1
        return float(self.ticks)


class Boom(Exception):
    """A source failure the program asked for."""


@dataclass
class Run:
    """What the program did, as the checks need it."""

    clock: TickClock
    #: event id -> the number of ticks sealed when it was accepted
    accepted_at: dict[int, int] = field(default_factory=dict)
    #: event ids by input, in the order each input handed them over
    by_input: dict[str, list[int]] = field(default_factory=dict)
    #: input name -> origin, and its position in the order inputs were added
    origin_of: dict[str, str] = field(default_factory=dict)
    rank_of: dict[str, int] = field(default_factory=dict)
    raised: set[str] = field(default_factory=set)
    #: (tick number, what tick() returned) for every host tick
    host_ticks: list[tuple[int, EventBatch | None]] = field(default_factory=list)

    def add_input(self, name: str, origin: str) -> None:
        self.origin_of[name] = origin
        self.rank_of[name] = len(self.rank_of)
        self.by_input[name] = []

    def accept(self, name: str, ids: list[int]) -> None:
        for i in ids:
            self.accepted_at[i] = self.clock.ticks
        self.by_input[name] += ids

    def input_of(self, i: int) -> str:
        if i < 1_000_000:
            return "emit:" + (OWN if i % 2 else RELAY)
        if i >= CONNECTOR_IDS:
            return "connector"
        return f"s{i // 1_000_000 - 1}"


class ScriptedSource:
    """An async source following a script; records each item as it hands it over.

    The record is made right before the ``yield`` that hands the item over,
    with no await in between: whenever this generator is suspended, ``Run``
    holds exactly what the scheduler has accepted from it, and when.
    """

    def __init__(self, run: Run, number: int, script: list[tuple[str, int]]) -> None:
        self.run = run
        self.name = f"s{number}"
        self.script = script
        self.fail_requested = False
        self._ids = itertools.count((number + 1) * 1_000_000)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._items()

    async def _items(self) -> AsyncIterator[Any]:
        for kind, n in self.script:
            if self.fail_requested:
                self.run.raised.add(self.name)
                raise Boom(f"{self.name} asked to fail")
            if kind == "await":
                for _ in range(n):
                    await anyio.lowlevel.checkpoint()
            elif kind == "one":
                i = next(self._ids)
                self.run.accept(self.name, [i])
                yield event(i)
            else:
                ids = [next(self._ids) for _ in range(n)]
                self.run.accept(self.name, ids)
                yield [event(i) for i in ids]


class Connector:
    """``take_events()``: what it holds is polled (and sealed) by the next tick."""

    def __init__(self) -> None:
        self.pending: list[int] = []

    def take_events(self) -> list[KVCacheEvent]:
        ids, self.pending = self.pending, []
        return [event(i) for i in ids]


async def ticker(pauses: list[int]) -> AsyncIterator[None]:
    """A ticker the program scripts: tick after so many loop rounds, then stop."""
    for n in pauses:
        for _ in range(n):
            await anyio.lowlevel.checkpoint()
        yield
    await anyio.sleep_forever()


steps = st.one_of(
    st.tuples(st.just("one"), st.just(1)),
    st.tuples(st.just("chunk"), st.integers(0, 6)),
    st.tuples(st.just("await"), st.integers(1, 3)),
)
scripts = st.lists(steps, max_size=12)
origins = st.sampled_from([OWN, OWN, RELAY])
operations = st.one_of(
    st.tuples(st.just("tick")),
    st.tuples(st.just("tick")),
    st.tuples(st.just("emit"), st.integers(0, 3), origins),
    st.tuples(st.just("run"), st.integers(1, 6)),
    st.tuples(st.just("connector"), st.integers(1, 3)),
    st.tuples(st.just("add"), scripts, origins),
    st.tuples(st.just("fail"), st.integers(0, 7)),
    st.tuples(st.just("remove"), st.integers(0, 7)),
)


@dataclass
class Outcome:
    run: Run
    batches: list[EventBatch]
    narrow_batches: list[EventBatch] | None
    scheduler: Scheduler
    report: Any


async def run_program(
    initial: list[tuple[list[tuple[str, int]], str]],
    program: list[tuple[Any, ...]],
    max_pending: int = 65_536,
    narrow: bool = False,
    ticks: list[int] | None = None,
) -> Outcome:
    clock = TickClock()
    run = Run(clock)
    sink = MemorySink()
    # A second sink whose outbox holds one batch: ticks wait for its writer.
    narrow_sink = MemorySink(policy="block", max_batches=1, name="narrow")
    s = Scheduler(
        sinks=[narrow_sink, sink] if narrow else [sink],
        origin=OWN,
        clock=clock,
        max_pending_events=max_pending,
        ticker=ticker(ticks) if ticks is not None else None,
    )
    run.add_input("emit:" + OWN, OWN)
    run.add_input("emit:" + RELAY, RELAY)
    sources: list[ScriptedSource] = []
    handles: list[SourceHandle] = []
    emit_ids = {OWN: itertools.count(1, 2), RELAY: itertools.count(2, 2)}  # odd: own
    connector_ids = itertools.count(CONNECTOR_IDS)

    def add(script: list[tuple[str, int]], origin: str) -> None:
        src = ScriptedSource(run, len(sources), script)
        sources.append(src)
        run.add_input(src.name, origin)
        handles.append(s.add_source(src, name=src.name, origin=None if origin == OWN else origin))

    for script, origin in initial:
        add(script, origin)
    connector = Connector()
    s.add_source(connector, name="connector")
    run.add_input("connector", OWN)
    async with s:
        for op in program:
            kind = op[0]
            if kind == "tick":
                number = clock.ticks + 1  # tick() seals before it first awaits
                run.host_ticks.append((number, await s.tick()))
            elif kind == "emit":
                _, n, origin = op
                ids = [next(emit_ids[origin]) for _ in range(n)]
                target = None if origin == OWN else origin
                s.emit(event(ids[0]) if n == 1 else [event(i) for i in ids], origin=target)
                run.accept("emit:" + origin, ids)
            elif kind == "run":
                for _ in range(op[1]):
                    await anyio.lowlevel.checkpoint()
            elif kind == "connector":
                ids = [next(connector_ids) for _ in range(op[1])]
                connector.pending += ids
                run.accept("connector", ids)  # the next tick must poll and seal them
            elif kind == "add":
                add(op[1], op[2])
            elif kind == "fail" and sources:
                sources[op[1] % len(sources)].fail_requested = True
            elif kind == "remove" and handles:
                s.remove_source(handles[op[1] % len(handles)])
        report = await s.aclose(timeout=30)
    leftover = asyncio.all_tasks() - {asyncio.current_task()}
    assert not leftover, leftover
    return Outcome(run, sink.batches, narrow_sink.batches if narrow else None, s, report)


def check(outcome: Outcome) -> None:
    run, batches, s = outcome.run, outcome.batches, outcome.scheduler
    assert outcome.report.complete
    assert set(outcome.report.failed_sources) == run.raised
    if outcome.narrow_batches is not None:  # every sink gets the same batches
        assert outcome.narrow_batches == batches

    # Sequence numbers 0, 1, 2, ... per origin, one epoch, no empty batch.
    by_origin: dict[str, list[EventBatch]] = {}
    for b in batches:
        assert b.epoch == s.epoch
        assert b.events
        by_origin.setdefault(b.origin, []).append(b)
    for origin, seq_batches in by_origin.items():
        assert [b.seq for b in seq_batches] == list(range(len(seq_batches))), origin
        assert [b.ts for b in seq_batches] == sorted({b.ts for b in seq_batches})

    # Nothing lost, nothing duplicated.
    delivered = [event_id(e) for b in batches for e in b.events]
    assert len(delivered) == len(set(delivered))
    assert set(delivered) == set(run.accepted_at)

    stream: dict[str, list[int]] = {}
    for b in batches:
        ids = [event_id(e) for e in b.events]
        for i in ids:
            name = run.input_of(i)
            # The barrier: sealed by the first tick after it was accepted ...
            assert b.ts == run.accepted_at[i] + 1, (name, i, b.ts, run.accepted_at[i])
            # ... in its input's origin.
            assert b.origin == run.origin_of[name]
            stream.setdefault(name, []).append(i)
        # In a batch: the host's events first, then each input's in the order added.
        ranks = [run.rank_of[run.input_of(i)] for i in ids]
        assert ranks == sorted(ranks), (b.origin, b.seq, ranks)

    # Per-input order, across batches.
    for name, ids in run.by_input.items():
        assert stream.get(name, []) == ids, name

    # tick() returned the batch of the scheduler's own origin it sealed, or None.
    own_by_tick = {b.ts: b for b in by_origin.get(OWN, [])}
    for number, returned in run.host_ticks:
        assert returned is own_by_tick.get(float(number))


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    initial=st.lists(st.tuples(scripts, origins), max_size=4),
    program=st.lists(operations, max_size=40),
    max_pending=st.sampled_from([2, 5, 65_536]),
    narrow=st.booleans(),
    ticks=st.none() | st.lists(st.integers(0, 8), max_size=20),
)
def test_barrier_order_sequence_and_no_loss(
    initial: list[tuple[list[tuple[str, int]], str]],
    program: list[tuple[Any, ...]],
    max_pending: int,
    narrow: bool,
    ticks: list[int] | None,
) -> None:
    check(anyio.run(run_program, initial, program, max_pending, narrow, ticks))


def test_the_checks_can_fail() -> None:
    """A guard on the guard: the checks refuse a late event and a lost one."""
    program: list[tuple[Any, ...]] = [("emit", 2, OWN), ("tick",), ("emit", 1, OWN), ("tick",)]
    outcome = anyio.run(run_program, [], program)
    check(outcome)
    first, second = outcome.batches
    late = EventBatch(seq=1, ts=second.ts + 1, events=second.events, origin=OWN, epoch=second.epoch)
    for wrong in ([first, late], [first]):
        outcome.batches = wrong
        try:
            check(outcome)
        except AssertionError:
            continue
        raise AssertionError(f"the checks accepted {wrong!r}")
