"""kvstream bench's drop-in publisher comparison runs at tiny sizes (no timings asserted)."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import zmq

from kvstream._bench.frame_counter import CounterProcess
from kvstream._bench.publisher_compare import (
    bench_publisher,
    busy_chunks,
    busy_work,
    calibrate_busy_work,
    turn_orders,
    whole_rounds,
)
from kvstream._bench.sizes import TINY
from kvstream._bench.suite import BENCHMARKS, run_suite
from kvstream._bench.vllm_baseline import KVEventBatch
from kvstream._bench.workload import event_pool
from kvstream._bench.zmq_compare import free_tcp_port


async def test_the_publisher_comparison_reports_every_row_and_target() -> None:
    result = await bench_publisher(event_pool(TINY.pool_events), TINY)
    assert result.skipped == ""
    cases = [(row.case, row.param) for row in result.rows]
    assert ("vLLM-design publisher (baseline)", "16/batch") in cases
    assert ("kvstream EventPublisher (drop-in)", "16/batch") in cases
    for n in (16, 256):
        assert ("engine + kvstream EventPublisher", f"busy 2 ms, {n}/step") in cases
        assert ("engine alone (no publisher: the limit)", f"busy 2 ms, {n}/step") in cases
    names = [t.name for t in result.targets]
    assert "drop-in publish() p50 at 16/batch" in names
    assert "busy engine steps/s with the drop-in over vLLM design, 256/step" in names
    # Every batch published reached the counting subscriber in the other process.
    for row in result.rows:
        if "subscriber got" in row.note:
            got, sent = row.note.rsplit("subscriber got ", 1)[1].split()[0].split("/")
            assert got == sent


async def test_the_suite_runs_it_by_name() -> None:
    assert "publisher" in BENCHMARKS
    report = await run_suite(TINY, only=["publisher"], quick=True)
    assert [r["name"] for r in report["results"]] == ["publisher"]


def test_busy_work_is_calibrated_to_a_positive_loop_count() -> None:
    loops = calibrate_busy_work(0.0005)
    assert loops >= 1
    assert busy_work(10) == sum(i * i % 7 for i in range(10))


def test_turn_orders_put_every_name_after_every_other_equally_often() -> None:
    for names in (["none", "baseline", "kvstream"], ["a", "b", "c", "d"]):
        orders = turn_orders(names)
        assert len(orders) == len(set(orders)) == math.factorial(len(names))
        follows = Counter(pair for order in orders for pair in itertools.pairwise(order))
        assert set(follows) == set(itertools.permutations(names, 2))
        assert len(set(follows.values())) == 1


def test_whole_rounds_rounds_turns_up_to_every_order_alike() -> None:
    assert whole_rounds(60, ["a", "b", "c"]) == 60
    assert whole_rounds(61, ["a", "b", "c"]) == 66
    assert whole_rounds(60, ["a", "b", "c", "d"]) == 72
    assert whole_rounds(0, ["a", "b", "c"]) == 6


class _Recorder:
    """A publisher as busy_chunks sees one: it logs what it is asked to do."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name = name
        self.log = log

    def expect(self, events: int) -> None:
        self.log.append((self.name, "expect"))

    def publish(self, batch: object) -> None:
        self.log.append((self.name, "publish"))

    def wait_sent(self) -> None:
        self.log.append((self.name, "sent"))


def test_busy_chunks_settles_each_publisher_turn_after_it_has_sent_everything() -> None:
    log: list[tuple[str, str]] = []
    pubs = {"none": None, "x": _Recorder("x", log), "y": _Recorder("y", log)}
    chunk = [KVEventBatch(ts=0.0, events=[])] * 3

    def settle(name: str) -> None:
        log.append((name, "settled"))

    took, cpu = busy_chunks(pubs, chunk, 1, 6, 1, settle)
    assert set(took) == set(cpu) == {"none", "x", "y"}
    for name in ("x", "y"):
        mine = [what for who, what in log if who == name]
        # 7 turns (one warm-up): each expect, 3 publishes, sent, then settled
        assert mine == ["expect", "publish", "publish", "publish", "sent", "settled"] * 7
    assert ("none", "settled") not in log
    # the turns run through every order of the three names, then start over
    orders = list(itertools.permutations(["none", "x", "y"]))
    expected = [who for c in range(7) for who in orders[c % 6] if who != "none"]
    assert [who for who, what in log if what == "expect"] == expected


def test_wait_count_returns_once_the_subscriber_has_the_messages() -> None:
    port = free_tcp_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    counter = CounterProcess("zmq", endpoint)
    try:

        def probe() -> None:
            pub.send_multipart([b"", b"probe"])

        counter.wait_ready(probe)
        for _ in range(5):
            pub.send_multipart([b"", b"x" * 100])
        counter.wait_count(5)
        assert counter.counts()["messages"] == 5
        with pytest.raises(TimeoutError, match="fewer than 6"):
            counter.wait_count(6, timeout=0.2)
    finally:
        counter.close()
        pub.close(linger=0)
        ctx.term()
