"""A request head that arrived whole, read as strictly as h11 reads it; a response head
written as h11 writes it. Sans-IO, for `kvstream._wire.http`.

h11 costs 45 to 80 µs per request cycle here, most of it in its event machinery rather
than in parsing. The common request (HTTP/1.1, one `Host`, an optional
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

__all__ = ["Head", "parse_head", "response_head", "valid_field"]

# The grammar as h11 spells it (RFC 9110 / 9112): a token, a field value without
# NUL or line breaks, a request target of visible ASCII.
_TOKEN: Final = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_FIELD_VALUE: Final = rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?"
_HEADER_LINE: Final = _TOKEN + rb":[ \t]*" + _FIELD_VALUE + rb"[ \t]*\r\n"
#: The request line, HTTP/1.1 only (h11 takes any `[0-9].[0-9]`; the rest go to it).
_REQUEST_LINE: Final = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/1\.1\r\n")
#: Every header line, then the blank line; nothing else (no folding, no bare LF).
_HEADER_BLOCK: Final = re.compile(rb"(?:" + _HEADER_LINE + rb")*\r\n")
#: One header line, its name and value captured.
_HEADER_FIELDS: Final = re.compile(rb"(" + _TOKEN + rb"):[ \t]*(" + _FIELD_VALUE + rb")[ \t]*\r\n")
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


def parse_head(data: bytes | bytearray) -> Head | None:
    """The head at the start of `data` if it is complete there and in the subset read
    here; `None` when h11 must read it (incomplete, outside the subset, or malformed:
    h11 then gives its own answer)."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    line = _REQUEST_LINE.match(data)
    if line is None:
        return None
    start = line.end()
    size = end + 4
    if _HEADER_BLOCK.fullmatch(data, start, size) is None:
        return None
    headers: dict[str, str] = {}
    hosts = 0
    length = None
    close = False
    for raw_name, raw_value in _HEADER_FIELDS.findall(data, start, size):
        name = raw_name.lower().decode("ascii")
        value = raw_value.decode("latin-1")
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
        headers[name] = value
    if hosts != 1:
        return None
    method = line[1].decode("ascii")
    if method == "CONNECT":
        return None
    return Head(
        method=method,
        target=line[2].decode("ascii"),
        headers=headers,
        size=size,
        length=length or 0,
        close=close,
    )


def valid_field(name: str, value: str) -> bool:
    """Whether a response header is one h11 would send: ASCII, a token for a name, a
    field value (no NUL, no line break) for a value."""
    try:
        raw_name, raw_value = name.encode("ascii"), value.encode("ascii")
    except UnicodeEncodeError:
        return False
    return _NAME.fullmatch(raw_name) is not None and _VALUE.fullmatch(raw_value) is not None


def response_head(
    status: int,
    reason: bytes,
    headers: list[tuple[str, str]],
) -> bytes:
    """The status line and `headers` as h11 writes them (in order, a blank line after);
    the caller has checked them with `valid_field()`."""
    lines = [b"HTTP/1.1 %d %s" % (status, reason)]
    lines.extend(f"{name}: {value}".encode("ascii") for name, value in headers)
    lines.append(b"\r\n")
    return b"\r\n".join(lines)
