"""The results table: plain text (and, with rich installed, a rich table)."""

from __future__ import annotations

import math
from typing import Any, TextIO

__all__ = ["COLUMNS", "format_number", "print_report", "render_markdown", "render_text"]

#: (key, heading) of every column, in order.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("case", "case"),
    ("param", "size"),
    ("events_per_s", "events/s"),
    ("ratio", "ratio"),
    ("baseline", "vs"),
    ("cpu_us_per_event", "CPU us/ev"),
    ("p50_us", "p50 us"),
    ("p99_us", "p99 us"),
    ("mb_per_s", "MB/s"),
    ("note", "note"),
)


def format_number(key: str, value: Any) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if key == "events_per_s":
        return f"{value:,.0f}"
    if key == "ratio":
        return f"{value:.2f}x"
    if key in ("cpu_us_per_event", "p50_us", "p99_us"):
        return f"{value:.2f}" if value < 100 else f"{value:,.0f}"
    if key == "mb_per_s":
        return f"{value:,.1f}"
    return str(value)


def _cells(row: dict[str, Any]) -> list[str]:
    return [format_number(key, row.get(key)) for key, _ in COLUMNS]


def _target_line(t: dict[str, Any]) -> str:
    mark = "MET " if t["met"] else "MISS"
    unit = f" {t['unit']}" if t.get("unit") else ""
    return (
        f"  [{mark}] {t['target']}: {t['value']:.3g}{unit} (target {t['op']} {t['limit']:g}{unit})"
    )


_RIGHT = frozenset({2, 3, 5, 6, 7, 8})  # numeric columns


def _line(cells: list[str], used: list[int], widths: dict[int, int], width: int) -> str:
    parts = [cells[i].rjust(widths[i]) if i in _RIGHT else cells[i].ljust(widths[i]) for i in used]
    return ("  ".join(parts)).rstrip()[:width]


def _on_loop(machine: dict[str, Any]) -> str:
    """For the report's first line: ", on uvloop" (say) unless it ran on asyncio's own loop."""
    loop = machine.get("event_loop")
    return f", on {loop}" if loop and loop != "asyncio" else ""


def render_text(report: dict[str, Any], width: int = 200) -> str:
    """The whole report as plain text: one table per benchmark, then the targets."""
    lines: list[str] = []
    m = report.get("machine", {})
    lines.append(
        f"kvstream bench{' --quick' if report.get('quick') else ''}: {m.get('cpus')} CPUs "
        f"({m.get('cpu_model')}), Python {m.get('python')}{_on_loop(m)}, load average "
        f"{m.get('load_average')} -> {m.get('load_average_end')}, {report.get('seconds')} s"
    )
    for result in report["results"]:
        lines.append("")
        lines.append(f"== {result['title']}")
        if result.get("skipped"):
            lines.append(f"   {result['skipped']}")
            continue
        rows = [_cells(r) for r in result["rows"]]
        headings = [h for _, h in COLUMNS]
        used = [i for i in range(len(COLUMNS)) if any(r[i] for r in rows)]
        widths = {i: max(len(headings[i]), *(len(r[i]) for r in rows)) for i in used}
        lines.append(_line(headings, used, widths, width))
        lines.append(
            _line(["-" * widths.get(i, 0) for i in range(len(COLUMNS))], used, widths, width)
        )
        lines.extend(_line(r, used, widths, width) for r in rows)
        for t in result.get("targets", []):
            lines.append(_target_line(t))
    targets = report.get("targets", [])
    if targets:
        met = sum(1 for t in targets if t["met"])
        lines.append("")
        lines.append(f"Targets: {met} of {len(targets)} met")
        lines.extend(_target_line(t) for t in targets)
    return "\n".join(lines)


def render_markdown(report: dict[str, Any], *, heading: str = "###") -> str:
    """The results as Markdown tables (for docs/benchmarks.md), one per benchmark."""
    out: list[str] = []
    for result in report["results"]:
        out.append(f"{heading} {result['title']}")
        out.append("")
        if result.get("skipped"):
            out.append(f"{result['skipped']}")
            out.append("")
            continue
        rows = [_cells(r) for r in result["rows"]]
        used = [i for i in range(len(COLUMNS)) if any(r[i] for r in rows)]
        out.append("| " + " | ".join(COLUMNS[i][1] for i in used) + " |")
        out.append("|" + "|".join("---:" if i in _RIGHT else "---" for i in used) + "|")
        for r in rows:
            out.append("| " + " | ".join(r[i].replace("|", "/") for i in used) + " |")
        out.append("")
        for t in result.get("targets", []):
            out.append(f"- {_target_line(t).strip()}")
        if result.get("targets"):
            out.append("")
    return "\n".join(out)


def print_report(report: dict[str, Any], out: TextIO, *, rich: bool = True) -> None:
    """Print `report` to `out`: a rich table when rich is installed and asked for."""
    if rich:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            rich = False
    console = Console(file=out) if rich else None
    if console is None or console.width < 160:  # too narrow for the table: plain text
        print(render_text(report), file=out)
        return
    m = report.get("machine", {})
    console.print(
        f"[bold]kvstream bench{' --quick' if report.get('quick') else ''}[/bold]: "
        f"{m.get('cpus')} CPUs ({m.get('cpu_model')}), Python {m.get('python')}{_on_loop(m)}, "
        "load average "
        f"{m.get('load_average')} -> {m.get('load_average_end')}, {report.get('seconds')} s"
    )
    for result in report["results"]:
        if result.get("skipped"):
            console.print(f"[bold]{result['title']}[/bold]: {result['skipped']}")
            continue
        rows = [_cells(r) for r in result["rows"]]
        used = [i for i in range(len(COLUMNS)) if any(r[i] for r in rows)]
        table = Table(title=result["title"], title_justify="left", show_lines=False)
        for i in used:
            table.add_column(
                COLUMNS[i][1], justify="right" if i in _RIGHT else "left", overflow="fold"
            )
        for r in rows:
            table.add_row(*(r[i] for i in used))
        console.print(table)
        for t in result.get("targets", []):
            style = "green" if t["met"] else "red"
            console.print(f"[{style}]{_target_line(t)}[/{style}]", highlight=False)
    targets = report.get("targets", [])
    if targets:
        met = sum(1 for t in targets if t["met"])
        console.print(f"\n[bold]Targets: {met} of {len(targets)} met[/bold]")
