"""Builds the Grafana dashboards that docker-compose provisions (``infra/grafana/dashboards/*.json``).

    python infra/grafana/build_dashboards.py           # rewrite the JSON files
    python infra/grafana/build_dashboards.py --check   # exit 1 if the committed files differ from this script

The JSON is what Grafana reads; this script is where it is edited. Every query names the provisioned Prometheus
data source by its fixed uid (``DATASOURCE_UID``, see ``provisioning/datasources/prometheus.yml``). Queries use
Grafana's ``$__rate_interval`` for rates and ``$__range`` for figures over the whole time range.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATASOURCE_UID = "chorus-prometheus"
DATASOURCE = {"type": "prometheus", "uid": DATASOURCE_UID}
OUT_DIR = Path(__file__).resolve().parent / "dashboards"
SCHEMA_VERSION = 39
TAGS = ["chorus"]

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


# ------------------------------------------------------------------------------------------------ overview

RATE = "[$__rate_interval]"
RANGE = "[$__range]"


def overview() -> dict[str, Any]:
    lay = Layout()
    lay.row("Service level (over the selected time range)")
    lay.add(
        stat(
            "Requests accepted",
            Query("sum(rate(chorus_requests_accepted_total[$__range]))"),
            unit="reqps",
            description="Requests whose work order reached the broker, per second, averaged over the range.",
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "Donor hit ratio",
            Query(
                'sum(increase(chorus_donor_lookups_total{outcome="hit"}[$__range]))'
                " / sum(increase(chorus_donor_lookups_total[$__range]))"
            ),
            unit="percentunit",
            description="Donor lookups that found a finished donor or a running leader to follow.",
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "Estimated speedup",
            Query(
                "sum(increase(chorus_worker_steps_requested_total[$__range]))"
                " / sum(increase(chorus_worker_token_steps_computed_total[$__range]))"
            ),
            unit="suffix:×",
            decimals=2,
            description="Denoising token-steps requested / computed (decode and I/O are not in it).",
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "Token-steps saved",
            Query("sum(increase(chorus_donor_steps_saved_total[$__range]))"),
            unit="short",
            decimals=1,
            description="Steps × skipped-token fraction of every request that used its donor.",
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "Error ratio",
            Query(
                '(sum(increase(chorus_worker_requests_total{status="failed"}[$__range]))'
                ' + sum(increase(chorus_requests_rejected_total{reason="scheduling_failed"}[$__range])))'
                " / (sum(increase(chorus_worker_requests_total[$__range]))"
                ' + sum(increase(chorus_requests_rejected_total{reason="scheduling_failed"}[$__range])))'
            ),
            unit="percentunit",
            description="Failed results and requests dead-lettered after repeated scheduling failures.",
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "p95 end to end",
            Query(
                "histogram_quantile(0.95, sum by (le) "
                '(increase(chorus_request_duration_seconds_bucket{status="done"}[$__range])))'
            ),
            unit="s",
            description="Submission to result, finished requests.",
        ),
        4,
        4,
    )

    lay.row("Throughput")
    lay.add(
        timeseries(
            "Requests",
            [
                Query(f"sum(rate(chorus_requests_received_total{RATE}))", "received"),
                Query(f"sum by (role) (rate(chorus_requests_accepted_total{RATE}))", "accepted ({{role}})"),
                Query(
                    f"sum by (reason) (rate(chorus_requests_rejected_total{RATE}))", "rejected ({{reason}})"
                ),
                Query(f"sum(rate(chorus_requests_duplicate_total{RATE}))", "duplicate"),
            ],
            unit="reqps",
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Results",
            [Query(f"sum by (status) (rate(chorus_worker_requests_total{RATE}))", "{{status}}")],
            unit="reqps",
            stack=True,
        ),
        12,
        8,
    )

    lay.row("Reuse")
    lay.add(
        timeseries(
            "Donor lookups by outcome",
            [Query(f"sum by (outcome) (rate(chorus_donor_lookups_total{RATE}))", "{{outcome}}")],
            unit="reqps",
            stack=True,
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Hit ratio",
            [
                Query(
                    f'sum(rate(chorus_donor_lookups_total{{outcome="hit"}}{RATE}))'
                    f" / sum(rate(chorus_donor_lookups_total{RATE}))",
                    "planned (scheduler)",
                ),
                Query(
                    f'sum(rate(chorus_worker_requests_total{{status="done",reuse="donor"}}{RATE}))'
                    f' / sum(rate(chorus_worker_requests_total{{status="done"}}{RATE}))',
                    "donor used (workers)",
                ),
            ],
            unit="percentunit",
            maximum=1,
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Estimated speedup",
            [
                Query(
                    f"sum(rate(chorus_worker_steps_requested_total{RATE}))"
                    f" / sum(rate(chorus_worker_token_steps_computed_total{RATE}))",
                    "requested / computed token-steps",
                )
            ],
            unit="suffix:×",
            minimum=1,
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Steps per second",
            [
                Query(f"sum(rate(chorus_worker_steps_requested_total{RATE}))", "requested"),
                Query(f"sum(rate(chorus_worker_steps_computed_total{RATE}))", "computed (passes)"),
                Query(f"sum(rate(chorus_worker_token_steps_computed_total{RATE}))", "computed (token-steps)"),
                Query(f"sum(rate(chorus_donor_steps_saved_total{RATE}))", "saved by donors"),
            ],
        ),
        8,
        8,
    )
    lay.add(
        heatmap(
            "Similarity of chosen donors",
            f"sum by (le) (increase(chorus_donor_similarity_bucket{RATE}))",
            description="Prompt-embedding cosine similarity of each donor or leader a request was given.",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Group roles",
            [Query(f"sum by (role) (rate(chorus_requests_accepted_total{RATE}))", "{{role}}")],
            unit="reqps",
            stack=True,
            description="leader: ran in full for a group; follower: took a running leader's steps; solo: alone "
            "(with or without a finished donor).",
        ),
        8,
        8,
    )

    lay.row("Latency")
    lay.add(
        timeseries(
            "End to end",
            quantiles("chorus_request_duration_seconds", '{status="done"}'),
            unit="s",
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Per phase (p95)",
            [
                Query(
                    "histogram_quantile(0.95, sum by (phase, le) "
                    f"(rate(chorus_worker_phase_duration_seconds_bucket{RATE})))",
                    "{{phase}}",
                ),
                Query(
                    "histogram_quantile(0.95, sum by (phase, le) "
                    f"(rate(chorus_scheduler_phase_duration_seconds_bucket{RATE})))",
                    "scheduler {{phase}}",
                ),
            ],
            unit="s",
            description="Worker: queue wait, donor fetch, denoise, decode, upload. Scheduler: embed (per poll), "
            "search, dispatch.",
        ),
        12,
        8,
    )

    lay.row("Errors")
    lay.add(
        timeseries(
            "Error ratio",
            [
                Query(
                    f'(sum(rate(chorus_worker_requests_total{{status="failed"}}{RATE}))'
                    f' + sum(rate(chorus_requests_rejected_total{{reason="scheduling_failed"}}{RATE})))'
                    f" / (sum(rate(chorus_worker_requests_total{RATE}))"
                    f' + sum(rate(chorus_requests_rejected_total{{reason="scheduling_failed"}}{RATE})))',
                    "error ratio",
                )
            ],
            unit="percentunit",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Failed results by code",
            [Query(f"sum by (code) (rate(chorus_worker_failures_total{RATE}))", "{{code}}")],
            unit="reqps",
            stack=True,
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Dead-lettered and retried",
            [
                Query(
                    f"sum by (reason) (rate(chorus_requests_dead_lettered_total{RATE}))",
                    "dead-lettered ({{reason}})",
                ),
                Query(f"sum by (cause) (rate(chorus_scheduler_retries_total{RATE}))", "retried ({{cause}})"),
                Query(f"sum(rate(chorus_worker_result_publish_errors_total{RATE}))", "result not published"),
            ],
            unit="reqps",
        ),
        8,
        8,
    )

    lay.row("Donor cache")
    lay.add(
        timeseries(
            "Size and budget",
            [
                Query("max(chorus_cache_size_bytes)", "trajectories"),
                Query("max(chorus_cache_budget_bytes)", "budget"),
            ],
            unit="bytes",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Index entries",
            [Query("max by (status) (chorus_cache_entries)", "{{status}}")],
            description="ready: finished donors; running: group leaders still computing.",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Evictions",
            [
                Query(f"sum by (reason) (rate(chorus_cache_evictions_total{RATE}))", "{{reason}}"),
                Query(f"sum(rate(chorus_donors_indexed_total{RATE}))", "indexed"),
            ],
            unit="ops",
        ),
        8,
        8,
    )
    return dashboard(
        "chorus-overview",
        "Chorus · Overview",
        "Throughput, reuse (hit ratio, speedup), latency, errors and the donor cache.",
        lay,
    )


# ------------------------------------------------------------------------------------------------- workers

INSTANCE = '{instance=~"$instance"}'


def _sel(extra: str = "") -> str:
    return f'{{instance=~"$instance"{"," + extra if extra else ""}}}'


def workers() -> dict[str, Any]:
    lay = Layout()
    lay.row("Load")
    lay.add(
        timeseries(
            "Busy slots",
            [Query(f"sum by (instance) (chorus_worker_busy_slots{INSTANCE})", "{{instance}}")],
            description="Pool processes running an order now, per worker container.",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Utilisation",
            [
                Query(
                    f"sum by (instance) (chorus_worker_busy_slots{INSTANCE})"
                    f" / sum by (instance) (chorus_worker_pool_slots{INSTANCE})",
                    "{{instance}}",
                )
            ],
            unit="percentunit",
            maximum=1,
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Results per worker",
            [
                Query(
                    f"sum by (instance, status) (rate(chorus_worker_requests_total{INSTANCE}{RATE}))",
                    "{{instance}} {{status}}",
                )
            ],
            unit="reqps",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Pool slots",
            [Query(f"sum by (instance) (chorus_worker_pool_slots{INSTANCE})", "{{instance}}")],
            description="Pool processes taking orders, per worker container (idle = pool − busy).",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Celery queue depth",
            [Query("max by (queue) (chorus_celery_queue_length)", "{{queue}}")],
            description="Work orders waiting on each queue (sampled by the schedulers).",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Kafka consumer lag",
            [Query("sum by (consumer) (chorus_consumer_lag_messages)", "{{consumer}}")],
            description="Messages not yet read by the schedulers, requests and results topics.",
        ),
        8,
        8,
    )

    lay.row("Stage timings")
    lay.add(
        timeseries(
            "Denoising per stage",
            quantiles(
                "chorus_worker_denoise_stage_duration_seconds", _sel(), by="stage", legend_prefix="stage "
            ),
            unit="s",
            description="1: replayed from the donor; 2: divergent tokens only; 3: full steps.",
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Worker phases (p95)",
            [
                Query(
                    "histogram_quantile(0.95, sum by (phase, le) "
                    f"(rate(chorus_worker_phase_duration_seconds_bucket{INSTANCE}{RATE})))",
                    "{{phase}}",
                )
            ],
            unit="s",
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Follower wait for the leader",
            quantiles("chorus_worker_follower_wait_seconds", _sel()),
            unit="s",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Tokens computed (median fraction)",
            [
                Query(
                    "histogram_quantile(0.5, sum by (role, le) "
                    f"(rate(chorus_worker_tokens_computed_fraction_bucket{INSTANCE}{RATE})))",
                    "{{role}}",
                )
            ],
            unit="percentunit",
            maximum=1,
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Fallbacks by cause",
            [
                Query(
                    f"sum by (cause) (rate(chorus_worker_fallbacks_total{INSTANCE}{RATE}))",
                    "{{cause}}",
                )
            ],
            unit="ops",
            stack=True,
        ),
        8,
        8,
    )

    lay.row("Models")
    lay.add(
        timeseries(
            "Model load time (mean over the range)",
            [
                Query(
                    f"sum by (model) (increase(chorus_worker_model_load_duration_seconds_sum{INSTANCE}{RANGE}))"
                    " / sum by (model) "
                    f"(increase(chorus_worker_model_load_duration_seconds_count{INSTANCE}{RANGE}))",
                    "{{model}}",
                )
            ],
            unit="s",
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Processes holding each model",
            [Query(f"sum by (model) (chorus_worker_models_loaded{INSTANCE})", "{{model}}")],
        ),
        12,
        8,
    )
    variable = {
        "name": "instance",
        "label": "Worker",
        "type": "query",
        "datasource": DATASOURCE,
        "definition": "label_values(chorus_worker_pool_slots, instance)",
        "query": {
            "query": "label_values(chorus_worker_pool_slots, instance)",
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
            "qryType": 1,
        },
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
        "hide": 0,
        "options": [],
    }
    return dashboard(
        "chorus-workers",
        "Chorus · Workers",
        "Per-worker load, stage timings, queue depth and lag, fallbacks, models.",
        lay,
        variables=[variable],
    )


DASHBOARDS = {"chorus-overview.json": overview, "chorus-workers.json": workers}


def render(build: Any) -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path = OUT_DIR / name
        text = render(build)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"out of date (run {Path(__file__).name}): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
