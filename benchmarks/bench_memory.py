"""Memory under a stalled sink (issue item 5).

    python benchmarks/bench_memory.py [--quick] [--json PATH]

1M events (200k with --quick), 64 per tick, cycled from the pre-built pool,
flow through a scheduler with a healthy null sink and a sink whose send never
returns, bounded at 16 MB (8 MB with --quick); RSS growth after a warm-up, per
overflow policy (drop_oldest, drop_newest, block), against the bound + 32 MB.
"""

from __future__ import annotations

import _common

if __name__ == "__main__":
    args = _common.parser(__doc__ or "").parse_args()
    raise SystemExit(_common.main(args, ["memory"]))
