"""A subscriber process that only counts: ZMQ messages, or bytes from a TCP/Unix stream.

Run as `python -m kvstream._bench.frame_counter zmq ENDPOINT` (a SUB socket,
connecting, subscribed to everything) or `... stream HOST:PORT` /
`... stream unix:PATH` (a socket sink's subscriber: it sends the empty hello,
`{}`, and reads the stream). It decodes
nothing, so it does not cap what it measures. Commands, one per line on stdin:

* `arm`: reset the counts and print `armed`; then print `ready` after the
  next message (ZMQ), or connect and print `ready` (stream);
* `count`: print the counts as one JSON line;
* `quit`: exit.

The benchmark (the parent) drives it through `CounterProcess`.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO, Any

__all__ = ["CounterProcess", "main"]


def _zmq_loop(endpoint: str, commands: IO[str]) -> None:
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(commands.fileno(), zmq.POLLIN)
    messages = frames = nbytes = 0
    first = last = 0.0
    armed = False
    recv = sub.recv
    more = sub.getsockopt
    while True:
        for item, _ in poller.poll():
            if item is sub:
                # Drain what is queued without polling again.
                while True:
                    try:
                        frame = recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    frames += 1
                    nbytes += len(frame)
                    if not more(zmq.RCVMORE):
                        messages += 1
                        last = time.perf_counter()
                        if not first:
                            first = last
                        if armed:
                            armed = False
                            print("ready", flush=True)
                continue
            line = commands.readline().strip()
            if line == "arm":
                messages = frames = nbytes = 0
                first = last = 0.0
                armed = True
                print("armed", flush=True)
            elif line == "count":
                print(
                    json.dumps(
                        {
                            "messages": messages,
                            "frames": frames,
                            "bytes": nbytes,
                            "seconds": last - first,
                        }
                    ),
                    flush=True,
                )
            elif line in ("quit", ""):
                sub.close(linger=0)
                ctx.term()
                return


def _stream_loop(address: str, commands: IO[str]) -> None:
    sock: socket.socket | None = None
    nbytes = 0
    first = last = 0.0
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    while True:
        fds: list[Any] = [commands]
        if sock is not None:
            fds.append(sock)
        ready, _, _ = select.select(fds, [], [])
        if sock is not None and sock in ready:
            try:
                n = sock.recv_into(view)
            except OSError:
                n = 0
            if n == 0:
                sock.close()
                sock = None
            else:
                nbytes += n
                last = time.perf_counter()
                if not first:
                    first = last
        if commands in ready:
            line = commands.readline().strip()
            if line == "arm":
                if sock is not None:
                    sock.close()
                sock = _connect(address)
                nbytes = 0
                first = last = 0.0
                print("ready", flush=True)
            elif line == "count":
                print(json.dumps({"bytes": nbytes, "seconds": last - first}), flush=True)
            elif line in ("quit", ""):
                if sock is not None:
                    sock.close()
                return


def _connect(address: str) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            if address.startswith("unix:"):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(address[5:])
            else:
                host, _, port = address.rpartition(":")
                s = socket.create_connection((host, int(port)))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            s.sendall(b"{}\n")  # the socket sink's hello: every key optional (live only)
            return s
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("zmq", "stream"):
        print("usage: python -m kvstream._bench.frame_counter zmq|stream ADDRESS", file=sys.stderr)
        return 2
    if args[0] == "zmq":
        _zmq_loop(args[1], sys.stdin)
    else:
        _stream_loop(args[1], sys.stdin)
    return 0


class CounterProcess:
    """The parent's handle on a counting subscriber (see the module doc)."""

    def __init__(self, kind: str, address: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstream._bench.frame_counter", kind, address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._pending = b""

    def command(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def poll_line(self, timeout: float) -> str | None:
        """A line of output if one arrives within `timeout` seconds."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                return None
            data = os.read(fd, 65536)
            if not data:
                return None
            self._pending += data
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode().strip()

    def counts(self, timeout: float = 10.0) -> dict[str, Any]:
        counts = self._ask_counts(timeout)
        if counts is None:
            raise TimeoutError("the counting subscriber did not answer")
        return counts

    def _ask_counts(self, timeout: float = 5.0) -> dict[str, Any] | None:
        """The subscriber's counts now (a late "ready" or "armed" line skipped), or
        None when it does not answer within `timeout` seconds."""
        self.command("count")
        line = self.poll_line(timeout)
        while line in ("ready", "armed"):
            line = self.poll_line(timeout)
        if not line:
            return None
        counts: dict[str, Any] = json.loads(line)
        return counts

    def arm(self, timeout: float = 20.0) -> None:
        """Reset the subscriber's counts; returns once it has done so."""
        self.command("arm")
        deadline = time.monotonic() + timeout
        while self.poll_line(max(deadline - time.monotonic(), 0)) != "armed":
            if time.monotonic() > deadline:
                raise TimeoutError("the counting subscriber did not answer 'arm'")

    def wait_ready(self, probe: Callable[[], None], timeout: float = 20.0) -> None:
        """Send probes until the subscriber has one, let stragglers land, re-arm the counts."""
        self.arm()
        deadline = time.monotonic() + timeout
        while True:
            probe()
            if self.poll_line(0.02) == "ready":
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the counting subscriber never received a probe")
        time.sleep(0.2)
        self.arm()

    def counts_when(self, messages: int, timeout: float = 20.0) -> dict[str, Any]:
        """The counts once `messages` arrived, or once they stop growing (or time runs out)."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        stable = 0
        while time.monotonic() < deadline:
            now = self._ask_counts()
            if now is None:
                break
            if now.get("messages", 0) >= messages:
                return now
            stable = stable + 1 if now == last else 0
            if stable >= 10:
                return now
            last = now
            time.sleep(0.05)
        return last

    def wait_count(self, messages: int, timeout: float = 20.0) -> None:
        """Return once `messages` messages arrived since the last `arm()` (asked for
        about every millisecond; raises `TimeoutError` after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            counts = self._ask_counts()
            if counts is None:
                raise TimeoutError("the counting subscriber did not answer")
            if counts.get("messages", 0) >= messages:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the counting subscriber got fewer than {messages} messages")
            time.sleep(0.001)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.command("quit")
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
