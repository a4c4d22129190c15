from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from producer.contract import (
    GenerationResult,
    PhaseTimings,
    ResultStatus,
    ReuseKind,
    VerificationReport,
    build_request,
)
from workers.bench.serve import report
from workers.bench.serve.replay import Observation
from workers.bench.serve.trace import TraceItem, Variant


def _obs(i: int, latency: float, *, reuse: ReuseKind = ReuseKind.NONE, fraction: float = 1.0) -> Observation:
    item = TraceItem(i, 0.0, Variant.FRESH, 0, "a red circle", i, {})
    request = build_request(request_id=f"r{i}", prompt=item.prompt, model="toy", seed=i)
    done = datetime(2026, 1, 1, tzinfo=UTC)
    worked = reuse is not ReuseKind.EXACT
    timings = (
        PhaseTimings(queue_s=1.0, prepare_s=0.01, fetch_s=0.02, denoise_s=0.4, decode_s=0.05, upload_s=0.03,
                     worker_s=0.55)
        if worked
        else PhaseTimings()
    )  # fmt: skip
    result = GenerationResult(
        request_id=request.request_id,
        status=ResultStatus.DONE,
        steps_requested=4,
        steps_computed=round(4 * fraction),
        tokens_computed_fraction=fraction,
        reuse=reuse,
        timings=timings,
        completed_at=done,
    )
    return Observation(item, request, 10.0, 10.0 + latency, done + timedelta(seconds=0.1), result)


def test_percentile_interpolates() -> None:
    assert report.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert report.percentile([5.0], 99) == 5.0


def test_summary_counts_hits_steps_and_phases() -> None:
    obs = [
        _obs(0, 1.0),
        _obs(1, 2.0, reuse=ReuseKind.STAGE1, fraction=0.25),
        _obs(2, 0.5, reuse=ReuseKind.EXACT, fraction=0.0),
    ]
    s = report.summarize(obs, start=10.0, publish_s=0.03)
    assert s["hits"] == 2 and s["reuse"]["exact"] == 1 and s["reuse"]["stage1"] == 1
    assert s["token_steps_computed"] == pytest.approx(4 + 1 + 0.0 * 4)
    assert s["makespan_s"] == pytest.approx(2.0) and s["throughput_rps"] == pytest.approx(1.5)
    phases = s["worker_phase_s"]
    assert s["worker_requests"] == 2  # the exact hit had no worker
    assert phases["other"] == pytest.approx(0.55 - 0.51) and phases["publish"] == pytest.approx(0.03)
    assert phases["deliver"] == pytest.approx(0.1 - 0.03)  # the hop to the reader is latency, not worker time
    assert s["outside_engine_s"] == pytest.approx(0.01 + 0.02 + 0.05 + 0.03 + 0.04 + 0.03)
    assert s["outside_engine_ratio"] == pytest.approx(s["outside_engine_s"] / 0.4, rel=1e-3)


def test_a_donor_check_that_threw_its_pass_away_counts_as_computed_work() -> None:
    def checked(o: Observation, check: VerificationReport) -> Observation:
        return dataclasses.replace(o, result=o.result.model_copy(update={"verification": check}))

    rejected = checked(  # computed in full after its donor was rejected
        _obs(0, 1.0),
        VerificationReport(
            decision="rejected", signal=0.5, step=3, stage1_steps=0, wasted_tokens_fraction=1.0
        ),
    )
    accepted = checked(
        _obs(1, 1.0, reuse=ReuseKind.STAGE1, fraction=0.25),
        VerificationReport(decision="accepted", signal=0.001, step=3, stage1_steps=3),
    )
    s = report.summarize([rejected, accepted], start=10.0)
    assert s["token_steps_computed"] == pytest.approx(4 + 1 + 1) and s["token_steps_thrown_away"] == 1.0
    assert s["token_steps_fraction"] == pytest.approx(6 / 8)
    assert s["verification"] == {"accepted": 1, "rejected": 1}


def test_without_the_workers_publish_time_it_is_left_out_not_guessed() -> None:
    s = report.summarize([_obs(0, 1.0)], start=10.0)
    assert s["worker_phase_s"]["publish"] is None and s["worker_phase_s"]["deliver"] == pytest.approx(0.1)
    assert s["outside_engine_s"] == pytest.approx(0.01 + 0.02 + 0.05 + 0.03 + 0.04)


def test_compare_divides_reuse_by_no_reuse() -> None:
    fast = report.summarize([_obs(0, 1.0)], start=10.0)
    slow = report.summarize([_obs(0, 2.0)], start=10.0)
    c = report.compare(fast, slow)
    assert c["throughput_ratio"] == pytest.approx(2.0) and c["latency_ratio"]["p50"] == pytest.approx(0.5)


def test_the_speed_probe_times_more_work_as_longer() -> None:
    from workers.bench.serve.report import speed_probe_ms

    assert 0 < speed_probe_ms(20_000) < speed_probe_ms(2_000_000)
