"""The scheduler's guarantees as properties, over random programs (hypothesis).

A program is a random sequence of host operations (emit, tick, letting the loop
run, feeding a ``take_events()`` connector, adding, failing and removing
sources) run against random async sources (yielding single events and chunks,
sometimes awaiting, sometimes held back by ``max_pending_events``). Afterwards:

* order: every source's events arrive in the order it yielded them;
* the barrier: an event accepted before ``tick()`` was called is in that tick's
  batch or an earlier one; the host's emits (and a connector's events) before
  ``tick()`` are in that tick's batch;
* sequence numbers run 0, 1, 2, ... per origin, one epoch;
* nothing is lost or duplicated: exactly the accepted events are delivered.

Every run is deterministic (asyncio without time), so hypothesis can shrink.
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


def event(event_id: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[event_id])


def event_id(e: KVCacheEvent) -> int:
    assert isinstance(e, BlockRemoved)
    h = e.block_hashes[0]
    assert isinstance(h, int)
    return h


class Boom(Exception):
    """A source failure the program asked for."""


class ScriptedSource:
    """An async source following a script of steps; records what it handed over.

    An item is handed over (accepted) by the ``yield`` that returns it, so it
    is recorded just before the ``yield``: whenever the generator is suspended,
    ``handed`` is exactly what the scheduler has accepted from it.
    """

    def __init__(self, number: int, script: list[tuple[str, int]], origin: str) -> None:
        self.number = number
        self.script = script
        self.origin = origin
        self.handed: list[int] = []
        self.fail_requested = False
        self.raised = False
        self._next = itertools.count((number + 1) * 1_000_000)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._run()

    async def _run(self) -> AsyncIterator[Any]:
        for kind, n in self.script:
            if self.fail_requested:
                self.raised = True
                raise Boom(f"source {self.number} asked to fail")
            if kind == "await":
                for _ in range(n):
                    await anyio.lowlevel.checkpoint()
            elif kind == "one":
                i = next(self._next)
                self.handed.append(i)
                yield event(i)
            else:
                ids = [next(self._next) for _ in range(n)]
                self.handed.extend(ids)
                yield [event(i) for i in ids]


class Connector:
    def __init__(self) -> None:
        self.pending: list[KVCacheEvent] = []

    def take_events(self) -> list[KVCacheEvent]:
        out, self.pending = self.pending, []
        return out


class CountingClock:
    """The batch timestamp is the number of the tick that sealed it."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return float(self.calls)


@dataclass
class TickRecord:
    ts: float  # the clock value this tick sealed with
    accepted_before: set[int]  # every event accepted before tick() was called
    emitted: dict[str, list[int]]  # emits since the last tick: first in this tick's batch
    polled: list[int]  # the connector's events at the tick: in this tick's batch, in order
    returned: EventBatch | None = None


@dataclass
class Run:
    sources: list[ScriptedSource] = field(default_factory=list)
    handles: list[SourceHandle] = field(default_factory=list)
    emitted: dict[str, list[int]] = field(default_factory=lambda: {OWN: [], RELAY: []})
    unsealed: dict[str, list[int]] = field(default_factory=lambda: {OWN: [], RELAY: []})
    polled: list[int] = field(default_factory=list)
    ticks: list[TickRecord] = field(default_factory=list)
    #: the position of every input in the order it was added (the host's emit is -1)
    ranks: dict[str, int] = field(default_factory=dict)

    def rank(self, i: int) -> int:
        if i < 1_000_000:
            return -1
        if i >= 900_000_000:
            return self.ranks["connector"]
        return self.ranks[f"s{i // 1_000_000 - 1}"]

    def accepted(self) -> set[int]:
        out = {i for ids in self.emitted.values() for i in ids} | set(self.polled)
        for src in self.sources:
            out.update(src.handed)
        return out


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


async def run_program(
    initial: list[tuple[list[tuple[str, int]], str]],
    program: list[tuple[Any, ...]],
    max_pending: int,
    narrow: bool = False,
) -> tuple[Run, list[EventBatch], Scheduler, Any]:
    run = Run()
    sink = MemorySink()
    # A second sink whose outbox holds one batch: ticks wait for its writer.
    narrow_sink = MemorySink(policy="block", max_batches=1, name="narrow")
    clock = CountingClock()
    connector = Connector()
    emit_ids = itertools.count(1)
    polled_ids = itertools.count(900_000_000)
    s = Scheduler(
        sinks=[narrow_sink, sink] if narrow else [sink],
        origin=OWN,
        clock=clock,
        max_pending_events=max_pending,
    )

    def add(script: list[tuple[str, int]], origin: str) -> None:
        src = ScriptedSource(len(run.sources), script, origin)
        run.sources.append(src)
        run.ranks[f"s{src.number}"] = len(run.ranks)
        run.handles.append(
            s.add_source(src, name=f"s{src.number}", origin=None if origin == OWN else origin)
        )

    for script, origin in initial:
        add(script, origin)
    s.add_source(connector)
    run.ranks["connector"] = len(run.ranks)
    async with s:
        for op in program:
            kind = op[0]
            if kind == "tick":
                record = TickRecord(
                    ts=float(clock.calls + 1),
                    accepted_before=run.accepted(),
                    emitted=run.unsealed,
                    polled=[event_id(e) for e in connector.pending],
                )
                run.polled += [event_id(e) for e in connector.pending]
                run.unsealed = {OWN: [], RELAY: []}
                record.returned = await s.tick()
                run.ticks.append(record)
            elif kind == "emit":
                _, n, origin = op
                ids = [next(emit_ids) for _ in range(n)]
                target = None if origin == OWN else origin
                if n == 1:
                    s.emit(event(ids[0]), origin=target)
                else:
                    s.emit([event(i) for i in ids], origin=target)
                run.emitted[origin] += ids
                run.unsealed[origin] += ids
            elif kind == "run":
                for _ in range(op[1]):
                    await anyio.lowlevel.checkpoint()
            elif kind == "connector":
                connector.pending += [event(next(polled_ids)) for _ in range(op[1])]
            elif kind == "add":
                add(op[1], op[2])
            elif kind == "fail" and run.sources:
                run.sources[op[1] % len(run.sources)].fail_requested = True
            elif kind == "remove" and run.handles:
                s.remove_source(run.handles[op[1] % len(run.handles)])
        # The last tick happens in aclose(): the connector's events are polled then.
        run.polled += [event_id(e) for e in connector.pending]
        report = await s.aclose(timeout=30)
    leftover = asyncio.all_tasks() - {asyncio.current_task()}
    assert not leftover, leftover
    if narrow:
        assert narrow_sink.batches == sink.batches
        assert narrow_sink.statistics().batches_dropped == 0
    return run, sink.batches, s, report


def check(run: Run, batches: list[EventBatch], s: Scheduler, report: Any) -> None:
    assert report.complete
    assert set(report.failed_sources) == {f"s{src.number}" for src in run.sources if src.raised}

    # Contiguous sequence numbers per origin, one epoch, timestamps never going back.
    by_origin: dict[str, list[EventBatch]] = {}
    for b in batches:
        assert b.epoch == s.epoch
        by_origin.setdefault(b.origin, []).append(b)
    for origin, seq_batches in by_origin.items():
        assert [b.seq for b in seq_batches] == list(range(len(seq_batches))), origin
        assert [b.ts for b in seq_batches] == sorted(b.ts for b in seq_batches)
        assert all(b.events for b in seq_batches)  # no empty batch is ever sealed

    # Within a batch: the host's events first, then each input's, in the order added.
    for b in batches:
        ranks = [run.rank(event_id(e)) for e in b.events]
        assert ranks == sorted(ranks), (b.origin, b.seq, ranks)

    # Nothing lost, nothing duplicated.
    delivered = [event_id(e) for b in batches for e in b.events]
    assert len(delivered) == len(set(delivered))
    assert set(delivered) == run.accepted()

    # Where each event went: (origin, batch ts), and order within the origin's stream.
    sealed_at: dict[int, tuple[str, float]] = {}
    stream: dict[str, list[int]] = {}
    for b in batches:
        for e in b.events:
            sealed_at[event_id(e)] = (b.origin, b.ts)
            stream.setdefault(b.origin, []).append(event_id(e))

    # Per-source order, and every source's events in its own origin.
    for src in run.sources:
        mine = set(src.handed)
        assert [i for i in stream.get(src.origin, []) if i in mine] == src.handed
        assert all(sealed_at[i][0] == src.origin for i in src.handed)
    for origin in (OWN, RELAY):
        emitted = set(run.emitted[origin])
        assert [i for i in stream.get(origin, []) if i in emitted] == run.emitted[origin]

    # The barrier.
    own_by_ts = {b.ts: b for b in by_origin.get(OWN, [])}
    by_origin_ts = {(b.origin, b.ts): b for b in batches}
    for record in run.ticks:
        for i in record.accepted_before:
            assert sealed_at[i][1] <= record.ts, (i, sealed_at[i], record.ts)
        for origin, ids in record.emitted.items():
            if ids:  # the host's events come first in this tick's batch, in order
                batch = by_origin_ts[(origin, record.ts)]
                assert [event_id(e) for e in batch.events[: len(ids)]] == ids
        if record.polled:  # the connector's are in this tick's batch too, in order
            in_batch = [event_id(e) for e in by_origin_ts[(OWN, record.ts)].events]
            assert [i for i in in_batch if i in set(record.polled)] == record.polled
        assert record.returned is own_by_ts.get(record.ts)


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
)
def test_order_barrier_sequence_and_no_loss(
    initial: list[tuple[list[tuple[str, int]], str]],
    program: list[tuple[Any, ...]],
    max_pending: int,
    narrow: bool,
) -> None:
    run, batches, s, report = anyio.run(run_program, initial, program, max_pending, narrow)
    check(run, batches, s, report)


def test_the_property_check_can_fail() -> None:
    """The checker refuses a delivery that breaks the barrier (a guard on the guard)."""
    program: list[tuple[Any, ...]] = [("emit", 2, OWN), ("tick",), ("emit", 1, OWN), ("tick",)]
    run, batches, s, report = anyio.run(run_program, [], program, 65_536)
    check(run, batches, s, report)
    # Pretend the second tick's event arrived a tick late.
    late = EventBatch(
        seq=1, ts=batches[1].ts + 1, events=batches[1].events, origin=OWN, epoch=s.epoch
    )
    try:
        check(run, [batches[0], late], s, report)
    except AssertionError:
        return
    raise AssertionError("a late event passed the barrier check")
