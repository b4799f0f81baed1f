"""Per sink: events/s and MB/s (issue item 6).

    python benchmarks/bench_sinks.py [--quick] [--json PATH] [--sink tcp --sink zmq]

file (disk), tcp and unix (socket sink, a counting subscriber process), zmq (a
frame-counting SUB process), nats (JetStream, memory storage, acked) and redis
(Streams, no persistence), as available: a missing module or server binary is
reported "not available". 64-event batches; interleaved runs, medians.
"""

from __future__ import annotations

import _common

from kvstream._bench.per_sink import SINK_NAMES

if __name__ == "__main__":
    p = _common.parser(__doc__ or "")
    p.add_argument("--sink", action="append", choices=SINK_NAMES, help="only these (repeatable)")
    args = p.parse_args()
    raise SystemExit(_common.main(args, ["sinks"], sinks=args.sink or SINK_NAMES))
