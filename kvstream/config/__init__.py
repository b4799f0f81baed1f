"""The one place where URLs become objects: sinks, subscribers and codecs.

Sink URLs (every one also takes `?policy=block|drop_oldest|drop_newest`,
`max_bytes=64MiB`, `max_batches=N`, `codec=json|msgpack`, `name=...`):

    -                         JSON lines on standard output
    file:PATH  file://PATH    JSON lines appended to PATH (a bare path works too);
                              ?rotate_bytes=64MiB&rotate_seconds=3600&keep=10 rotate it;
                              ?inline=false never writes on the event loop
    memory:                   a MemorySink (tests, examples)

and `tcp://HOST:PORT`, `unix:PATH`, `zmq+tcp://...`, `zmq+ipc://...`,
`nats://...`, `redis://...`. An option a sink does not know is an error
that names it; so is a malformed value. Installed plug-ins add schemes and
codecs through entry points (`kvstream.config._registry`). kvstream's own
factories are in `kvstream.config._sinks`, `kvstream.config._subscribers` and
`kvstream.config._codecs`; transport modules import nothing from here.

Integrations are imported only when their scheme is used, so a missing extra
says which `pip install 'kvstream-events[...]'` fixes it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qsl, unquote, urlsplit

from kvstream._redact import redact_url
from kvstream._wire.from_seq import FromSeq
from kvstream.codecs.base import Codec
from kvstream.config._registry import Registry
from kvstream.consumers.base import Subscriber
from kvstream.errors import ConfigError
from kvstream.sinks.base import DEFAULT_MAX_BATCHES, DEFAULT_MAX_BYTES, POLICIES, Sink

__all__ = [
    "Options",
    "ParsedURL",
    "Registry",
    "make_codec",
    "open_sink",
    "open_subscriber",
    "parse_size",
    "parse_url",
    "redact_url",
    "subscribe",
]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS: Final = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(text: str, what: str = "size") -> int:
    """`"64MiB"` -> 67108864. Plain numbers are bytes."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{what}: expected a size like 1048576, 64KiB or 64MiB, got {text!r}")
    value = float(m.group(1)) * _UNITS[unit]
    if value < 1:
        raise ConfigError(f"{what}: expected a positive size, got {text!r}")
    return int(value)


@dataclass(frozen=True)
class ParsedURL:
    """A sink or source URL, split once."""

    raw: str
    scheme: str
    #: host (without brackets) for network schemes, else ""
    host: str
    port: int | None
    #: path for file/unix/ipc schemes and URLs without a host; else the URL path without "/"
    path: str
    options: Mapping[str, str] = field(default_factory=dict)

    @property
    def shown(self) -> str:
        """The URL as messages show it: credentials and secret options as `***`."""
        return redact_url(self.raw)

    @property
    def address(self) -> str:
        """`host:port` (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}" if self.port is not None else host


class Options:
    """The query options of a URL, taken one by one; leftovers are errors."""

    def __init__(self, url: str, options: Mapping[str, str]) -> None:
        self.url = url
        #: `url` as messages show it (`redact_url()`)
        self.shown = redact_url(url)
        self._options = dict(options)

    def __contains__(self, key: str) -> bool:
        return key in self._options

    def pop_str(
        self, key: str, default: str | None = None, *, allow_empty: bool = False
    ) -> str | None:
        """The option's text, or `default` when absent. An empty value (`?group=`, often a
        template variable left unset) is refused unless `allow_empty`: taken as the
        default, it would quietly change what the URL means."""
        value = self._options.pop(key, None)
        if value is None:
            return default
        if not value and not allow_empty:
            raise ConfigError(
                f"{self.shown}: option {key}: expected a value, got an empty one "
                "(leave the option out for its default)"
            )
        return value

    def pop_choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        value = self._options.pop(key, default)
        if value not in choices:
            raise ConfigError(
                f"{self.shown}: option {key}: expected one of {', '.join(choices)}, got {value!r}"
            )
        return value

    def pop_int(self, key: str, default: int | None = None, *, minimum: int = 0) -> int | None:
        value = self._options.pop(key, None)
        if value is None:
            return default
        try:
            n = int(value)
        except ValueError:
            raise ConfigError(
                f"{self.shown}: option {key}: expected an integer, got {value!r}"
            ) from None
        if n < minimum:
            raise ConfigError(f"{self.shown}: option {key}: expected >= {minimum}, got {n}")
        return n

    def pop_float(self, key: str, default: float | None = None) -> float | None:
        value = self._options.pop(key, None)
        if value is None:
            return default
        try:
            x = float(value)
        except ValueError:
            raise ConfigError(
                f"{self.shown}: option {key}: expected a number, got {value!r}"
            ) from None
        if not x >= 0:
            raise ConfigError(f"{self.shown}: option {key}: expected a number >= 0, got {value!r}")
        return x

    def pop_size(self, key: str, default: int) -> int:
        value = self._options.pop(key, None)
        return default if value is None else parse_size(value, f"{self.shown}: option {key}")

    def pop_bool(self, key: str, default: bool = False) -> bool:
        value = self._options.pop(key, None)
        if value is None:
            return default
        lowered = value.lower()
        if lowered in ("1", "true", "yes", "on", ""):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{self.shown}: option {key}: expected true or false, got {value!r}")

    def finish(self) -> None:
        """Raise for every option nobody took."""
        if self._options:
            names = ", ".join(sorted(self._options))
            raise ConfigError(f"{self.shown}: unknown option(s): {names}")


def parse_url(url: str) -> ParsedURL:
    """Split a sink/source URL. `-` and bare paths are files."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"URL: expected a non-empty string, got {url!r}")
    if url == "-":
        return ParsedURL(url, "file", "", None, "-")
    base, _, query = url.partition("?")
    try:
        options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError:
        raise ConfigError(
            f"{redact_url(url)}: malformed query string: expected NAME=VALUE pairs joined by &"
        ) from None
    m = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*):(.*)$", base)
    if m is None or (len(m.group(1)) == 1 and base[1:3] in (":\\", ":/")):  # a bare path
        return ParsedURL(url, "file", "", None, base, options)
    scheme = m.group(1).lower()
    rest = m.group(2)
    if scheme in ("file", "unix", "memory") or scheme.endswith("+ipc") or scheme == "ipc":
        path = rest[2:] if rest.startswith("//") else rest
        return ParsedURL(url, scheme, "", None, unquote(path), options)
    parts = urlsplit(base)
    try:
        port = parts.port
    except ValueError:
        given = parts.netloc.rpartition("@")[2].rpartition(":")[2]
        raise ConfigError(
            f"{redact_url(url)}: port: expected a number 0-65535, got {given!r}"
        ) from None
    host = parts.hostname or ""
    if "*" in parts.netloc:
        host = "*"
    # Without a host the path is a path (a plug-in's ``scheme:/var/kv.db``).
    path = parts.path.lstrip("/") if parts.netloc else parts.path
    return ParsedURL(url, scheme, host, port, unquote(path), options)


def make_codec(
    name: str, options: Options | None = None, *, registry: Registry | None = None
) -> Codec:
    """Build a codec by name (`json`, `msgpack`, or a plug-in's), taking its options."""
    opts = options or Options(name, {})
    what = "codec" if options is None else f"{options.shown}: option codec"
    factory = (registry or Registry.default()).factory("codec", name, what)
    return factory(opts)  # type: ignore[no-any-return]


def open_sink(
    url: str, *, codecs: dict[str, Codec] | None = None, registry: Registry | None = None
) -> Sink:
    """Build the sink a URL describes (not yet opened: enter it or add it to a scheduler).

    `codecs` lets several URLs share codec instances (so a batch is encoded
    once per distinct codec configuration). `registry` says which schemes
    exist (default: `Registry.default()`, kvstream's own and every installed
    plug-in's).
    """
    registry = registry or Registry.default()
    parsed = parse_url(url)
    opts = Options(url, parsed.options)
    policy = opts.pop_choice("policy", POLICIES, "block")
    common: dict[str, Any] = {
        "policy": policy,
        "max_bytes": opts.pop_size("max_bytes", DEFAULT_MAX_BYTES),
        "max_batches": opts.pop_int("max_batches", DEFAULT_MAX_BATCHES, minimum=1),
    }
    name = opts.pop_str("name")
    if name:
        common["name"] = name
    codec_name = opts.pop_str("codec")
    if codec_name is not None:
        codec = make_codec(codec_name, opts, registry=registry)
        if codecs is not None:
            codec = codecs.setdefault(repr(codec), codec)
        common["codec"] = codec
    factory = registry.factory("sink", parsed.scheme, parsed.shown)
    sink: Sink = factory(parsed, opts, common)
    opts.finish()
    return sink


def open_subscriber(url: str, *, registry: Registry | None = None, **kwargs: Any) -> Subscriber:
    """Build the subscriber a URL describes (`from_seq=`, `follow=` where supported)."""
    parsed = parse_url(url)
    opts = Options(url, parsed.options)
    factory = (registry or Registry.default()).factory("subscriber", parsed.scheme, parsed.shown)
    sub: Subscriber = factory(parsed, opts, kwargs)
    opts.finish()
    return sub


def subscribe(url: str, from_seq: FromSeq = None, **kwargs: Any) -> Subscriber:
    """A subscriber for any URL `open_subscriber()` knows, from `from_seq` on:

        async with kvstream.subscribe("tcp://127.0.0.1:5600", from_seq=0) as sub:
            async for item in sub:   # EventBatch or Gap, in order per origin
                ...

    `from_seq=None` means live batches only (for a file: from its start).
    Other keyword arguments go to the subscriber (`follow=True` for a file).
    """
    if from_seq is not None:
        kwargs["from_seq"] = from_seq
    return open_subscriber(url, **kwargs)
