"""Snapshot cost: keeping an origin's state, taking its snapshot, its size, reading it back.

    python benchmarks/bench_snapshot.py                 # 1M blocks
    python benchmarks/bench_snapshot.py --quick         # 100k blocks
    python benchmarks/bench_snapshot.py --json -

What is measured, for one origin holding N blocks on one tier (block size 16,
token ids below 32000, stored in chains of 512 blocks, 16 blocks per event):

* **keep**: CPU time of `StateKeeper.apply()` over the batches that store
  the N blocks (64 events per batch), and the bytes the keeper holds then
  (`tracemalloc`) beside its own estimate (what `max_bytes` bounds).
* **take + encode**: CPU time of what a broker sink does when a snapshot is
  due: the snapshot's events made a slice at a time and encoded as JSON parts
  in an envelope (`kvstream._wire.broker.snapshot_parts()`), and its bytes;
  and the longest slice (how long the event loop runs without a checkpoint).
* **decode**: CPU time of reading the envelope back into one batch of events,
  as the subscribers do.
* **baseline** (same run): encoding with the same JSON codec the batches that
  built the state: what a consumer would have to be sent, at the least, to
  rebuild the state from the stream instead.
* with `--nats URL` / `--redis URL` (a running server): wall time of a
  sink publishing the snapshot (`publish_snapshot`) and of a subscriber
  reading it back into one `SnapshotBatch` (medians of `--repeat`).
* with `--zmq`: a `ZmqSink` with a snapshot endpoint (ipc, in this process)
  that published the batches, and a cold-starting `ZmqSubscriber`: wall time
  from the subscriber's start to its `SnapshotBatch` (the sink takes, encodes
  in msgpack and sends the parts; the subscriber decodes them; medians of
  `--repeat`).

Medians of `--repeat` runs after a warm-up (the keep step once: it builds the
state the others use). CPU time of this process (the machines are shared).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from kvstream._wire.broker import (
    PayloadDecoder,
    SnapshotInfo,
    read_envelope,
    snapshot_envelope,
    snapshot_parts,
)
from kvstream.codecs.json import JsonCodec
from kvstream.events import BlockHash, BlockStored, EventBatch, KVCacheEvent
from kvstream.state import StateKeeper

BLOCK_SIZE = 16
CHAIN = 512
PER_EVENT = 16
PER_BATCH = 64


def _batches(n_blocks: int, seed: int = 0) -> list[EventBatch]:
    rng = random.Random(seed)
    events: list[KVCacheEvent] = []
    h = 1
    while h <= n_blocks:
        parent: BlockHash | None = None
        for _ in range(CHAIN // PER_EVENT):
            if h > n_blocks:
                break
            n = min(PER_EVENT, n_blocks - h + 1)
            hashes: list[BlockHash] = list(range(h, h + n))
            tokens = [rng.randrange(32000) for _ in range(n * BLOCK_SIZE)]
            events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=BLOCK_SIZE,
                    medium="GPU",
                )
            )
            parent = hashes[-1]
            h += n
    return [
        EventBatch(seq=i, ts=0.0, events=events[j : j + PER_BATCH], origin="bench", epoch="e")
        for i, j in enumerate(range(0, len(events), PER_BATCH))
    ]


def _cpu(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    fn()  # warm-up
    times: list[float] = []
    result: Any = None
    for _ in range(repeat):
        start = time.process_time()
        result = fn()
        times.append(time.process_time() - start)
    return statistics.median(times), result


def run(n_blocks: int, repeat: int) -> dict[str, Any]:
    batches = _batches(n_blocks)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    traced = StateKeeper(max_bytes=1 << 40)
    traced.apply_all(batches)
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del traced

    start = time.process_time()
    keeper = StateKeeper(max_bytes=1 << 40)
    keeper.apply_all(batches)
    keep_s = time.process_time() - start

    head = keeper.snapshot_header("bench")
    info = SnapshotInfo("bench", "e", head.resume_seq, "1", "kv.events.bench", head.blocks, 0.0)
    slices: list[float] = []

    def publish() -> bytes:
        parts: list[bytes] = []
        slices.clear()
        it = snapshot_parts(head, keeper.snapshot_events("bench"))
        while True:
            t0 = time.process_time()
            part = next(it, None)
            slices.append(time.process_time() - t0)
            if part is None:
                break
            parts.append(part)
        return snapshot_envelope(info, parts)

    encode_s, envelope = _cpu(publish, repeat)
    longest = max(slices)
    snap = keeper.snapshot("bench")

    decoder = PayloadDecoder()

    def decode() -> int:
        got, parts = read_envelope(envelope, "bench")
        key = (got.origin, got.epoch, got.resume_seq - 1)
        events = 0
        for part in parts:
            events += len(decoder.decode(bytes(part), key, "json").events)
        return events

    decode_s, decoded = _cpu(decode, repeat)
    assert decoded == len(snap.events)
    codec = JsonCodec()
    baseline_s, stream_bytes = _cpu(lambda: sum(len(codec.encode(b)) for b in batches), repeat)
    return {
        "blocks": n_blocks,
        "events": len(snap.events),
        "keep_s": keep_s,
        "keep_blocks_per_s": n_blocks / keep_s,
        "held_bytes_traced": held,
        "held_bytes_estimated": keeper.statistics().bytes,
        "take_encode_s": encode_s,
        "longest_slice_s": longest,
        "snapshot_bytes": len(envelope),
        "decode_s": decode_s,
        "baseline_stream_encode_s": baseline_s,
        "baseline_stream_bytes": stream_bytes,
    }


async def _through_brokers(
    batches: list[EventBatch], nats_url: str | None, redis_url: str | None, repeat: int
) -> dict[str, float]:
    from kvstream.consumers.nats import NatsSubscriber
    from kvstream.consumers.redis import RedisSubscriber
    from kvstream.sinks.nats import NatsSink
    from kvstream.sinks.redis import RedisSink

    out: dict[str, float] = {}
    cases: list[tuple[str, Any, Any]] = []
    if nats_url:
        cases.append(
            (
                "nats",
                NatsSink(nats_url, create=True, snapshot_every=10**9),
                NatsSubscriber(nats_url, follow=False),
            )
        )
    if redis_url:
        cases.append(
            (
                "redis",
                RedisSink(redis_url, snapshot_every=10**9),
                RedisSubscriber(redis_url, follow=False, snapshots=False),
            )
        )
    for name, sink, sub in cases:
        publish: list[float] = []
        read: list[float] = []
        async with sink:
            for i, b in enumerate(batches):  # the state, as if these were delivered
                sink.snapshots.delivered(b, str(i + 1))
            for _ in range(repeat):
                start = time.perf_counter()
                ok = await sink.publish_snapshot("bench")
                publish.append(time.perf_counter() - start)
                assert ok, f"{name}: the snapshot was not published"
        async with sub:
            client = sub._client
            for _ in range(repeat):
                start = time.perf_counter()
                heads = await sub._snapshot_heads(client, "bench")
                snap = await sub._load_snapshot(client, heads[0][0], heads[0][1], 0)
                read.append(time.perf_counter() - start)
                assert snap is not None, f"{name}: the snapshot was not read back"
        out[f"{name}_publish_wall_s"] = statistics.median(publish)
        out[f"{name}_read_wall_s"] = statistics.median(read)
    return out


async def _through_zmq(batches: list[EventBatch], repeat: int) -> dict[str, float]:
    import tempfile

    import anyio

    from kvstream.consumers.zmq import ZmqPublisher, ZmqSubscriber
    from kvstream.sinks.zmq import ZmqSink

    folder = tempfile.mkdtemp(prefix="kvsnap")
    live, snap = f"ipc://{folder}/live", f"ipc://{folder}/snap"
    walls: list[float] = []
    sink = ZmqSink(live, snapshot_endpoint=snap, policy="block", buffer_steps=4)
    async with sink:
        for b in batches:
            await sink.put(b)
        # The sink's counters have no event to wait on (ASYNC110): poll every 10 ms.
        while sink.statistics().batches_out < len(batches):  # noqa: ASYNC110
            await anyio.sleep(0.01)
        for _ in range(repeat):
            sub = ZmqSubscriber(ZmqPublisher(live, snapshot_endpoint=snap, origin="bench"))
            start = time.perf_counter()
            async with sub:
                async for item in sub:
                    assert getattr(item, "is_snapshot", False), item
                    walls.append(time.perf_counter() - start)
                    break
    return {"zmq_snapshot_wall_s": statistics.median(walls)}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="100k blocks instead of 1M")
    p.add_argument("--blocks", type=int, help="blocks held (overrides --quick)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per step (median)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON ('-': stdout)")
    p.add_argument("--nats", metavar="URL", help="also publish and read it through NATS")
    p.add_argument("--redis", metavar="URL", help="also write and read it through Redis")
    p.add_argument("--zmq", action="store_true", help="also serve it on a ZMQ snapshot endpoint")
    args = p.parse_args()
    n = args.blocks or (100_000 if args.quick else 1_000_000)
    result = run(n, max(args.repeat, 1))
    if args.nats or args.redis:
        import anyio

        batches = _batches(n)
        result.update(anyio.run(_through_brokers, batches, args.nats, args.redis, args.repeat))
    if args.zmq:
        import anyio

        result.update(anyio.run(_through_zmq, _batches(n), args.repeat))
    report = {
        "command": " ".join(["python", *sys.argv]),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "result": result,
    }
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    r = result
    mb = 1 / 2**20
    print(f"snapshot of {r['blocks']:,} blocks ({r['events']:,} events), CPU seconds (median):")
    print(f"  keep   {r['keep_s']:8.2f} s  ({r['keep_blocks_per_s']:,.0f} blocks/s)")
    print(
        f"  held   {r['held_bytes_traced'] * mb:8.1f} MiB traced, "
        f"{r['held_bytes_estimated'] * mb:.1f} MiB estimated "
        f"({r['held_bytes_traced'] / r['blocks']:.0f} B/block traced)"
    )
    print(
        f"  take + encode {r['take_encode_s']:6.2f} s  -> {r['snapshot_bytes'] * mb:.1f} MiB "
        f"(longest slice {r['longest_slice_s'] * 1000:.1f} ms)"
    )
    print(f"  decode {r['decode_s']:8.2f} s")
    print(
        f"  baseline: encode the stream that built it {r['baseline_stream_encode_s']:.2f} s "
        f"-> {r['baseline_stream_bytes'] * mb:.1f} MiB"
    )
    for name in ("nats", "redis"):
        if f"{name}_publish_wall_s" in r:
            print(
                f"  {name}: publish {r[f'{name}_publish_wall_s']:.2f} s, "
                f"read back {r[f'{name}_read_wall_s']:.2f} s (wall)"
            )
    if "zmq_snapshot_wall_s" in r:
        print(
            "  zmq: sink to subscriber, cold start to SnapshotBatch "
            f"{r['zmq_snapshot_wall_s']:.2f} s (wall)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
