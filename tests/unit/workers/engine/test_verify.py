"""Model-verified donors (``workers.engine.verify``): the first computed step checks the donor before its Stage 1
is trusted; accepted it is that step, otherwise Stage 1 is shortened or the donor dropped, and the output says so."""

from __future__ import annotations

import pytest
import torch

from producer.contract import DonorVerification, ReusePlan
from workers.engine import Trajectory
from workers.engine.fallback import FallbackCause
from workers.engine.request_run import donor_steps
from workers.engine.verify import decide, relative_sq_diff

RED = "a red circle moving left on a white background"
BLUE = "a blue circle moving left on a white background"


def _plan(k1: int, k2: int, n: int, policy: DonorVerification | None, **kw: float) -> ReusePlan:
    return ReusePlan(
        stage1_steps=k1, stage2_steps=k2, stage3_steps=n - k1 - k2, alpha=2.0, verification=policy, **kw
    )


def _latents(out) -> list[torch.Tensor]:
    return [s.latent_after for s in out.trajectory.steps]


def test_signal_and_decision_bands():
    d = torch.tensor([1.0, -1.0, 2.0, 0.0])
    assert relative_sq_diff(d, d) == 0.0
    assert relative_sq_diff(d + 0.5, d) == pytest.approx(0.25 / 1.5)
    policy = DonorVerification(accept_max=0.01, shorten_max=0.05, shorten_fraction=0.5)
    assert decide(0.01, policy, 5) == ("accepted", 5)
    assert decide(0.02, policy, 5) == ("shortened", 2)
    assert decide(0.06, policy, 5) == ("rejected", 0)
    assert decide(0.02, DonorVerification(accept_max=0.01), 5) == ("rejected", 0)


def test_identical_prompt_donor_is_accepted_at_no_cost(engine, make_request):
    donor = engine.generate(make_request(RED, seed=1), ReusePlan.full(5))
    target = make_request(RED, seed=2)
    trusted = engine.generate(target, _plan(2, 0, 5, None), donor=donor.trajectory)
    checked = engine.generate(
        target, _plan(2, 0, 5, DonorVerification(accept_max=0.0)), donor=donor.trajectory
    )
    report = checked.verification
    assert report is not None and report.decision == "accepted" and report.signal == 0.0
    assert (report.step, report.stage1_steps, report.wasted_seconds) == (2, 2, 0.0)
    # the verification pass was the request's step 2: same steps computed, same latents as without the check
    assert checked.steps_computed == trusted.steps_computed == 3
    for a, b in zip(_latents(checked), _latents(trusted), strict=True):
        assert torch.equal(a, b)
    assert checked.fallback is None and trusted.verification is None


def test_accepted_stage2_first_step_is_kept(engine, make_request):
    donor = engine.generate(make_request(RED, seed=1), ReusePlan.full(5))
    target = make_request(BLUE, seed=2)
    kw = {"mask_threshold": 0.3}
    trusted = engine.generate(target, _plan(1, 2, 5, None, **kw), donor=donor.trajectory)
    checked = engine.generate(
        target, _plan(1, 2, 5, DonorVerification(accept_max=1e9), **kw), donor=donor.trajectory
    )
    assert checked.verification is not None and checked.verification.decision == "accepted"
    assert checked.verification.signal is not None and checked.verification.signal > 0
    assert [s.active_fraction for s in checked.steps] == [s.active_fraction for s in trusted.steps]
    for a, b in zip(_latents(checked), _latents(trusted), strict=True):
        assert torch.equal(a, b)


def test_signal_above_the_shorten_band_drops_the_donor(engine, make_request):
    donor = engine.generate(make_request(RED, seed=1), ReusePlan.full(5))
    target = make_request(BLUE, seed=2)
    policy = DonorVerification(accept_max=0.0, shorten_max=None)
    out = engine.generate(target, _plan(2, 0, 5, policy), donor=donor.trajectory)
    report = out.verification
    assert report is not None and report.decision == "rejected" and report.signal is not None
    assert report.signal > 0 and report.stage1_steps == 0 and report.wasted_seconds > 0
    assert out.fallback_cause is FallbackCause.VERIFICATION_REJECTED and not out.donor_gone
    assert (
        out.fallback is not None
        and "donor rejected" in out.fallback
        and f"{report.signal:.4f}" in out.fallback
    )
    assert out.donor_request_id is None and out.trajectory.meta.initial_from is None
    # exactly the request without reuse: its own noise, every step computed
    full = engine.generate(target, ReusePlan.full(5))
    assert out.steps_computed == 5 and out.tokens_computed_fraction == 1.0
    for a, b in zip(_latents(out), _latents(full), strict=True):
        assert torch.equal(a, b)


def test_signal_in_the_shorten_band_shortens_stage1(engine, make_request):
    donor = engine.generate(make_request(RED, seed=1, num_steps=6), ReusePlan.full(6))
    target = make_request(BLUE, seed=2, num_steps=6)
    policy = DonorVerification(accept_max=0.0, shorten_max=1e9, shorten_fraction=0.5)
    out = engine.generate(target, _plan(4, 0, 6, policy), donor=donor.trajectory)
    report = out.verification
    assert report is not None and report.decision == "shortened" and report.stage1_steps == 2
    assert (
        out.fallback_cause is FallbackCause.VERIFICATION_SHORTENED and "shortened from 4 to 2" in out.fallback
    )
    assert [s.stage for s in out.steps] == [1, 1, 3, 3, 3, 3] and out.steps_computed == 4
    # the same as planning k1 = 2 from the start
    planned = engine.generate(target, _plan(2, 0, 6, None), donor=donor.trajectory)
    for a, b in zip(_latents(out), _latents(planned), strict=True):
        assert torch.equal(a, b)


def test_unreadable_donor_output_runs_the_plan_unverified(engine, make_request):
    donor = engine.generate(make_request(RED, seed=1), ReusePlan.full(5))
    cut = Trajectory(donor.trajectory.meta, donor.trajectory.initial, donor.trajectory.steps[:2])
    out = engine.generate(
        make_request(BLUE, seed=2), _plan(2, 0, 5, DonorVerification(accept_max=0.0)), donor=cut
    )
    assert out.verification is not None and out.verification.decision == "unverified"
    assert out.verification.signal is None and out.steps_computed == 3 and out.fallback is None


def test_a_verified_plan_prefetches_the_donor_step_it_compares_with():
    policy = DonorVerification(accept_max=0.01)
    assert donor_steps(_plan(2, 0, 5, None), 5) == range(2)
    assert donor_steps(_plan(2, 0, 5, policy), 5) == range(3)
    assert donor_steps(_plan(1, 2, 5, policy), 5) == range(3)
