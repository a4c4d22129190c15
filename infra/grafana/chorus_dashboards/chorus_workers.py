"""The ``chorus-workers`` dashboard: per-worker load, stage timings, queue depth and lag, fallbacks, models,
filtered by the ``instance`` variable. One function per row of panels; ``workers`` lays them out."""

from __future__ import annotations

from typing import Any

from chorus_dashboards.panels import DATASOURCE, RANGE, RATE, Layout, Query, dashboard, quantiles, timeseries

INSTANCE = '{instance=~"$instance"}'


def _sel(extra: str = "") -> str:
    return f'{{instance=~"$instance"{"," + extra if extra else ""}}}'


def workers() -> dict[str, Any]:
    lay = Layout()
    load(lay)
    stage_timings(lay)
    models(lay)
    return dashboard(
        "chorus-workers",
        "Chorus · Workers",
        "Per-worker load, stage timings, queue depth and lag, fallbacks, models.",
        lay,
        variables=[instance_variable()],
    )


def load(lay: Layout) -> None:
    """Busy and pool slots, utilisation, results, queue depth and consumer lag."""
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


def stage_timings(lay: Layout) -> None:
    """Denoising per stage, worker phases, follower wait, tokens computed, fallbacks."""
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


def models(lay: Layout) -> None:
    """Model load time and the processes holding each model."""
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


def instance_variable() -> dict[str, Any]:
    """The ``instance`` template variable: which worker containers the panels show (all by default)."""
    return {
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
