"""The gate on verified rows: it pauses a similarity band whose donor checks reject too often to pay, keeps
exploring it, reopens it when checks accept again, and the scheduler feeds it from results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chorus_sched.embedding import word_diff
from chorus_sched.planner import Planner, parse_calibration
from chorus_sched.reuse_gate import GateConfig, VerifiedReuseGate
from producer.contract import DonorInfo, ReusePlan, VerificationReport
from tests.helpers.scheduler_fakes import Msg, done, make_ports, request
from tests.unit.chorus_sched.test_planner_verification import RED, _with_verified_row

OTHER_WORDS = "a crimson ring drifting leftward over a pale backdrop"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _rejected_enough(gate: VerifiedReuseGate, regime: str = "few", similarity: float = 0.72) -> None:
    for _ in range(3):
        gate.record("toy", regime, similarity, "rejected", stage1_steps=2)


def test_a_band_pauses_below_break_even_explores_and_reopens() -> None:
    clock = Clock()
    gate = VerifiedReuseGate(GateConfig(explore_every_s=5.0), clock=clock)
    assert gate.allows("toy", "few", 0.72, 2)  # the prior: one accept, one reject
    _rejected_enough(gate)
    assert gate.acceptance("toy", "few", 0.72) < 1 / 3  # k1 = 2 of 4: a check must accept a third of the time
    assert gate.allows("toy", "few", 0.72, 2)  # the band's first exploration
    assert not gate.allows("toy", "few", 0.71, 2) and gate.refusals == 1  # same band, within the interval
    clock.now += 5.0
    assert gate.allows("toy", "few", 0.74, 2)  # explores again after the interval
    assert not gate.allows("toy", "few", 0.74, 2)
    for _ in range(3):
        gate.record("toy", "few", 0.73, "accepted", stage1_steps=2)
    assert gate.allows("toy", "few", 0.72, 2) and gate.allows("toy", "few", 0.72, 2)  # reopened


def test_bands_regimes_and_step_counts_are_judged_apart() -> None:
    gate = VerifiedReuseGate()
    _rejected_enough(gate)
    gate.allows("toy", "few", 0.72, 2)  # spend the exploration
    assert not gate.allows("toy", "few", 0.72, 2)
    assert gate.allows("toy", "few", 0.77, 2)  # another band
    assert gate.allows("toy", "many", 0.72, 2)  # another regime
    assert gate.allows("mid", "few", 0.72, 2)  # another model
    assert gate.allows("toy", "few", 0.72, 25)  # skipping 25 steps pays even at this acceptance


def test_unverified_checks_say_nothing_and_shortened_ones_count_half() -> None:
    gate = VerifiedReuseGate()
    gate.record("toy", "few", 0.72, "unverified", stage1_steps=2)
    assert gate.acceptance("toy", "few", 0.72) == 0.5
    gate.record("toy", "few", 0.72, "shortened", stage1_steps=2)
    assert gate.acceptance("toy", "few", 0.72) == (0.97 + 0.5) / (2 * 0.97 + 1)


def test_the_planner_skips_a_paused_verified_row_but_not_the_others() -> None:
    table = parse_calibration(json.dumps(_with_verified_row()))
    gate = VerifiedReuseGate()
    planner = Planner(table).gated(gate)
    assert planner.plan(0.5, word_diff(OTHER_WORDS, RED), 4, "toy").row == "reworded"  # the exploration
    _rejected_enough(gate, similarity=0.5)
    gate.allows("toy", "few", 0.5, 3)
    paused = planner.plan(0.5, word_diff(OTHER_WORDS, RED), 4, "toy")
    assert not paused.reuses and paused.row is None
    assert planner.plan(0.5, word_diff(OTHER_WORDS, RED), 4, "mid").row == "reworded"  # another model
    assert planner.plan(1.0, word_diff(RED, RED), 4).row == "same"  # rows on similarity alone: unaffected
    assert Planner(table).plan(0.5, word_diff(OTHER_WORDS, RED), 4).row == "reworded"  # ungated: the bench


def _checked(rid: str, decision: str, similarity: float) -> bytes:
    plan = ReusePlan(stage1_steps=2, stage2_steps=0, stage3_steps=2)
    check = VerificationReport(decision=decision, signal=0.2, step=2, stage1_steps=0)
    result = done(
        rid,
        donor=DonorInfo(request_id="donor", similarity=similarity),
        plan=plan,
        verification=check,
        fallback="verification_rejected" if decision == "rejected" else None,
    )
    return result.to_bytes()


def test_the_scheduler_learns_from_its_results(tmp_path: Path) -> None:
    ports = make_ports(tmp_path)
    gate = ports.scheduler.gate
    assert gate is not None
    regime = ports.scheduler.planner.table.regime_for(4).name
    ids = [f"r{i}" for i in range(3)]
    ports.scheduler.handle_requests(
        [Msg(request(request_id=r, seed=i).to_bytes(), i) for i, r in enumerate(ids)]
    )
    results = [Msg(_checked(r, "rejected", 0.72), i, topic="results") for i, r in enumerate(ids)]
    ports.scheduler.handle_results(results)
    assert gate.acceptance("toy", regime, 0.72) < 1 / 3
    assert gate.acceptance("toy", regime, 0.92) == 0.5  # other bands untouched


def test_the_gate_can_be_switched_off(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("CHORUS_VERIFIED_GATE", "false")
    assert make_ports(tmp_path).scheduler.gate is None
