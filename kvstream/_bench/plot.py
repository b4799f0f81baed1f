"""The plot: events/s against events per tick, kvstream and the baselines.

With matplotlib (the `bench` extra) any format matplotlib writes (`.png`,
`.svg`, ...); without it, a small self-contained SVG drawn here (a `.png`
path then gets `.svg` instead, and the caller is told).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

__all__ = ["plot_series", "series_of"]

Series = dict[str, list[tuple[int, float]]]

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


def series_of(report: dict[str, Any]) -> list[tuple[str, str, Series]]:
    """(title, x label, series) for each panel the report has data for."""
    panels: list[tuple[str, str, Series]] = []
    for result in report.get("results", []):
        series = (result.get("data") or {}).get("series")
        if not series:
            continue
        if result["name"] == "efficiency":
            named = {
                "JSON codec alone (baseline)": series.get("codec alone", []),
                "kvstream pipeline -> null sink": series.get("null sink", []),
                "kvstream pipeline -> file (tmpfs)": series.get("file", []),
            }
            panels.append(("Pipeline vs the codec alone", "events per tick", named))
        elif result["name"] == "zmq":
            panels.append(
                ("ZMQ: kvstream vs vLLM's publisher design", "events per batch", dict(series))
            )
    return panels


def plot_series(report: dict[str, Any], path: str) -> str:
    """Draw the report's series to `path`; returns the path actually written."""
    panels = series_of(report)
    if not panels:
        raise ValueError("the report has no events/s series to plot (run efficiency or zmq)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        out = path if path.endswith(".svg") else str(Path(path).with_suffix(".svg"))
        Path(out).write_text(_svg(panels, report))
        return out
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (title, xlabel, series) in zip(axes[0], panels, strict=True):
        for (name, points), color in zip(series.items(), _COLORS, strict=False):
            if not points:
                continue
            xs = [p[0] for p in points]
            ys = [p[1] for p in points]
            ax.plot(xs, ys, marker="o", label=name, color=color)
        ax.set_xscale("log", base=2)
        ticks = sorted({p[0] for points in series.values() for p in points})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("events/s")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.yaxis.set_major_formatter(
            matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1000:.0f}k")
        )
    m = report.get("machine", {})
    fig.suptitle(
        f"kvstream bench{' --quick' if report.get('quick') else ''}: {m.get('cpus')} CPUs, "
        f"Python {m.get('python')}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _svg(panels: list[tuple[str, str, Series]], report: dict[str, Any]) -> str:
    """A plain SVG line chart per panel (log2 x axis, linear y from 0)."""
    w, h, pad_l, pad_b, pad_t, pad_r = 460, 320, 70, 45, 30, 15
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * len(panels)}" height="{h}" '
        'font-family="sans-serif" font-size="11">'
    ]
    for k, (title, xlabel, series) in enumerate(panels):
        x0 = k * w
        points = [p for s in series.values() for p in s]
        if not points:
            continue
        xmin = math.log2(min(p[0] for p in points))
        xmax = math.log2(max(p[0] for p in points))
        ymax = max(p[1] for p in points) * 1.1
        xspan = (xmax - xmin) or 1.0

        def sx(x: float, xmin: float = xmin, xspan: float = xspan, x0: int = x0) -> float:
            return x0 + pad_l + (math.log2(x) - xmin) / xspan * (w - pad_l - pad_r)

        def sy(y: float, ymax: float = ymax) -> float:
            return h - pad_b - y / ymax * (h - pad_b - pad_t)

        parts.append(
            f'<text x="{x0 + w / 2}" y="16" text-anchor="middle" '
            f'font-weight="bold">{escape(title)}</text>'
        )
        parts.append(
            f'<line x1="{x0 + pad_l}" y1="{h - pad_b}" x2="{x0 + w - pad_r}" '
            f'y2="{h - pad_b}" stroke="black"/>'
        )
        parts.append(
            f'<line x1="{x0 + pad_l}" y1="{pad_t}" x2="{x0 + pad_l}" '
            f'y2="{h - pad_b}" stroke="black"/>'
        )
        for x in sorted({p[0] for p in points}):
            parts.append(
                f'<text x="{sx(x):.1f}" y="{h - pad_b + 14}" text-anchor="middle">{x}</text>'
            )
        for i in range(6):
            y = ymax * i / 5
            parts.append(
                f'<text x="{x0 + pad_l - 6}" y="{sy(y) + 4:.1f}" '
                f'text-anchor="end">{y / 1000:.0f}k</text>'
            )
            parts.append(
                f'<line x1="{x0 + pad_l}" y1="{sy(y):.1f}" x2="{x0 + w - pad_r}" '
                f'y2="{sy(y):.1f}" stroke="#ddd"/>'
            )
        parts.append(
            f'<text x="{x0 + pad_l + (w - pad_l - pad_r) / 2}" y="{h - 8}" '
            f'text-anchor="middle">{escape(xlabel)}</text>'
        )
        for j, ((name, pts), color) in enumerate(zip(series.items(), _COLORS, strict=False)):
            if not pts:
                continue
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
            parts.append(
                f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>'
            )
            for x, y in pts:
                parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>')
            ly = pad_t + 6 + 14 * j
            parts.append(
                f'<rect x="{x0 + pad_l + 10}" y="{ly - 8}" width="10" height="10" fill="{color}"/>'
            )
            parts.append(f'<text x="{x0 + pad_l + 25}" y="{ly + 1}">{escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)
