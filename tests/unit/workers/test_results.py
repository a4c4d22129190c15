"""How a worker's result is assembled from an order and what happened."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import pytest

from producer.contract import (
    GenerationResult,
    PhaseTimings,
    ResultStatus,
    ReuseKind,
    ReusePlan,
    VerificationReport,
    build_request,
)
from producer.orders import DonorRef, Role, WorkOrder, trajectory_prefix
from workers.failures import FailureCode
from workers.results import PhaseClock, done_result, failed_result, queue_seconds, salvage_ids


def make_order(with_donor: bool = True) -> WorkOrder:
    request = build_request(prompt="a blue circle", model="tiny-random-wan", tenant="acme", num_steps=6)
    donor = (
        DonorRef(request_id="d-1", similarity=0.91, trajectory_prefix=trajectory_prefix("d-1"), wait_s=2.0)
        if with_donor
        else None
    )
    plan = ReusePlan(stage1_steps=2, stage2_steps=2, stage3_steps=2) if with_donor else ReusePlan.full(6)
    return WorkOrder(request=request, plan=plan, donor=donor, role=Role.FOLLOWER if with_donor else Role.SOLO)


def test_done_result_carries_request_donor_plan_and_what_was_computed() -> None:
    order = make_order()
    timings = PhaseTimings(queue_s=0.5, fetch_s=0.1, denoise_s=2.0, decode_s=0.2, upload_s=0.3)
    result = done_result(
        order,
        video_uri="s3://b/videos/x.mp4",
        trajectory_uri="s3://b/trajectories/x/",
        trajectory_bytes=1234,
        steps_computed=4,
        tokens_computed_fraction=0.61,
        fallback=None,
        timings=timings,
        worker="chorus@host",
        noise_seed=0,
        verification=VerificationReport(decision="shortened", signal=0.02, step=2, stage1_steps=1),
    )
    assert result.status is ResultStatus.DONE and result.error is None
    assert result.verification is not None and result.verification.decision == "shortened"
    assert (result.request_id, result.tenant) == (order.request.request_id, "acme")
    assert result.donor is not None and (result.donor.request_id, result.donor.similarity) == ("d-1", 0.91)
    assert result.plan == order.plan
    assert (result.steps_computed, result.steps_requested) == (4, 6)
    assert result.trajectory_bytes == 1234 and result.timings == timings and result.worker == "chorus@host"
    # It survives the wire.
    assert GenerationResult.model_validate_json(result.to_bytes()) == result


def test_a_result_without_a_stored_trajectory_reports_no_bytes_and_clamps_the_fraction() -> None:
    result = done_result(
        make_order(with_donor=False),
        video_uri="s3://b/v.mp4",
        trajectory_uri=None,
        trajectory_bytes=999,
        steps_computed=6,
        tokens_computed_fraction=1.0000001,
        fallback="donor d-1 unusable: computed in full",
        timings=PhaseTimings(),
        worker=None,
        noise_seed=0,
    )
    assert result.trajectory_bytes == 0 and result.donor is None
    assert result.tokens_computed_fraction == 1.0
    assert result.fallback is not None and "computed in full" in result.fallback


def test_failed_result_names_code_and_keeps_the_plan() -> None:
    order = make_order()
    result = failed_result(
        order.request.request_id, FailureCode.ENGINE_ERROR, "boom", order=order, worker="w"
    )
    assert result.status is ResultStatus.FAILED
    assert result.error is not None and (result.error.code, result.error.message) == ("engine_error", "boom")
    assert result.plan == order.plan and result.steps_requested == 6 and result.video_uri is None
    bare = failed_result("r-9", FailureCode.INVALID_ORDER, "x" * 5000, tenant="t")
    assert bare.tenant == "t" and bare.error is not None and len(bare.error.message) == 2000


def test_salvage_ids_reads_what_it_can_from_a_broken_order() -> None:
    assert salvage_ids(json.dumps({"request": {"request_id": "r-1", "tenant": "acme", "prompt": ""}})) == (
        "r-1",
        "acme",
    )
    assert salvage_ids(json.dumps({"request": {"request_id": 5}})) == (None, "default")
    assert salvage_ids("{not json") == (None, "default")
    assert salvage_ids(json.dumps([1, 2])) == (None, "default")


def test_phase_clock_adds_and_moves_time_without_going_negative() -> None:
    clock = PhaseClock()
    clock.add("denoise", 3.0)
    clock.add("fetch", -1.0)
    clock.move("denoise", "fetch", 1.0)
    clock.move("denoise", "fetch", 10.0)
    with clock.phase("upload"):
        pass
    timings = clock.timings(queue_s=-2.0)
    assert timings.denoise_s == 0.0 and timings.fetch_s == 3.0 and timings.queue_s == 0.0
    assert timings.upload_s >= 0.0
    with pytest.raises(KeyError):
        clock.add("dance", 1.0)


def test_phase_clock_counts_the_worker_time_from_the_task_start() -> None:
    started = time.perf_counter() - 2.0  # the task began two seconds ago
    clock = PhaseClock(started)
    clock.add("prepare", 0.5)
    timings = clock.timings(queue_s=1.0)
    assert timings.prepare_s == 0.5 and timings.worker_s >= 2.0


def test_a_timing_a_reader_does_not_know_is_ignored() -> None:
    raw = PhaseTimings(denoise_s=1.0).model_dump() | {"teleport_s": 0.1}
    result = GenerationResult(request_id="r", status=ResultStatus.DONE, timings=raw)
    assert result.timings.denoise_s == 1.0


def test_queue_seconds_is_measured_from_acceptance() -> None:
    accepted = datetime(2026, 1, 1, tzinfo=UTC)
    assert queue_seconds(accepted, accepted + timedelta(seconds=2.5)) == 2.5
    assert queue_seconds(accepted, accepted - timedelta(seconds=1)) == 0.0


@pytest.mark.parametrize(
    ("steps_computed", "fraction", "noise_seed", "kind", "honoured", "hit"),
    [
        (4, 0.61, 0, ReuseKind.STAGE1, True, True),  # steps skipped from a donor of the same seed (0)
        (4, 0.61, 5, ReuseKind.STAGE1, False, True),  # ... of another seed: not the requested seed's sample
        (4, 0.61, None, ReuseKind.STAGE1, False, True),  # the noise's seed unknown: not claimed as honoured
        (6, 0.8, 0, ReuseKind.STAGE2, True, True),  # every step run, only tokens skipped, same seed
        # Stage 2 alone keeps the donor's tokens, started from the donor's noise: another seed's sample
        (6, 0.8, 5, ReuseKind.STAGE2, False, True),
        (6, 1.0, 5, ReuseKind.NONE, False, False),  # saved nothing, yet started from the donor's noise
        (6, 1.0, 0, ReuseKind.NONE, True, False),  # a planned donor that saved nothing is no hit
    ],
)
def test_a_result_says_what_its_video_is(
    steps_computed: int, fraction: float, noise_seed: int | None, kind: ReuseKind, honoured: bool, hit: bool
) -> None:
    result = done_result(
        make_order(),
        video_uri="s3://b/videos/x.mp4",
        trajectory_uri=None,
        trajectory_bytes=0,
        steps_computed=steps_computed,
        tokens_computed_fraction=fraction,
        fallback=None,
        timings=PhaseTimings(),
        worker=None,
        noise_seed=noise_seed,
    )
    assert (result.reuse, result.seed_honoured, result.saved_compute) == (kind, honoured, hit)
