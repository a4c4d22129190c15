"""Grafana panel and dashboard JSON for the Chorus dashboards: queries, a grid layout, the panel kinds used.

Every query names the provisioned Prometheus data source by its fixed uid (``DATASOURCE_UID``, see
``provisioning/datasources/prometheus.yml``). Queries use Grafana's ``$__rate_interval`` for rates (``RATE``) and
``$__range`` for figures over the whole time range (``RANGE``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DATASOURCE_UID = "chorus-prometheus"
DATASOURCE = {"type": "prometheus", "uid": DATASOURCE_UID}
SCHEMA_VERSION = 39
TAGS = ["chorus"]
RATE = "[$__rate_interval]"
RANGE = "[$__range]"

Panel = dict[str, Any]


@dataclass
class Query:
    expr: str
    legend: str = ""
    instant: bool = False
    heatmap: bool = False


@dataclass
class Layout:
    """Places panels left to right in rows of 24 grid units; ``row`` starts a titled row."""

    panels: list[Panel] = field(default_factory=list)
    x: int = 0
    y: int = 0
    row_height: int = 0
    next_id: int = 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "type": "row",
                "id": self._id(),
                "title": title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
            }
        )
        self.y += 1

    def _newline(self) -> None:
        self.y += self.row_height
        self.x = 0
        self.row_height = 0

    def add(self, panel: Panel, w: int, h: int) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = self._id()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_height = max(self.row_height, h)


def _targets(queries: list[Query]) -> list[dict[str, Any]]:
    out = []
    for i, q in enumerate(queries):
        target: dict[str, Any] = {
            "datasource": DATASOURCE,
            "refId": chr(ord("A") + i),
            "expr": q.expr,
            "legendFormat": q.legend or "__auto",
            "range": not q.instant,
            "instant": q.instant,
        }
        if q.heatmap:
            target["format"] = "heatmap"
        out.append(target)
    return out


def timeseries(
    title: str,
    queries: list[Query],
    *,
    unit: str = "short",
    description: str = "",
    stack: bool = False,
    minimum: float | None = 0,
    maximum: float | None = None,
) -> Panel:
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 20 if stack else 0,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        },
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": _targets(queries),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(title: str, query: Query, *, unit: str, description: str = "", decimals: int | None = None) -> Panel:
    defaults: dict[str, Any] = {"unit": unit, "color": {"mode": "thresholds"}}
    if decimals is not None:
        defaults["decimals"] = decimals
    defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": "blue", "value": None}]}
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": _targets([Query(query.expr, query.legend, instant=True)]),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "none",
            "justifyMode": "auto",
            "textMode": "auto",
            "orientation": "auto",
        },
    }


def heatmap(title: str, expr: str, *, description: str = "") -> Panel:
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": _targets([Query(expr, "{{le}}", heatmap=True)]),
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {
            "calculate": False,
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
            "yAxis": {"axisPlacement": "left"},
            "rowsFrame": {"layout": "auto"},
            "tooltip": {"mode": "single", "yHistogram": False},
            "legend": {"show": True},
        },
    }


def quantiles(metric: str, selector: str, by: str = "", legend_prefix: str = "") -> list[Query]:
    group = f"{by}, le" if by else "le"
    label = f"{{{{{by}}}}} " if by else ""
    return [
        Query(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{selector}[$__rate_interval])))",
            f"{legend_prefix}{label}p{int(q * 100)}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


def dashboard(uid: str, title: str, description: str, layout: Layout, **extra: Any) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": TAGS,
        "timezone": "browser",
        "editable": False,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "annotations": {"list": []},
        "links": [
            {
                "type": "dashboards",
                "tags": TAGS,
                "asDropdown": False,
                "includeVars": False,
                "keepTime": True,
                "title": "Chorus",
            }
        ],
        "templating": {"list": extra.pop("variables", [])},
        "panels": layout.panels,
        **extra,
    }
