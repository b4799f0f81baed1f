"""Which URL scheme builds which sink or subscriber, and which name which codec.

A `Registry` maps names to factories. kvstream's own transports are
built in; an installed package adds its own through an entry point, with no
change to kvstream:

    # the plug-in's pyproject.toml
    [project.entry-points."kvstream.sinks"]
    sqlite = "kvstream_sqlite:sink_from_url"

    # kvstream_sqlite/__init__.py
    def sink_from_url(parsed: ParsedURL, opts: Options, common: dict[str, Any]) -> Sink:
        return SqliteSink(parsed.path, **common)

Then `kvstream demo --sink sqlite:/tmp/kv.db` (and `relay`, `tail`,
`bench`, `kvstream.config.open_sink()`) accept `sqlite:` URLs. The groups
are `kvstream.sinks` (factories `(ParsedURL, Options, common) -> Sink`, where
`common` holds `policy`, `max_bytes`, `max_batches` and maybe `codec` and
`name`, to pass to the sink's constructor), `kvstream.subscribers`
(`(ParsedURL, Options, kwargs) -> Subscriber`) and `kvstream.codecs`
(`(Options) -> Codec`). A factory takes the options it knows from `opts`
(`opts.pop_int("batch", 100)`, ...); any option left over is an error naming it.

Entry points are read when a registry is made and imported only when their name
is used, so one broken plug-in cannot break the others; a plug-in cannot take
over a built-in name (it is ignored, with a warning). A registry can also be
built by hand and passed in (`open_sink(url, registry=...)`), which is how
tests and embedders add a scheme without installing anything.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

from kvstream.errors import ConfigError, MissingDependencyError

if TYPE_CHECKING:
    from kvstream.codecs.base import Codec
    from kvstream.config import Options, ParsedURL
    from kvstream.consumers.base import Subscriber
    from kvstream.sinks.base import Sink

__all__ = [
    "ENTRY_POINT_GROUPS",
    "CodecFactory",
    "Registry",
    "SinkFactory",
    "SubscriberFactory",
]

log = logging.getLogger("kvstream.config")

SinkFactory: TypeAlias = "Callable[[ParsedURL, Options, dict[str, Any]], Sink]"
SubscriberFactory: TypeAlias = "Callable[[ParsedURL, Options, dict[str, Any]], Subscriber]"
CodecFactory: TypeAlias = "Callable[[Options], Codec]"

Kind = Literal["sink", "subscriber", "codec"]

#: The entry-point group of each kind of plug-in.
ENTRY_POINT_GROUPS: Final[Mapping[Kind, str]] = {
    "sink": "kvstream.sinks",
    "subscriber": "kvstream.subscribers",
    "codec": "kvstream.codecs",
}

_NAME = re.compile(r"^[a-z][a-z0-9+.-]*$")


@dataclass(frozen=True)
class _Entry:
    """A factory, or where to import it from (`"module:function"`) on first use."""

    target: str | Callable[..., Any]
    #: The extra that installs what the module needs (named when the import fails).
    extra: str | None = None
    #: Who provides it: "kvstream", a distribution's name, or "registered".
    provider: str = "kvstream"

    def load(self, kind: Kind, name: str) -> Callable[..., Any]:
        if callable(self.target):
            return self.target
        module_name, _, attribute = self.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except MissingDependencyError:
            raise  # the module already named the package and the extra
        except ImportError as exc:
            if self.extra is not None:
                raise MissingDependencyError.for_extra(
                    exc.name or module_name, self.extra, exc
                ) from exc
            if self.provider == "kvstream":
                raise
            raise ConfigError(
                f"{kind} {name!r} from {self.provider}: cannot import {module_name}: {exc}"
            ) from exc
        factory = getattr(module, attribute, None) if attribute else None
        if not callable(factory):
            raise ConfigError(
                f"{kind} {name!r} from {self.provider}: expected a callable at "
                f"{self.target!r}, found {type(factory).__name__}"
            )
        return factory  # type: ignore[no-any-return]


# name -> "module:function" (the factories in kvstream.config._sinks, .subscribers and .codecs),
# and the extra its transport needs. A transport is imported only when its name is used.
_BUILTIN_SINKS: Final = {
    "file": _Entry("kvstream.config._sinks:file_sink"),
    "memory": _Entry("kvstream.config._sinks:memory_sink"),
    "zmq+tcp": _Entry("kvstream.config._sinks:zmq_sink", "zmq"),
    "zmq+ipc": _Entry("kvstream.config._sinks:zmq_sink", "zmq"),
    "nats": _Entry("kvstream.config._sinks:nats_sink", "nats"),
    "redis": _Entry("kvstream.config._sinks:redis_sink", "redis"),
    "tcp": _Entry("kvstream.config._sinks:socket_sink"),
    "unix": _Entry("kvstream.config._sinks:socket_sink"),
}
_BUILTIN_SUBSCRIBERS: Final = {
    "file": _Entry("kvstream.config._subscribers:file_subscriber"),
    "zmq+tcp": _Entry("kvstream.config._subscribers:zmq_subscriber", "zmq"),
    "zmq+ipc": _Entry("kvstream.config._subscribers:zmq_subscriber", "zmq"),
    "nats": _Entry("kvstream.config._subscribers:nats_subscriber", "nats"),
    "redis": _Entry("kvstream.config._subscribers:redis_subscriber", "redis"),
    "tcp": _Entry("kvstream.config._subscribers:socket_subscriber"),
    "unix": _Entry("kvstream.config._subscribers:socket_subscriber"),
}
_BUILTIN_CODECS: Final = {
    "json": _Entry("kvstream.config._codecs:json_codec"),
    "msgpack": _Entry("kvstream.config._codecs:msgpack_codec"),
}

# Entry points found per sys.path (reading them costs ~10 ms; open_sink runs often).
_DISCOVERED: dict[tuple[str, ...], dict[Kind, dict[str, _Entry]]] = {}


class Registry:
    """Names to factories, for sinks (by URL scheme), subscribers and codecs.

    Immutable: `with_sink()` and friends return a new registry. Use
    `default()` (kvstream's own plus every installed plug-in) or
    `builtin()` (kvstream's own only).
    """

    __slots__ = ("_tables",)

    def __init__(
        self,
        *,
        sinks: Mapping[str, _Entry] | None = None,
        subscribers: Mapping[str, _Entry] | None = None,
        codecs: Mapping[str, _Entry] | None = None,
    ) -> None:
        self._tables: dict[Kind, dict[str, _Entry]] = {
            "sink": dict(sinks or {}),
            "subscriber": dict(subscribers or {}),
            "codec": dict(codecs or {}),
        }

    @classmethod
    def builtin(cls) -> Registry:
        """kvstream's own transports and codecs."""
        return cls(sinks=_BUILTIN_SINKS, subscribers=_BUILTIN_SUBSCRIBERS, codecs=_BUILTIN_CODECS)

    @classmethod
    def default(cls) -> Registry:
        """The built-ins plus the plug-ins installed where `sys.path` reaches."""
        registry = cls.builtin()
        for kind, found in _entry_points().items():
            table = registry._tables[kind]
            for name, entry in found.items():
                if name in table:
                    log.warning(
                        "%s %r from %s is ignored: %s already provides it",
                        kind,
                        name,
                        entry.provider,
                        table[name].provider,
                    )
                    continue
                table[name] = entry
        return registry

    def _with(self, kind: Kind, name: str, factory: Callable[..., Any]) -> Registry:
        if not isinstance(name, str) or _NAME.match(name) is None:
            raise ConfigError(
                f"{kind} name: expected lower-case letters, digits, '+', '.' or '-' "
                f"starting with a letter, got {name!r}"
            )
        if not callable(factory):
            raise ConfigError(
                f"{kind} {name!r}: expected a callable factory, got {type(factory).__name__}"
            )
        tables = {kind_: dict(table) for kind_, table in self._tables.items()}
        tables[kind][name] = _Entry(factory, provider="registered")
        new = Registry()
        new._tables = tables
        return new

    def with_sink(self, scheme: str, factory: SinkFactory) -> Registry:
        """A registry that also builds `scheme:` sinks with `factory`."""
        return self._with("sink", scheme, factory)

    def with_subscriber(self, scheme: str, factory: SubscriberFactory) -> Registry:
        """A registry that also reads `scheme:` URLs with `factory`."""
        return self._with("subscriber", scheme, factory)

    def with_codec(self, name: str, factory: CodecFactory) -> Registry:
        """A registry that also knows `codec=name`."""
        return self._with("codec", name, factory)

    def names(self, kind: Kind) -> tuple[str, ...]:
        """The names known for `kind`, sorted."""
        return tuple(sorted(self._tables[kind]))

    def provider(self, kind: Kind, name: str) -> str:
        """Who provides `name`: `kvstream`, a distribution, or `registered`."""
        return self._entry(kind, name, name).provider

    def factory(self, kind: Kind, name: str, what: str) -> Callable[..., Any]:
        """The factory for `name` (imported on first use); `what` prefixes errors."""
        return self._entry(kind, name, what).load(kind, name)

    def _entry(self, kind: Kind, name: str, what: str) -> _Entry:
        entry = self._tables[kind].get(name)
        if entry is None:
            word = "codec" if kind == "codec" else "scheme"
            known = ", ".join(self.names(kind))
            raise ConfigError(f"{what}: unknown {word} {name!r}; expected one of: {known}")
        return entry

    def __repr__(self) -> str:
        parts = (f"{kind}s={list(self.names(kind))}" for kind in self._tables)
        return f"Registry({', '.join(parts)})"


def _entry_points() -> dict[Kind, dict[str, _Entry]]:
    key = tuple(sys.path)
    found = _DISCOVERED.get(key)
    if found is None:
        found = _DISCOVERED[key] = {
            kind: _read_group(group) for kind, group in ENTRY_POINT_GROUPS.items()
        }
    return found


def _read_group(group: str) -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    points: Iterable[importlib.metadata.EntryPoint] = importlib.metadata.entry_points(group=group)
    for point in points:
        provider = point.dist.name if point.dist is not None else "an unnamed distribution"
        name = point.name.lower()
        if _NAME.match(name) is None:
            log.warning(
                "entry point %r of %s in %s is ignored: not a valid name",
                point.name,
                provider,
                group,
            )
            continue
        entries.setdefault(name, _Entry(point.value, provider=provider))
    return entries
