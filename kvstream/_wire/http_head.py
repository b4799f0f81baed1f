"""A request head that arrived whole, read as strictly as h11 reads it; a response head
written as h11 writes it. Sans-IO, for `kvstream._wire.http`.

h11 costs 45 to 80 µs per request cycle here (events, state machine and writer);
this reading costs about 4 µs. The common request (HTTP/1.1, one `Host`, an optional
`Content-Length`, the head complete in the first bytes received) is read here with
h11's own grammar (the same token, field-value and request-line patterns, the same
`Host` and `Content-Length` rules), and every request outside that subset is left to
h11: `parse_head()` answers `None` and the server hands the bytes to h11 unchanged.
So this path never accepts what h11 would refuse, nor reads a request differently:
chunked bodies, `Expect`, `Upgrade`, `CONNECT`, HTTP/1.0, folded header lines, bare
LF line ends, duplicate or odd `Content-Length` values and heads arriving in pieces
all take h11's path, with h11's answers.
"""

from __future__ import annotations

import re
from typing import Final, NamedTuple

__all__ = ["Head", "parse_head", "response_head", "valid_field", "valid_value"]

# The grammar as h11 spells it (RFC 9110 / 9112): a token, a field value without
# NUL or line breaks, a request target of visible ASCII.
_TOKEN: Final = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_FIELD_VALUE: Final = rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?"
#: The request line, HTTP/1.1 only (h11 takes any `[0-9].[0-9]`; the rest go to it).
_REQUEST_LINE: Final = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/1\.1\r\n")
#: One header line, its name and value captured (no folding, no bare LF).
_HEADER_LINE: Final = re.compile(rb"(" + _TOKEN + rb"):[ \t]*(" + _FIELD_VALUE + rb")[ \t]*\r\n")
#: h11's Content-Length: digits only, at most 20 of them.
_LENGTH: Final = re.compile(rb"[0-9]{1,20}")
_NAME: Final = re.compile(_TOKEN)
_VALUE: Final = re.compile(_FIELD_VALUE)
#: Headers that change how h11 frames or answers a request: h11 reads those.
_H11_ONLY: Final = frozenset({"transfer-encoding", "upgrade", "expect"})


class Head(NamedTuple):
    """A request head read in full (header names lower-cased, as h11 gives them)."""

    method: str
    target: str
    headers: dict[str, str]
    #: Bytes of the head, its blank line included.
    size: int
    #: The body's length (`Content-Length`, 0 without one).
    length: int
    #: The client asked to close after this request (`Connection: close`).
    close: bool


def parse_head(data: bytes | bytearray, limit: int) -> Head | None:
    """The head at the start of `data` if it is complete there within `limit` bytes and
    in the subset read here; `None` when h11 must read it (incomplete, longer, outside
    the subset, or malformed: h11 then gives its own answer)."""
    end = data.find(b"\r\n\r\n", 0, limit)  # the whole head within the limit, or h11's
    if end < 0:
        return None
    line = _REQUEST_LINE.match(data)
    if line is None:
        return None
    size = end + 4
    blank = end + 2  # where the blank line starts: every header line ends before it
    headers: dict[str, str] = {}
    hosts = 0
    length = None
    close = False
    pos = line.end()
    field = _HEADER_LINE.match
    while pos < blank:
        found = field(data, pos, size)
        if found is None:
            return None
        pos = found.end()
        raw_name, raw_value = found.groups()
        name = raw_name.lower().decode("ascii")
        if name == "host":
            hosts += 1
        elif name == "content-length":
            if length is not None or _LENGTH.fullmatch(raw_value) is None:
                return None
            length = int(raw_value)
        elif name == "connection":
            # h11's reading: comma-separated, each stripped and lower-cased as bytes
            close = close or any(t.strip().lower() == b"close" for t in raw_value.split(b","))
        elif name in _H11_ONLY:
            return None
        headers[name] = raw_value.decode("latin-1")
    if pos != blank or hosts != 1:
        return None
    method = line[1].decode("ascii")
    if method == "CONNECT":
        return None
    return Head(method, line[2].decode("ascii"), headers, size, length or 0, close)


def valid_value(value: str) -> bool:
    """Whether a response header's value is one h11 would send: ASCII, no NUL, no line
    break."""
    return value.isascii() and _VALUE.fullmatch(value.encode("ascii")) is not None


def valid_field(name: str, value: str) -> bool:
    """Whether a response header is one h11 would send: a token for a name (ASCII), a
    valid value (`valid_value()`)."""
    return (
        name.isascii()
        and _NAME.fullmatch(name.encode("ascii")) is not None
        and (valid_value(value))
    )


def response_head(
    status: int,
    reason: bytes,
    content_type: str,
    length: int,
    headers: tuple[tuple[str, str], ...] = (),
    *,
    close: bool = False,
) -> bytes:
    """The status line and headers as h11 writes them for kvstream's answers:
    `Content-Type`, `Content-Length`, `headers` in order, `Connection: close` last when
    `close`, then the blank line. The caller has checked them (`valid_value()`,
    `valid_field()`)."""
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (
        status,
        reason,
        content_type.encode("ascii"),
        length,
    )
    for name, value in headers:
        head += f"{name}: {value}\r\n".encode("ascii")
    return head + (b"Connection: close\r\n\r\n" if close else b"\r\n")
