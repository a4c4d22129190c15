"""The pure parts of drawing a dashboard as a picture: Grafana's variables replaced by fixed values
(``substitute``), series names from a target's legend format (``legend``), and the dashboard's grid of panels as
slots of a 24-column subplot grid (``layout``).

Nothing here talks to Prometheus or draws; ``picture_prom`` fetches and ``picture_draw`` draws.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Panel = dict[str, Any]
GRID_COLUMNS = 24  # Grafana's grid is 24 units wide

# $name, ${name} or ${name:format}, [[name]] or [[name:format]]
_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def duration(seconds: float) -> str:
    """A PromQL duration of whole seconds, at least 1 s: ``90`` → ``90s``."""
    return f"{max(1, math.ceil(seconds))}s"


@dataclass(frozen=True)
class Window:
    """The time range a picture shows (Unix seconds), its query step and the window of ``$__rate_interval``."""

    start: float
    end: float
    step: float
    rate_window: str = "1m"

    @classmethod
    def over(cls, start: float, end: float, *, points: int = 300, rate_window: str = "1m") -> Window:
        """A window with about ``points`` points per series (a step of at least 1 s)."""
        return cls(start, end, max(1.0, round((end - start) / points)), rate_window)

    def builtins(self) -> dict[str, str]:
        """Grafana's built-in variables for this window."""
        span = max(1.0, self.end - self.start)
        return {
            "__rate_interval": self.rate_window,
            "__range": duration(span),
            "__range_s": str(math.ceil(span)),
            "__range_ms": str(math.ceil(span * 1000)),
            "__interval": duration(self.step),
            "__interval_ms": str(math.ceil(self.step * 1000)),
        }


def variable_values(dashboard: Mapping[str, Any]) -> dict[str, str]:
    """Each template variable of ``dashboard`` as one fixed value: "All" (its ``allValue``, else ``.*``) where
    the variable offers it, else its current value (several joined as a regex alternation)."""
    values: dict[str, str] = {}
    for variable in dashboard.get("templating", {}).get("list", []):
        name = variable.get("name")
        if not name:
            continue
        if variable.get("includeAll"):
            values[name] = variable.get("allValue") or ".*"
            continue
        current = variable.get("current", {}).get("value", ".*")
        if isinstance(current, list):
            current = "|".join(str(v) for v in current) or ".*"
        values[name] = str(current)
    return values


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """``expr`` with every variable ``values`` names replaced (``$x``, ``${x}``, ``${x:fmt}``, ``[[x]]``);
    variables it does not name stay as they are."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        return values.get(name, match.group(0))

    return _VARIABLE.sub(one, expr)


def legend(fmt: str, labels: Mapping[str, str], expr: str) -> str:
    """A series' name as Grafana shows it: ``{{label}}`` replaced by the label's value; with no format (or
    ``__auto``), the labels as ``{a="1"}``, or the expression for a series without labels."""
    if fmt and fmt != "__auto":
        return _LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), fmt)
    shown = {k: v for k, v in labels.items() if k != "__name__"}
    if not shown:
        return expr if len(expr) <= 60 else expr[:57] + "…"
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(shown.items())) + "}"


@dataclass(frozen=True)
class Slot:
    """Where a panel goes in the subplot grid: ``rows`` × ``cols`` grid cells from (``top``, ``left``)."""

    panel: Panel = field(hash=False, compare=False)
    top: int
    left: int
    rows: int
    cols: int

    @property
    def is_row(self) -> bool:
        return self.panel.get("type") == "row"

    @property
    def title(self) -> str:
        return str(self.panel.get("title", ""))


def _position(panel: Panel) -> tuple[int, int, int, int]:
    pos = panel.get("gridPos", {})
    y, x = int(pos.get("y", 0)), int(pos.get("x", 0))
    h, w = max(1, int(pos.get("h", 8))), int(pos.get("w", 12))
    x = min(max(0, x), GRID_COLUMNS - 1)
    return y, x, h, max(1, min(w, GRID_COLUMNS - x))


def layout(panels: Iterable[Panel]) -> list[Slot]:
    """The dashboard's panels (``dashboard["panels"]``) as grid slots, top to bottom.

    A collapsed row keeps its panels inside it (``row["panels"]``); they are drawn expanded, right under the row,
    and everything below moves down by their height. Empty grid lines between panels are dropped.
    """
    placed: list[tuple[int, int, int, int, Panel]] = []
    shift = 0
    for panel in sorted(panels, key=lambda p: (_position(p)[0], _position(p)[1])):
        y, x, h, w = _position(panel)
        placed.append((y + shift, x, h, w, panel))
        inner = (panel.get("panels") or []) if panel.get("type") == "row" else []
        if inner:
            first = min(_position(p)[0] for p in inner)
            below = y + shift + h
            for child in inner:
                cy, cx, ch, cw = _position(child)
                placed.append((below + cy - first, cx, ch, cw, child))
            shift += max(_position(p)[0] + _position(p)[2] for p in inner) - first
    placed.sort(key=lambda s: (s[0], s[1]))
    # Drop grid lines no panel covers (as Grafana floats panels up).
    used = sorted({line for y, _, h, _, _ in placed for line in range(y, y + h)})
    compact = {line: i for i, line in enumerate(used)}
    return [Slot(panel, compact[y], x, h, w) for y, x, h, w, panel in placed]


def grid_rows(slots: Iterable[Slot]) -> int:
    """The number of grid lines the slots take."""
    return max((s.top + s.rows for s in slots), default=0)
