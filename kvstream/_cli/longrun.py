"""What the long-running commands share: `--metrics ADDR` and the progress line.

A command that runs until stopped (`demo`, `relay`, `tail`, `index`,
`bench`) adds the option in its `register`:

    add_metrics_option(parser)

and, in `run`, serves its objects' statistics while it works:

    async with open_metrics(args.metrics, command="relay") as metrics:
        async with Scheduler(...) as scheduler:
            if metrics is not None:
                metrics.collector.add(scheduler)
                metrics.collector.add(subscriber, kind="subscriber")
            ...

(Open the metrics server outside the scheduler, so it is still listening while
the scheduler closes, and a closing scheduler never cancels it.)

It stops on SIGINT, SIGTERM or SIGHUP (a closed terminal), delivering what it accepted,
and a command with sinks also once its standard output's reader went away
(`kvstream relay --sink - | head`):

    stop = Stop(relay.stop)                  # what stopping does
    tg.start_soon(stop.on_signal)
    tg.start_soon(stop.when_stdout_closes, sinks)
    ...
    if stop.by:
        print(f"kvstream relay: stopped by {stop.by}", file=sys.stderr)
    return 0 if delivered(report, sinks) else 1

and shows a progress line on stderr when stderr is a terminal:

    progress = Progress("relay", lambda: f"{n:,} batches")
    tg.start_soon(progress.run)    # returns at once when stderr is not a TTY
    ...
    progress.clear()               # before printing the final summary
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Final, TextIO

import anyio

from kvstream._wire.socket_security import read_token
from kvstream.scheduler import CloseReport
from kvstream.sinks.base import Sink
from kvstream.sinks.file import FileSink

if TYPE_CHECKING:
    from kvstream.metrics import MetricsServer

__all__ = [
    "STDOUT_CLOSED",
    "STOP_SIGNALS",
    "Progress",
    "Stop",
    "add_metrics_option",
    "delivered",
    "metrics_token",
    "open_metrics",
]

#: What a command stopped by its standard output's reader says ("stopped by ...").
STDOUT_CLOSED: Final = "the reader of standard output going away"
#: The signals that stop a long-running command gracefully; SIGHUP is a closed terminal
#: (an ssh session gone), which would otherwise end it at once, undelivered batches lost.
STOP_SIGNALS: Final = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


def _stdout_sinks(sinks: Sequence[Sink]) -> list[FileSink]:
    return [s for s in sinks if isinstance(s, FileSink) and s.path == "-"]


class Stop:
    """Why a long-running command stops (`by`: None until it is asked to), and
    `action`, what stopping does (cancel its task group, stop its relay), done once."""

    def __init__(self, action: Callable[[], object]) -> None:
        self.by: str | None = None
        self._action = action

    def __call__(self, why: str) -> None:
        if self.by is None:
            self.by = why
            self._action()

    async def on_signal(self) -> None:
        """Stop at the first of `STOP_SIGNALS`."""
        with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
            async for signum in signals:
                self(signal.Signals(signum).name)
                return

    async def when_stdout_closes(self, sinks: Sequence[Sink], *, interval: float = 0.1) -> None:
        """Stop once a standard-output sink can deliver nothing more (its reader went
        away: `| head` has what it wanted). Returns at once without such a sink."""
        watched = _stdout_sinks(sinks)
        if not watched:
            return
        # Polled: the sink notices in its writer, and says so only through `ended`.
        while not any(s.ended for s in watched):  # noqa: ASYNC110 - no event to wait on
            await anyio.sleep(interval)
        # Keep Python's last flush of stdout, at exit, from complaining of the pipe.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        self(STDOUT_CLOSED)


def delivered(report: CloseReport, sinks: Sequence[Sink]) -> bool:
    """Whether every batch was delivered, but to a standard output whose reader left
    (the summary still counts those: the reader chose to stop reading)."""
    gone = {s.name for s in _stdout_sinks(sinks) if s.ended}
    return all(r.complete or r.name in gone for r in report.sinks)


def add_metrics_option(parser: argparse.ArgumentParser) -> None:
    """Add `--metrics ADDR` to a subcommand's parser."""
    parser.add_argument(
        "--metrics",
        metavar="ADDR",
        default=None,
        help="serve Prometheus metrics at http://ADDR/metrics while running, "
        "e.g. 127.0.0.1:9464 or :0 (needs kvstream-events[metrics])",
    )
    parser.add_argument(
        "--metrics-token-env",
        metavar="NAME",
        default=None,
        help="environment variable holding a bearer token scrapers must send "
        "(required to serve metrics beyond loopback)",
    )
    parser.add_argument(
        "--metrics-token-file",
        metavar="PATH",
        default=None,
        help="file holding that bearer token (instead of --metrics-token-env)",
    )


def metrics_token(args: argparse.Namespace) -> str | None:
    """The bearer token `--metrics-token-env` / `--metrics-token-file` name, or None."""
    return read_token(
        env=getattr(args, "metrics_token_env", None),
        file=getattr(args, "metrics_token_file", None),
        where="--metrics",
    )


@asynccontextmanager
async def open_metrics(
    address: str | None, *targets: object, command: str, token: str | None = None
) -> AsyncIterator[MetricsServer | None]:
    """Serve the targets' statistics at `address` (yields None when it is None).

    Prints the URL on stderr. Add more targets later with
    `server.collector.add(...)`.
    """
    if not address:
        yield None
        return
    from kvstream.metrics import MetricsServer, StatisticsCollector

    async with MetricsServer(StatisticsCollector(*targets), address, token=token) as server:
        print(f"kvstream {command}: metrics on {server.url}", file=sys.stderr, flush=True)
        yield server


class Progress:
    """A status line on stderr, rewritten in place once a second.

    Shown only when the stream is a terminal (`enabled` overrides). `render`
    is called once per refresh, never per event, so the line costs nothing on
    the hot path.
    """

    def __init__(
        self,
        command: str,
        render: Callable[[], str],
        *,
        stream: TextIO | None = None,
        interval: float = 1.0,
        enabled: bool | None = None,
    ) -> None:
        self.command = command
        self.render = render
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.started = time.perf_counter()
        self._shown = False

    @property
    def elapsed(self) -> float:
        """Seconds since the progress line was created."""
        return time.perf_counter() - self.started

    def show(self) -> None:
        """Rewrite the line now."""
        if not self.enabled:
            return
        text = f"kvstream {self.command}: {self.render()}"
        self.stream.write(f"\r{text}\x1b[K")
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        """Erase the line (call before printing the summary). Idempotent."""
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

    async def run(self) -> None:
        """Refresh every `interval` seconds until cancelled; erases the line on exit."""
        if not self.enabled:
            return
        try:
            while True:
                await anyio.sleep(self.interval)
                self.show()
        finally:
            self.clear()
