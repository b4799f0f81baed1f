"""The cost of making one event, against serializing it (issue item 3, last part).

For one 16-block, 256-token `BlockStored` from the pool, timed in the same
process, interleaved, median of repeats:

* **kvstream event**: `BlockStored(...)` — construction plus validation;
* **msgspec Struct**: the same fields in a plain tagged msgspec Struct, as vLLM
  builds its events (no validation);
* **orjson.dumps**: serializing the same fields, from a dict built beforehand
  (the pure serialization cost: the target's yardstick);
* **JSON codec, one event**: kvstream's JSON codec path for one event (its dict,
  then orjson), for reference.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec
import orjson

from kvstream._bench.results import Result, Row, Target
from kvstream._bench.sizes import Sizes
from kvstream._bench.workload import sample_stored
from kvstream.codecs.json import JsonCodec
from kvstream.events import BlockStored, KVCacheEvent

__all__ = ["bench_event_cost"]

Progress = Callable[[], None]


class _PlainStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """vLLM's way: a tagged Struct, built without checks."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


def _loop(fn: Callable[[], Any], n: int) -> float:
    """Seconds per call of `fn` over `n` calls."""
    clock = time.perf_counter
    t0 = clock()
    for _ in range(n):
        fn()
    return (clock() - t0) / n


async def bench_event_cost(
    pool: list[KVCacheEvent], sizes: Sizes, progress: Progress | None = None
) -> Result:
    result = Result("event", "Making one event (16 blocks, 256 tokens) against serializing it")
    event = sample_stored(pool)
    hashes = list(event.block_hashes)
    parent = event.parent_block_hash
    tokens = list(event.token_ids)
    size = event.block_size
    medium = event.medium
    fields = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }
    codec = JsonCodec()
    dumps = orjson.dumps
    cases: dict[str, Callable[[], Any]] = {
        "kvstream event (validated)": lambda: BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=size,
            medium=medium,
        ),
        "msgspec Struct (vLLM-style, unvalidated)": lambda: _PlainStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=size,
            lora_id=None,
            medium=medium,
            lora_name=None,
        ),
        "orjson.dumps of the same fields": lambda: dumps(fields),
        "JSON codec path, one event": lambda: dumps(codec.event_to_dict(event)),
    }
    n = sizes.event_loops
    for fn in cases.values():  # warm-up
        _loop(fn, max(n // 10, 1))
    timings: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(sizes.event_repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            timings[name].append(_loop(cases[name], n))
        if progress is not None and r % 4 == 3:
            progress()
    med = {name: statistics.median(v) * 1e6 for name, v in timings.items()}
    best = {name: min(v) * 1e6 for name, v in timings.items()}
    yardstick = "orjson.dumps of the same fields"
    for name in names:
        result.rows.append(
            Row(
                "event",
                name,
                "16 blocks/256 tokens",
                1e6 / med[name],
                "time vs orjson.dumps" if name != yardstick else "",
                med[name] / med[yardstick] if name != yardstick else None,
                p50_us=med[name],
                note=f"best {best[name]:.2f} us",
            )
        )
    result.targets.append(
        Target(
            "make a validated event / orjson.dumps",
            med["kvstream event (validated)"] / med[yardstick],
            1.5,
            "<=",
        )
    )
    result.data = {"us_median": med, "us_best": best, "loops": n, "repeats": sizes.event_repeats}
    return result
