"""Figures of one replay (``summarize``) and of a reuse/no-reuse pair (``compare``).

Per replay: requests and their outcome, hit kinds (``GenerationResult.reuse``; a *hit* is a result that saved
compute, ``saved_compute``, or an exact hit), steps and token-steps computed (token-steps in units of full
steps: a request's ``tokens_computed_fraction`` × its steps, plus the pass a rejected or shortened donor check
threw away, also apart as ``token_steps_thrown_away``; ``verification`` counts the checks' decisions), throughput (requests over the makespan, from the
first request sent to the last result read), latency percentiles (sent → result read), and the worker's seconds
per request by phase for the requests a worker ran (exact hits have none):

- ``queue``: scheduler accepted → worker started (waiting behind other orders, the broker hop);
- ``prepare``: the task's redelivery checks, order parsing, model lookup;
- ``fetch``, ``denoise``, ``decode`` (the engine's decode and the video encoding), ``upload`` (video and
  trajectory): the worker's own phases (``workers.results.PhaseClock``);
- ``other``: the rest of the worker's time on the order (``worker_s`` minus the phases above);
- ``publish``: the worker producing the result until the broker acknowledged it (the worker's own
  ``chorus_worker_phase_duration_seconds{phase="publish"}``, mean over the pass; the worker waits for it);
- ``deliver``: result assembled → read by the benchmark, less ``publish``: the broker and the reader's poll,
  a share of latency, not of worker time.

``outside_engine_s`` is the worker's time outside the engine: everything but ``denoise``, ``queue`` and
``deliver``; ``outside_engine_ratio`` divides it by ``denoise``.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from producer.contract import GenerationResult, ResultStatus, ReuseKind
from workers.bench.serve.replay import Observation

PHASES = ("queue", "prepare", "fetch", "denoise", "decode", "upload", "other", "deliver")
OUTSIDE = ("prepare", "fetch", "decode", "upload", "other", "publish")


def speed_probe_ms(iterations: int = 1_000_000) -> float:
    """CPU milliseconds a fixed pure-Python loop takes now: this machine's speed drifts by ±20% within minutes
    (a shared host), so reports carry it, taken before and after, to compare runs by."""
    start = time.process_time()
    total = 0
    for i in range(iterations):
        total += i * i
    return round((time.process_time() - start) * 1000, 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between closest ranks; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def is_hit(result: GenerationResult) -> bool:
    return result.status is ResultStatus.DONE and (result.reuse is ReuseKind.EXACT or result.saved_compute)


def phases_of(obs: Observation) -> dict[str, float]:
    t = obs.result.timings
    named = {
        "queue": t.queue_s,
        "prepare": t.prepare_s,
        "fetch": t.fetch_s,
        "denoise": t.denoise_s,
        "decode": t.decode_s,
        "upload": t.upload_s,
    }
    inside = sum(v for k, v in named.items() if k != "queue")
    named["other"] = max(0.0, t.worker_s - inside) if t.worker_s else 0.0
    named["deliver"] = obs.delivery_s  # publish included: summarize takes the worker's share out
    return named


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def summarize(
    observations: Sequence[Observation], start: float, publish_s: float | None = None
) -> dict[str, Any]:
    """One pass's figures; ``publish_s`` is the worker's mean seconds producing a result (None: not measured,
    left out of ``outside_engine_s``)."""
    results = [o.result for o in observations]
    done = [r for r in results if r.status is ResultStatus.DONE]
    makespan = max(o.received for o in observations) - start if observations else float("nan")
    latencies = [o.latency_s for o in observations]
    worked = [
        o for o in observations if o.result.reuse is not ReuseKind.EXACT and o.result.timings.worker_s > 0
    ]
    phases: dict[str, float | None] = {p: round(_mean([phases_of(o)[p] for o in worked]), 4) for p in PHASES}
    phases["publish"] = None if publish_s is None else round(publish_s, 4)
    if publish_s is not None and worked:
        phases["deliver"] = round(max(0.0, (phases["deliver"] or 0.0) - publish_s), 4)
    outside = sum(phases[p] or 0.0 for p in OUTSIDE) if worked else float("nan")
    denoise = phases["denoise"] or 0.0
    steps_requested = sum(r.steps_requested for r in done)
    # A rejected or shortened donor check computed a pass the video did not keep: it is computed work all the same.
    thrown_away = sum(r.verification.wasted_tokens_fraction for r in done if r.verification is not None)
    token_steps = sum(r.tokens_computed_fraction * r.steps_requested for r in done) + thrown_away
    return {
        "requests": len(observations),
        "status": {str(s): sum(r.status is s for r in results) for s in ResultStatus},
        "reuse": {str(k): sum(r.reuse is k for r in done) for k in ReuseKind},
        "hits": sum(is_hit(r) for r in results),
        "fallbacks": sum(r.fallback is not None for r in done),
        "steps_requested": steps_requested,
        "steps_computed": sum(r.steps_computed for r in done),
        "token_steps_computed": round(token_steps, 2),
        "token_steps_thrown_away": round(thrown_away, 2),
        "token_steps_fraction": round(token_steps / steps_requested, 4) if steps_requested else None,
        "verification": dict(
            sorted(Counter(r.verification.decision for r in done if r.verification is not None).items())
        ),
        "makespan_s": round(makespan, 3),
        "throughput_rps": round(len(observations) / makespan, 4) if makespan > 0 else None,
        "latency_s": {
            "mean": round(_mean(latencies), 4),
            **{f"p{q}": round(percentile(latencies, q), 4) for q in (50, 95, 99)},
            "max": round(max(latencies, default=float("nan")), 4),
        },
        "worker_requests": len(worked),
        "worker_phase_s": phases,
        "outside_engine_s": round(outside, 4),
        "outside_engine_ratio": round(outside / denoise, 3) if worked and denoise > 0 else None,
    }


def compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """Reuse against no reuse: throughput ratio (> 1: reuse serves more per second), the same by the worker's
    CPU seconds per request, and latency ratios (< 1: reuse is faster)."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {
        "throughput_ratio": ratio(on["throughput_rps"], off["throughput_rps"]),
        "latency_ratio": {q: ratio(on["latency_s"][q], off["latency_s"][q]) for q in ("p50", "p95", "p99")},
        "token_steps_ratio": ratio(on["token_steps_computed"], off["token_steps_computed"]),
        # Requests per worker CPU-second, reuse over no reuse: the throughput ratio other load cannot skew.
        "cpu_throughput_ratio": ratio(
            off.get("cpu", {}).get("worker_s_per_request"), on.get("cpu", {}).get("worker_s_per_request")
        ),
    }
