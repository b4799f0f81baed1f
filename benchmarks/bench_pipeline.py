"""Pipeline benchmarks: efficiency against the codec alone, cost to the host, scaling.

    python benchmarks/bench_pipeline.py                  # all three, full size
    python benchmarks/bench_pipeline.py --quick --only efficiency
    python benchmarks/bench_pipeline.py --json pipeline.json

* efficiency (issue item 1): events/s through an async source, the tick, the
  JSON codec and a null sink (and a file sink on tmpfs), against the JSON codec
  encoding the same pre-built batches in a plain loop; 1 to 1024 events per
  tick; interleaved runs in one process, median of runs.
* host (item 3): tick() wall time (p50/p99) with 4 paced sources at 16 and 256
  events per tick; the whole pipeline's CPU per event against the codec's;
  the cost of emit().
* scaling (item 4): events/s with 1, 4, 16, 64 sources (64-event chunks) and
  1, 2, 4 sinks.
"""

from __future__ import annotations

import _common

NAMES = ("efficiency", "host", "scaling")

if __name__ == "__main__":
    p = _common.parser(__doc__ or "")
    p.add_argument("--only", action="append", choices=NAMES, help="one part (repeatable)")
    args = p.parse_args()
    raise SystemExit(_common.main(args, args.only or NAMES))
