"""kvstream's ZMQ sink against vLLM's publisher design (issue item 2).

    python benchmarks/bench_vllm_zmq.py [--quick] [--json PATH] [--runs N]

The baseline (kvstream/_bench/vllm_baseline.py) is built as WIRE.md describes
vLLM's publisher: publish() does a blocking queue.put; a thread encodes with
msgspec and sends on a PUB socket (hwm 100 000) and keeps a ring. Both sides
publish the same pre-built batches (1, 16 and 256 events) over TCP to a
subscriber process that only counts frames; events/s and CPU per event are
measured in the sender process. Interleaved runs, medians, ratios per pair.
"""

from __future__ import annotations

import _common

if __name__ == "__main__":
    args = _common.parser(__doc__ or "").parse_args()
    raise SystemExit(_common.main(args, ["zmq"]))
