"""What the codecs cost against the libraries under them (issue 12, target 7),
and what a batch costs the host's loop beyond encoding it (target 4).

* `MsgpackCodec.encode` against msgspec encoding the vLLM-style structs of the
  same batch (`kvstream._bench.vllm_baseline`, built before timing): the
  bytes are identical (checked), so the difference is what kvstream adds.
* `JsonCodec.encode` against `orjson.dumps` of the same content, the dict
  `JsonCodec.batch_to_dict` gives (built before timing), plus the newline.
* Per batch on the host's loop: `emit(events)` then `await tick()` into a
  [`ZmqSink`][kvstream.sinks.zmq.ZmqSink] publishing to a connected subscriber (the
  tick encodes and sends inline), at 1 event per batch, against encoding the
  same batches alone. The difference is what kvstream adds per batch; the
  longest tick against the longest encode shows the loop is blocked no longer
  than encoding a batch takes (plus the send).

Both workload shapes run (`vllm`, the main case, and `mixed`); every timing
is the median of interleaved rounds.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio

from kvstream._bench.results import Result, Row, Target
from kvstream._bench.sizes import Sizes
from kvstream._bench.workload import EPOCH, ORIGIN, batches, chunks, event_pool
from kvstream.codecs.json import JsonCodec, json_default
from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.events import EventBatch, KVCacheEvent
from kvstream.scheduler import Scheduler

__all__ = ["bench_batch_cost", "bench_codecs"]

Progress = Callable[[], None]


def _per_event(fn: Callable[[], Any], events: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) / events * 1e6)
    return out


async def bench_codecs(
    pool: list[KVCacheEvent], sizes: Sizes, progress: Progress | None = None
) -> Result:
    """The codecs' encode over msgspec / orjson on the same content, per event."""
    import msgspec
    import orjson

    from kvstream._bench.vllm_baseline import to_vllm_batch

    result = Result("codec", "Codecs: encode against msgspec and orjson on the same content")
    encoder = msgspec.msgpack.Encoder()
    msgpack = MsgpackCodec()
    json = JsonCodec()
    dumps = orjson.dumps
    option = orjson.OPT_APPEND_NEWLINE
    rounds = max(sizes.runs, 3)
    shapes = {"vllm": pool, "mixed": event_pool(len(pool), shape="mixed")}
    for shape, events in shapes.items():
        n = 256
        count = max(min(len(events) // n, 32), 1)
        prebuilt = batches(events, n, count)
        vstructs = [to_vllm_batch(b) for b in prebuilt]
        dicts = [json.batch_to_dict(b) for b in prebuilt]
        for b, v in zip(prebuilt, vstructs, strict=True):
            if encoder.encode(v) != msgpack.encode(b):  # pragma: no cover - tests check it
                raise AssertionError("MsgpackCodec and msgspec wrote different bytes")
        total = n * count

        def run_msgspec(v: list[Any] = vstructs) -> None:
            for x in v:
                encoder.encode(x)

        def run_msgpack(p: list[EventBatch] = prebuilt) -> None:
            for x in p:
                msgpack.encode(x)

        def run_orjson(d: list[dict[str, Any]] = dicts) -> None:
            for x in d:
                dumps(x, default=json_default, option=option)

        def run_json(p: list[EventBatch] = prebuilt) -> None:
            for x in p:
                json.encode(x)

        cases: dict[str, Callable[[], None]] = {
            "msgspec": run_msgspec,
            "msgpack": run_msgpack,
            "orjson": run_orjson,
            "json": run_json,
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for fn in cases.values():
            fn()  # warm-up
        for r in range(rounds):
            names = list(cases)
            k = r % len(names)
            for name in names[k:] + names[:k]:
                gc.collect()
                times[name].extend(_per_event(cases[name], total, 1))
            if progress is not None:
                progress()
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio_mp = statistics.median(
            a / b for a, b in zip(times["msgpack"], times["msgspec"], strict=True)
        )
        ratio_js = statistics.median(
            a / b for a, b in zip(times["json"], times["orjson"], strict=True)
        )
        for name, label, base, ratio in (
            ("msgspec", "msgspec encoding vLLM-style structs (baseline)", "", None),
            ("msgpack", "MsgpackCodec.encode (map profile)", "msgspec", ratio_mp),
            ("orjson", "orjson.dumps of the batch's dict (baseline)", "", None),
            ("json", "JsonCodec.encode", "orjson", ratio_js),
        ):
            result.rows.append(
                Row(
                    "codec",
                    label,
                    f"{shape}, {n}/batch",
                    1e6 / med[name],
                    base,
                    ratio,
                    med[name],
                    note="time ratio (lower is faster)" if ratio is not None else "",
                )
            )
        if shape == "vllm":
            result.targets.append(
                Target("[12.7] MsgpackCodec.encode time over msgspec's", ratio_mp, 1.1, "<=")
            )
            result.targets.append(
                Target("[12.7] JsonCodec.encode time over orjson.dumps'", ratio_js, 1.1, "<=")
            )
        else:
            result.data[f"msgpack_ratio_{shape}"] = ratio_mp
            result.data[f"json_ratio_{shape}"] = ratio_js
    return result


async def _host_steps(
    step_chunks: list[list[KVCacheEvent]], ring: bool
) -> tuple[float, float, float]:
    """Mean and max wall µs of `emit` + `await tick()` into a ZmqSink; and bytes sent."""
    import zmq

    from kvstream.sinks.zmq import ZmqSink

    sink = ZmqSink(
        "tcp://127.0.0.1:0",
        bind=True,
        replay_endpoint="tcp://127.0.0.1:0" if ring else None,
        linger=0.0,
        hwm=0,
        name="zmq",
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    try:
        async with Scheduler(sinks=[sink], origin=ORIGIN, epoch=EPOCH) as s:
            sub.connect(sink.endpoint)
            with anyio.fail_after(20):
                await sink.wait_subscribed()
            emit = s.emit
            tick = s.tick
            clock = time.perf_counter_ns
            worst = 0
            t_all = 0
            for chunk in step_chunks:
                t0 = clock()
                emit(chunk)
                await tick()
                dt = clock() - t0
                t_all += dt
                if dt > worst:
                    worst = dt
                await anyio.lowlevel.checkpoint()  # the host's own yield, untimed
            inline = sink.batches_inline
    finally:
        sub.close(linger=0)
        ctx.term()
    if inline != len(step_chunks):  # pragma: no cover - a full pipe in a benchmark
        raise AssertionError(f"only {inline} of {len(step_chunks)} batches went inline")
    return t_all / len(step_chunks) / 1000, worst / 1000, 0.0


async def bench_batch_cost(
    pool: list[KVCacheEvent], sizes: Sizes, progress: Progress | None = None
) -> Result:
    """Per-batch cost on the host's loop beyond encoding, at 1 event per batch."""
    import anyio.lowlevel  # noqa: F401 - used by _host_steps

    result = Result("batch", "Per batch on the host's loop, beyond encoding (1 event/batch)")
    n_steps = min(max(sizes.zmq_events // 8, 256), 10_000)
    step_chunks = chunks(pool, 1, n_steps)
    prebuilt: list[EventBatch] = batches(pool, 1, n_steps)
    codec = MsgpackCodec()
    rounds = max(sizes.runs, 3)
    steps: dict[bool, list[float]] = {False: [], True: []}
    worst: dict[bool, float] = {False: 0.0, True: 0.0}
    encodes: list[float] = []
    worst_encode = 0.0
    for r in range(rounds + 1):
        gc.collect()
        mean_off, worst_off, _ = await _host_steps(step_chunks, ring=False)
        gc.collect()
        mean_on, worst_on, _ = await _host_steps(step_chunks, ring=True)
        gc.collect()
        clock = time.perf_counter_ns
        total = 0
        longest = 0
        for b in prebuilt:
            t0 = clock()
            codec.encode(b)
            dt = clock() - t0
            total += dt
            longest = max(longest, dt)
        if r == 0:
            continue  # warm-up round
        steps[False].append(mean_off)
        steps[True].append(mean_on)
        worst[False] = max(worst[False], worst_off)
        worst[True] = max(worst[True], worst_on)
        encodes.append(total / n_steps / 1000)
        worst_encode = max(worst_encode, longest / 1000)
        if progress is not None:
            progress()
    encode = statistics.median(encodes)
    result.rows.append(
        Row(
            "batch",
            "MsgpackCodec.encode of a 1-event batch (baseline)",
            "1/batch",
            p50_us=encode,
            note=f"longest {worst_encode:.0f} us",
        )
    )
    for ring in (False, True):
        beyond = statistics.median(a - b for a, b in zip(steps[ring], encodes, strict=True))
        label = "emit + tick -> ZmqSink (inline), " + ("replay ring on" if ring else "no ring")
        result.rows.append(
            Row(
                "batch",
                label,
                "1/batch",
                p50_us=statistics.median(steps[ring]),
                note=f"{beyond:.1f} us beyond encoding; longest tick {worst[ring]:.0f} us",
            )
        )
        result.data[f"beyond_encoding_us_{'ring' if ring else 'noring'}"] = beyond
        if not ring:
            result.targets.append(
                Target(
                    "[12.4] host loop per batch beyond encoding, 1 event", beyond, 10.0, "<=", "us"
                )
            )
    return result
