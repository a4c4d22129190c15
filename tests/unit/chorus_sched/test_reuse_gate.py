"""The gate on verified rows: it pauses a similarity band whose donor checks reject too often to pay, keeps
exploring it, reopens it when checks accept again, and the scheduler feeds it from results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chorus_sched.embedding import word_diff
from chorus_sched.planner import Planner, parse_calibration
from chorus_sched.reuse_gate import GateConfig, VerifiedReuseGate
from producer.contract import DonorInfo, GenerationResult, ResultStatus, ReusePlan, VerificationReport
from tests.helpers.scheduler_fakes import PROMPT, Msg, done, make_ports, recased, request
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
    assert gate.allows("toy", "few", 0.72, 2) and gate.allows("toy", "few", 0.72, 2)  # asking spends nothing
    gate.chosen("toy", "few", 0.72, 2)  # the band's first exploration was dispatched
    assert not gate.allows("toy", "few", 0.71, 2) and gate.refusals == 1  # same band, within the interval
    clock.now += 5.0
    assert gate.allows("toy", "few", 0.74, 2)  # explores again after the interval
    gate.chosen("toy", "few", 0.74, 2)
    assert not gate.allows("toy", "few", 0.74, 2)
    for _ in range(3):
        gate.record("toy", "few", 0.73, "accepted", stage1_steps=2)
    assert gate.allows("toy", "few", 0.72, 2)  # reopened
    gate.chosen("toy", "few", 0.72, 2)  # an open band spends no exploration
    assert gate.allows("toy", "few", 0.72, 2)


def test_explorations_that_keep_a_band_closed_back_off_and_reopening_resets() -> None:
    clock = Clock()
    gate = VerifiedReuseGate(GateConfig(explore_every_s=5.0, explore_max_s=20.0), clock=clock)
    _rejected_enough(gate)  # closed; its interval starts at 5 s

    def explore_rejected() -> float:
        waited = 0.0
        while not gate.allows("toy", "few", 0.72, 2):
            clock.now += 1.0
            waited += 1.0
        gate.chosen("toy", "few", 0.72, 2)
        gate.record("toy", "few", 0.72, "rejected", stage1_steps=2)
        return waited

    assert [explore_rejected() for _ in range(5)] == [0.0, 5.0, 10.0, 20.0, 20.0]  # doubled, then capped
    for _ in range(6):
        gate.record("toy", "few", 0.72, "accepted", stage1_steps=2)
    assert gate.allows("toy", "few", 0.72, 2)  # reopened
    _rejected_enough(gate)
    gate.chosen("toy", "few", 0.72, 2)
    clock.now += 5.0
    assert gate.allows("toy", "few", 0.72, 2)  # paused again: back to the first interval


def test_band_edges_hold_under_binary_rounding() -> None:
    gate = VerifiedReuseGate()
    _rejected_enough(gate, similarity=0.70)  # 0.70 / 0.05 is 13.999999999999998 in floating point
    assert gate.acceptance("toy", "few", 0.74) < 1 / 3  # the same band [0.70, 0.75)
    assert gate.acceptance("toy", "few", 0.69) == 0.5


def test_bands_regimes_and_step_counts_are_judged_apart() -> None:
    gate = VerifiedReuseGate()
    _rejected_enough(gate)
    gate.chosen("toy", "few", 0.72, 2)  # spend the exploration
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
    explored = planner.plan(0.5, word_diff(OTHER_WORDS, RED), 4, "toy")
    assert explored.row == "reworded" and explored.verified
    _rejected_enough(gate, similarity=0.5)
    assert planner.plan(0.5, word_diff(OTHER_WORDS, RED), 4, "toy").reuses  # not dispatched: not spent
    planner.chosen(explored, "toy", 0.5)  # dispatched while the band is closed: its exploration
    paused = planner.plan(0.5, word_diff(OTHER_WORDS, RED), 4, "toy")
    assert not paused.reuses and paused.row is None
    assert planner.plan(0.5, word_diff(OTHER_WORDS, RED), 4, "mid").row == "reworded"  # another model
    same = planner.plan(1.0, word_diff(RED, RED), 4)
    assert same.row == "same" and not same.verified  # rows on similarity alone: unaffected
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


def _dispatched(ports: Any, ids: list[str], *, verified: bool, seed: int = 0) -> None:
    ports.scheduler.handle_requests(
        [
            Msg(request(recased(PROMPT, seed + i), request_id=r, seed=seed + i).to_bytes(), i)
            for i, r in enumerate(ids)
        ]
    )
    for r in ids:  # as if a verified row (or another row) had planned each with a donor
        ports.ledger.records[r] = ports.ledger.records[r].model_copy(update={"verified_plan": verified})


def _two_verified_plans(tmp_path: Path) -> tuple[Any, VerifiedReuseGate, str]:
    """A scheduler on fakes with two dispatched verified plans, v0 and v1: (ports, its gate, the 4-step regime)."""
    ports = make_ports(tmp_path)
    gate = ports.scheduler.gate
    assert gate is not None
    _dispatched(ports, ["v0", "v1"], verified=True)
    return ports, gate, ports.scheduler.planner.table.regime_for(4).name


def test_the_scheduler_learns_from_its_verified_plans_results_once(tmp_path: Path) -> None:
    ports, gate, regime = _two_verified_plans(tmp_path)
    _dispatched(ports, ["s0", "s1", "s2"], verified=False, seed=10)
    same_prompt = [
        Msg(_checked(r, "accepted", 0.72), i, topic="results") for i, r in enumerate(["s0", "s1", "s2"])
    ]
    ports.scheduler.handle_results(same_prompt)
    # a same-prompt row's checks say nothing of the loose row
    assert gate.acceptance("toy", regime, 0.72) == 0.5
    rejected = [Msg(_checked(r, "rejected", 0.72), i, topic="results") for i, r in enumerate(["v0", "v1"])]
    ports.scheduler.handle_results(rejected)
    after = gate.acceptance("toy", regime, 0.72)
    assert after < 1 / 3
    ports.scheduler.handle_results(rejected)  # redelivered: counted once
    assert gate.acceptance("toy", regime, 0.72) == after
    assert gate.acceptance("toy", regime, 0.92) == 0.5  # other bands untouched


def test_a_dispatched_verified_plan_is_recorded_as_such_and_spends_the_exploration(tmp_path: Path) -> None:
    planner = Planner(parse_calibration(json.dumps(_with_verified_row())))
    ports = make_ports(tmp_path, planner)
    gate = ports.scheduler.gate
    assert gate is not None
    ports.scheduler.handle_requests([Msg(request(RED, request_id="donor").to_bytes(), 0)])
    ports.scheduler.handle_results([Msg(done("donor").to_bytes(), 0, topic="results")])
    reworded = "a red circle drifting leftward on a pale white backdrop"
    ports.scheduler.handle_requests([Msg(request(reworded, request_id="t0").to_bytes(), 1)])
    order = ports.dispatcher.orders[-1]
    assert order.donor is not None and order.plan.stage1_steps == 3
    assert ports.ledger.records["t0"].verified_plan
    similarity = order.donor.similarity
    assert gate.allows("toy", "few", similarity, 3)  # the band is open: nothing was spent
    _rejected_enough(gate, similarity=similarity)
    gate.record("toy", "few", similarity, "rejected", stage1_steps=3)  # below 1/4 accepted: closed
    ports.scheduler.handle_requests(
        [Msg(request(recased(reworded, 1), request_id="t1", seed=1).to_bytes(), 2)]
    )
    assert ports.dispatcher.orders[-1].plan.stage1_steps == 3  # the closed band's exploration, dispatched
    ports.scheduler.handle_requests(
        [Msg(request(recased(reworded, 2), request_id="t2", seed=2).to_bytes(), 3)]
    )
    assert ports.dispatcher.orders[-1].plan.stage1_steps == 0  # spent: paused until the next interval
    assert not ports.ledger.records["t2"].verified_plan


def test_a_gate_failure_does_not_fail_the_result(tmp_path: Path, monkeypatch: Any) -> None:
    ports = make_ports(tmp_path)
    gate = ports.scheduler.gate
    assert gate is not None

    def broken(*args: Any) -> None:
        raise RuntimeError("gate broke")

    monkeypatch.setattr(gate, "record", broken)
    _dispatched(ports, ["v0"], verified=True)
    outcome = ports.scheduler.handle_results([Msg(_checked("v0", "rejected", 0.72), 0, topic="results")])
    assert not outcome.retry  # the partition is not rewound for advice
    entry = ports.index.get("v0")
    assert entry is not None and entry.ready


def test_the_gate_can_be_switched_off(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("CHORUS_VERIFIED_GATE", "false")
    assert make_ports(tmp_path).scheduler.gate is None


def test_checks_in_flight_count_as_rejected_until_they_answer() -> None:
    clock = Clock()
    gate = VerifiedReuseGate(GateConfig(explore_every_s=5.0), clock=clock)
    for _ in range(2):  # a new band (prior one accept, one reject) at k1 = 2 of 4: two plans may be in flight
        assert gate.allows("toy", "few", 0.72, 2)
        gate.chosen("toy", "few", 0.72, 2)
    assert not gate.allows("toy", "few", 0.72, 2)  # a third waits for an outcome
    assert gate.allows("toy", "few", 0.82, 2)  # another band is not held up
    gate.record("toy", "few", 0.72, "accepted", stage1_steps=2)
    assert gate.allows("toy", "few", 0.72, 2)  # one answered (and accepted): room again
    gate.chosen("toy", "few", 0.72, 2)
    gate.record("toy", "few", 0.72, "unverified", stage1_steps=2)  # says nothing, but is no longer in flight
    gate.record("toy", "few", 0.72, "accepted", stage1_steps=2)
    for _ in range(4):  # a band whose checks accept keeps many in flight
        assert gate.allows("toy", "few", 0.72, 2)
        gate.chosen("toy", "few", 0.72, 2)


def test_a_check_never_heard_of_stops_counting_after_its_ttl() -> None:
    clock = Clock()
    gate = VerifiedReuseGate(GateConfig(explore_every_s=1000.0, pending_ttl_s=120.0), clock=clock)
    gate.chosen("toy", "few", 0.72, 2)
    gate.chosen("toy", "few", 0.72, 2)
    assert not gate.allows("toy", "few", 0.72, 2)
    clock.now += 121.0  # their results were lost: they no longer hold the band
    assert gate.allows("toy", "few", 0.72, 2)


def test_a_verified_plan_that_failed_takes_its_check_out_of_flight_once(tmp_path: Path) -> None:
    ports, gate, regime = _two_verified_plans(tmp_path)
    for r in (
        "v0",
        "v1",
    ):  # as the intake records a verified plan: its donor's similarity, its check in flight
        ports.ledger.records[r] = ports.ledger.records[r].model_copy(update={"similarity": 0.72})
        gate.chosen("toy", regime, 0.72, 2)
    assert not gate.allows("toy", regime, 0.72, 2)  # two in flight in a new band
    failed = GenerationResult(request_id="v0", tenant="default", status=ResultStatus.FAILED)
    ports.scheduler.handle_results([Msg(failed.to_bytes(), 0, topic="results")])
    assert gate.allows("toy", regime, 0.72, 2)  # released, and no outcome learned
    assert gate.acceptance("toy", regime, 0.72) == 0.5
    gate.chosen("toy", regime, 0.72, 2)
    ports.scheduler.handle_results([Msg(failed.to_bytes(), 0, topic="results")])  # redelivered: not again
    assert not gate.allows("toy", regime, 0.72, 2)
