"""URLs as they may be shown: in messages, logs, names and metric labels.

A URL may carry a secret: a broker's user and password or token
(`redis://user:PASSWORD@host`, `nats://TOKEN@host`), or a query option that
kvstream refuses but a user may still have typed (`?token=...`). Wherever a
URL is shown, its userinfo becomes `***` and so does the value of every such
option; everything else (scheme, host, port, path, the other options) stays,
so that a message still says which URL and which option it is about.
"""

from __future__ import annotations

from typing import Final

__all__ = ["redact_url"]

#: Query options whose values are secrets (compared lower-cased).
SECRET_OPTIONS: Final = frozenset({"token", "password", "passwd", "secret"})


def redact_url(url: str) -> str:
    """`url` with its credentials and secret option values replaced by `***`.

    Text that is not a URL with an authority or a query comes back unchanged.
    """
    base, sep, query = url.partition("?")
    scheme, slashes, rest = base.partition("://")
    if slashes:
        authority, slash, path = rest.partition("/")
        if "@" in authority:
            authority = "***@" + authority.rpartition("@")[2]
            base = f"{scheme}://{authority}{slash}{path}"
    if not sep:
        return base
    shown = []
    for pair in query.split("&"):
        key, eq, value = pair.partition("=")
        if eq and value and key.lower() in SECRET_OPTIONS:
            pair = f"{key}=***"
        shown.append(pair)
    return f"{base}?{'&'.join(shown)}"
