"""`kvstream`: entry point, subcommand table and error handling.

Each subcommand lives in its own module with two functions: `register(sub)`
adds its parser (`sub.add_parser(...)`) and sets `func` to an async
`run(args) -> int`. User mistakes (a `KVStreamError`, a bad option)
end in one line on stderr and a non-zero exit, never a stack trace.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Final, NoReturn, get_args

import anyio

import kvstream
from kvstream._cli.configfile import apply_config, finish_args, load_config
from kvstream._event_loop import EventLoopName, backend_options, resolve_event_loop
from kvstream.errors import KVStreamError

#: Subcommand modules, in the order `--help` lists them.
COMMANDS: Final = (
    "kvstream._cli.bench",
    "kvstream._cli.demo",
    "kvstream._cli.index",
    "kvstream._cli.relay",
    "kvstream._cli.tail",
    "kvstream._cli.verify",
)

EPILOG = """\
examples:
  kvstream demo                                  simulated engine -> ./kvstream-demo-*.jsonl
  kvstream demo --steps 500 --sink - --sink file:events.jsonl
  kvstream verify events.jsonl                   check a stream's consistency
  kvstream --config kvstream.toml demo           defaults from a TOML file ([demo] table)
  kvstream demo --help                           every command has its own help and examples

Every long-running command stops cleanly on Ctrl-C, SIGTERM or SIGHUP, delivering what it has,
and prints a summary; --metrics ADDR serves Prometheus metrics while it runs.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line as every other error of the command line
    (the usage block it prints before them is what `--help` is for)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="the same as --log-level INFO: shows every connection attempt, among others",
    )
    parser.add_argument(
        "--loop",
        default="asyncio",
        choices=get_args(EventLoopName),
        help="the event loop the command runs on: asyncio's own, uvloop "
        "(pip install 'kvstream-events[uvloop]'), or auto: uvloop when installed "
        "(default: asyncio)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file giving defaults for any option: global keys at the top, "
        "a [table] per command (the command line wins)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def _config_path(argv: Sequence[str] | None) -> str | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    return known.config  # type: ignore[no-any-return]


def _user_errors(group: BaseExceptionGroup[BaseException]) -> list[KVStreamError] | None:
    """The errors of a task group's exception group, if all are user mistakes."""
    leaves: list[KVStreamError] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            inner = _user_errors(exc)
            if inner is None:
                return None
            leaves.extend(inner)
        elif isinstance(exc, KVStreamError):
            leaves.append(exc)
        else:
            return None
    return leaves


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    config = _config_path(argv)
    if config:
        try:
            apply_config(parser, load_config(config), config)
        except KVStreamError as exc:
            print(f"kvstream: error: {exc}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    finish_args(args)
    level = getattr(logging, args.log_level)
    if args.verbose:
        level = min(level, logging.INFO)
    logging.basicConfig(
        level=level,
        format="kvstream: %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        args.loop = resolve_event_loop(args.loop, field="--loop")
        code: int = anyio.run(
            args.func, args, backend="asyncio", backend_options=backend_options(args.loop)
        )
    except KVStreamError as exc:
        print(f"kvstream {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:
        errors = _user_errors(group)
        if not errors:
            raise
        print(f"kvstream {args.command}: error: {errors[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
