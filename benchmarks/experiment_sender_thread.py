"""Measured, not kept: the native ZMQ sink with a sender thread, as vLLM's publisher has.

vLLM's publisher runs on two threads: the engine's `publish()` puts the batch on
a queue, and a publisher thread encodes it, sends it and keeps it in the ring.
kvstream's native path (`Scheduler` + `ZmqSink`) does all of that on the host's
loop, inline from `tick()`. At 1 event per batch it moves fewer events than the
vLLM design (issue 12, target 3). This experiment puts the native path into
vLLM's shape, as a subclass of `ZmqSink`, in two variants:

* `send`: the tick encodes and keeps the ring as it does now, and hands the three
  frames to a sender thread through a deque (the thread is woken only when it
  sleeps);
* `encode`: the tick hands over the sealed batch; the thread encodes it, keeps it
  in the ring and sends it.

Both run side by side with the vLLM design and with kvstream's sink as it is. The
rounds alternate, and each case publishes the same batches to a counting
subscriber in another process (the bench's `CounterProcess`), with the ring on
(64 MiB) and filled before the timed run. The script prints events/s, and the
events/s and CPU per event (process CPU, every thread) over the vLLM design, as
medians of per-round ratios:

    python benchmarks/experiment_sender_thread.py --batch 1 --batches 20000 --rounds 5
    python benchmarks/experiment_sender_thread.py --batch 16 --batches 5000 --rounds 5

This is not product code. In the `encode` variant the thread fills the ring
without a lock, which is safe here only because no replay client reads it; and
neither variant handles a full pipe or a failed send. The results are in
docs/benchmarks.md ("What limits the targets not met").
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
from collections import deque
from typing import Any

import anyio
import anyio.lowlevel
import zmq

from kvstream import Scheduler
from kvstream._bench.frame_counter import CounterProcess
from kvstream._bench.measure import Meter, Sample
from kvstream._bench.vllm_baseline import to_vllm_batch
from kvstream._bench.workload import EPOCH, ORIGIN, batches, chunks, event_pool
from kvstream._bench.zmq_compare import _baseline_run, free_tcp_port
from kvstream.errors import ConfigError
from kvstream.events import EventBatch, KVCacheEvent
from kvstream.sinks._encoding import SharedEncoding, held_bytes
from kvstream.sinks.zmq import ZmqSink

#: What the ring charges per entry beyond its payload (as `ZmqSink` does).
_ENTRY_OVERHEAD = 256


class ThreadedZmqSink(ZmqSink):
    """`ZmqSink` whose sends (`mode="send"`) or encoding and sends (`mode="encode"`)
    run on a sender thread of its own."""

    def __init__(self, *args: Any, mode: str, **options: Any) -> None:
        super().__init__(*args, **options)
        if mode not in ("send", "encode"):
            raise ConfigError(f"ThreadedZmqSink: mode: expected 'send' or 'encode', got {mode!r}")
        self.mode = mode
        self._handed: deque[Any] = deque()
        self._wake = threading.Event()
        self._sleeping = True
        self._stopping = False
        self._thread: threading.Thread | None = None

    def use_encoding(self, encoding: SharedEncoding) -> None:
        if self.mode == "encode":  # the tick does not encode: the thread does
            self._encoding = SharedEncoding(None)
        else:
            super().use_encoding(encoding)

    async def open(self) -> None:
        await super().open()
        self._thread = threading.Thread(target=self._send_loop, name="sender", daemon=True)
        self._thread.start()

    @property
    def drained(self) -> bool:
        """Everything handed over has been sent."""
        return not self._handed and self._sleeping

    def write_nowait(self, data: bytes, batch: EventBatch) -> bool:
        topic = self._topic_for(batch.origin)
        assert topic is not None
        if self.mode == "send":
            seq_frame = batch.seq.to_bytes(8, "big")
            self._handed.append((topic, seq_frame, data))
            self._keep(batch, topic, seq_frame, data)
        else:
            self._handed.append((topic, batch))
        if self._sleeping:
            self._sleeping = False
            self._wake.set()
        return True

    def _send_loop(self) -> None:
        handed = self._handed
        pub = self._pub
        assert pub is not None
        encode = self.codec.encode if self.codec is not None else None
        ring = self._ring if self._router is not None else None
        more = zmq.SNDMORE
        while True:
            while handed:
                if self.mode == "send":
                    topic, seq_frame, data = handed.popleft()
                else:
                    topic, batch = handed.popleft()
                    assert encode is not None
                    data = encode(batch)
                    seq_frame = batch.seq.to_bytes(8, "big")
                    if ring is not None:
                        entry = (batch.seq, topic, seq_frame, data)
                        ring.push(entry, held_bytes(len(data)) + _ENTRY_OVERHEAD)
                pub.send(topic, more)
                pub.send(seq_frame, more)
                pub.send(data)
            self._sleeping = True
            if handed:  # handed over after the check: no wake was sent for it
                self._sleeping = False
                continue
            if self._stopping:
                return
            self._wake.wait()
            self._wake.clear()

    def _close_sockets(self) -> None:
        # The sink's drain has handed everything over by now: the thread sends what is
        # left, then ends, and only then are the sockets closed.
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        super()._close_sockets()


async def _run(
    sink: ZmqSink,
    counter: CounterProcess,
    kchunks: list[list[KVCacheEvent]],
    probe: list[KVCacheEvent],
) -> Sample:
    """The bench's native drive (`emit`, `await tick()`, a checkpoint), timed until
    the sink has sent everything."""

    def drained() -> bool:
        return sink.drained if isinstance(sink, ThreadedZmqSink) else True

    async with Scheduler(sinks=[sink], origin=ORIGIN, epoch=EPOCH, data_parallel_rank=0) as s:
        with anyio.fail_after(20):
            await sink.wait_subscribed()
        counter.arm()
        with anyio.fail_after(20):
            while True:
                s.emit(probe)
                await s.tick()
                await anyio.sleep(0.01)
                if counter.poll_line(0.0) == "ready":
                    break
        for _ in range(2):  # fill the ring: the timed run measures it full and wrapping
            for chunk in kchunks:
                s.emit(chunk)
                await s.tick()
                await anyio.lowlevel.checkpoint()
        while not drained():  # noqa: ASYNC110 - the thread has no event to wait on
            await anyio.sleep(0.001)
        await anyio.sleep(0.2)
        counter.arm()
        emit, tick, checkpoint = s.emit, s.tick, anyio.lowlevel.checkpoint
        meter = Meter()
        for chunk in kchunks:
            emit(chunk)
            await tick()
            await checkpoint()
        while not drained():  # noqa: ASYNC110
            await anyio.sleep(0.0005)
        sample = meter.stop(sum(map(len, kchunks)))
        counter.counts_when(len(kchunks))
    return sample


async def main(args: argparse.Namespace) -> None:
    n, count = args.batch, args.batches
    pool = event_pool(4096)
    gc.collect()
    gc.freeze()
    kchunks = chunks(pool, n, count)
    cache: dict[int, Any] = {}
    vbatches = [to_vllm_batch(b, cache) for b in batches(pool, n, count)]
    probe_batch = to_vllm_batch(batches(pool, 1, 1)[0])
    cases = (
        "vLLM design",
        "ZmqSink as it is",
        "sender thread: sends",
        "sender thread: encode+send",
    )
    endpoints = {case: f"tcp://127.0.0.1:{free_tcp_port()}" for case in cases}
    counters = {case: CounterProcess("zmq", endpoints[case]) for case in cases}
    samples: dict[str, list[Sample]] = {case: [] for case in cases}
    try:
        for _ in range(args.rounds):
            for case in cases:
                endpoint = endpoints[case]
                if case == "vLLM design":
                    sample = await _baseline_run(
                        endpoint, counters[case], vbatches, n * count, probe_batch
                    )
                    samples[case].append(sample)
                    continue
                options: dict[str, Any] = {
                    "replay_endpoint": "tcp://127.0.0.1:*",
                    "replay_max_bytes": args.ring_mib << 20,
                    "bind": True,
                    "hwm": 100_000,
                    "linger": 0.0,
                    "name": "zmq",
                }
                sink: ZmqSink
                if case == "ZmqSink as it is":
                    sink = ZmqSink(endpoint, **options)
                else:
                    mode = "send" if case.endswith("sends") else "encode"
                    sink = ThreadedZmqSink(endpoint, mode=mode, **options)
                samples[case].append(await _run(sink, counters[case], kchunks, pool[:1]))
    finally:
        for counter in counters.values():
            counter.close()
    base = samples["vLLM design"]
    print(f"{n} events per batch, {count} batches, {args.rounds} rounds (medians):")
    for case in cases:
        runs = samples[case]
        rate = statistics.median(b.wall / a.wall for a, b in zip(runs, base, strict=True))
        cpu = statistics.median(
            a.cpu_us_per_event / b.cpu_us_per_event for a, b in zip(runs, base, strict=True)
        )
        per_s = statistics.median(r.events_per_s for r in runs)
        print(f"  {case:28} {per_s:10,.0f} events/s  x{rate:.2f} events/s  x{cpu:.2f} CPU/event")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=1, help="events per batch (1)")
    p.add_argument("--batches", type=int, default=20_000, help="batches per run (20000)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, every case once each (5)")
    p.add_argument("--ring-mib", type=int, default=64, help="replay ring bound, MiB (64)")
    anyio.run(main, p.parse_args())
