"""Prefix index: apply throughput, match latency, bytes per block (issue item 7).

    python benchmarks/bench_index.py [--quick] [--json] [--repeat N] [--queries N]

The benchmark lives in `kvstream._bench.index_measure` (what it measures is
described there); `kvstream bench --only index` runs the same code.
"""

from __future__ import annotations

from kvstream._bench.index_measure import main

if __name__ == "__main__":
    raise SystemExit(main())
