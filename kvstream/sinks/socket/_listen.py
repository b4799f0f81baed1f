"""The socket sink's listening side: Unix sockets made safely, peers named, hellos read.

* `bind_unix()` creates a listening Unix socket with mode 0600 set before
  `bind`, so the path is never reachable with looser permissions; a stale
  socket file is replaced, a live one (or any other file) is an error.
* `read_hello()` reads a subscriber's one hello line, bounded in bytes.
* `peer_name()` and `host_port()` name addresses for log records.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat

import anyio.abc
from anyio.abc import SocketAttribute

from kvstream._wire.socket_protocol import MAX_HELLO_BYTES, ProtocolError
from kvstream.errors import TransportError

__all__ = ["bind_unix", "host_port", "peer_name", "read_hello"]


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def peer_name(stream: anyio.abc.ByteStream) -> str:
    """The remote address of `stream` for messages (`unix peer` on a Unix socket)."""
    addr = stream.extra(SocketAttribute.remote_address, None)
    if isinstance(addr, tuple) and len(addr) >= 2:
        return host_port(str(addr[0]), int(addr[1]))
    return "unix peer" if addr is not None else "peer"


async def read_hello(stream: anyio.abc.ByteStream) -> bytes:
    """The subscriber's hello line, without its newline; ProtocolError when malformed."""
    buf = bytearray()
    while True:
        buf += await stream.receive(MAX_HELLO_BYTES)
        end = buf.find(b"\n")
        if end >= 0:
            if end + 1 != len(buf):
                raise ProtocolError("hello: nothing may follow the hello line", "bad_hello")
            return bytes(buf[:end])
        if len(buf) >= MAX_HELLO_BYTES:
            raise ProtocolError(f"hello: no newline within {MAX_HELLO_BYTES} bytes", "bad_hello")


def bind_unix(path: str) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600 from the start.

    A stale socket file (nobody listening) is replaced; a live one, or any other
    kind of file, is an error.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise TransportError(f"unix:{path}: {exc.strerror}") from exc
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise TransportError(f"unix:{path}: the path exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        except OSError as exc:
            raise TransportError(f"unix:{path}: {exc.strerror}") from exc
        else:
            raise TransportError(f"unix:{path}: another process is listening there")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.fchmod(sock.fileno(), 0o600)  # Linux creates the file with the socket's mode
        sock.bind(path)
        os.chmod(path, 0o600)  # elsewhere: tighten right after bind
        sock.listen(1024)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise TransportError(f"unix:{path}: address in use") from exc
        raise TransportError(f"unix:{path}: cannot listen: {exc.strerror or exc}") from exc
    return sock
