"""Prefix index: apply throughput, match latency, bytes per block.

    python benchmarks/bench_index.py            # 100k and 1M indexed blocks
    python benchmarks/bench_index.py --quick    # 10k and 100k
    python benchmarks/bench_index.py --json
    python benchmarks/bench_index.py --only apply,match --sizes 1000000   # a part of it
    python -m kvstream._bench.index_measure --json   # the same, from an installed package

`kvstream bench --only index` runs it in a child process (`index_runner`).

What is measured (block size 16, four origins, tokens below 32000, engine hashes
random 64-bit integers as vLLM's are):

* **apply**: blocks/s of `PrefixIndex.apply` over batches of `BlockStored`
  events of 16 blocks (256 tokens) each, chains of 512 blocks, every block
  then also placed on a second tier by a placeholder event one time in four;
  and over the events of simulated engines (stores, evictions, three tiers).
  The baseline, measured in the same run, is the index's hash alone
  (`BlockHasher.chain` over the same tokens): the floor of any rehashing index.
* **match**: latency of `PrefixIndex.match` for 1k- and 8k-token prompts (64
  and 512 blocks) against indexes of N blocks: `hit` prompts are fully indexed
  (the worst case: every block is hashed and looked up), `miss` prompts share
  nothing. Baseline: hashing the prompt alone.
* **match, bytes API**: `PrefixIndex.match_bytes` on the same prompts as
  uint32 little-endian bytes; baseline: hashing those bytes alone.
* **live**: what a router sees while events flow: the index built from all
  but the last `--queries` batches, then per query one more batch applied
  (512 new blocks and their placeholders) and an 8k-token bytes match, then a
  second match before the next batch; baseline: the same prompts matched with
  no batch between them. The first match after a batch pays for entering
  the batch's blocks in the lookup table.
* **http**: `POST /match` round trips for 8k-token prompts (JSON and binary
  bodies) over a kept-alive loopback connection, against the in-process call
  (`match()` for JSON, `match_bytes()` for binary); also, in the same run, a
  bare anyio echo of the same bytes through the same client (the transport's
  floor), h11's request cycle alone, and `orjson.loads` of the JSON body; the
  binary body also through a client on an asyncio `Protocol`, beside its own
  echo floor (`*_lean_*`).
* **memory**: bytes per block traced with `tracemalloc` while the index is
  built (events are made before tracing starts) and its lookup table made by a
  first match, for one origin on one tier, the same blocks on two tiers, and
  four origins holding the same blocks.
* **gc**: a full `gc.collect()` with the largest index alive (its state is
  dicts of integers, which the collector does not track).

Medians of `--repeat` runs after a warm-up; latencies are p50/p99 over
`--queries` prompts. Times are the process's CPU time by default (the
machines this runs on are shared; `--clock wall` for wall-clock time).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable, Iterator
from typing import Any

from kvstream.events import BlockHash, BlockStored, EventBatch, KVCacheEvent
from kvstream.index import BlockHasher, PrefixIndex
from kvstream.sim import SimulatedEngine, Workload

__all__ = [
    "Corpus",
    "bench_apply",
    "bench_apply_sim",
    "bench_gc",
    "bench_http",
    "bench_match",
    "bench_match_live",
    "bench_memory",
    "main",
]

BLOCK = 16
CHAIN = 512  # blocks per chain: an 8k-token prompt
EVENT_BLOCKS = 16
ORIGINS = 4
TOKENS = list(range(32000))  # token ints made once, shared by every list
clock = time.process_time


def _chain_tokens(rng: random.Random, blocks: int) -> list[int]:
    return [TOKENS[rng.randrange(32000)] for _ in range(blocks * BLOCK)]


class Corpus:
    """Chains of CHAIN blocks, spread over ORIGINS origins, as batches of BlockStored."""

    def __init__(self, blocks: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.chains = [_chain_tokens(rng, CHAIN) for _ in range(max(1, blocks // CHAIN))]
        self.blocks = len(self.chains) * CHAIN
        self.rng = rng
        self.seed = seed

    def batches(self, *, placeholders: bool = True) -> Iterator[EventBatch]:
        """Batches per origin (one chain per batch), each origin's seq from 0.

        Engine hashes are random 64-bit integers, as vLLM's are (the low 64 bits of
        sha256 digests), the same ones at every call: counting integers would be
        kinder to the index's dicts than a real engine's hashes (about 20% more block
        events/s in apply at 1M blocks).
        """
        seqs = [0] * ORIGINS
        hash_rng = random.Random(self.seed ^ 0x5EED)
        bits = hash_rng.getrandbits
        for c, tokens in enumerate(self.chains):
            o = c % ORIGINS
            events: list[KVCacheEvent] = []
            parent: BlockHash | None = None
            for start in range(0, CHAIN, EVENT_BLOCKS):
                hashes: list[BlockHash] = [bits(64) for _ in range(EVENT_BLOCKS)]
                events.append(
                    BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=parent,
                        token_ids=tokens[start * BLOCK : (start + EVENT_BLOCKS) * BLOCK],
                        block_size=BLOCK,
                        medium="GPU",
                    )
                )
                if placeholders and start % (4 * EVENT_BLOCKS) == 0:
                    events.append(
                        BlockStored(
                            block_hashes=hashes,
                            parent_block_hash=None,
                            token_ids=[],
                            block_size=0,
                            medium="CPU",
                        )
                    )
                parent = hashes[-1]
            yield EventBatch(seq=seqs[o], ts=0.0, events=events, origin=f"engine-{o}", epoch="e")
            seqs[o] += 1


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_apply(corpus: Corpus, repeat: int) -> dict[str, Any]:
    batches = list(corpus.batches())
    stored = sum(
        len(e.block_hashes) for b in batches for e in b.events if isinstance(e, BlockStored)
    )
    runs = []
    for _ in range(repeat + 1):  # the first run is the warm-up
        index = PrefixIndex(block_size=BLOCK)
        started = clock()
        for batch in batches:
            index.apply(batch)
        runs.append(clock() - started)
        del index
    apply_s = _median(runs[1:])
    hasher = BlockHasher(BLOCK)
    base = []
    for _ in range(repeat + 1):
        started = clock()
        for tokens in corpus.chains:
            hasher.chain(None, tokens)
        base.append(clock() - started)
    hash_s = _median(base[1:])
    return {
        "blocks_indexed": corpus.blocks,
        "block_events": stored,
        "apply_blocks_per_s": stored / apply_s,
        "apply_ns_per_block": 1e9 * apply_s / stored,
        "baseline_hash_only_blocks_per_s": corpus.blocks / hash_s,
        "baseline_hash_only_ns_per_block": 1e9 * hash_s / corpus.blocks,
    }


def bench_apply_sim(steps: int, repeat: int) -> dict[str, Any]:
    engines = [
        SimulatedEngine(
            seed=i,
            gpu_blocks=1024,
            cpu_blocks=4096,
            remote_blocks=8192,
            workload=Workload(seed=i),
            origin=f"sim-{i}",
        )
        for i in range(ORIGINS)
    ]
    batches = [
        EventBatch(seq=s, ts=0.0, events=e.step_events(), origin=e.origin, epoch="e")
        for s in range(steps)
        for e in engines
    ]
    blocks = sum(
        len(ev.block_hashes) for b in batches for ev in b.events if hasattr(ev, "block_hashes")
    )
    runs = []
    for _ in range(repeat + 1):
        index = PrefixIndex(block_size=BLOCK)
        started = clock()
        for batch in batches:
            index.apply(batch)
        runs.append(clock() - started)
    apply_s = _median(runs[1:])
    return {
        "batches": len(batches),
        "block_events": blocks,
        "apply_block_events_per_s": blocks / apply_s,
        "blocks_held_at_end": index.statistics().distinct_blocks,
    }


def bench_match(corpus: Corpus, queries: int, repeat: int) -> dict[str, Any]:
    index = PrefixIndex(block_size=BLOCK)
    for batch in corpus.batches():
        index.apply(batch)
    gc.collect()
    hasher = BlockHasher(BLOCK)
    rng = random.Random(1)
    out: dict[str, Any] = {"blocks_indexed": index.statistics().distinct_blocks}
    for tokens_n in (1024, 8192):
        blocks = tokens_n // BLOCK
        hit = [rng.choice(corpus.chains)[:tokens_n] for _ in range(queries)]
        miss = [_chain_tokens(rng, blocks) for _ in range(queries)]
        assert index.match(hit[0])[0].blocks == blocks
        assert index.match(miss[0]) == []
        hit_bytes = [array("I", p).tobytes() for p in hit]
        assert index.match_bytes(hit_bytes[0]) == index.match(hit[0])

        def hash_bytes(data: bytes, n: int = blocks) -> list[int]:
            return hasher.chain_values(hasher.root, hasher.finish(hasher.values(data, n)))

        cases: list[tuple[str, list[Any], Callable[[Any], object]]] = [
            ("hit", hit, index.match),
            ("miss", miss, index.match),
            ("baseline_hash_only", hit, lambda t: hasher.chain(None, t)),
            ("bytes_hit", hit_bytes, index.match_bytes),
            ("baseline_bytes_hash_only", hit_bytes, hash_bytes),
        ]
        for name, prompts, fn in cases:
            p50s, p99s = [], []
            for r in range(repeat + 1):
                lat = []
                for p in prompts:
                    started = clock()
                    fn(p)
                    lat.append(clock() - started)
                if r:
                    p50s.append(_percentile(lat, 0.5))
                    p99s.append(_percentile(lat, 0.99))
            out[f"{tokens_n}_tokens_{name}_p50_us"] = 1e6 * _median(p50s)
            out[f"{tokens_n}_tokens_{name}_p99_us"] = 1e6 * _median(p99s)
    return out


def bench_match_live(corpus: Corpus, queries: int, repeat: int) -> dict[str, Any]:
    """8k-token bytes matches with a batch applied before each (see the module doc)."""
    batches = list(corpus.batches())
    queries = min(queries, len(batches) // 2)
    held = batches[-queries:]
    applied = corpus.chains[: len(batches) - queries]  # chain c is batch c
    rng = random.Random(2)
    prompts = [array("I", rng.choice(applied)[:8192]).tobytes() for _ in range(2 * queries)]
    runs: dict[str, list[float]] = {"after_batch": [], "second": [], "static": [], "apply": []}
    keys = {name: f"8192_tokens_bytes_{name}_p50_us" for name in runs} | {
        "apply": "apply_batch_p50_us"
    }
    for _ in range(repeat):
        index = PrefixIndex(block_size=BLOCK)
        for batch in batches[:-queries]:
            index.apply(batch)
        index.match_bytes(prompts[0])  # the lookup table made, as in `bench_match`
        gc.collect()
        lat: dict[str, list[float]] = {name: [] for name in runs}
        for p in prompts:
            started = clock()
            index.match_bytes(p)
            lat["static"].append(clock() - started)
        for i, batch in enumerate(held):
            started = clock()
            index.apply(batch)
            lat["apply"].append(clock() - started)
            for name, p in (("after_batch", prompts[2 * i]), ("second", prompts[2 * i + 1])):
                started = clock()
                index.match_bytes(p)
                lat[name].append(clock() - started)
        for name, values in lat.items():
            runs[name].append(_percentile(values, 0.5))
        del index
    return {
        "blocks_indexed": corpus.blocks,
        "queries": queries,
        **{keys[name]: 1e6 * _median(v) for name, v in runs.items()},
    }


def _traced(build: Callable[[], PrefixIndex]) -> tuple[int, PrefixIndex]:
    gc.collect()
    tracemalloc.start()
    index = build()
    gc.collect()
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return current, index


def bench_memory(blocks: int) -> dict[str, Any]:
    corpus = Corpus(blocks)
    one_origin = [
        EventBatch(seq=s, ts=0.0, events=b.events, origin="engine-0", epoch="e")
        for s, b in enumerate(corpus.batches(placeholders=False))
    ]
    n = corpus.blocks
    out: dict[str, Any] = {"blocks": n}

    def build(batches: list[EventBatch]) -> Callable[[], PrefixIndex]:
        prompt = [t for e in batches[0].events for t in getattr(e, "token_ids", ())]

        def run() -> PrefixIndex:
            index = PrefixIndex(block_size=BLOCK)
            for batch in batches:
                index.apply(batch)
            assert index.match(prompt)  # a hit: builds the lookup table, part of the state
            return index

        return run

    used, index = _traced(build(one_origin))
    out["bytes_per_block_one_origin_one_tier"] = used / n
    out["estimate_bytes_per_block_one_origin_one_tier"] = index.statistics().memory_bytes / n
    del index
    two_tiers = [
        EventBatch(
            seq=b.seq,
            ts=0.0,
            events=[
                *b.events,
                *(
                    BlockStored(
                        block_hashes=e.block_hashes,
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=0,
                        medium="CPU",
                    )
                    for e in b.events
                    if isinstance(e, BlockStored)  # every event of the corpus
                ),
            ],
            origin="engine-0",
            epoch="e",
        )
        for b in one_origin
    ]
    used, index = _traced(build(two_tiers))
    out["bytes_per_block_one_origin_two_tiers"] = used / n
    del index, two_tiers
    shared = [
        EventBatch(seq=b.seq, ts=0.0, events=b.events, origin=f"engine-{o}", epoch="e")
        for o in range(ORIGINS)
        for b in one_origin
    ]
    used, index = _traced(build(shared))
    out[f"bytes_per_block_{ORIGINS}_origins_same_blocks"] = used / n
    out[f"bytes_per_block_per_origin_{ORIGINS}_origins"] = used / n / ORIGINS
    del index, shared
    return out


class _Node:
    """What an index with an object per block would keep (the GC baseline)."""

    __slots__ = ("holders", "parent")

    def __init__(self, parent: int, holders: int) -> None:
        self.parent = parent
        self.holders = holders


def bench_gc(blocks: int) -> dict[str, Any]:
    """A full collection with the index alive, against an object per block in a dict.

    Everything alive before is frozen first (`gc.freeze()`), so the collection
    walks only what is built here.
    """
    gc.collect()
    gc.freeze()
    try:
        corpus = Corpus(blocks)
        index = PrefixIndex(block_size=BLOCK)
        for batch in corpus.batches():
            index.apply(batch)
        n = index.statistics().distinct_blocks
        del corpus, batch

        def collect_ms() -> float:
            runs = []
            for _ in range(3):
                started = time.perf_counter()
                gc.collect()
                runs.append(time.perf_counter() - started)
            return 1e3 * _median(runs)

        empty = collect_ms()
        del index
        gc.collect()
        nodes = {i: _Node(i, i + 1) for i in range(n)}  # an object per block: GC-tracked
        with_objects = collect_ms()
        del nodes
    finally:
        gc.unfreeze()
    return {
        "blocks_indexed": n,
        "gc_collect_ms_with_index": empty,
        "baseline_gc_collect_ms_with_an_object_per_block": with_objects,
    }


def bench_http(corpus: Corpus, queries: int) -> dict[str, Any]:
    """`POST /match` for an 8k-token prompt over a kept-alive loopback connection,
    JSON (orjson) and binary bodies, against the in-process call in the same run
    (`match()` of the `list[int]` for JSON, `match_bytes()` for binary).

    Round trips measured by the client (in the server's process and event loop),
    which sends pre-encoded requests and reads each response whole without
    parsing it, in the benchmark's clock (CPU time by default, the kernel's
    loopback work included): what is left over the in-process call is the
    server's HTTP work, the client's and the loop's turns. Two clients: anyio's
    socket stream (`http_*`, `echo_*`), and for the binary body a client on an
    asyncio `Protocol` (`*_lean_*`, `kvstream._bench.http_client`), which adds
    less of its own. Each has its floor in the same run: a bare echo server
    answering the same bytes with a response of the same size (anyio's stream
    for the first, a `Protocol` for the second).
    """
    import anyio
    import orjson
    from anyio.abc import SocketAttribute

    from kvstream._bench.http_client import connect, echo_server
    from kvstream.index._http import QueryServer

    index = PrefixIndex(block_size=BLOCK)
    for batch in corpus.batches():
        index.apply(batch)
    rng = random.Random(2)
    prompts = [rng.choice(corpus.chains)[:8192] for _ in range(queries)]

    def request(body: bytes, binary: bool) -> bytes:
        kind = "application/octet-stream" if binary else "application/json"
        return (
            f"POST /match HTTP/1.1\r\nHost: x\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    json_requests = [request(orjson.dumps({"token_ids": p}), False) for p in prompts]
    binary_requests = [request(array("I", p).tobytes(), True) for p in prompts]
    out: dict[str, Any] = {"blocks_indexed": index.statistics().distinct_blocks}

    bodies = [array("I", p).tobytes() for p in prompts]

    def in_process(binary: bool) -> float:
        lat = []
        for p, b in zip(prompts, bodies, strict=True):
            started = clock()
            if binary:
                index.match_bytes(b)
            else:
                index.match(p)
            lat.append(clock() - started)
        return _percentile(lat, 0.5)

    async def measure(port: int, prefix: str) -> None:
        stream = await anyio.connect_tcp("127.0.0.1", port)
        async with stream:
            buffer = bytearray()

            async def round_trip(raw: bytes) -> None:
                await stream.send(raw)
                while True:
                    end = buffer.find(b"\r\n\r\n")
                    if end >= 0:
                        head = bytes(buffer[:end]).lower()
                        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
                        if len(buffer) >= end + 4 + length:
                            assert head.startswith(b"http/1.1 200"), head
                            del buffer[: end + 4 + length]
                            return
                    buffer.extend(await stream.receive(1 << 20))

            for name, reqs in (("json", json_requests), ("binary", binary_requests)):
                for raw in reqs[:20]:  # warm-up
                    await round_trip(raw)
                p50s = []
                for _ in range(3):
                    lat = []
                    for raw in reqs:
                        started = clock()
                        await round_trip(raw)
                        lat.append(clock() - started)
                    p50s.append(_percentile(lat, 0.5))
                out[f"{prefix}_{name}_p50_us"] = 1e6 * _median(p50s)

    answer = index.match(prompts[0])
    canned = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(body := orjson.dumps({"matches": [m._asdict() for m in answer]})), body)
    )

    async def echo(stream: Any) -> None:
        """The transport's floor: the same bytes in and out, no HTTP, no index."""
        async with stream:
            pending = b""
            while True:
                while True:
                    end = pending.find(b"\r\n\r\n")
                    if end >= 0:
                        head = pending[:end].lower()
                        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
                        if len(pending) >= end + 4 + length:
                            pending = pending[end + 4 + length :]
                            break
                    try:
                        pending += await stream.receive(65536)
                    except anyio.EndOfStream:
                        return
                await stream.send(canned)

    async def measure_lean(port: int, prefix: str) -> None:
        async with connect(port) as client:
            for raw in binary_requests[:20]:  # warm-up
                await client.round_trip(raw)
            p50s = []
            for _ in range(3):
                lat = []
                for raw in binary_requests:
                    started = clock()
                    await client.round_trip(raw)
                    lat.append(clock() - started)
                p50s.append(_percentile(lat, 0.5))
            out[f"{prefix}_binary_lean_p50_us"] = 1e6 * _median(p50s)

    async def run() -> None:
        async with QueryServer(index, port=0) as server:
            await measure(server.port, "http")
            await measure_lean(server.port, "http")
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, echo)
            await measure(listener.extra(SocketAttribute.local_port), "echo")
            tg.cancel_scope.cancel()
        lean_echo = await echo_server(canned)
        try:
            await measure_lean(lean_echo.sockets[0].getsockname()[1], "echo")
        finally:
            lean_echo.close()
            await lean_echo.wait_closed()

    anyio.run(run)
    out["h11_cycle_us"] = 1e6 * _h11_cycle(binary_requests[0], canned)
    out["orjson_loads_p50_us"] = 1e6 * _median(
        [
            _percentile(
                _each(orjson.loads, [r.partition(b"\r\n\r\n")[2] for r in json_requests]), 0.5
            )
        ]
    )
    out["in_process_p50_us"] = 1e6 * _median([in_process(False) for _ in range(3)])
    out["in_process_bytes_p50_us"] = 1e6 * _median([in_process(True) for _ in range(3)])
    # Each body over the in-process call it stands for: JSON over match(list[int]),
    # binary over match_bytes().
    out["http_json_added_us"] = out["http_json_p50_us"] - out["in_process_p50_us"]
    out["http_binary_added_us"] = out["http_binary_p50_us"] - out["in_process_bytes_p50_us"]
    out["http_binary_lean_added_us"] = (
        out["http_binary_lean_p50_us"] - out["in_process_bytes_p50_us"]
    )
    for name in ("json", "binary", "binary_lean"):  # the server's work over the bare transport
        out[f"http_{name}_over_echo_us"] = out[f"http_{name}_p50_us"] - out[f"echo_{name}_p50_us"]
    return out


def _each(fn: Callable[[Any], object], items: list[Any]) -> list[float]:
    lat = []
    for item in items:
        started = clock()
        fn(item)
        lat.append(clock() - started)
    return lat


def _h11_cycle(raw: bytes, response: bytes, rounds: int = 500) -> float:
    """Seconds h11 takes for one keep-alive request cycle, in memory: `raw` parsed into
    its events, a response of `response`'s size sent back."""
    import h11

    conn = h11.Connection(h11.SERVER)
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(response)))]
    started = clock()
    for _ in range(rounds):
        conn.receive_data(raw)
        while type(conn.next_event()) is not h11.EndOfMessage:
            pass
        conn.send(h11.Response(status_code=200, headers=headers, reason=b"OK"))
        conn.send(h11.Data(data=response))
        conn.send(h11.EndOfMessage())
        conn.start_next_cycle()
    return (clock() - started) / rounds


#: the parts `--only` can name, in the order they run
PARTS = ("apply", "sim", "match", "live", "http", "memory", "gc")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10k and 100k blocks")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--repeat", type=int, default=3, help="measured runs (3)")
    parser.add_argument("--queries", type=int, default=200, help="prompts per latency run (200)")
    parser.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="what time is measured (cpu)"
    )
    parser.add_argument(
        "--only",
        type=lambda text: set(text.split(",")),
        default=set(PARTS),
        help=f"comma-separated parts to run, of {','.join(PARTS)} (all)",
    )
    parser.add_argument(
        "--sizes",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        help="comma-separated index sizes in blocks (100000,1000000; --quick 10000,100000)",
    )
    args = parser.parse_args(argv)
    unknown = args.only - set(PARTS)
    if unknown:
        parser.error(f"--only: unknown parts {sorted(unknown)}, expected some of {PARTS}")
    only = args.only
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    sizes = args.sizes or ((10_000, 100_000) if args.quick else (100_000, 1_000_000))
    results: dict[str, Any] = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "mode": "quick" if args.quick else "full",
        "repeat": args.repeat,
        "queries": args.queries,
        "clock": args.clock,
    }

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    corpora = {n: Corpus(n) for n in sizes} if only & {"apply", "match", "live", "http"} else {}
    for n, corpus in corpora.items() if "apply" in only else ():
        results[f"apply_{n}"] = r = bench_apply(corpus, args.repeat)
        say(
            f"apply, {r['blocks_indexed']:,} blocks: {r['apply_blocks_per_s']:,.0f} blocks/s "
            f"({r['apply_ns_per_block']:.0f} ns/block); hash alone "
            f"{r['baseline_hash_only_blocks_per_s']:,.0f} blocks/s"
        )
    if "sim" in only:
        results["apply_sim"] = r = bench_apply_sim(100 if args.quick else 400, args.repeat)
        say(
            f"apply, simulated engines ({r['batches']} batches, {r['block_events']:,} block "
            f"events): {r['apply_block_events_per_s']:,.0f} block events/s"
        )
    for n, corpus in corpora.items() if "match" in only else ():
        results[f"match_{n}"] = r = bench_match(corpus, args.queries, args.repeat)
        for tokens in (1024, 8192):
            say(
                f"match, {r['blocks_indexed']:,} blocks, {tokens} tokens: "
                f"hit p50 {r[f'{tokens}_tokens_hit_p50_us']:.0f} µs "
                f"p99 {r[f'{tokens}_tokens_hit_p99_us']:.0f} µs; "
                f"miss p50 {r[f'{tokens}_tokens_miss_p50_us']:.1f} µs; "
                f"hash alone p50 {r[f'{tokens}_tokens_baseline_hash_only_p50_us']:.0f} µs; "
                f"bytes API hit p50 {r[f'{tokens}_tokens_bytes_hit_p50_us']:.0f} µs "
                f"(hash alone {r[f'{tokens}_tokens_baseline_bytes_hash_only_p50_us']:.0f} µs)"
            )
    for n, corpus in corpora.items() if "live" in only else ():
        results[f"live_{n}"] = r = bench_match_live(corpus, args.queries, args.repeat)
        say(
            f"live, {r['blocks_indexed']:,} blocks, 8192 tokens, bytes API: match p50 right "
            f"after a batch {r['8192_tokens_bytes_after_batch_p50_us']:.0f} µs, a second "
            f"before the next {r['8192_tokens_bytes_second_p50_us']:.0f} µs, with no batch "
            f"between {r['8192_tokens_bytes_static_p50_us']:.0f} µs; the batch's apply "
            f"{r['apply_batch_p50_us']:.0f} µs"
        )
    if "http" in only:
        results["http"] = r = bench_http(corpora[sizes[-1]], min(args.queries, 200))
        say(
            f"http /match, {r['blocks_indexed']:,} blocks, 8192 tokens (wall clock): in "
            f"process p50 {r['in_process_p50_us']:.0f} µs; JSON body p50 "
            f"{r['http_json_p50_us']:.0f} µs (+{r['http_json_added_us']:.0f}); binary body "
            f"p50 {r['http_binary_p50_us']:.0f} µs (+{r['http_binary_added_us']:.0f})"
        )
    for n in sizes if "memory" in only else ():
        results[f"memory_{n}"] = r = bench_memory(n)
        say(
            f"memory, {r['blocks']:,} blocks: {r['bytes_per_block_one_origin_one_tier']:.0f} "
            f"B/block (one origin, one tier; statistics() estimates "
            f"{r['estimate_bytes_per_block_one_origin_one_tier']:.0f}), "
            f"{r['bytes_per_block_one_origin_two_tiers']:.0f} on two tiers, "
            f"{r[f'bytes_per_block_per_origin_{ORIGINS}_origins']:.0f} per origin when "
            f"{ORIGINS} origins hold the same blocks"
        )
    del corpora
    if "gc" in only:
        results["gc"] = r = bench_gc(sizes[-1])
        say(
            f"gc.collect() with {r['blocks_indexed']:,} blocks indexed: "
            f"{r['gc_collect_ms_with_index']:.2f} ms; with a slotted object per block instead "
            f"{r['baseline_gc_collect_ms_with_an_object_per_block']:.1f} ms (wall clock)"
        )
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
