"""Model-verified donors: before a request commits to its donor's first k1 steps, the model checks the donor.

Embedding similarity and a word diff (the planner's filter) cannot tell a paraphrase from a swapped attribute or a
negation; the model can. At the switch point the target computes its own first step on the donor's latent after
Stage 1 — step k1, exactly as the loop would (a Stage-2 step on its mask, or a full step) — and compares the
velocity it predicts with the one the donor recorded at that step:

    signal = mean((m_t − m_d)²) / mean(m_d²)

Both are the guided velocities (the trajectory records what the scheduler consumed), so with the same negative
prompt the unconditional halves cancel and the difference is the guidance scale times the difference of the
conditional predictions. On a Stage-2 first step the tokens outside the mask are the donor's by construction, so
the signal is the part of the whole-latent difference that the step computed.

Decision (thresholds: ``ReusePlan.verification``, filled by the planner from its calibration table):

- ``signal ≤ accept_max``: **accepted** — the computed step *is* step k1 of the request (``PendingStep``): the
  check costs nothing.
- ``signal ≤ shorten_max``: **shortened** — Stage 1 restarts with ``floor(k1 · shorten_fraction)`` of the donor's
  steps (every trajectory step records its model output, so any earlier switch point is available); Stage 2 keeps
  its length and Stage 3 gets the steps Stage 1 gave up. The verification pass is thrown away.
- above: **rejected** — the donor is dropped and the request computed in full from its own noise (as when
  shortening would leave nothing of the donor).
- the donor's output at step k1 cannot be read: **unverified** — the plan runs as the planner made it.

Anything but an accepted donor is a fallback (``FallbackCause.VERIFICATION_*``) whose message carries the signal;
``GenerationOutput.verification`` (a ``producer.contract.VerificationReport``) holds the signal, the decision and
the seconds thrown away.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Literal

import torch

from producer.contract import DonorVerification, VerificationReport
from workers.engine.fallback import Fallback, FallbackCause
from workers.engine.output import StepStat
from workers.engine.request_run import DONOR_PROBLEMS, RequestRun, Stage1, replay_stage1, set_timesteps
from workers.engine.steps import Stepper
from workers.engine.trajectory import StepRecord

log = logging.getLogger(__name__)

Decision = Literal["accepted", "shortened", "rejected"]


@dataclass(frozen=True)
class PendingStep:
    """The first computed step, already run by verification; the loop records it and carries on after it."""

    x: torch.Tensor
    record: StepRecord
    stat: StepStat


def relative_sq_diff(prediction: torch.Tensor, donor: torch.Tensor) -> float:
    """``mean((prediction − donor)²) / mean(donor²)``, in float32."""
    d = donor.float()
    num = (prediction.float() - d).pow(2).mean()
    return float(num / d.pow(2).mean().clamp_min(1e-12))


def decide(signal: float, policy: DonorVerification, stage1_steps: int) -> tuple[Decision, int]:
    """The decision for ``signal`` and the Stage-1 steps it leaves (``stage1_steps`` when accepted, 0 rejected)."""
    if signal <= policy.accept_max:
        return "accepted", stage1_steps
    if policy.shorten_max is not None and signal <= policy.shorten_max:
        return "shortened", math.floor(stage1_steps * policy.shorten_fraction)
    return "rejected", 0


def verify_donor(
    stepper: Stepper, run: RequestRun, start: Stage1, noise: torch.Tensor
) -> tuple[Stage1, PendingStep | None]:
    """Check ``start``'s donor where ``run.plan.verification`` asks for it (a donor in use, 0 < k1 < N); returns
    the Stage 1 to run and, when the donor was accepted or ran unverified, its first computed step."""
    policy = run.plan.verification
    k1, k2 = start.stage1_steps, start.stage2_steps
    if policy is None or run.donor is None or not 0 < k1 < run.request.num_steps:
        return start, None
    t0 = time.perf_counter()
    x, rec, stat = stepper.step(run, k1, start.x, k1, k2)
    donor_out = None if stat.fallback else _donor_output(run, k1)
    if donor_out is None:  # nothing to compare with: the step stands, the plan runs as made
        run.verification = VerificationReport(decision="unverified", step=k1, stage1_steps=k1)
        return start, PendingStep(x, rec, stat)
    signal = relative_sq_diff(rec.model_output, donor_out)
    if not math.isfinite(
        signal
    ):  # a non-finite prediction vouches for nothing: reject (and report no number)
        signal = math.inf
    decision, kept = decide(signal, policy, k1)
    if decision == "accepted":
        run.verification = VerificationReport(decision="accepted", signal=signal, step=k1, stage1_steps=k1)
        _log(run, decision, signal, k1, k1, 0.0)
        return start, PendingStep(x, rec, stat)
    wasted = time.perf_counter() - t0
    said = f"verification: signal {signal:.4f} at step {k1}"
    if decision == "shortened" and (kept > 0 or k2 > 0):
        message = f"{said} > {policy.accept_max}: Stage 1 shortened from {k1} to {kept} steps"
        start = _restart(stepper, run, start, kept, noise, message)
    else:  # rejected, or shortened to nothing of the donor
        bound = (
            policy.shorten_max
            if decision == "rejected" and policy.shorten_max is not None
            else policy.accept_max
        )
        message = f"{said} > {bound}: donor rejected, computed in full"
        start = _drop(stepper, run, start, noise, message, FallbackCause.VERIFICATION_REJECTED)
    decision = "shortened" if start.stage1_steps + start.stage2_steps > 0 else "rejected"
    start = dataclasses.replace(start, seconds=start.seconds + wasted)
    run.verification = VerificationReport(
        decision=decision,
        signal=signal if math.isfinite(signal) else None,
        step=k1,
        stage1_steps=start.stage1_steps,
        wasted_seconds=wasted,
        wasted_tokens_fraction=min(1.0, max(0.0, stat.active_fraction)),
    )
    _log(run, decision, signal, k1, start.stage1_steps, wasted)
    return start, None


def _donor_output(run: RequestRun, i: int) -> torch.Tensor | None:
    """The donor's recorded model output at step ``i`` (a Stage-2 step has just read it), None if unreadable."""
    if run.last_donor_output is not None and run.last_donor_output[0] == i:
        return run.last_donor_output[1]
    assert run.donor is not None
    try:
        return run.check_shape(run.donor.step(i).model_output, "model output")
    except DONOR_PROBLEMS as exc:
        log.info(
            "donor verification skipped: the donor's output is unreadable",
            extra={"request_id": run.request.request_id, "step": i, "error": str(exc)},
        )
        return None


def _reset_scheduler(stepper: Stepper, run: RequestRun) -> None:
    """A fresh scheduler: the verification pass stepped the old one, and a multistep scheduler keeps history."""
    run.scheduler = stepper.bundle.make_scheduler()
    run.timesteps = set_timesteps(run.scheduler, run.request.num_steps, stepper.bundle.device)
    run.own_prev_maps = None
    run.donor_maps = None
    run.last_donor_output = None


def _restart(
    stepper: Stepper, run: RequestRun, start: Stage1, kept: int, noise: torch.Tensor, message: str
) -> Stage1:
    """Stage 1 again with ``kept`` of the donor's steps (Stage 2 keeps its length); rejected if the donor's steps
    cannot be read again."""
    _reset_scheduler(stepper, run)
    try:
        initial, x, records = replay_stage1(run, kept, stepper.bundle.device)
    except DONOR_PROBLEMS as exc:
        message = f"{message}; donor unavailable for the shorter Stage 1 ({exc}): computed in full"
        return _drop(stepper, run, start, noise, message, FallbackCause.VERIFICATION_REJECTED)
    decided = Fallback(FallbackCause.VERIFICATION_SHORTENED, message)
    return Stage1(
        initial, x, records, start.seconds, kept, start.stage2_steps, [*start.fallback, message], decided
    )


def _drop(
    stepper: Stepper, run: RequestRun, start: Stage1, noise: torch.Tensor, message: str, cause: FallbackCause
) -> Stage1:
    """No donor: every step computed in full from this request's own noise."""
    _reset_scheduler(stepper, run)
    run.donor, run.donor_meta, run.diff = None, None, None
    run.meta = dataclasses.replace(run.meta, initial_from=None)
    decided = Fallback(cause, message)
    return Stage1(
        noise, noise.to(stepper.bundle.device), [], start.seconds, 0, 0, [*start.fallback, message], decided
    )


def _log(run: RequestRun, decision: str, signal: float, planned: int, kept: int, wasted: float) -> None:
    log.info(
        "donor verified",
        extra={
            "request_id": run.request.request_id,
            "decision": decision,
            "signal": round(signal, 5) if math.isfinite(signal) else None,
            "stage1_planned": planned,
            "stage1_steps": kept,
            "wasted_s": round(wasted, 4),
        },
    )
