"""`kvstream verify`: check that JSON-lines recordings describe a consistent cache.

Takes files and globs (quoted globs are expanded here too), and checks each
file on its own: per origin and tier every removed block was held, every stored
block's parent was held, and sequence numbers are contiguous per
`(origin, epoch)`. A recording that starts after seq 0 (a `kvstream tail`
that joined a running stream) is judged from its first batch on; so is every
origin with `--joined-late` (a relay that joined its upstreams late numbers
from 0). Snapshot lines of `kvstream tail --format json` are read as the
state they describe.
"""

from __future__ import annotations

import argparse
import glob
import sys
from typing import Any

import anyio
import orjson

from kvstream.codecs.json import JsonCodec
from kvstream.errors import ConfigError, DecodeError, TransportError
from kvstream.events import EventBatch
from kvstream.sim._check import ConsistencyError, check_consistency

__all__ = ["expand_paths", "read_recording", "register", "run"]

EXAMPLES = """\
examples:
  kvstream verify demo.jsonl                     one file
  kvstream verify kvstream-demo-*.jsonl          every demo run here, each checked on its own
  kvstream verify --joined-late relay.jsonl      a relay recording that joined its upstreams late
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="check JSON-lines files: contiguous seq, no removal of unheld blocks, parents held",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "path",
        nargs="+",
        metavar="PATH",
        help="JSON-lines files (file sink, tail, relay) or globs",
    )
    p.add_argument(
        "--joined-late",
        action="store_true",
        help="the state before each origin's first batch is unknown, even at seq 0",
    )
    p.set_defaults(func=run)


def expand_paths(patterns: list[str]) -> list[str]:
    """Each pattern's matches (sorted), or the pattern itself when it has no glob magic."""
    paths: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise ConfigError(f"{pattern}: no file matches")
            paths.extend(matches)
        else:
            paths.append(pattern)
    return list(dict.fromkeys(paths))


def read_recording(data: bytes, torn: list[int] | None = None) -> list[EventBatch]:
    """The batches of a JSON-lines recording, snapshot lines included.

    With `torn`, a line that is cut short (not JSON, after at least one batch:
    a writer stopped mid-line, e.g. killed) is skipped and its number appended
    to `torn`; any other bad line raises `DecodeError` naming it.
    """
    codec = JsonCodec()
    batches: list[EventBatch] = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        if torn is not None and batches and _is_torn(line):
            torn.append(number)
            continue
        if b'"snapshot"' in line:
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise DecodeError(f"line {number}: not a JSON line: {exc}") from exc
            if isinstance(obj, dict) and obj.get("type") == "snapshot":
                obj.pop("type")
                next_seq = obj.pop("next_seq", None)
                if type(next_seq) is not int or next_seq < 1:
                    raise DecodeError(
                        f"line {number}: snapshot next_seq: expected an int >= 1, got {next_seq!r}"
                    )
                obj["seq"] = next_seq - 1
                for key in ("first_missing", "part", "last"):
                    obj.pop(key, None)
                try:
                    batches.append(codec.batch_from_dict(obj))
                except DecodeError as exc:
                    raise DecodeError(f"line {number}: {exc}") from exc
                continue
        try:
            batches.append(codec.decode(line))
        except DecodeError as exc:
            raise DecodeError(f"line {number}: {exc}") from exc
    return batches


def _is_torn(line: bytes) -> bool:
    """A line of kvstream's format cut short: it starts as one and is not JSON."""
    if not line.startswith(b"{"):
        return False
    try:
        orjson.loads(line)
    except orjson.JSONDecodeError:
        return True
    return False


def _verify_one(path: str, data: bytes, joined_late: bool) -> bool:
    torn: list[int] = []
    try:
        batches = read_recording(data, torn)
    except DecodeError as exc:
        print(f"kvstream verify: {path}: not a kvstream recording: {exc}", file=sys.stderr)
        return False
    if torn:
        lines = ", ".join(map(str, torn[:5])) + (" ..." if len(torn) > 5 else "")
        print(
            f"kvstream verify: {path}: {len(torn)} torn line(s) skipped (line {lines}): a "
            "writer stopped mid-line (killed?); the batches around them are checked",
            file=sys.stderr,
        )
    try:
        report = check_consistency(batches, start_seq=None, joined_late=joined_late)
    except ConsistencyError as exc:
        hint = ""
        if not joined_late and "is not held" in str(exc):
            hint = " (a recording that joined its stream late, e.g. a relay's: --joined-late)"
        print(f"kvstream verify: {path}: INCONSISTENT: {exc}{hint}", file=sys.stderr)
        return False
    held = "; ".join(
        f"{origin}: " + ", ".join(f"{m or '?'} {n}" for m, n in sorted(tiers.items(), key=str))
        for origin, tiers in report.held.items()
    )
    print(
        f"kvstream verify: {path}: OK: {report.batches} batches, {report.events} events; "
        f"held at the end: {held or 'nothing'}"
    )
    return True


async def run(args: argparse.Namespace) -> int:
    paths = expand_paths(args.path)
    ok = True
    for path in paths:
        try:
            data = await anyio.Path(path).read_bytes()
        except OSError as exc:
            if len(paths) == 1:
                raise TransportError(f"cannot read {path}: {exc}") from exc
            print(f"kvstream verify: cannot read {path}: {exc}", file=sys.stderr)
            ok = False
            continue
        ok = _verify_one(path, data, args.joined_late) and ok
    return 0 if ok else 1
