"""Stage 1 / Stage 2 / Stage 3 semantics, checked exactly against self-donors and plain runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from diffusers import UniPCMultistepScheduler

from producer.contract import ReusePlan
from tests.helpers.donors import FlakyDonor
from workers.engine import (
    CorruptTrajectory,
    DonorSource,
    Engine,
    IncompatibleDonor,
    Trajectory,
    decode_header,
    decode_step,
    encode_header,
    encode_step,
)
from workers.engine.errors import DonorWaitExpired
from workers.engine.fallback import FallbackCause
from workers.engine.request_run import prefetch_donor


def _unipc() -> UniPCMultistepScheduler:
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


@pytest.fixture(params=["euler", "unipc"])
def any_engine(request, tiny_bundle, engine):
    if request.param == "euler":
        return engine
    return Engine(dataclasses.replace(tiny_bundle, make_scheduler=_unipc))


def _assert_same_steps(a: Trajectory, b: Trajectory, steps: range) -> None:
    for i in steps:
        torch.testing.assert_close(a.latent_after(i), b.latent_after(i), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_self_donor_stage1_and_all_active_stage2_reproduce_full_result(any_engine, make_request, guidance):
    request = make_request(guidance_scale=guidance, num_steps=6)
    full = any_engine.generate(request, ReusePlan.full(6))
    plan = ReusePlan(stage1_steps=2, stage2_steps=3, stage3_steps=1, min_active_fraction=1.0, alpha=1.0)
    out = any_engine.generate(request, plan, donor=full.trajectory)
    assert out.fallback is None
    assert out.donor_request_id == request.request_id
    _assert_same_steps(out.trajectory, full.trajectory, range(6))
    assert out.steps_computed == 4
    assert out.tokens_computed_fraction == pytest.approx(4 / 6)
    assert [s.stage for s in out.steps] == [1, 1, 2, 2, 2, 3]
    assert (out.frames == full.frames).all() or abs(
        out.frames.astype(int) - full.frames.astype(int)
    ).max() <= 1


def test_empty_mask_stage2_reproduces_donor_steps(any_engine, make_request):
    donor = any_engine.generate(make_request(num_steps=5), ReusePlan.full(5))
    target = make_request("a blue square moving up on a black background", seed=99, num_steps=5)
    plan = ReusePlan(
        stage1_steps=1, stage2_steps=3, stage3_steps=1, min_active_fraction=0.0, max_active_fraction=0.0
    )
    out = any_engine.generate(target, plan, donor=donor.trajectory)
    for i in range(4):
        assert torch.equal(out.trajectory.latent_after(i), donor.trajectory.latent_after(i)), i
        assert torch.equal(out.trajectory.model_output(i), donor.trajectory.model_output(i)), i
    assert [s.computed for s in out.steps] == [False, False, False, False, True]
    assert out.steps_computed == 1
    assert out.tokens_computed_fraction == pytest.approx(1 / 5)


def test_partial_mask_mixes_donor_and_computed_outputs(engine, make_request):
    donor = engine.generate(make_request(num_steps=4), ReusePlan.full(4))
    target = make_request("a red circle moving left on a green background", num_steps=4)
    plan = ReusePlan(
        stage1_steps=1,
        stage2_steps=2,
        stage3_steps=1,
        min_active_fraction=0.25,
        max_active_fraction=0.25,
        alpha=2.0,
    )
    out = engine.generate(target, plan, donor=donor.trajectory)
    for i in (1, 2):
        stat = out.steps[i]
        assert stat.stage == 2 and stat.computed and stat.tgaa
        assert stat.active_fraction == pytest.approx(0.25)
        mine, theirs = out.trajectory.model_output(i), donor.trajectory.model_output(i)
        same = (mine == theirs).all(dim=0)  # (F, H, W) latent positions that took the donor's output
        assert same.float().mean().item() == pytest.approx(0.75, abs=0.01)
    assert out.tokens_computed_fraction == pytest.approx((0 + 0.25 + 0.25 + 1) / 4)


def test_stage1_only_plan(engine, make_request):
    donor = engine.generate(make_request(num_steps=4), ReusePlan.full(4))
    out = engine.generate(
        make_request(seed=5, num_steps=4),
        ReusePlan(stage1_steps=4, stage2_steps=0, stage3_steps=0),
        donor=donor.trajectory,
    )
    assert out.steps_computed == 0
    assert torch.equal(out.trajectory.latent_after(3), donor.trajectory.latent_after(3))
    assert (out.frames == donor.frames).all()


def test_reused_trajectory_serves_as_donor_again(any_engine, make_request):
    """A trajectory that itself started from a donor (initial_from) reproduces itself as a self-donor."""
    a = any_engine.generate(make_request(num_steps=5), ReusePlan.full(5))
    req_b = make_request("a red triangle moving left on a white background", seed=3, num_steps=5)
    b = any_engine.generate(
        req_b, ReusePlan(stage1_steps=2, stage2_steps=2, stage3_steps=1), donor=a.trajectory
    )
    assert b.trajectory.meta.initial_from == a.request_id
    again = any_engine.generate(
        req_b,
        ReusePlan(stage1_steps=3, stage2_steps=1, stage3_steps=1, min_active_fraction=1.0, alpha=1.0),
        donor=b.trajectory,
    )
    _assert_same_steps(again.trajectory, b.trajectory, range(5))


def test_donor_unavailable_before_stage1_runs_in_full(engine, make_request):
    request = make_request()
    full = engine.generate(request, ReusePlan.full(5))
    plan = ReusePlan(stage1_steps=2, stage2_steps=2, stage3_steps=1)
    for donor in (
        FlakyDonor(full.trajectory, fail_metadata=True),
        FlakyDonor(full.trajectory, fail_steps=frozenset({1})),
    ):
        out = engine.generate(request, plan, donor=donor)
        assert out.fallback is not None and "computed in full" in out.fallback
        assert out.donor_request_id is None
        assert out.steps_computed == 5 and [s.stage for s in out.steps] == [3] * 5
        _assert_same_steps(out.trajectory, full.trajectory, range(5))
        assert out.trajectory.meta.initial_from is None


def test_donor_vanishing_mid_stage2_falls_back_per_step(engine, make_request):
    donor = engine.generate(make_request(num_steps=6), ReusePlan.full(6))
    flaky = FlakyDonor(donor.trajectory, fail_from_step=3)
    plan = ReusePlan(
        stage1_steps=1, stage2_steps=4, stage3_steps=1, min_active_fraction=0.25, max_active_fraction=0.25
    )
    out = engine.generate(
        make_request("a blue circle moving left on a white background", num_steps=6), plan, donor=flaky
    )
    assert [s.active_fraction for s in out.steps] == [0.0, 0.25, 0.25, 1.0, 1.0, 1.0]
    assert [s.fallback is not None for s in out.steps] == [False, False, False, True, True, False]
    assert out.fallback is not None and "step 3" in out.fallback and "step 4" in out.fallback
    assert out.donor_request_id == donor.request_id


def test_corrupt_donor_step_falls_back(engine, make_request):
    donor = engine.generate(make_request(num_steps=4), ReusePlan.full(4))

    class Corrupt(FlakyDonor):
        def step(self, index):
            if index == 2:
                raise CorruptTrajectory("sha256 mismatch")
            return super().step(index)

    plan = ReusePlan(stage1_steps=1, stage2_steps=2, stage3_steps=1, max_active_fraction=0.5)
    out = engine.generate(make_request("a blue circle", num_steps=4), plan, donor=Corrupt(donor.trajectory))
    assert out.steps[2].fallback is not None and "sha256" in out.steps[2].fallback
    assert out.steps[1].active_fraction <= 0.5


def test_missing_donor_is_a_fallback_not_an_error(engine, make_request):
    out = engine.generate(
        make_request(num_steps=3), ReusePlan(stage1_steps=1, stage2_steps=1, stage3_steps=1)
    )
    assert out.fallback is not None and "none was given" in out.fallback
    assert out.steps_computed == 3


def test_the_engine_decides_each_fallback_and_names_its_cause(engine, make_request):
    """What the worker reports comes from the engine: why, what kind, and whether the donor is gone for good."""
    request = make_request(num_steps=4)
    full = engine.generate(request, ReusePlan.full(4))
    plan = ReusePlan(stage1_steps=1, stage2_steps=2, stage3_steps=1)

    class Prefetchable(FlakyDonor):
        def prefetch(self, indices):
            self.metadata()
            for i in indices:
                self.step(i)

    # A finished donor found unreadable up front is dropped before the model runs: the request runs in full.
    dropped = prefetch_donor(Prefetchable(full.trajectory, fail_steps=frozenset({2})), plan, 4, name="d-1")
    assert dropped.source is None and dropped.fallback is not None
    out = engine.generate(request, plan, donor=dropped)
    assert out.fallback == "donor d-1 unusable (step 2 not uploaded): computed in full"
    assert out.fallback_cause is FallbackCause.DONOR_UNAVAILABLE and not out.donor_gone
    assert out.steps_computed == 4 and out.donor_request_id is None
    _assert_same_steps(out.trajectory, full.trajectory, range(4))
    kept = prefetch_donor(Prefetchable(full.trajectory), plan, 4, name="d-1")
    assert kept.source is not None and kept.fallback is None

    # An incompatible donor, when the caller asks for it, is computed around like any other fallback; a finished
    # (prefetched) one is gone for good, a running leader is not.
    other = engine.generate(make_request(num_steps=4, height=32), ReusePlan.full(4))
    for donor, gone in (
        (other.trajectory, False),
        (prefetch_donor(Prefetchable(other.trajectory), plan, 4, name="x"), True),
    ):
        out = engine.generate(request, plan, donor=donor, refuse_incompatible=False)
        assert (
            out.fallback is not None
            and out.fallback.startswith("incompatible donor (")
            and "height" in out.fallback
        )
        assert out.fallback_cause is FallbackCause.DONOR_INCOMPATIBLE and out.donor_gone is gone
        _assert_same_steps(out.trajectory, full.trajectory, range(4))

    # Problems met while the engine ran: a leader whose wait ran out, or a step that could not be read.
    class Late(FlakyDonor):
        def step(self, index):
            if index == 2:
                raise DonorWaitExpired("step 2 was not uploaded within 1 s")
            return super().step(index)

    assert (
        engine.generate(request, plan, donor=Late(full.trajectory)).fallback_cause
        is FallbackCause.LEADER_WAIT_TIMEOUT
    )
    flaky = FlakyDonor(full.trajectory, fail_steps=frozenset({2}))
    assert engine.generate(request, plan, donor=flaky).fallback_cause is FallbackCause.DONOR_STEP_UNAVAILABLE
    none = engine.generate(request, plan)
    assert none.fallback_cause is FallbackCause.NO_DONOR_REF and not none.donor_gone
    assert engine.generate(request, plan, donor=full.trajectory).fallback_cause is None


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_steps": 4}, "num_steps"),
        ({"height": 32}, "height"),
        ({"num_frames": 2}, "num_frames"),
    ],
)
def test_incompatible_donor_is_refused(engine, make_request, change, field):
    donor = engine.generate(make_request(num_steps=5), ReusePlan.full(5))
    target = make_request(**change)
    plan = ReusePlan(stage1_steps=1, stage2_steps=1, stage3_steps=target.num_steps - 2)
    with pytest.raises(IncompatibleDonor, match=field):
        engine.generate(target, plan, donor=donor.trajectory)


@pytest.mark.parametrize(
    ("field", "value"), [("weights_id", "other-weights"), ("model", "toy"), ("scheduler_hash", "0" * 64)]
)
def test_incompatible_model_or_scheduler_is_refused(engine, make_request, field, value):
    donor = engine.generate(make_request(num_steps=3), ReusePlan.full(3))
    forged = Trajectory(
        dataclasses.replace(donor.trajectory.meta, **{field: value}),
        donor.trajectory.initial,
        donor.trajectory.steps,
    )
    with pytest.raises(IncompatibleDonor, match=field.split("_")[0]):
        engine.generate(
            make_request(num_steps=3), ReusePlan(stage1_steps=1, stage2_steps=1, stage3_steps=1), donor=forged
        )


def test_other_scheduler_is_refused(engine, tiny_bundle, make_request):
    donor = Engine(dataclasses.replace(tiny_bundle, make_scheduler=_unipc)).generate(
        make_request(num_steps=3), ReusePlan.full(3)
    )
    with pytest.raises(IncompatibleDonor, match="scheduler"):
        engine.generate(
            make_request(num_steps=3),
            ReusePlan(stage1_steps=1, stage2_steps=1, stage3_steps=1),
            donor=donor.trajectory,
        )


def test_streamed_parts_rebuild_the_trajectory(engine, make_request):
    donor = engine.generate(make_request(num_steps=5), ReusePlan.full(5))
    header: list[bytes] = []
    parts: list[bytes] = []
    out = engine.generate(
        make_request("a blue circle moving left on a white background", num_steps=5),
        ReusePlan(stage1_steps=2, stage2_steps=2, stage3_steps=1, max_active_fraction=0.5),
        donor=donor.trajectory,
        on_start=lambda traj: header.append(encode_header(traj)),
        on_step=lambda rec: parts.append(encode_step(rec)),
    )
    assert len(header) == 1 and len(parts) == 5
    assert [decode_step(p).index for p in parts] == list(range(5))
    meta, initial = decode_header(header[0])
    assert meta == out.trajectory.meta
    assert torch.equal(initial, donor.trajectory.initial)  # stage 1 starts from the donor's noise
    rebuilt = Trajectory.from_parts(header[0], parts)
    assert rebuilt.to_bytes() == out.trajectory.to_bytes()
    assert isinstance(rebuilt, DonorSource)


def test_attention_maps_are_recorded(engine, make_request):
    donor = engine.generate(make_request(num_steps=3), ReusePlan.full(3))
    traj = donor.trajectory
    n_valid = sum(traj.meta.valid)
    for i in range(3):
        maps = traj.attn_maps(i)
        assert maps is not None and maps.shape == (n_valid, traj.meta.num_tokens)
        assert (maps >= 0).all() and (maps.sum(0) <= 1 + 1e-5).all()
    out = engine.generate(
        make_request("a blue circle", num_steps=3),
        ReusePlan(stage1_steps=1, stage2_steps=1, stage3_steps=1),
        donor=traj,
    )
    assert out.trajectory.attn_maps(0) is None
    assert out.trajectory.attn_maps(1) is not None


def test_stage2_from_step_zero_starts_from_the_donor_noise(engine, make_request):
    donor = engine.generate(make_request(num_steps=3), ReusePlan.full(3))
    plan = ReusePlan(
        stage1_steps=0, stage2_steps=3, stage3_steps=0, min_active_fraction=0.0, max_active_fraction=0.0
    )
    out = engine.generate(make_request("a blue square", seed=11, num_steps=3), plan, donor=donor.trajectory)
    assert torch.equal(out.trajectory.initial, donor.trajectory.initial)
    assert out.trajectory.meta.initial_from == donor.request_id
    assert torch.equal(out.trajectory.latent_after(2), donor.trajectory.latent_after(2))
    assert out.steps_computed == 0
