"""Prometheus metrics read from `statistics()` at scrape time.

`StatisticsCollector` is a prometheus-client *custom collector*: it keeps
references to the objects it reports on (a [`Scheduler`][kvstream.scheduler.Scheduler] with its
sources and sinks, a lone sink, a subscriber, an index ...) and calls their
`statistics()` only when Prometheus scrapes. Nothing is counted twice and
nothing costs anything per event.

`MetricsServer` serves the collector over HTTP on the event loop (no
thread), for `--metrics ADDR` on the long-running commands:

    collector = StatisticsCollector(scheduler)
    async with MetricsServer(collector, "127.0.0.1:9464") as server:
        ...  # GET http://127.0.0.1:9464/metrics

Names follow Prometheus conventions: `kvstream_` prefix, counters end in
`_total`, units in the name (`_bytes`). The sink, source and scheduler
records map field by field (see `SINK_FIELDS` and friends); the fields a
transport's record adds to the sink's (`SocketSinkStatistics`,
`ZmqSinkStatistics`, and the records nested in them) and the fields of any
other target are exported by one rule (`metric_for_field()`): integers are
counters unless the name says they are a level.

Needs the `metrics` extra (`pip install 'kvstream-events[metrics]'`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AsyncExitStack
from typing import Any, Final, Literal, NamedTuple

from kvstream._wire.http import HttpLimits, HttpServer, HttpServerStatistics, Request, Response
from kvstream.errors import ClosedError, ConfigError, MissingDependencyError, TransportError
from kvstream.lifetime import TaskOwner
from kvstream.scheduler import Scheduler
from kvstream.sinks.base import Sink

try:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        InfoMetricFamily,
        Metric,
    )
    from prometheus_client.exposition import choose_encoder
    from prometheus_client.gc_collector import GCCollector
    from prometheus_client.process_collector import ProcessCollector
    from prometheus_client.registry import CollectorRegistry
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError.for_extra("prometheus_client", "metrics", exc) from exc

__all__ = [
    "SCHEDULER_FIELDS",
    "SINK_FIELDS",
    "SOURCE_FIELDS",
    "HttpLimits",
    "HttpServerStatistics",
    "MetricSpec",
    "MetricsServer",
    "StatisticsCollector",
    "metric_for_field",
    "parse_address",
]

log = logging.getLogger("kvstream.metrics")

NAMESPACE: Final = "kvstream"


class MetricSpec(NamedTuple):
    """How one statistics field becomes a metric."""

    #: `counter` or `gauge`.
    type: Literal["counter", "gauge"]
    #: The name after `kvstream_<kind>_`; counters without the `_total`.
    name: str
    help: str


def _c(name: str, help: str) -> MetricSpec:
    return MetricSpec("counter", name, help)


def _g(name: str, help: str) -> MetricSpec:
    return MetricSpec("gauge", name, help)


#: `SchedulerStatistics` field -> metric (labels: `origin`).
SCHEDULER_FIELDS: Final[Mapping[str, MetricSpec]] = {
    "ticks": _c("ticks", "Ticks run (including ticks with nothing to seal)."),
    "batches_sealed": _c("batches_sealed", "Batches sealed, over every origin."),
    "events_sealed": _c("events_sealed", "Events sealed into batches."),
    "events_accepted": _c("events_accepted", "Events accepted (emit or a source's yield)."),
    "pending_events": _g("pending_events", "Events accepted and waiting for the next tick."),
}

#: `SourceStatistics` field -> metric (labels: `source`, `origin`, `kind`).
SOURCE_FIELDS: Final[Mapping[str, MetricSpec]] = {
    "events_accepted": _c("events_accepted", "Events this source handed to the scheduler."),
    "pending_events": _g("pending_events", "Events of this source waiting for the next tick."),
    "running": _g("running", "1 while the source is being pulled."),
}

#: `SinkStatistics` field -> metric (labels: `sink`).
SINK_FIELDS: Final[Mapping[str, MetricSpec]] = {
    "batches_in": _c("batches_in", "Batches offered to the sink, including those it dropped."),
    "batches_out": _c("batches_out", "Batches the sink delivered."),
    "events_out": _c("events_out", "Events the sink delivered."),
    "bytes_out": _c("sent_bytes", "Encoded bytes the sink delivered."),
    "batches_dropped": _c("batches_dropped", "Batches dropped by the overflow policy."),
    "events_dropped": _c("events_dropped", "Events dropped by the overflow policy."),
    "queued_batches": _g("queued_batches", "Batches waiting in the outbox."),
    "queued_bytes": _g("queued_bytes", "Bytes waiting in the outbox (estimated before encoding)."),
    "send_errors": _c("send_errors", "Failed send attempts (each is retried)."),
    "healthy": _g("healthy", "0 while sending fails and is being retried, else 1."),
    "undelivered_batches": _g("undelivered_batches", "Batches not delivered at close."),
    "undelivered_events": _g("undelivered_events", "Events not delivered at close."),
    "events_refused": _c("events_refused", "Events a strict codec left out of sent batches."),
}

# Statistics records count things: an integer field is a counter unless its
# name says it is a level. A level's first word (``queued_bytes``,
# ``pending_events``, ``ring_batches``) or last word (``subscribers``,
# ``block_size``, ``replays_active``) says so.
_LEVEL_FIRST: Final = frozenset(
    {
        "active",
        "connected",
        "current",
        "distinct",
        "held",
        "inflight",
        "lag",
        "last",
        "max",
        "memory",
        "min",
        "next",
        "open",
        "pending",
        "queued",
        "ring",
        "undelivered",
    }
)
_LEVEL_LAST: Final = frozenset(
    {
        "active",
        "blocks",
        "capacity",
        "connected",
        "depth",
        "entries",
        "healthy",
        "limit",
        "orphans",
        "origins",
        "running",
        "seq",
        "size",
        "subscribers",
        "subscriptions",
    }
)
_NAME_OK = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def metric_for_field(field: str, value: object = 0) -> MetricSpec:
    """How a field no table names is exported.

    A flag or a float is a gauge. An integer is a counter (`replay_hits`,
    `reconnects`, `gap_notices`, `blocks_stored`) unless its first word is
    a level word (`queued`, `pending`, `ring`, `lag`, `memory`,
    `next` ...) or its last word is one (`subscribers`, `active`,
    `size`, `blocks`, `origins` ...). A `bytes` word moves to the end
    as the unit: `bytes_in` -> `in_bytes_total`.
    """
    words = field.split("_")
    counter = (
        type(value) is int
        and words[0] not in _LEVEL_FIRST
        and words[-1] not in _LEVEL_LAST
        and field not in _LEVEL_LAST
    )
    if "bytes" in words and words[-1] != "bytes":
        words = [w for w in words if w != "bytes"] + ["bytes"]
    if counter and words[-1] == "total" and len(words) > 1:
        words = words[:-1]
    name = "_".join(words)
    what = field.replace("_", " ")
    if counter:
        return MetricSpec("counter", name, f"{what} (from statistics().{field}).")
    return MetricSpec("gauge", name, f"{what} (from statistics().{field}).")


def _is_record(value: object) -> bool:
    """A named tuple or a dataclass instance: a record with declared fields."""
    if isinstance(value, tuple):
        return isinstance(getattr(type(value), "_fields", None), tuple)
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _fields(record: object) -> dict[str, Any]:
    """A record's declared fields and values (a mapping's items)."""
    if isinstance(record, tuple) and _is_record(record):
        names: tuple[str, ...] = type(record)._fields  # type: ignore[attr-defined]
        return dict(zip(names, record, strict=True))
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    if isinstance(record, Mapping):
        return dict(record)
    raise ConfigError(
        f"statistics(): expected a named tuple, dataclass or mapping, got {type(record).__name__}"
    )


def _number(value: object) -> float | None:
    if type(value) is bool:
        return 1.0 if value else 0.0
    if type(value) is int or type(value) is float:
        return float(value)
    return None


class _Families:
    """Metric families of one scrape, made on first use, in first-use order."""

    def __init__(self) -> None:
        self._families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        self._labels: dict[str, tuple[str, ...]] = {}

    def add(
        self, kind: str, spec: MetricSpec, labels: Mapping[str, str], value: float, field: str
    ) -> None:
        name = f"{NAMESPACE}_{kind}_{spec.name}"
        if not _NAME_OK.match(name):
            log.debug("statistics field %r does not make a metric name; skipped", field)
            return
        key = f"{spec.type}:{name}"
        family = self._families.get(key)
        names = tuple(labels)
        if family is None:
            if spec.type == "counter":
                family = CounterMetricFamily(name, spec.help, labels=names)
            else:
                family = GaugeMetricFamily(name, spec.help, labels=names)
            self._families[key] = family
            self._labels[key] = names
        elif self._labels[key] != names:
            return  # same metric, other label set: not representable, keep the first
        family.add_metric([labels[n] for n in names], value)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


def _unique(name: str, seen: dict[str, int]) -> str:
    n = seen.get(name, 0) + 1
    seen[name] = n
    return name if n == 1 else f"{name}#{n}"


class StatisticsCollector:
    """A prometheus-client collector over kvstream objects' `statistics()`.

    Targets are a [`Scheduler`][kvstream.scheduler.Scheduler] (its own counters, each source
    and each sink), a [`Sink`][kvstream.sinks.base.Sink] on its own, or any object with a
    `statistics()` method returning a named tuple, a dataclass or a mapping,
    registered with a `kind` (`kvstream_<kind>_<field>`) and labels.
    """

    def __init__(self, *targets: object) -> None:
        self._targets: list[tuple[object, str | None, dict[str, str]]] = []
        for target in targets:
            self.add(target)

    def add(
        self, target: object, *, kind: str | None = None, labels: Mapping[str, str] | None = None
    ) -> None:
        """Report on `target` from the next scrape on.

        `kind` is required for objects that are neither a scheduler nor a sink
        (`"subscriber"`, `"index"`, ...); `labels` are added to each of its
        metrics (default: `name` from its `name` attribute when it has one).
        """
        if not callable(getattr(target, "statistics", None)):
            raise ConfigError(
                f"metrics target: expected an object with statistics(), got {target!r:.80}"
            )
        if kind is None and not isinstance(target, Scheduler | Sink):
            raise ConfigError(
                f"metrics target {target!r:.80}: kind: expected a name such as 'subscriber' "
                "for an object that is neither a Scheduler nor a Sink"
            )
        if kind is not None and not re.match(r"^[a-z][a-z0-9_]*$", kind):
            raise ConfigError(f"metrics kind: expected lowercase snake_case, got {kind!r}")
        extra = dict(labels or {})
        if kind is not None and not extra:
            name = getattr(target, "name", None)
            if isinstance(name, str):
                extra["name"] = name
        self._targets.append((target, kind, extra))

    def remove(self, target: object) -> None:
        """Stop reporting on `target`."""
        self._targets = [t for t in self._targets if t[0] is not target]

    def describe(self) -> Iterable[Metric]:
        """Nothing: the metric set depends on the targets at scrape time."""
        return ()

    def collect(self) -> Iterator[Metric]:
        """Read every target's `statistics()` once and yield the metrics."""
        families = _Families()
        sink_names: dict[str, int] = {}
        source_names: dict[str, int] = {}
        infos: list[tuple[str, str]] = []
        for target, kind, labels in self._targets:
            try:
                stats = target.statistics()  # type: ignore[attr-defined]
            except Exception as exc:  # a broken target must not break the scrape
                log.warning("metrics: %r.statistics() failed: %s", target, exc)
                continue
            if kind is not None:
                self._generic(families, kind, stats, labels, {})
            elif isinstance(target, Scheduler):
                infos.append((stats.origin, stats.epoch))
                self._scheduler(families, stats, labels, sink_names, source_names)
            elif isinstance(target, Sink):
                self._sink(families, stats, labels, sink_names)
        yield from families
        info = InfoMetricFamily(
            f"{NAMESPACE}_scheduler",
            "The origin and epoch of each scheduler (a new epoch means it restarted).",
            labels=("origin", "epoch"),
        )
        for origin, epoch in infos:
            info.add_metric([origin, epoch], {})
        if infos:
            yield info

    def _scheduler(
        self,
        families: _Families,
        stats: Any,
        extra: dict[str, str],
        sink_names: dict[str, int],
        source_names: dict[str, int],
    ) -> None:
        labels = {"origin": stats.origin, **extra}
        fields = _fields(stats)
        for field, spec in SCHEDULER_FIELDS.items():
            value = _number(fields.get(field))
            if value is not None:
                families.add("scheduler", spec, labels, value, field)
        seq_spec = _g("next_seq", "The next sequence number of each origin (batches sealed).")
        for origin, next_seq in stats.next_seq.items():
            families.add("origin", seq_spec, {"origin": origin, **extra}, float(next_seq), "")
        for source in stats.sources:
            src = _fields(source)
            src_labels = {
                "source": _unique(str(src.get("name")), source_names),
                "origin": str(src.get("origin")),
                **extra,
            }
            for field, spec in SOURCE_FIELDS.items():
                value = _number(src.get(field))
                if value is not None:
                    families.add("source", spec, src_labels, value, field)
            failed = _g("failed", "1 when the source raised and was closed.")
            families.add("source", failed, src_labels, float(src.get("error") is not None), "")
        for record in stats.sinks:
            self._sink(families, record, extra, sink_names)

    def _sink(
        self,
        families: _Families,
        stats: Any,
        extra: dict[str, str],
        names: dict[str, int],
    ) -> None:
        fields = _fields(stats)
        labels = {"sink": _unique(str(fields.pop("name", "sink")), names), **extra}
        fields.pop("policy", None)
        for value in list(fields.values()):
            if _is_record(value):  # a record nested in the sink's (the ZMQ snapshots')
                for field, nested in _fields(value).items():
                    fields.setdefault(field, nested)  # the sink's own fields win
        self._generic(families, "sink", fields, labels, SINK_FIELDS)

    def _generic(
        self,
        families: _Families,
        kind: str,
        stats: Any,
        labels: Mapping[str, str],
        table: Mapping[str, MetricSpec],
    ) -> None:
        for field, raw in _fields(stats).items():
            value = _number(raw)
            if value is None:
                continue
            spec = table.get(field) or metric_for_field(field, raw)
            families.add(kind, spec, labels, value, field)


def parse_address(text: str) -> tuple[str, int]:
    """`"127.0.0.1:9464"`, `"[::1]:9464"`, `":9464"` or `"9464"` -> (host, port).

    A missing host is 127.0.0.1: exposing metrics beyond the machine is a choice
    to make explicitly (`0.0.0.0:9464`).
    """
    value = text.strip()
    host, sep, port_text = value.rpartition(":")
    if not sep:
        host, port_text = "", value
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(
            f"metrics address: expected HOST:PORT (such as 127.0.0.1:9464), got {text!r}"
        )
    return host or "127.0.0.1", port


class MetricsServer(TaskOwner):
    """Serves `GET /metrics` for a collector, on the event loop.

    An async context manager; `port` is the bound port (useful with port
    0). Each scrape reads the targets' statistics once; OpenMetrics when the
    scraper asks for it. The HTTP layer is kvstream's one server
    (`HttpServer`), with its documented limits
    (`limits`) and counters (`statistics()`).
    """

    def __init__(
        self,
        collector: StatisticsCollector,
        address: str = "127.0.0.1:9464",
        *,
        process_metrics: bool = True,
        token: str | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        TaskOwner.__init__(self)
        self.host, self.requested_port = parse_address(address)
        self.collector = collector
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        if process_metrics:
            ProcessCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        self.scrapes = 0
        self._http = HttpServer(
            self._handle,
            host=self.host,
            port=self.requested_port,
            limits=limits or HttpLimits(max_connections=16, body_bytes=64 * 1024),
            token=token,
            name="metrics",
            token_hint="--metrics-token-env NAME or --metrics-token-file PATH",
            keep_alive=False,  # a scrape is one request; Prometheus reconnects each time
        )

    @property
    def port(self) -> int:
        return self._http.port

    @property
    def url(self) -> str:
        return f"{self._http.url}/metrics"

    def statistics(self) -> HttpServerStatistics:
        """The HTTP listener's counters (connections, refusals, timeouts)."""
        return self._http.statistics()

    def reentry_error(self) -> ClosedError:
        return self._http.reentry_error()

    async def open_lifetime(self, stack: AsyncExitStack) -> None:
        try:
            await stack.enter_async_context(self._http)
        except TransportError as exc:
            raise TransportError(
                f"metrics address {self.host}:{self.requested_port}: {exc}"
            ) from exc

    async def aclose(self) -> None:
        """Stop listening and drop open connections. Idempotent."""
        await self._http.aclose()

    async def _handle(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return Response(405, b"only GET and HEAD\n", headers=(("Allow", "GET, HEAD"),))
        if request.path not in ("/metrics", "/"):
            return Response(404, b"not found: try /metrics\n")
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        body = encoder(self.registry)
        self.scrapes += 1
        return Response(200, body, content_type=content_type)
