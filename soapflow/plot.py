"""Charts as PNG files, drawn with matplotlib: a line chart (a search's convergence), a grouped bar chart
(`compare`) and a scatter of predicted against measured times (`validate`).

matplotlib is the optional extra `plot` (``pip install 'soapflow[plot]'``). It is imported only here and
only when a chart is asked for; `require_matplotlib` is what a command calls before any work when it has a
plot to write, so that a missing matplotlib is one line naming the extra rather than a traceback after a
long run. Figures are drawn off screen on the Agg canvas (no display, no pyplot and its global state).

Imports nothing from the rest of the project.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

INSTALL_HINT = "pip install 'soapflow[plot]'"
SIZE_IN = (7.2, 4.2)  # width, height in inches; at DPI, 864 x 504 pixels
DPI = 120


class PlotUnavailable(ValueError):
    """A plot was asked for and matplotlib is not installed."""


def require_matplotlib() -> None:
    """Raise `PlotUnavailable` (one line, naming the extra to install) if matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from None


def _figure(size_in: tuple[float, float] = SIZE_IN) -> tuple[Any, Any]:
    """A figure on an Agg canvas and its one axes."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size_in, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.grid(True, color="0.9")
    ax.set_axisbelow(True)
    return fig, ax


def _save(fig: Any, path: str | os.PathLike) -> None:
    fig.savefig(os.fspath(path), format="png", dpi=DPI)


def line_chart(path: str | os.PathLike, series: Sequence[tuple[str, Sequence[float], Sequence[float]]], *,
               title: str, x_label: str, y_label: str, x_end: float | None = None,
               references: Sequence[tuple[str, float]] = ()) -> None:
    """Write a PNG of (label, xs, ys) series, each drawn as a staircase held to `x_end` (None: the largest
    x; a running best) with its points marked, and `references` (label, y) as dashed horizontal lines; the
    y axis starts at 0."""
    xs = [x for _, sx, _ in series for x in sx]
    if not xs:
        raise ValueError("a line chart needs at least one point")
    end = max(xs) if x_end is None else max(x_end, max(xs))
    fig, ax = _figure()
    for label, sx, sy in series:
        (line,) = ax.step([*sx, end], [*sy, sy[-1]], where="post", linewidth=2, label=label)
        ax.plot(sx, sy, "o", color=line.get_color(), markersize=4)
    for (label, y), style in zip(references, ("--", ":", "-.", (0, (5, 1, 1, 1))), strict=False):
        ax.axhline(y, linestyle=style, linewidth=1.5, color="0.4", label=f"{label} ({y:.4g})")
    ax.set_xlim(min(0.0, min(xs)), end)
    ax.set_ylim(0, 1.08 * max([y for _, _, sy in series for y in sy] + [y for _, y in references]))
    ax.set(title=title, xlabel=x_label, ylabel=y_label)
    ax.legend(loc="lower left")
    _save(fig, path)


def bar_chart(path: str | os.PathLike, categories: Sequence[str],
              groups: Sequence[tuple[str, Sequence[float | None]]], *, title: str, y_label: str) -> None:
    """Write a PNG grouped bar chart: one group of bars per category, one bar per (label, values) entry,
    each bar labelled with its value; a None value leaves its bar out."""
    if not any(v is not None for _, vs in groups for v in vs):
        raise ValueError("a bar chart needs at least one value")
    fig, ax = _figure((max(SIZE_IN[0], 1.1 * len(categories)), SIZE_IN[1]))
    width = 0.8 / len(groups)
    for i, (label, values) in enumerate(groups):
        at = [k for k, v in enumerate(values) if v is not None]
        bars = ax.bar([k - 0.4 + width * (i + 0.5) for k in at], [values[k] for k in at], width, label=label)
        ax.bar_label(bars, fmt="{:.4g}".format, padding=2, fontsize=8)
    ax.set_xticks(range(len(categories)), categories)
    ax.grid(False, axis="x")
    ax.margins(y=0.12)
    ax.set(title=title, ylabel=y_label)
    if len(groups) > 1:
        ax.legend()
    _save(fig, path)


def scatter_chart(path: str | os.PathLike, points: Sequence[tuple[str, float, float]], *, title: str,
                  x_label: str, y_label: str, note: str = "", band: float = 0.1) -> None:
    """Write a PNG scatter of (group, x, y) points, one colour per group, on equal axes from 0 with the
    line y = x and a shaded band of ±`band` relative error around it; `note` goes in the top left corner."""
    if not points:
        raise ValueError("a scatter plot needs at least one point")
    top = 1.08 * max(max(x, y) for _, x, y in points)
    top = top if top > 0 and math.isfinite(top) else 1.0
    fig, ax = _figure((6.0, 5.6))
    ax.plot([0, top], [0, top], color="0.4", linewidth=1, label="y = x")
    ax.fill_between([0, top], [0, top * (1 - band)], [0, top * (1 + band)], color="0.85", linewidth=0,
                    label=f"±{band:.0%}")
    for group in dict.fromkeys(g for g, _, _ in points):
        mine = [(x, y) for g, x, y in points if g == group]
        ax.scatter([x for x, _ in mine], [y for _, y in mine], s=28, label=group, zorder=3)
    ax.set(xlim=(0, top), ylim=(0, top), title=title, xlabel=x_label, ylabel=y_label)
    ax.set_aspect("equal")
    if note:
        ax.text(0.03, 0.97, note, transform=ax.transAxes, va="top", fontsize=9)
    ax.legend(loc="lower right")
    _save(fig, path)


__all__ = ["INSTALL_HINT", "PlotUnavailable", "bar_chart", "line_chart", "require_matplotlib", "scatter_chart"]
