"""What a benchmark returns: rows for the table, targets checked, raw data for JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Result", "Row", "Target"]


@dataclass
class Row:
    """One line of the results table."""

    bench: str
    case: str
    param: str = ""
    events_per_s: float | None = None
    baseline: str = ""
    ratio: float | None = None
    cpu_us_per_event: float | None = None
    p50_us: float | None = None
    p99_us: float | None = None
    mb_per_s: float | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None and v != ""}


@dataclass
class Target:
    """One of the issue's targets, checked against a measured ratio or value."""

    name: str
    value: float
    limit: float
    #: ">=" or "<=".
    op: str
    unit: str = ""

    @property
    def met(self) -> bool:
        return self.value >= self.limit if self.op == ">=" else self.value <= self.limit

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.name,
            "value": round(self.value, 4),
            "op": self.op,
            "limit": self.limit,
            "unit": self.unit,
            "met": self.met,
        }


@dataclass
class Result:
    """Everything one benchmark measured."""

    name: str
    title: str
    rows: list[Row] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    #: Why the benchmark did not run (a sink not available, ...), or "".
    skipped: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "title": self.title}
        if self.skipped:
            out["skipped"] = self.skipped
        out["rows"] = [r.as_dict() for r in self.rows]
        out["targets"] = [t.as_dict() for t in self.targets]
        if self.data:
            out["data"] = self.data
        return out
