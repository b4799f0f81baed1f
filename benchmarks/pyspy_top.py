"""Summarize a py-spy raw profile: the functions with the most samples.

    py-spy record -f raw -r 1000 -o prof.txt -- python benchmarks/profile_zmq.py
    python benchmarks/pyspy_top.py prof.txt --within _writer --within _kvstream_run

Prints, for the samples whose stack contains one of the `--within` frames
(all samples without it), the share of samples per frame: *self* (the frame
was running) and *inclusive* (the frame was on the stack).
"""

from __future__ import annotations

import argparse
from collections import Counter


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("path", help="a py-spy raw (collapsed stacks) file")
    p.add_argument("--within", action="append", default=[], help="keep stacks with this frame")
    p.add_argument("--top", type=int, default=25, help="rows per table (25)")
    args = p.parse_args()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    with open(args.path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or (args.within and not any(w in stack for w in args.within)):
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            own[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
    print(f"{total} samples")
    for title, counter in (("self", own), ("inclusive", inclusive)):
        print(f"\n{title}:")
        for frame, n in counter.most_common(args.top):
            print(f"  {n / max(total, 1) * 100:5.1f}%  {frame[:140]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
