from __future__ import annotations

from chorus_sched.grouping import Candidate, blocked_gain, decide
from chorus_sched.planner import CalibrationTable, Planner
from producer.contract import build_request
from producer.orders import Role

RED = "a red circle moving left on a white background"
BLUE = "a blue circle moving left on a white background"

PLANNER = Planner(
    CalibrationTable.model_validate(
        {
            "format": "chorus-calibration/1",
            "provisional": False,
            "source": "test",
            "embedder": "test",
            "ignorable_words": ["a", "on"],
            "regimes": [
                {
                    "name": "all",
                    "max_steps": 1000,
                    "rows": [
                        {
                            "name": "same",
                            "min_similarity": 0.95,
                            "max_content_changes": 0,
                            "k1": 0.5,
                            "k2": 0.0,
                        },
                        {
                            "name": "one",
                            "min_similarity": 0.8,
                            "max_content_changes": 1,
                            "k1": 0.25,
                            "k2": 0.0,
                        },
                    ],
                }
            ],
        }
    )
)


def cand(rid: str, prompt: str, similarity: float, *, ready: bool = True, tenant: str = "t1") -> Candidate:
    return Candidate(rid, prompt, tenant, similarity, ready, f"trajectories/{rid}/")


def req(prompt: str = RED, **fields: object):
    return build_request(prompt=prompt, tenant="t1", num_steps=8, model="tiny-random-wan", **fields)


def test_no_candidate_makes_a_leader_or_a_solo_run_without_grouping() -> None:
    decision = decide(req(), [], PLANNER)
    assert decision.role is Role.LEADER and not decision.plan.reuses and decision.donor is None
    assert "no donor found" in decision.reason
    assert decide(req(), [], PLANNER, grouping=False).role is Role.SOLO


def test_reuse_off_runs_solo_in_full_whatever_is_found() -> None:
    decision = decide(req(reuse="off"), [cand("d", RED, 1.0)], PLANNER)
    assert decision.role is Role.SOLO and decision.plan.stage3_steps == 8 and decision.donor is None
    assert decision.considered == []


def test_a_finished_donor_gives_a_solo_run_with_its_plan() -> None:
    decision = decide(req(), [cand("d", RED, 0.99)], PLANNER)
    assert decision.role is Role.SOLO
    assert decision.donor is not None and decision.donor.request_id == "d"
    assert decision.plan.stage1_steps == 4
    assert decision.steps_saved_estimate == 4


def test_a_running_leader_gives_a_follower() -> None:
    decision = decide(req(), [cand("L", RED, 0.99, ready=False)], PLANNER)
    assert decision.role is Role.FOLLOWER
    assert decision.donor is not None and decision.donor.request_id == "L"
    assert "follows running leader L" in decision.reason


def test_the_candidate_saving_most_steps_wins_and_a_finished_donor_wins_ties() -> None:
    candidates = [
        cand("swap", BLUE, 0.99),  # one content change: row "one", k1 = 2
        cand("leader", RED, 0.97, ready=False),  # same words: k1 = 4
        cand("donor", RED, 0.96),  # same words: k1 = 4, finished
    ]
    decision = decide(req(), candidates, PLANNER)
    assert decision.donor is not None and decision.donor.request_id == "donor"
    assert decision.role is Role.SOLO
    assert len(decision.considered) == 3


def test_refused_candidates_are_explained() -> None:
    decision = decide(req(), [cand("far", BLUE, 0.7)], PLANNER)
    assert decision.role is Role.LEADER
    assert "1 candidate(s) refused" in decision.reason
    summary = decision.considered[0].summary()
    assert summary["accepted"] is False
    assert summary["donor_only"] == ["blue"] and summary["target_only"] == ["red"]
    assert summary["similarity"] == 0.7
    assert "no all row admits similarity 0.700" in str(summary["why"])


def test_the_request_never_takes_itself_as_a_donor() -> None:
    request = req(request_id="me")
    # the index names its entries by job id (tenant~request id)
    decision = decide(request, [cand(request.job_id, RED, 1.0, ready=False)], PLANNER)
    assert decision.role is Role.LEADER and decision.considered == []


def test_blocked_gain_counts_only_a_better_donor_of_another_tenant() -> None:
    request = req()
    own = decide(request, [cand("mine", BLUE, 0.9)], PLANNER)  # saves 2
    everyone = decide(request, [cand("mine", BLUE, 0.9), cand("theirs", RED, 0.99, tenant="t2")], PLANNER)
    assert blocked_gain("t1", own, everyone) == 2.0
    same_tenant_best = decide(request, [cand("mine", RED, 0.99)], PLANNER)
    assert blocked_gain("t1", same_tenant_best, same_tenant_best) == 0.0
    assert blocked_gain("t1", own, decide(request, [cand("theirs", BLUE, 0.5, tenant="t2")], PLANNER)) == 0.0
