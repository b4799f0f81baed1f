"""``kvstream verify``: check that a JSON-lines stream describes a consistent cache."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import anyio

from kvstream.codecs.json import JsonCodec
from kvstream.errors import DecodeError, TransportError
from kvstream.sim.check import ConsistencyError, check_consistency

__all__ = ["register", "run"]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="check a JSON-lines file: contiguous seq, no removal of unheld blocks, parents held",
        description=(
            "Reads a JSON-lines file of batches and checks, per origin and tier, that "
            "every removed block was held, every stored block's parent was held, and "
            "sequence numbers are contiguous per (origin, epoch)."
        ),
        epilog="example:\n  kvstream verify kvstream-demo-20261129-172233.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", help="a JSON-lines file written by a file sink")
    p.add_argument(
        "--joined-late",
        action="store_true",
        help="the file does not start at seq 0 (state before it is unknown)",
    )
    p.set_defaults(func=run)


async def run(args: argparse.Namespace) -> int:
    try:
        data = await anyio.Path(args.path).read_bytes()
    except OSError as exc:
        raise TransportError(f"cannot read {args.path}: {exc}") from exc
    try:
        batches = JsonCodec().decode_lines(data)
    except DecodeError as exc:
        print(f"kvstream verify: {args.path}: {exc}", file=sys.stderr)
        return 1
    try:
        report = check_consistency(batches, start_seq=None if args.joined_late else 0)
    except ConsistencyError as exc:
        print(f"kvstream verify: {args.path}: INCONSISTENT: {exc}", file=sys.stderr)
        return 1
    held = "; ".join(
        f"{origin}: " + ", ".join(f"{m or '?'} {n}" for m, n in sorted(tiers.items(), key=str))
        for origin, tiers in report.held.items()
    )
    print(
        f"kvstream verify: {args.path}: OK: {report.batches} batches, {report.events} events; "
        f"held at the end: {held or 'nothing'}"
    )
    return 0
