"""The drop-in `EventPublisher` against a publisher that behaves as vLLM's (issue 12, 1 and 2).

Both are driven the way vLLM's scheduler drives its publisher: `publish(batch)`
once per step from the engine's thread, with vLLM's event structs (the same
pre-built batches for both, converted from the workload before anything is
timed), publishing on TCP with a replay ROUTER to a subscriber in another
process that only counts frames (`kvstream._bench.frame_counter`).

* **Target 1, a tight step loop.** Sender events/s from the first `publish`
  until the last batch has left the socket; `publish()` wall time in the
  caller (median); sender CPU per event (`time.process_time()`, every
  thread of the process: the loop's, the publisher's, ZMQ's I/O thread).
* **Target 2, a busy engine.** The engine's thread does about 2 ms of Python
  work per step (calibrated once, alone) and then publishes 16 or 256 events.
  What a publisher costs such an engine is the GIL its own thread holds: the
  row is the engine's steps/s with each publisher, and without one (the limit).
  All three take turns, `BUSY_CHUNK` steps at a time, with both publishers
  alive side by side, so that the machine's drift lands on each alike.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from kvstream._bench.frame_counter import CounterProcess
from kvstream._bench.measure import Meter, Sample, percentile, summarize
from kvstream._bench.results import Result, Row, Target
from kvstream._bench.sizes import Sizes
from kvstream._bench.workload import batches
from kvstream._event_loop import EventLoopName
from kvstream.events import KVCacheEvent

__all__ = [
    "bench_publisher",
    "busy_chunks",
    "busy_work",
    "calibrate_busy_work",
    "turn_orders",
    "whole_rounds",
]

Progress = Callable[[], None]

#: Python work per engine step in the busy-engine case (seconds).
STEP_WORK = 0.002


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def busy_work(loops: int) -> int:
    """Pure Python work, as an engine's scheduler step does: no I/O, holds the GIL."""
    total = 0
    for i in range(loops):
        total += i * i % 7
    return total


def calibrate_busy_work(seconds: float = STEP_WORK) -> int:
    """How many `busy_work()` loops take `seconds` on this machine, alone."""
    loops = 1000
    while True:
        start = time.perf_counter()
        busy_work(loops)
        took = time.perf_counter() - start
        if took > 0.02:
            break
        loops *= 2
    per_loop = min(_timed(busy_work, loops) for _ in range(5)) / loops
    return max(int(seconds / per_loop), 1)


def _timed(fn: Callable[[int], object], arg: int) -> float:
    start = time.perf_counter()
    fn(arg)
    return time.perf_counter() - start


# -- the two publishers, behind one small interface ----------------------------------------


class _Baseline:
    name = "vLLM-design publisher"

    def __init__(self, endpoint: str, buffer_steps: int = 10_000) -> None:
        from kvstream._bench.vllm_baseline import VllmStylePublisher

        self.pub = VllmStylePublisher(
            endpoint, replay_endpoint="tcp://127.0.0.1:*", buffer_steps=buffer_steps, bind=True
        )
        self.publish = self.pub.publish

    def expect(self, events: int) -> None:
        self.pub.expect(events)

    def wait_sent(self) -> None:
        if not self.pub.wait_sent(120.0):
            raise TimeoutError("the vLLM-design publisher did not send everything")

    def close(self) -> None:
        self.pub.close()


class _DropIn:
    name = "kvstream EventPublisher"

    def __init__(
        self,
        endpoint: str,
        idle_poll: float | None = None,
        buffer_steps: int = 10_000,
        loop: EventLoopName = "asyncio",
    ) -> None:
        from kvstream.publisher import DEFAULT_IDLE_POLL, EventPublisher

        self.pub = EventPublisher.from_kv_events_config(
            {
                "endpoint": endpoint,
                "replay_endpoint": "tcp://127.0.0.1:*",
                "buffer_steps": buffer_steps,
            },
            origin="bench-0",
            sink_options={"bind": True},
            idle_poll=DEFAULT_IDLE_POLL if idle_poll is None else idle_poll,
            loop=loop,
        )
        self.sink = self.pub.scheduler.sinks[0]
        self.publish = self.pub.publish
        self._target = 0

    def expect(self, events: int) -> None:
        self._target = self.sink.statistics().events_out + events

    def wait_sent(self) -> None:
        # Wait without polling while steps are queued (the baseline waits on an Event
        # too): flush() returns once the loop has worked through every step, each
        # written inline or queued; then poll for what a full pipe left queued.
        self.pub.flush(120.0)
        deadline = time.monotonic() + 120.0
        stats = self.sink.statistics
        while stats().events_out < self._target:
            if time.monotonic() > deadline:
                raise TimeoutError("the drop-in publisher did not send everything")
            time.sleep(0.0005)

    def close(self) -> None:
        self.pub.shutdown()


_Publisher = _Baseline | _DropIn


def _tight_run(
    make: Callable[[], _Publisher], counter: CounterProcess, vbatches: list[Any], probe: Any
) -> Sample:
    pub = make()
    try:
        counter.wait_ready(lambda: pub.publish(probe))
        events = sum(len(b.events) for b in vbatches)
        pub.expect(events)
        publish = pub.publish
        clock = time.perf_counter
        costs: list[float] = []
        add = costs.append
        meter = Meter()
        for batch in vbatches:
            start = clock()
            publish(batch)
            add(clock() - start)
        pub.wait_sent()
        sample = meter.stop(events)
        got = int(counter.counts_when(len(vbatches)).get("messages", 0))
    finally:
        pub.close()
    return Sample(
        sample.wall,
        sample.cpu,
        sample.events,
        extra={
            "publish_p50_us": statistics.median(costs) * 1e6,
            "publish_p99_us": percentile(costs, 99) * 1e6,
            "received": got,
            "sent": len(vbatches),
        },
    )


#: Steps per chunk in the busy-engine case: the publishers take turns this often.
BUSY_CHUNK = 25
#: The busy engine's turns: the engine alone, then each publisher beside it (row labels).
_BUSY_CASES: dict[str, str] = {
    "none": "engine alone (no publisher: the limit)",
    "baseline": "engine + vLLM-design publisher (baseline)",
    "kvstream": "engine + kvstream EventPublisher",
}


def busy_chunks(
    pubs: dict[str, Any],
    chunk: list[Any],
    loops: int,
    chunks: int,
    warmup: int,
    settle: Callable[[str], None] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per publisher for `chunks` chunks of busy steps, all publishers alive,
    and the engine thread's CPU seconds in them.

    Each chunk is `loops` of Python work then one publish, per step; the
    publishers (None: the engine alone) take turns chunk by chunk, in an order
    that runs through every permutation of them (`turn_orders()`), so that the
    machine's drift lands on all of them alike and each follows every other as
    often. A turn ends once its publisher has sent every step of it, and that is
    timed: beside an engine that holds the GIL, both publishers fall behind by tens
    to hundreds of steps (their thread gets the GIL in slices), and a measure that
    stops at the last `publish()` leaves the work of those steps out, crediting
    whichever lags more. Then, untimed, `settle(name)` (when given) waits until
    the turn's messages have arrived: what ZMQ's I/O thread and the subscriber
    still do for a turn would otherwise slow the next turn's engine (in a fixed
    rotation, mostly the same one's). The first `warmup` turns are not timed.
    """
    orders = turn_orders(list(pubs))
    took = dict.fromkeys(pubs, 0.0)
    cpu = dict.fromkeys(pubs, 0.0)
    events = sum(len(batch.events) for batch in chunk)
    for c in range(warmup + chunks):
        for name in orders[c % len(orders)]:
            pub = pubs[name]
            cpu_start = time.thread_time()
            start = time.perf_counter()
            if pub is None:
                for _ in chunk:
                    busy_work(loops)
            else:
                pub.expect(events)
                publish = pub.publish
                for batch in chunk:
                    busy_work(loops)
                    publish(batch)
                pub.wait_sent()
            if c >= warmup:
                took[name] += time.perf_counter() - start
                cpu[name] += time.thread_time() - cpu_start
            if pub is not None and settle is not None:
                settle(name)
    return took, cpu


def _settler(counters: dict[str, CounterProcess], per_turn: int) -> Callable[[str], None]:
    """`busy_chunks()`'s `settle`: wait until `name`'s subscriber has every message of
    its turns so far (`per_turn` each; its counts were armed before the first)."""
    sent = dict.fromkeys(counters, 0)

    def settle(name: str) -> None:
        sent[name] += per_turn
        counters[name].wait_count(sent[name])

    return settle


def whole_rounds(turns: int, names: list[str]) -> int:
    """`turns` rounded up to whole rounds of `turn_orders(names)` (one round at least),
    so that every order runs as often as the others."""
    orders = len(turn_orders(names))
    return max(1, -(-turns // orders)) * orders


def turn_orders(names: list[str]) -> list[tuple[str, ...]]:
    """Every order of `names` (their permutations): within them each name follows
    each other name equally often. A rotation of three does not: it puts the same
    name after a given one two times in three, and what a turn leaves behind (ZMQ's
    I/O thread still sending) then lands mostly on that one."""
    return list(itertools.permutations(names))


async def bench_publisher(
    pool: list[KVCacheEvent], sizes: Sizes, progress: Progress | None = None
) -> Result:
    """Issue 12 targets 1 and 2: the drop-in against the vLLM-design publisher, one run."""
    result = Result("publisher", "Drop-in EventPublisher against vLLM's publisher design")
    try:
        import zmq  # noqa: F401

        from kvstream._bench.vllm_baseline import to_vllm_batch
    except ImportError as exc:
        result.skipped = f"not available: {exc}"
        return result
    base_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    kv_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    counters = {
        "baseline": CounterProcess("zmq", base_endpoint),
        "kvstream": CounterProcess("zmq", kv_endpoint),
    }
    makers: dict[str, Callable[[], _Publisher]] = {
        "baseline": lambda: _Baseline(base_endpoint),
        "kvstream": lambda: _DropIn(kv_endpoint),
    }
    probe = to_vllm_batch(batches(pool, 1, 1)[0], rank=False)
    runs, warmup = sizes.runs, sizes.warmup
    try:
        # -- target 1: a tight step loop ------------------------------------------------
        for n in sizes.zmq_batch_sizes:
            count = min(max(sizes.zmq_events // n, 16), 20_000)
            cache: dict[int, Any] = {}
            vbatches = [to_vllm_batch(b, cache, rank=False) for b in batches(pool, n, count)]
            samples: dict[str, list[Sample]] = {"baseline": [], "kvstream": []}
            names = list(samples)
            for r in range(warmup + runs):
                order = names[r % 2 :] + names[: r % 2]
                for name in order:
                    sample = _tight_run(makers[name], counters[name], vbatches, probe)
                    if r >= warmup:
                        samples[name].append(sample)
                        if progress is not None:
                            progress()
            base, kvs = samples["baseline"], samples["kvstream"]
            rate = statistics.median(
                k.events_per_s / b.events_per_s for k, b in zip(kvs, base, strict=True)
            )
            cpu = statistics.median(
                k.cpu_us_per_event / b.cpu_us_per_event for k, b in zip(kvs, base, strict=True)
            )

            def p50(runs_: list[Sample]) -> float:
                return statistics.median(float((s.extra or {})["publish_p50_us"]) for s in runs_)

            def p99(runs_: list[Sample]) -> float:
                return statistics.median(float((s.extra or {})["publish_p99_us"]) for s in runs_)

            def got(runs_: list[Sample]) -> str:
                received = sum(int((s.extra or {})["received"]) for s in runs_)
                sent = sum(int((s.extra or {})["sent"]) for s in runs_)
                return f"subscriber got {received}/{sent} batches"

            sb, sk = summarize(base), summarize(kvs)
            result.rows.append(
                Row(
                    "publisher",
                    "vLLM-design publisher (baseline)",
                    f"{n}/batch",
                    sb.events_per_s,
                    cpu_us_per_event=sb.cpu_us_per_event,
                    p50_us=p50(base),
                    p99_us=p99(base),
                    note=f"publish() p50/p99 in the caller; {got(base)}",
                )
            )
            result.rows.append(
                Row(
                    "publisher",
                    "kvstream EventPublisher (drop-in)",
                    f"{n}/batch",
                    sk.events_per_s,
                    "vLLM-design",
                    rate,
                    sk.cpu_us_per_event,
                    p50_us=p50(kvs),
                    p99_us=p99(kvs),
                    note=f"CPU/event ratio {cpu:.2f}; {got(kvs)}",
                )
            )
            result.data[f"rate_ratio_{n}"] = rate
            result.data[f"cpu_ratio_{n}"] = cpu
            result.targets.append(
                Target(f"drop-in events/s over vLLM design at {n}/batch", rate, 1.0, ">=")
            )
            result.targets.append(
                Target(f"drop-in publish() p50 at {n}/batch", p50(kvs), 3.0, "<=", "us")
            )
            result.targets.append(
                Target(f"drop-in sender CPU/event over vLLM design at {n}/batch", cpu, 1.0, "<=")
            )
        # -- target 2: a busy engine ----------------------------------------------------
        # Every publisher alive side by side, taking turns every BUSY_CHUNK steps, each
        # turn timed until its publisher has sent every step of it, then (untimed) until
        # its subscriber has them all, in every order of the three (see busy_chunks):
        # whole runs one after the other moved by 5-10% from run to run on a shared
        # machine, and stopping at the last publish() left out the steps still queued.
        loops = calibrate_busy_work()
        steps = min(max(sizes.zmq_events // 200, 25), 500)
        chunk_steps = min(BUSY_CHUNK, steps)
        chunks = whole_rounds(-(-runs * steps // chunk_steps), list(_BUSY_CASES))
        for n in (16, 256):
            cache = {}
            vbatches = [to_vllm_batch(b, cache, rank=False) for b in batches(pool, n, chunk_steps)]
            pubs: dict[str, Any] = {"none": None}
            try:
                for name in list(_BUSY_CASES)[1:]:  # the publishers
                    made = pubs[name] = makers[name]()
                    counters[name].wait_ready(partial(made.publish, probe))
                took, _ = busy_chunks(
                    pubs, vbatches, loops, chunks, warmup, _settler(counters, len(vbatches))
                )
            finally:
                for alive in pubs.values():
                    if alive is not None:
                        alive.close()
            if progress is not None:
                for _ in range(3 * runs):
                    progress()
            ratio = took["baseline"] / took["kvstream"]
            timed = chunks * chunk_steps
            for name, case in _BUSY_CASES.items():
                steps_rate = timed / took[name]
                result.rows.append(
                    Row(
                        "publisher",
                        case,
                        f"busy 2 ms, {n}/step",
                        steps_rate * n,
                        "vLLM-design" if name == "kvstream" else "",
                        ratio if name == "kvstream" else None,
                        note=(
                            f"{steps_rate:.1f} steps/s ({chunks} turns of {chunk_steps} steps "
                            f"of {loops} loops, side by side)"
                        ),
                    )
                )
            result.data[f"busy_ratio_{n}"] = ratio
            result.targets.append(
                Target(
                    f"busy engine steps/s with the drop-in over vLLM design, {n}/step",
                    ratio,
                    1.0,
                    ">=",
                )
            )
    finally:
        for counter in counters.values():
            counter.close()
    return result
