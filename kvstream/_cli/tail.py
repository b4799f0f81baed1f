"""`kvstream tail`: print batches as they arrive, from any subscriber URL.

Works against a socket sink (`tcp://HOST:PORT`, `unix:PATH`), a JSON-lines
file (followed as it grows, like `tail -f`; `--no-follow` stops at its
end) and every other URL `kvstream.subscribe` knows (ZMQ, NATS, Redis).
Batches go to standard output; gaps (batches that will never come) are
warnings on standard error. An upstream that cannot be reached is retried
with backoff (`-v` shows every attempt; `--no-retry` exits at once); a
file that is not kvstream's JSON lines is refused. Ctrl-C, SIGTERM or SIGHUP stops it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import IO, Any, Final, NamedTuple

import anyio
import orjson

from kvstream._cli.argtypes import non_negative_int
from kvstream._cli.longrun import Stop, add_metrics_option, metrics_token, open_metrics
from kvstream._cli.upstream import bind_rule, open_upstream, refuse_foreign_file
from kvstream.codecs.json import JsonCodec, json_default
from kvstream.config import ParsedURL, parse_url, redact_url, subscribe
from kvstream.consumers.base import Gap, Subscriber
from kvstream.errors import ConfigError
from kvstream.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)

__all__ = ["Printer", "register", "run"]

EXAMPLES = """\
examples:
  kvstream tail tcp://127.0.0.1:5600                  live batches from a socket sink
  kvstream tail tcp://127.0.0.1:5600 --from-seq 0     everything the sink can still replay
  kvstream tail unix:/run/kvstream.sock --format json  JSON lines, for piping into jq
  kvstream tail events.jsonl                          a file, followed as it grows
  kvstream tail 'tcp://10.0.0.5:5600?token_env=KV_TOKEN&tls_ca=ca.pem'
  kvstream tail 'zmq+tcp://127.0.0.1:5557?replay=tcp://127.0.0.1:5558'   a vLLM engine
  kvstream tail 'zmq+tcp://*:5557'                    bind: for publishers that connect
"""

#: Seconds of silence from a ZMQ upstream before the bind-or-connect hint.
QUIET_HINT_AFTER: Final = 5.0

_RESET: Final = "\x1b[0m"
_COLORS: Final = {
    "stored": "\x1b[32m",
    "removed": "\x1b[31m",
    "cleared": "\x1b[33m",
    "snapshot": "\x1b[35m",
    "dim": "\x1b[2m",
    "warn": "\x1b[33m",
}
_U64: Final = (1 << 64) - 1


def register(sub: Any) -> None:
    p = sub.add_parser(
        "tail",
        help="print batches as they arrive (socket sink, JSON-lines file, ZMQ, NATS, Redis)",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", help="what to read: tcp://HOST:PORT, unix:PATH, a file, zmq+tcp://...")
    p.add_argument(
        "--from-seq",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="start at seq N (default: live batches only; a file: from its start)",
    )
    p.add_argument(
        "--format",
        choices=("pretty", "json"),
        default="pretty",
        help="pretty: one readable line per event; json: one JSON line per batch (pretty)",
    )
    p.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour pretty output: auto = when stdout is a terminal and NO_COLOR is unset",
    )
    p.add_argument(
        "--count",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="exit after N batches (0: never)",
    )
    p.add_argument(
        "--no-follow",
        action="store_true",
        help="for a file: print what it holds and exit instead of following it",
    )
    p.add_argument(
        "--no-retry",
        action="store_true",
        help="exit at once when the upstream cannot be reached (default: retry with backoff)",
    )
    add_metrics_option(p)
    p.set_defaults(func=run)


def _use_color(choice: str, stream: IO[str]) -> bool:
    if choice != "auto":
        return choice == "always"
    if os.environ.get("NO_COLOR"):
        return False
    return stream.isatty()


def _hash(h: BlockHash) -> str:
    if type(h) is int:
        return f"{h & _U64:016x}"
    raw = h.hex() if isinstance(h, bytes) else str(h)
    return raw[:16] + ("…" if len(raw) > 16 else "")


def _blocks(hashes: list[BlockHash]) -> str:
    if not hashes:
        return "0 blocks"
    if len(hashes) == 1:
        return f"1 block  {_hash(hashes[0])}"
    return f"{len(hashes)} blocks {_hash(hashes[0])}..{_hash(hashes[-1])}"


class Printer:
    """Turns subscriber items into text: pretty (one line per event) or JSON lines."""

    def __init__(self, fmt: str, *, color: bool) -> None:
        if fmt not in ("pretty", "json"):
            raise ConfigError(f"--format: expected pretty or json, got {fmt!r}")
        self.format = fmt
        self.color = color
        self._codec = JsonCodec()

    def _paint(self, what: str, text: str) -> str:
        return f"{_COLORS[what]}{text}{_RESET}" if self.color else text

    def event_line(self, prefix: str, event: KVCacheEvent, kind: str | None = None) -> str:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            extra = f" parent {_hash(parent)}" if parent is not None else " root"
            if event.token_ids:
                extra += f" {len(event.token_ids)} tokens"
            if event.lora_name:
                extra += f" lora={event.lora_name}"
            text = f"{'stored':<8} {event.medium or '-':<9} {_blocks(event.block_hashes)}{extra}"
            color = kind or "stored"
        elif isinstance(event, BlockRemoved):
            text = f"{'removed':<8} {event.medium or '-':<9} {_blocks(event.block_hashes)}"
            color = kind or "removed"
        elif isinstance(event, AllBlocksCleared):
            text = f"{'cleared':<8} (every tier)"
            color = kind or "cleared"
        else:  # pragma: no cover - the event union is closed
            text = repr(event)
            color = "dim"
        metadata = getattr(event, "metadata", None)
        if metadata:
            text += f" metadata={metadata!r:.120}"
        return f"{self._paint('dim', prefix)} {self._paint(color, text)}"

    def batch(self, batch: EventBatch) -> str:
        """The text for one batch (or snapshot), newline-terminated."""
        snapshot = getattr(batch, "is_snapshot", False)
        if self.format == "json":
            if not snapshot:
                return self._codec.encode(batch).decode()
            body = self._codec.batch_to_dict(batch)
            body["type"] = "snapshot"
            body["next_seq"] = body.pop("seq") + 1
            return _json(body)
        millis = int(batch.ts * 1000) % 1000
        clock = f"{time.strftime('%H:%M:%S', time.localtime(batch.ts))}.{millis:03d}"
        if snapshot:
            head = f"{clock} {batch.origin} snapshot<{batch.seq + 1}"
            lines = [
                self._paint(
                    "snapshot",
                    f"{head}: the state of {batch.origin} (epoch {batch.epoch}) before seq "
                    f"{batch.seq + 1}, {len(batch.events)} events",
                )
            ]
            lines += [self.event_line(head, e, "snapshot") for e in batch.events]
        else:
            head = f"{clock} {batch.origin} #{batch.seq}"
            lines = [self.event_line(head, e) for e in batch.events] or [
                f"{self._paint('dim', head)} (no events)"
            ]
        return "\n".join(lines) + "\n"

    @staticmethod
    def gap(gap: Gap) -> str:
        return (
            f"kvstream tail: gap: {gap.origin} epoch {gap.epoch}: batches "
            f"{gap.first_missing}..{gap.next_seq - 1} missing ({gap.reason})\n"
        )


def _json(obj: Any) -> str:
    return orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE, default=json_default).decode()


class TailStatistics(NamedTuple):
    batches: int
    events: int
    gaps: int
    missing_batches: int


class _TailCounters:
    """What `kvstream tail` has seen, for `--metrics`."""

    def __init__(self) -> None:
        self.batches = self.events = self.gaps = self.missing = 0

    def count(self, item: EventBatch | Gap) -> None:
        if isinstance(item, Gap):
            self.gaps += 1
            self.missing += item.missing
        else:
            self.batches += 1
            self.events += len(item.events)

    def statistics(self) -> TailStatistics:
        return TailStatistics(self.batches, self.events, self.gaps, self.missing)


def quiet_hint(parsed: ParsedURL, seconds: float) -> str | None:
    """Why nothing may have arrived from a ZMQ URL in `seconds`; None for other schemes."""
    if not parsed.scheme.startswith("zmq"):
        return None
    endpoint = parsed.raw.split("?", 1)[0].removeprefix("zmq+")
    bind = parsed.options.get("bind")
    flag = None if bind is None else bind.lower() in ("1", "true", "yes", "on")
    rule = bind_rule(endpoint, flag)
    if rule.startswith("binds"):
        fix = "the publisher must connect to it (vLLM connects when its endpoint has no '*')"
    else:
        fix = (
            "if the publisher connects too (vLLM and kvstream connect when the endpoint has "
            "no '*'), nothing can arrive: bind one end, e.g. tail 'zmq+tcp://*:PORT' or add "
            "?bind=1"
        )
    return (
        f"kvstream tail: nothing received from {endpoint} in {seconds:.0f} s; "
        f"this end {rule}; {fix}\n"
    )


async def run(args: argparse.Namespace) -> int:
    kwargs: dict[str, Any] = {}
    parsed = parse_url(args.url)
    if parsed.scheme == "file":
        kwargs["follow"] = not args.no_follow
        refuse_foreign_file(parsed.path)
    out = sys.stdout
    err = sys.stderr
    printer = Printer(args.format, color=_use_color(args.color, out))
    warn_color = _use_color(args.color, err)
    retry = not args.no_retry

    def make() -> Subscriber:
        return subscribe(args.url, from_seq=args.from_seq, **kwargs)

    printed = 0
    counters = _TailCounters()
    async with (
        open_metrics(args.metrics, command="tail", token=metrics_token(args)) as metrics,
        anyio.create_task_group() as tg,
    ):
        if metrics is not None:
            metrics.collector.add(counters, kind="tail", labels={"url": redact_url(args.url)})

        tg.start_soon(Stop(tg.cancel_scope.cancel).on_signal)
        hint = quiet_hint(parsed, QUIET_HINT_AFTER)
        if hint is not None:

            async def say_why_quiet() -> None:
                await anyio.sleep(QUIET_HINT_AFTER)
                if not counters.batches and not counters.gaps:
                    err.write(hint)
                    err.flush()

            tg.start_soon(say_why_quiet)
        try:
            async with open_upstream(make, url=args.url, command="tail", retry=retry) as sub:
                async for item in sub:
                    counters.count(item)
                    if isinstance(item, Gap):
                        text = printer.gap(item)
                        err.write(f"{_COLORS['warn']}{text}{_RESET}" if warn_color else text)
                        err.flush()
                        continue
                    out.write(printer.batch(item))
                    out.flush()
                    printed += 1
                    if args.count and printed >= args.count:
                        break
        except BrokenPipeError:
            # The reader went away (| head): stop quietly, and keep Python from
            # complaining when it flushes stdout at exit.
            with contextlib.suppress(OSError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, out.fileno())
        tg.cancel_scope.cancel()
    return 0
