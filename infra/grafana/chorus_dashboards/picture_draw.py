"""Draws a dashboard's panels with matplotlib into one PNG, laid out on Grafana's grid (``draw_dashboard``):
timeseries as lines (stacked where the panel stacks), stat panels as a big number, heatmaps as an image of the
per-bucket counts, tables as text, rows as section headers; a panel whose queries returned nothing says "no data".

Only ``matplotlib.figure.Figure`` is used (no pyplot, no global backend).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator

from chorus_dashboards.picture_model import GRID_COLUMNS, Slot, Window, grid_rows, layout, variable_values
from chorus_dashboards.picture_prom import PanelData, Queries, Series, fetch_panel

# Grafana's dark theme and classic palette.
PAGE, PANEL, TEXT, MUTED, GRID, BIG = "#111217", "#181b1f", "#ccccdc", "#8e8e9a", "#2c3235", "#5794f2"
PALETTE = ("#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0", "#37872d")
WIDTH_IN = 22.0  # the picture's width; one grid column is WIDTH_IN / 24
LINE_IN = 0.3  # one grid line's height
TOP_IN = 0.7  # the page title
PAD_IN = 0.06  # between panels
TITLE_IN = 0.26  # a panel's title strip
LEGEND_LINE_IN = 0.16
DPI = 80


def format_value(value: float, unit: str, decimals: int | None = None) -> str:
    """``value`` in the panel's unit, as a stat panel or an axis shows it."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    if unit == "percentunit":
        return f"{value * 100:.{1 if decimals is None else decimals}f}%"
    if unit == "s":
        if value != 0 and abs(value) < 1:
            return f"{value * 1000:.{0 if decimals is None else decimals}f} ms"
        return f"{_number(value, decimals)} s"
    if unit == "bytes":
        size, prefix = value, ""
        for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
            if abs(size) < 1024 or prefix == "Ti":
                break
            size /= 1024
        return f"{_number(size, decimals)} {prefix}B"
    suffix = {"reqps": " req/s", "ops": " ops/s"}.get(unit, "")
    if unit.startswith("suffix:"):
        suffix = unit.removeprefix("suffix:")
    return _number(value, decimals) + suffix


def _number(value: float, decimals: int | None) -> str:
    if decimals is not None:
        return f"{value:.{decimals}f}"
    if value != 0 and abs(value) >= 10_000:
        for div, letter in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= div:
                return f"{value / div:.3g}{letter}"
    return f"{value:.3g}"


def _unit(data: PanelData) -> str:
    return str(data.panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short"))


def _defaults(data: PanelData) -> dict[str, Any]:
    defaults: dict[str, Any] = data.panel.get("fieldConfig", {}).get("defaults", {})
    return defaults


def _elapsed(window: Window) -> FuncFormatter:
    return FuncFormatter(lambda x, _: f"{int(x - window.start) // 60}:{int(x - window.start) % 60:02d}")


def _style(ax: Axes) -> None:
    ax.set_facecolor(PANEL)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.tick_params(colors=MUTED, labelsize=7, length=0)
    ax.grid(True, color=GRID, linewidth=0.6)


def draw_no_data(ax: Axes, message: str = "no data") -> None:
    ax.set_axis_off()
    ax.text(0.5, 0.5, message, ha="center", va="center", color=MUTED, fontsize=10, transform=ax.transAxes)


def draw_errors(ax: Axes, errors: Sequence[str]) -> None:
    ax.set_axis_off()
    text = "\n".join(e if len(e) <= 140 else e[:137] + "…" for e in errors[:3])
    ax.text(
        0.02,
        0.5,
        text,
        ha="left",
        va="center",
        color="#f2495c",
        fontsize=7,
        wrap=True,
        transform=ax.transAxes,
    )


def legend_lines(names: Sequence[str], width_in: float) -> tuple[int, int]:
    """(columns, lines) of a legend of ``names`` under a panel ``width_in`` wide, at most 4 lines."""
    longest = max((len(n) for n in names), default=0)
    columns = max(1, min(len(names), int(width_in / max(1.0, 0.3 + longest * 0.062))))
    return columns, min(4, math.ceil(len(names) / columns)) if names else 0


def draw_timeseries(ax: Axes, data: PanelData, window: Window, size_in: tuple[float, float]) -> None:
    _style(ax)
    defaults = _defaults(data)
    stacked = defaults.get("custom", {}).get("stacking", {}).get("mode", "none") == "normal"
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(data.series))]
    if stacked and data.series and all(s.times == data.series[0].times for s in data.series):
        ys = [[0.0 if math.isnan(v) else v for v in s.values] for s in data.series]
        ax.stackplot(data.series[0].times, ys, colors=colors, alpha=0.5, labels=[s.name for s in data.series])
    else:
        for series, color in zip(data.series, colors, strict=True):
            ax.plot(series.times, series.values, color=color, linewidth=1.2, label=series.name)
    ax.set_xlim(window.start, window.end)
    ax.xaxis.set_major_formatter(_elapsed(window))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 3, 5, 6, 10]))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]))
    unit = _unit(data)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: format_value(y, unit)))
    bottom, top = defaults.get("min"), defaults.get("max")
    if bottom is not None or top is not None:
        ax.set_ylim(bottom=bottom, top=top)
    names = [s.name for s in data.series]
    columns, lines = legend_lines(names, size_in[0])
    shown = columns * lines
    handles, labels = ax.get_legend_handles_labels()
    if len(labels) > shown:
        handles, labels = [*handles[: shown - 1], Line2D([], [], alpha=0)], labels[: shown - 1]
        labels.append(f"+ {len(names) - shown + 1} more")
    legend = ax.legend(
        handles,
        labels,
        loc="upper left",
        bbox_to_anchor=(0, -0.24 / max(0.1, size_in[1])),
        ncols=columns,
        fontsize=7,
        frameon=False,
        labelcolor=TEXT,
        handlelength=1.2,
        borderaxespad=0,
    )
    legend.set_in_layout(False)


def draw_stat(ax: Axes, data: PanelData, height_in: float) -> None:
    ax.set_axis_off()
    values = [v for s in data.series[:1] for v in s.values if not math.isnan(v)]
    raw = values[-1] if values else math.nan
    text = format_value(raw, _unit(data), _defaults(data).get("decimals"))
    size = max(10.0, min(30.0, height_in * 72 * 0.32))
    ax.text(
        0.5,
        0.45,
        text,
        ha="center",
        va="center",
        color=BIG,
        fontsize=size,
        weight="bold",
        transform=ax.transAxes,
    )


def heatmap_matrix(series: Sequence[Series]) -> tuple[list[float], list[str], list[list[float]]]:
    """Per-bucket counts from cumulative ``le`` buckets (as Grafana's heatmap format does): the times (every
    series' points, aligned), the bucket bounds, lowest first, and one row of counts per bucket (a missing or
    NaN point counts as 0, a negative difference too)."""
    ordered = sorted(series, key=lambda s: float(s.labels.get("le", "inf")))
    times = sorted({t for s in ordered for t in s.times})
    bounds = [s.labels.get("le", "?") for s in ordered]
    rows: list[list[float]] = []
    below = [0.0] * len(times)
    for s in ordered:
        at = dict(zip(s.times, s.values, strict=True))
        cumulative = [0.0 if math.isnan(v := at.get(t, math.nan)) else v for t in times]
        rows.append([max(0.0, c - b) for c, b in zip(cumulative, below, strict=True)])
        below = cumulative
    return times, bounds, rows


def draw_heatmap(ax: Axes, data: PanelData, window: Window, height_in: float = 2.0) -> None:
    _style(ax)
    ax.grid(False)
    times, bounds, rows = heatmap_matrix(data.series)
    half = window.step / 2
    cmap = colormaps["Oranges"].with_extremes(bad=(0, 0, 0, 0))  # empty cells show the panel
    ax.imshow(
        np.ma.masked_less_equal(np.array(rows), 0),
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        cmap=cmap,
        extent=(times[0] - half, times[-1] + half, -0.5, len(rows) - 0.5),
    )
    ax.set_xlim(window.start, window.end)
    ax.xaxis.set_major_formatter(_elapsed(window))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 3, 5, 6, 10]))
    every = max(1, math.ceil(len(bounds) / max(1, int(height_in / 0.13))))  # as many labels as fit
    ax.set_yticks(range(0, len(bounds), every), [f"≤ {b}" for b in bounds[::every]])


def draw_table(ax: Axes, data: PanelData) -> None:
    ax.set_axis_off()
    lines = [
        f"{s.name:<40.40}  {format_value(s.values[-1], _unit(data)) if s.values else ''}" for s in data.series
    ]
    more = len(lines) - 12
    text = "\n".join(lines[:12] + ([f"… {more} more"] if more > 0 else []))
    ax.text(
        0.02,
        0.95,
        text,
        ha="left",
        va="top",
        color=TEXT,
        fontsize=7,
        family="monospace",
        transform=ax.transAxes,
    )


def draw_panel(ax: Axes, data: PanelData, window: Window, size_in: tuple[float, float]) -> None:
    """One panel's content into ``ax`` (its title is drawn by the caller)."""
    if data.errors and not data.series:
        draw_errors(ax, data.errors)
    elif not data.series:
        draw_no_data(ax)
    elif not data.has_values:
        draw_no_data(ax, "no data (NaN only)")
    elif data.kind in ("stat", "gauge", "bargauge"):
        draw_stat(ax, data, size_in[1])
    elif data.kind == "heatmap":
        draw_heatmap(ax, data, window, size_in[1])
    elif data.kind == "table":
        draw_table(ax, data)
    else:
        draw_timeseries(ax, data, window, size_in)


Rect = tuple[float, float, float, float]  # left, bottom, width, height


def _inner_rect(data: PanelData, box: Rect) -> Rect:
    """The axes rectangle (inches, from the bottom left) inside a panel's box, leaving room for the title,
    tick labels and the legend."""
    left, bottom, width, height = box
    if data.kind in ("timeseries", "heatmap") and data.series:
        names = [s.name for s in data.series] if data.kind == "timeseries" else []
        legend_in = legend_lines(names, width - 0.7)[1] * LEGEND_LINE_IN
        return (left + 0.62, bottom + 0.28 + legend_in, width - 0.75, height - TITLE_IN - 0.36 - legend_in)
    return (left + 0.05, bottom + 0.05, width - 0.1, height - TITLE_IN - 0.05)


class _Page:
    """A figure measured in inches from its bottom left, with Grafana's grid on it."""

    def __init__(self, grid_lines: int) -> None:
        self.height = TOP_IN + grid_lines * LINE_IN + PAD_IN
        self.fig = Figure(figsize=(WIDTH_IN, self.height), dpi=DPI, facecolor=PAGE)
        self.col_in = (WIDTH_IN - PAD_IN) / GRID_COLUMNS

    def axes(self, rect: Rect) -> Axes:
        x, y, w, h = rect
        return self.fig.add_axes(
            (x / WIDTH_IN, y / self.height, max(0.001, w) / WIDTH_IN, max(0.001, h) / self.height)
        )

    def box(self, slot: Slot) -> Rect:
        top = self.height - TOP_IN - slot.top * LINE_IN
        return (
            PAD_IN + slot.left * self.col_in,
            top - slot.rows * LINE_IN + PAD_IN,
            slot.cols * self.col_in - PAD_IN,
            slot.rows * LINE_IN - PAD_IN,
        )

    def header(self, title: str, note: str) -> None:
        x = PAD_IN / WIDTH_IN + 0.003
        self.fig.text(x, 1 - 0.3 / self.height, title, color=TEXT, fontsize=16, weight="bold", va="center")
        if note:
            self.fig.text(x, 1 - 0.55 / self.height, note, color=MUTED, fontsize=9, va="center")

    def row(self, slot: Slot) -> None:
        ax = self.axes(self.box(slot))
        ax.set_axis_off()
        ax.text(
            0.002,
            0.4,
            slot.title,
            color=TEXT,
            fontsize=12,
            weight="bold",
            va="center",
            transform=ax.transAxes,
        )
        ax.axhline(0.02, color=GRID, linewidth=1)

    def panel(self, slot: Slot, data: PanelData, window: Window) -> Axes:
        box = self.box(slot)
        frame = self.axes(box)
        frame.set_facecolor(PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for spine in frame.spines.values():
            spine.set_color(GRID)
        title_at = (0.1 / box[2], 1 - 0.15 / box[3])
        frame.text(
            *title_at,
            slot.title,
            transform=frame.transAxes,
            color=TEXT,
            fontsize=9,
            weight="bold",
            va="center",
        )
        rect = _inner_rect(data, box)
        ax = self.axes(rect)
        draw_panel(ax, data, window, (rect[2], rect[3]))
        return ax


def draw_dashboard(
    title: str, cells: Sequence[tuple[Slot, PanelData | None]], window: Window, out: Path, note: str = ""
) -> Path:
    """One PNG of the dashboard: every slot's panel (``None`` for a row header) on the grid, the title and
    ``note`` on top; returns ``out``."""
    page = _Page(grid_rows(slot for slot, _ in cells))
    page.header(title, note)
    for slot, data in cells:
        if slot.is_row or data is None:
            page.row(slot)
        else:
            page.panel(slot, data, window)
    out.parent.mkdir(parents=True, exist_ok=True)
    page.fig.savefig(out, facecolor=PAGE)
    return out


@dataclass(frozen=True)
class Rendered:
    """What one picture holds: its path, and the titles of the panels with data (a number somewhere), without (no
    series, or NaN only), and the errors of failed queries."""

    path: Path
    panels: int
    with_data: list[str]
    no_data: list[str]
    errors: list[str]


def render_dashboard(
    prom: Queries, dashboard: Mapping[str, Any], window: Window, out: Path, note: str = ""
) -> Rendered:
    """Evaluate every panel of ``dashboard`` (Grafana's JSON) over ``window`` and draw it into ``out``."""
    variables = variable_values(dashboard)
    cells: list[tuple[Slot, PanelData | None]] = []
    for slot in layout(dashboard.get("panels", [])):
        cells.append((slot, None if slot.is_row else fetch_panel(prom, slot.panel, window, variables)))
    draw_dashboard(str(dashboard.get("title", out.stem)), cells, window, out, note)
    panels = [(slot.title, data) for slot, data in cells if data is not None]
    return Rendered(
        path=out,
        panels=len(panels),
        with_data=[t for t, d in panels if d.has_values],
        no_data=[t for t, d in panels if not d.has_values and not d.errors],
        errors=[f"{t}: {e}" for t, d in panels for e in d.errors],
    )
