"""The ``chorus-overview`` dashboard: throughput, reuse (hit ratio, speedup), latency, errors and the donor
cache. One function per row of panels; ``overview`` lays them out top to bottom."""

from __future__ import annotations

from typing import Any

from chorus_dashboards.panels import RATE, Layout, Query, dashboard, heatmap, quantiles, stat, timeseries


def overview() -> dict[str, Any]:
    lay = Layout()
    service_level(lay)
    throughput(lay)
    reuse(lay)
    latency(lay)
    errors(lay)
    donor_cache(lay)
    return dashboard(
        "chorus-overview",
        "Chorus · Overview",
        "Throughput, reuse (hit ratio, speedup), latency, errors and the donor cache.",
        lay,
    )


def service_level(lay: Layout) -> None:
    """The headline figures, each over the whole selected time range."""
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


def throughput(lay: Layout) -> None:
    """Requests in, results out."""
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
                Query(
                    f"sum by (outcome) (rate(chorus_requests_resent_total{RATE}))",
                    "id sent again ({{outcome}})",
                ),
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


def reuse(lay: Layout) -> None:
    """Donor lookups, hit ratio, speedup, steps, donor similarity, group roles."""
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
    lay.add(
        timeseries(
            "Exact hits",
            [Query(f"sum by (kind) (rate(chorus_exact_hits_total{RATE}))", "{{kind}}")],
            unit="reqps",
            stack=True,
            description="Requests answered from an identical request's result with no worker compute: stored "
            "(answered at once) or coalesced (waited for an identical request in flight).",
        ),
        8,
        8,
    )


def latency(lay: Layout) -> None:
    """End to end and per phase."""
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


def errors(lay: Layout) -> None:
    """Error ratio, failures by code, dead letters and retries."""
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
    lay.add(
        timeseries(
            "Lost orders and index outages",
            [
                Query(f"sum by (outcome) (rate(chorus_orders_lost_total{RATE}))", "order lost ({{outcome}})"),
                Query(f"sum(rate(chorus_index_unavailable_total{RATE}))", "scheduled without the index"),
            ],
            unit="reqps",
            description="Orders whose worker vanished (sent again, or answered failed after max_redispatches), and "
            "requests computed in full because the donor index could not be opened.",
        ),
        8,
        8,
    )


def donor_cache(lay: Layout) -> None:
    """Size against budget, index entries, evictions."""
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
