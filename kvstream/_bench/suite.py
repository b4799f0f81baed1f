"""The whole suite: which benchmarks exist, how long each runs, the report they make.

`run_suite()` runs the selected benchmarks in order over one pre-built pool
(generated first, then frozen out of the garbage collector's way: it stands
for events an engine would have just made) and returns a JSON-ready report:
the machine, the sizes, every result, and every target checked.
"""

from __future__ import annotations

import gc
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from importlib import metadata
from typing import Any, Protocol

from kvstream._bench.codec_cost import bench_batch_cost, bench_codecs
from kvstream._bench.event_cost import bench_event_cost
from kvstream._bench.file_pipeline import bench_file
from kvstream._bench.index_runner import bench_index
from kvstream._bench.memory import bench_memory
from kvstream._bench.per_sink import SINK_NAMES, bench_sinks
from kvstream._bench.pipeline import bench_efficiency, bench_host_cost, bench_scaling
from kvstream._bench.publisher_compare import bench_publisher
from kvstream._bench.quiet import quiet_logs
from kvstream._bench.results import Result
from kvstream._bench.sizes import Sizes
from kvstream._bench.workload import event_pool, pool_stats
from kvstream._bench.zmq_compare import bench_zmq, zmq_cases
from kvstream._event_loop import running_loop_name
from kvstream.events import KVCacheEvent

__all__ = ["BENCHMARKS", "ProgressSink", "machine_info", "run_suite", "units"]

Bench = Callable[[list[KVCacheEvent], Sizes, Callable[[], None] | None], Awaitable[Result]]

#: Every benchmark, in the order the suite runs them (issue items in brackets).
BENCHMARKS: dict[str, str] = {
    "event": "making one event vs orjson and a msgspec Struct [3]",
    "codec": "codecs' encode vs msgspec and orjson on the same content [12.7]",
    "batch": "per batch on the host's loop beyond encoding [12.4]",
    "efficiency": "pipeline vs codec alone, by events per tick [1]",
    "host": "tick() latency, CPU per event, emit [3]",
    "scaling": "sources and sinks [4]",
    "file": "file sink pipeline vs the JSON codec writing [12.5]",
    "zmq": "ZMQ sink vs vLLM's publisher design and the floor [12.3, 12.6]",
    "publisher": "drop-in EventPublisher vs vLLM's publisher design, busy engine [12.1, 12.2]",
    "memory": "RSS with a stalled sink, per policy [5]",
    "sinks": "events/s and MB/s per sink [6]",
    "index": "prefix index (benchmarks/bench_index.py) [7]",
}

_FUNCS: dict[str, Bench] = {
    "event": bench_event_cost,
    "codec": bench_codecs,
    "batch": bench_batch_cost,
    "efficiency": bench_efficiency,
    "host": bench_host_cost,
    "scaling": bench_scaling,
    "file": bench_file,
    "zmq": bench_zmq,
    "publisher": bench_publisher,
    "memory": bench_memory,
    "sinks": bench_sinks,
}


class ProgressSink(Protocol):
    """What the suite reports progress to (the CLI's progress bar)."""

    def start(self, name: str, description: str, total: int) -> None: ...

    def advance(self) -> None: ...

    def finish(self, name: str) -> None: ...


def units(name: str, sizes: Sizes) -> int:
    """How many progress steps a benchmark reports (for the bar's length)."""
    runs = sizes.runs
    if name == "event":
        return max(sizes.event_repeats // 4, 1)
    if name == "efficiency":
        return len(sizes.events_per_tick) * runs * 3
    if name == "host":
        return 2 * runs * 2 + 1
    if name == "scaling":
        return runs * (len(sizes.sources) + len([k for k in sizes.sinks if k != 1]))
    if name == "codec":
        return max(runs, 3) * 2
    if name == "batch":
        return max(runs, 3)
    if name == "file":
        return runs * 4
    if name == "zmq":
        return len(sizes.zmq_batch_sizes) * runs * len(zmq_cases())
    if name == "publisher":
        return (len(sizes.zmq_batch_sizes) * 2 + 2 * 3) * runs
    if name == "memory":
        return 3
    if name == "sinks":
        return runs * len(SINK_NAMES)
    return 1


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "python": sys.version.split()[0],
        "event_loop": running_loop_name(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "load_average": load,
        # kvstream's own version is its distribution's, kvstream-events (the package
        # index's `kvstream` is an unrelated project that may be installed beside it)
        "versions": {
            "kvstream": _version("kvstream-events"),
            **{name: _version(name) for name in ("msgspec", "orjson", "pyzmq", "anyio", "uvloop")},
        },
    }


async def run_suite(
    sizes: Sizes,
    *,
    only: Sequence[str] | None = None,
    quick: bool = False,
    progress: ProgressSink | None = None,
    sinks: Sequence[str] = SINK_NAMES,
) -> dict[str, Any]:
    """Run the benchmarks named in `only` (default: all) and return the report."""
    names = [n for n in BENCHMARKS if only is None or n in only]
    started = time.time()
    info = machine_info()
    pool = event_pool(sizes.pool_events)
    gc.collect()
    gc.freeze()
    results: list[dict[str, Any]] = []
    try:
        for name in names:
            total = units(name, sizes)
            if progress is not None:
                progress.start(name, BENCHMARKS[name], total)
            advance = progress.advance if progress is not None else None
            with quiet_logs():
                if name == "index":
                    if quick and only is None:
                        result = Result("index", "Prefix index (benchmarks/bench_index.py)")
                        result.skipped = (
                            "skipped in --quick (about 30 s on its own): "
                            "kvstream bench --only index, or python benchmarks/bench_index.py"
                        )
                    else:
                        result = await bench_index(quick, advance)
                elif name == "sinks":
                    result = await bench_sinks(pool, sizes, advance, tuple(sinks))
                else:
                    result = await _FUNCS[name](pool, sizes, advance)
            results.append(result.as_dict())
            if progress is not None:
                progress.finish(name)
    finally:
        gc.unfreeze()
    load_end: list[float] | None
    try:
        load_end = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load_end = None
    info["load_average_end"] = load_end
    targets = [t for r in results for t in r.get("targets", [])]
    return {
        "kvstream_bench": 1,
        "quick": quick,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "machine": info,
        "sizes": asdict(sizes),
        "workload": pool_stats(pool).as_dict(),
        "results": results,
        "targets": targets,
    }
