"""The pure parts of the dashboard pictures (``infra/grafana/render_dashboards.py``): Grafana variables replaced by
fixed values, the grid layout as subplot slots, series names, heatmap buckets, units, which query each panel
runs, and drawing (an empty panel says "no data"; a whole dashboard becomes one PNG)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[3]
GRAFANA = ROOT / "infra" / "grafana"
if str(GRAFANA) not in sys.path:
    sys.path.insert(0, str(GRAFANA))

from chorus_dashboards.picture_draw import (  # noqa: E402
    draw_dashboard,
    draw_panel,
    format_value,
    heatmap_matrix,
    legend_lines,
)
from chorus_dashboards.picture_model import (  # noqa: E402
    GRID_COLUMNS,
    Window,
    grid_rows,
    layout,
    legend,
    substitute,
    variable_values,
)
from chorus_dashboards.picture_prom import PanelData, PromError, Series, fetch_panel  # noqa: E402

OVERVIEW = json.loads((GRAFANA / "dashboards" / "chorus-overview.json").read_text())
WORKERS = json.loads((GRAFANA / "dashboards" / "chorus-workers.json").read_text())
WINDOW = Window(start=1000.0, end=1150.0, step=5.0, rate_window="30s")


# --- variables ---------------------------------------------------------------------------------------------


def test_builtins_of_a_window() -> None:
    assert WINDOW.builtins() == {
        "__rate_interval": "30s",
        "__range": "150s",
        "__range_s": "150",
        "__range_ms": "150000",
        "__interval": "5s",
        "__interval_ms": "5000",
    }
    assert Window.over(0, 600, points=300).step == 2.0
    assert Window.over(0, 30, points=300).step == 1.0  # never under a second


def test_substitute_replaces_every_spelling_and_leaves_unknown_names() -> None:
    values = {**WINDOW.builtins(), "instance": ".*"}
    expr = (
        'rate(a{instance=~"$instance"}[$__rate_interval]) + increase(b[${__range}]) '
        '+ c{x=~"[[instance]]", y=~"${instance:regex}"} * $__range_s + $unknown'
    )
    assert substitute(expr, values) == (
        'rate(a{instance=~".*"}[30s]) + increase(b[150s]) + c{x=~".*", y=~".*"} * 150 + $unknown'
    )


def test_variable_values_take_all_where_offered_else_the_current_value() -> None:
    assert variable_values(WORKERS) == {"instance": ".*"}
    assert variable_values(OVERVIEW) == {}
    custom = {
        "templating": {
            "list": [
                {"name": "q", "current": {"value": ["a", "b"]}},
                {"name": "w", "current": {"value": "5m"}},
                {"name": "all", "includeAll": True, "allValue": None},
            ]
        }
    }
    assert variable_values(custom) == {"q": "a|b", "w": "5m", "all": ".*"}


def test_every_committed_query_is_left_without_a_grafana_variable() -> None:
    for dashboard in (OVERVIEW, WORKERS):
        values = {**variable_values(dashboard), **WINDOW.builtins()}
        for slot in layout(dashboard["panels"]):
            for target in slot.panel.get("targets", []):
                assert "$" not in substitute(target["expr"], values), target["expr"]


def test_legend_names_series_as_grafana_does() -> None:
    assert legend("accepted ({{role}})", {"role": "leader"}, "x") == "accepted (leader)"
    assert legend("{{ instance }} {{status}}", {"instance": "w:1"}, "x") == "w:1 "
    assert legend("__auto", {"__name__": "m", "b": "2", "a": "1"}, "x") == '{a="1", b="2"}'
    assert legend("", {}, "sum(rate(x[1m]))") == "sum(rate(x[1m]))"


# --- layout ------------------------------------------------------------------------------------------------


def _no_overlap(slots: list[Any]) -> None:
    cells: set[tuple[int, int]] = set()
    for s in slots:
        mine = {(r, c) for r in range(s.top, s.top + s.rows) for c in range(s.left, s.left + s.cols)}
        assert not cells & mine, s.title
        cells |= mine
        assert s.left >= 0 and s.left + s.cols <= GRID_COLUMNS


def test_layout_of_the_overview_keeps_grafanas_grid() -> None:
    slots = layout(OVERVIEW["panels"])
    assert len(slots) == len(OVERVIEW["panels"])
    rows = [s for s in slots if s.is_row]
    assert [s.title for s in rows][:3] == [
        "Service level (over the selected time range)",
        "Throughput",
        "Reuse",
    ]
    assert all((s.left, s.cols, s.rows) == (0, 24, 1) for s in rows)
    stats = [s for s in slots if s.panel["type"] == "stat"]
    assert [(s.top, s.left, s.rows, s.cols) for s in stats][:2] == [(1, 0, 4, 4), (1, 4, 4, 4)]
    assert grid_rows(slots) == max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in OVERVIEW["panels"])
    _no_overlap(slots)


def _panel(title: str, y: int, h: int = 4, x: int = 0, w: int = 12, **extra: Any) -> dict[str, Any]:
    return {"type": "timeseries", "title": title, "gridPos": {"x": x, "y": y, "w": w, "h": h}, **extra}


def test_layout_expands_collapsed_rows_and_drops_empty_lines() -> None:
    panels = [
        {**_panel("top row", 0, 1, w=24), "type": "row"},
        _panel("a", 1, x=0),
        _panel("b", 1, x=12),
        {
            **_panel("collapsed", 5, 1, w=24),
            "type": "row",
            "collapsed": True,
            "panels": [_panel("inner 1", 6, 3), _panel("inner 2", 9, 2, x=6, w=30)],
        },
        _panel("after a gap", 9, 2, w=24),  # y as Grafana stores it with the row collapsed, 3 lines of gap
    ]
    slots = {s.title: s for s in layout(panels)}
    assert list(slots) == ["top row", "a", "b", "collapsed", "inner 1", "inner 2", "after a gap"]
    assert (slots["inner 1"].top, slots["inner 1"].rows) == (6, 3)
    assert (slots["inner 2"].top, slots["inner 2"].left, slots["inner 2"].cols) == (9, 6, 18)  # clipped to 24
    assert slots["after a gap"].top == 11  # under the expanded panels, the empty lines dropped
    _no_overlap(list(slots.values()))


# --- data to pictures --------------------------------------------------------------------------------------


def test_heatmap_matrix_turns_cumulative_buckets_into_counts() -> None:
    def bucket(le: str, values: list[float]) -> Series:
        return Series(le, {"le": le}, [1.0, 2.0], values)

    late = Series("0.7", {"le": "0.7"}, [2.0], [2.0])  # no point at t=1
    times, bounds, rows = heatmap_matrix(
        [bucket("+Inf", [5, 9]), bucket("0.5", [1, 2]), late, bucket("0.9", [4, math.nan])]
    )
    assert times == [1.0, 2.0]
    assert bounds == ["0.5", "0.7", "0.9", "+Inf"]
    assert rows == [[1, 2], [0, 0], [4, 0], [1, 9]]  # missing and NaN as 0, never negative


@pytest.mark.parametrize(
    ("value", "unit", "decimals", "text"),
    [
        (0.4567, "percentunit", None, "45.7%"),
        (0.25, "s", None, "250 ms"),
        (12.5, "s", None, "12.5 s"),
        (3 * 1024**2, "bytes", None, "3 MiB"),
        (2.345, "suffix:×", 2, "2.35×"),
        (0.5, "reqps", None, "0.5 req/s"),
        (123456, "short", None, "123k"),
        (math.nan, "s", None, "NaN"),
    ],
)
def test_format_value(value: float, unit: str, decimals: int | None, text: str) -> None:
    assert format_value(value, unit, decimals) == text


def test_legend_lines_fit_the_width_and_stop_at_four() -> None:
    assert legend_lines([], 5.0) == (1, 0)
    columns, lines = legend_lines([f"series {i}" for i in range(40)], 5.0)
    assert columns >= 2 and lines == 4


def _texts(ax: Any) -> list[str]:
    return [t.get_text() for t in ax.texts]


@pytest.mark.parametrize("kind", ["timeseries", "stat", "heatmap", "table"])
def test_a_panel_with_no_data_says_so(kind: str) -> None:
    ax = Figure().add_subplot()
    draw_panel(ax, PanelData({"type": kind, "title": "t"}), WINDOW, (5.0, 2.0))
    assert _texts(ax) == ["no data"]


def test_a_panel_with_nan_only_says_so() -> None:
    ax = Figure().add_subplot()
    nan = Series("p95", {}, [1000.0, 1005.0], [math.nan, math.nan])
    data = PanelData({"type": "timeseries"}, [nan])
    assert not data.has_values
    draw_panel(ax, data, WINDOW, (5.0, 2.0))
    assert _texts(ax) == ["no data (NaN only)"]


def test_panels_with_data_draw_lines_a_number_an_image_and_text() -> None:
    times = [1000.0 + 5 * i for i in range(31)]
    line = Series("done", {"status": "done"}, times, [float(i) for i in range(31)])
    fig = Figure()
    ts = fig.add_subplot(2, 2, 1)
    draw_panel(ts, PanelData({"type": "timeseries"}, [line]), WINDOW, (5.0, 2.0))
    assert len(ts.lines) == 1 and ts.get_legend() is not None
    stat = fig.add_subplot(2, 2, 2)
    unit = {"fieldConfig": {"defaults": {"unit": "percentunit"}}}
    draw_panel(
        stat, PanelData({"type": "stat", **unit}, [Series("x", {}, [1150.0], [0.5])]), WINDOW, (4.0, 1.0)
    )
    assert _texts(stat) == ["50.0%"]
    heat = fig.add_subplot(2, 2, 3)
    buckets = [Series(le, {"le": le}, times, [1.0] * 31) for le in ("0.5", "+Inf")]
    draw_panel(heat, PanelData({"type": "heatmap"}, buckets), WINDOW, (5.0, 2.0))
    assert len(heat.images) == 1
    table = fig.add_subplot(2, 2, 4)
    draw_panel(table, PanelData({"type": "table"}, [line]), WINDOW, (5.0, 2.0))
    assert "done" in _texts(table)[0] and "30" in _texts(table)[0]


def test_a_query_error_is_shown_not_raised() -> None:
    ax = Figure().add_subplot()
    draw_panel(
        ax, PanelData({"type": "timeseries"}, errors=["[A] bad_data: parse error"]), WINDOW, (5.0, 2.0)
    )
    assert "parse error" in _texts(ax)[0]


class FakeProm:
    """Answers every query with one series and records what was asked."""

    def __init__(self, fail: str = "") -> None:
        self.asked: list[tuple[str, str]] = []
        self.fail = fail

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        self.asked.append(("instant", expr))
        return [{"metric": {"role": "leader"}, "value": [at, "2"]}]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        self.asked.append(("range", expr))
        if self.fail and self.fail in expr:
            raise PromError("bad_data: boom")
        return [{"metric": {}, "values": [[start, "1"], [end, "NaN"]]}]


def test_fetch_panel_runs_stat_panels_instant_and_others_over_the_range() -> None:
    prom = FakeProm()
    stat = next(p for p in OVERVIEW["panels"] if p["type"] == "stat")
    data = fetch_panel(prom, stat, WINDOW, {})
    assert prom.asked[0][0] == "instant" and "[150s]" in prom.asked[0][1]
    assert data.series[0].values == [2.0]
    prom = FakeProm(fail="chorus_requests_rejected_total")
    requests = next(p for p in OVERVIEW["panels"] if p.get("title") == "Requests")
    data = fetch_panel(prom, requests, WINDOW, {})
    assert {kind for kind, _ in prom.asked} == {"range"} and all("[30s]" in e for _, e in prom.asked)
    assert len(data.series) == len(requests["targets"]) - 1
    assert data.series[0].name == "received" and math.isnan(data.series[0].values[-1])
    assert data.errors == ["[C] bad_data: boom"]


def test_a_whole_dashboard_becomes_one_png(tmp_path: Path) -> None:
    slots = layout(WORKERS["panels"])
    cells = [(s, None if s.is_row else PanelData(s.panel)) for s in slots]
    out = draw_dashboard("Chorus · Workers", cells, WINDOW, tmp_path / "w.png", note="a note")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_live_runs_stream_mixes_reuse_exact_hits_and_invalid_messages() -> None:
    from chorus_dashboards.picture_run import RunPlan, build_shots

    for plan in (RunPlan(), RunPlan.quick()):
        shots = build_shots(plan, run_id="t")
        labels = [s.label for s in shots]
        assert labels[0] == "base f1"
        for kind in ("baseline", "new-seed", "paraphrase", "attribute"):
            assert sum(label.startswith(kind) for label in labels) == plan.families
        assert labels.index("exact hit (coalesced)") == labels.index("twin") + 1
        assert labels.index("exact hit (stored)") > labels.index("new-seed f1")
        expected = [(s.request.tenant, s.request.request_id) for s in shots if s.request and s.expect]
        assert len(set(expected)) == len(expected)
        duplicate = next(s for s in shots if s.label == "duplicate")
        assert duplicate.request is shots[0].request and not duplicate.expect
        raw = [s for s in shots if s.request is None]
        assert len(raw) == 4 and all(s.key for s in raw)
        assert json.loads(next(s.raw for s in raw if "blank" in s.label))["prompt"] == " "
