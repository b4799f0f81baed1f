"""The cost of making one event (issue item 3): construction plus validation.

    python benchmarks/bench_events.py [--quick] [--json PATH]

One 16-block, 256-token BlockStored from the workload, timed against
serializing the same fields with orjson (the yardstick), a plain msgspec Struct
of the same fields (vLLM's unvalidated events) and kvstream's JSON codec path
for one event. Interleaved repeats, medians.
"""

from __future__ import annotations

import _common

if __name__ == "__main__":
    args = _common.parser(__doc__ or "").parse_args()
    raise SystemExit(_common.main(args, ["event"]))
