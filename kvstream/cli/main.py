"""``kvstream``: entry point, subcommand table and error handling.

Each subcommand lives in its own module with two functions: ``register(sub)``
adds its parser (``sub.add_parser(...)``) and sets ``func`` to an async
``run(args) -> int``. User mistakes (a :class:`KVStreamError`, a bad option)
end in one line on stderr and a non-zero exit, never a stack trace.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Final

import anyio

import kvstream
from kvstream.errors import KVStreamError

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS: Final = (
    "kvstream.cli.demo",
    "kvstream.cli.verify",
)

EPILOG = """\
examples:
  kvstream demo                                  simulated engine -> ./kvstream-demo-*.jsonl
  kvstream demo --steps 500 --sink - --sink file:events.jsonl
  kvstream verify events.jsonl                   check a stream's consistency

Every long-running command stops cleanly on Ctrl-C or SIGTERM, delivering what it has.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstream",
        description="KV cache events for LLM serving: simulate, publish, relay, follow and index.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvstream {kvstream.__version__}")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log verbosity on stderr (default: WARNING)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="kvstream: %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        code: int = anyio.run(args.func, args)
    except KVStreamError as exc:
        print(f"kvstream {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
