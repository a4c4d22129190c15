"""The calibration sweep and the table it writes: rows match the measured classes the way the planner matches,
the most reuse within tolerance wins, and the planner reproduces the chosen plans."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from chorus_sched.embedding import MiniLMEmbedder, word_diff
from chorus_sched.planner import Planner, load_calibration, write_calibration
from producer.contract import DonorVerification, ReusePlan
from workers.bench import calibrate as cal
from workers.bench.pairs import eval_targets, make_pairs
from workers.toy import world

SIMILARITY = {
    "same-prompt": 1.0,
    "one-attribute": 0.9,
    "two-attributes": 0.7,
    "paraphrase": 0.6,
    "reworded-one-attribute": 0.55,
}


def _facts() -> list[cal.PairFacts]:
    ignorable = frozenset(cal.DEFAULT_IGNORABLE)
    out = []
    for i, p in enumerate(make_pairs(eval_targets(12))):
        sim = SIMILARITY[p.pair_class] - 0.01 * (i % 3)
        out.append(
            cal.PairFacts(p, sim, word_diff(p.donor_prompt, p.target.prompt).content_changes(ignorable))
        )
    return out


def test_rows_cover_the_measured_classes_in_planner_order() -> None:
    facts = _facts()
    rows = cal.derive_rows(facts)
    assert [r.name for r in rows] == [
        "same-prompt",
        "one-attribute",
        "two-attributes",
        cal.BLOCKER,
        "paraphrase",
    ]
    assert [r.max_content_changes for r in rows[:4]] == [0, 1, 2, 3]
    lowest = min(f.similarity for f in facts if f.pair.pair_class == "one-attribute")
    assert rows[1].min_similarity == cal.floor2(lowest - 1e-6) <= lowest < rows[1].min_similarity + 0.011
    assert rows[3].min_similarity == -1.0
    for f in facts:
        routed = cal.route(rows, f.similarity, f.content_changes)
        if f.pair.pair_class in ("same-prompt", "one-attribute", "two-attributes"):
            assert routed is not None and routed.name == f.pair.pair_class
        elif routed is not None:  # below every row's similarity: no row, no reuse
            assert routed.name in ("paraphrase", cal.BLOCKER)
    # a one-word change below the measured similarities is not reused by a wider row
    assert cal.route(rows, 0.3, 1) is rows[3]


def _negative(similarity: float, changes: int) -> cal.PairFacts:
    pair = make_pairs(eval_targets(1), ["paraphrase"])[0]
    return cal.PairFacts(pair, similarity, changes)


def test_negatives_raise_the_row_they_reach_above_them() -> None:
    facts = _facts()
    # 3 changes: the blocker takes it and bounds nothing; 2 changes at 0.675 reaches the two-attribute row
    negatives = [_negative(0.95, 3), _negative(0.675, 2), _negative(0.2, 2)]
    rows = cal.derive_rows(facts, negatives, min_pairs=1)
    two = rows[2]
    assert (
        two.name == "two-attributes" and two.min_similarity == 0.68 and two.negatives_max_similarity == 0.675
    )
    assert [r.negatives_max_similarity for r in rows if r is not two] == [None] * 4
    assert cal.route(rows, 0.675, 2) is rows[3] and cal.route(rows, 0.68, 2) is two  # the blocker takes it
    assert cal.above(0.58) == 0.59 and cal.above(0.5801) == 0.59


def test_the_paraphrase_row_is_verified_and_measured_on_its_negatives_instead_of_bounded() -> None:
    facts = _facts()
    unbounded = cal.derive_rows(facts)[-1]
    # 5 changes at 0.585, within the paraphrases' similarities: it would have raised a similarity-only row
    rows = cal.derive_rows(facts, [_negative(0.585, 5), _negative(0.61, 6)])
    para = rows[-1]
    assert para.name == "paraphrase" and para.verified and para == unbounded
    assert cal.route(rows, 0.585, 5) is para  # admitted: the worker's model check decides
    assert not any(r.verified for r in rows[:-1])
    table_row = cal.table_row(para, 4, cal.CandidatePlan(3, 0), None)
    assert table_row.verified and table_row.k1 == 0.75 and table_row.verification is None
    # its candidates: Stage-1 plans only, each at every acceptance threshold of the check, loosest first
    grid = cal.verified_candidates([cal.CandidatePlan(3, 0), cal.CandidatePlan(0, 2)], (0.01, 0.02), ())
    assert grid == [cal.CandidatePlan(3, 0, accept_max=0.02), cal.CandidatePlan(3, 0, accept_max=0.01)]
    floors = cal.verified_candidates([cal.CandidatePlan(3, 0)], (0.01,), (0.8, 0.7))
    assert [c.min_similarity for c in floors] == [None, 0.7, 0.8]
    assert cal.table_row(para, 4, floors[2], None).min_similarity == 0.8
    plan = grid[1].plan(4, DonorVerification(accept_max=0.5))
    assert (
        plan.verification is not None
        and plan.verification.accept_max == plan.verification.shorten_max == 0.01
    )
    written = cal.table_row(para, 4, grid[1], None)
    assert written.verification is not None and written.verification.accept_max == 0.01


def test_a_row_negatives_leave_too_few_pairs_is_dropped_and_bounding_starts_again() -> None:
    facts = _facts()
    # one content change at 0.95, above every one-attribute pair: the one-attribute row is bounded to 0.96 and
    # keeps no pair; once it is gone the same negative reaches the two-attribute row, which goes the same way
    rows = cal.derive_rows(facts, [_negative(0.95, 1)])
    assert [r.name for r in rows] == ["same-prompt", cal.BLOCKER, "paraphrase"]
    one = next(f for f in facts if f.pair.pair_class == "one-attribute")
    assert cal.route(rows, one.similarity, one.content_changes) is rows[1]  # refused, not reused


def test_rows_admitting_fewer_than_min_pairs_are_dropped() -> None:
    facts = _facts()
    assert [r.name for r in cal.derive_rows(facts, min_pairs=12)] == [
        "same-prompt",
        "one-attribute",
        "two-attributes",
        cal.BLOCKER,
        "paraphrase",
    ]
    # 12 pairs per class: once the same-prompt row is gone its pairs fall to the one-attribute row, which then
    # admits 24 and stays; two-attribute pairs fall to the blocker, and the paraphrase row admits only its 12
    rows = cal.derive_rows(facts, min_pairs=13)
    assert [r.name for r in rows] == ["one-attribute", cal.BLOCKER]
    assert cal.route(rows, 1.0, 0) is rows[0]


def test_fractions_round_trip_through_the_planner_floor() -> None:
    for n in (2, 4, 7, 8, 50, 999):
        for k in range(n):
            assert math.floor(cal.fraction(k, n) * n) == k


def test_candidates_largest_possible_saving_first() -> None:
    grid = cal.candidates(4, *cal.default_grid(4))
    assert grid[0] == cal.CandidatePlan(3, 0)
    assert all(c.k1 + c.k2 < 4 and c.k1 + c.k2 > 0 for c in grid)
    bounds = [cal.saving_bound(c, 4) for c in grid]
    assert bounds == sorted(bounds, reverse=True)
    assert cal.saving_bound(cal.CandidatePlan(1, 2), 4) == (1 + 2 * 0.95) / 4
    assert len(set(grid)) == len(grid)
    assert {c.alpha for c in grid if c.k2} == {1.0, 2.0, 4.0}


def test_sweep_picks_the_largest_measured_saving_within_tolerance() -> None:
    n = 4
    grid = [
        cal.CandidatePlan(1, 0),
        cal.CandidatePlan(2, 0),
        cal.CandidatePlan(0, 3, 1.0),
        cal.CandidatePlan(1, 2, 2.0),
        cal.CandidatePlan(3, 0),
    ]
    baseline = [True] * 18 + [False] * 2
    tried: list[tuple[int, int]] = []

    def evaluate(i: int, plan: ReusePlan) -> tuple[bool, int, float, float]:
        k1, k2 = plan.stage1_steps, plan.stage2_steps
        if i == 0:
            tried.append((k1, k2))
        if (k1, k2) == (3, 0):
            ok = i % 2 == 0  # half wrong: rejected at its first lost clip
        elif (k1, k2) == (0, 3) and plan.alpha == 2.0:
            ok = baseline[i] and i != 17
        else:
            ok = baseline[i]
        # Stage 2 computes half of the tokens in this fake
        fraction = (n - k1 - 0.5 * k2) / n
        return ok, n - k1, fraction, fraction

    chosen, trials = cal.sweep(n, grid, baseline, evaluate, tolerance=0.01)
    # bounds: (3,0) .75, (1,2) .725, (0,3) .7125, (2,0) .5 — (1,2) passes and saves .5, (0,3) passes but saves
    # .375, and nothing after (0,3) could save more than .5
    assert chosen == cal.CandidatePlan(1, 2, 2.0)
    assert tried == [(3, 0), (1, 2), (0, 3)]
    assert [t.passed for t in trials] == [False, True, True]
    assert trials[0].stopped_early and trials[0].evaluated == 2 and trials[0].lost == 1
    assert trials[1].evaluated == 20 and trials[1].tokens_fraction_mean == 0.5


def test_sweep_rejects_at_the_end_without_stopping_early() -> None:
    baseline = [True] * 20

    def evaluate(i: int, plan: ReusePlan) -> tuple[bool, int, float, float]:
        return i != 19, 2, 0.5, 0.5

    chosen, [trial] = cal.sweep(4, [cal.CandidatePlan(2, 0)], baseline, evaluate)
    assert chosen is None and not trial.passed and not trial.stopped_early
    assert trial.evaluated == 20 and trial.wrong == 1 and (trial.lost, trial.gained) == (1, 0)


def test_sweep_chooses_no_plan_that_saves_nothing_and_verification_reaches_stage1_plans() -> None:
    """A plan whose donor check turns the donors away computes more than no reuse (the thrown-away pass): it may
    pass on accuracy, but it is no reuse, not a hit."""
    policy = DonorVerification(accept_max=0.01)
    seen: list[ReusePlan] = []

    def evaluate(i: int, plan: ReusePlan) -> tuple[bool, int, float, float]:
        seen.append(plan)
        return True, 4, 1.25 if plan.stage1_steps else 1.0, 1.25

    grid = [cal.CandidatePlan(3, 0), cal.CandidatePlan(0, 2, 2.0)]
    chosen, trials = cal.sweep(4, grid, [True] * 10, evaluate, verification=policy)
    assert chosen is None and [t.passed for t in trials] == [True, True]
    assert {p.stage1_steps: p.verification for p in seen} == {3: policy, 0: None}


def test_a_similarity_floor_leaves_the_pairs_below_it_unreused_and_saves_by_admitting_fewer() -> None:
    """Below a candidate's own floor nothing runs: no reuse, every token computed, agreeing with the baseline.
    Above it, donors the check turns away cost a thrown-away pass (1.25 here)."""
    similarities = [0.9, 0.9, 0.5, 0.5, 0.5, 0.5]
    ran: list[int] = []

    def evaluate(i: int, plan: ReusePlan) -> tuple[bool, int, float, float]:
        ran.append(i)
        return True, 2, (0.5 if similarities[i] > 0.8 else 1.25), 0.0

    grid = cal.verified_candidates([cal.CandidatePlan(2, 0)], (0.01,), (0.8,))
    chosen, trials = cal.sweep(4, grid, [True] * 6, evaluate, similarities=similarities)
    assert chosen == cal.CandidatePlan(2, 0, accept_max=0.01, min_similarity=0.8)
    loose, floored = trials
    assert loose.tokens_fraction_mean == (2 * 0.5 + 4 * 1.25) / 6 and loose.passed  # passes, saves nothing
    assert floored.tokens_fraction_mean == (2 * 0.5 + 4 * 1.0) / 6
    assert ran == [0, 1, 2, 3, 4, 5, 0, 1]
    with pytest.raises(ValueError, match="similarities"):
        cal.sweep(4, grid, [True] * 6, evaluate)


def test_an_output_that_kept_a_stage1_donor_is_paired_with_the_donor_seed_s_clip() -> None:
    """A Stage-1 output is the donor noise's sample: a fragile clip the target seed got right and the donor's seed
    got wrong is not charged to the reuse. A donor turned away runs from the target's own noise: paired with
    the target seed's clip."""
    baseline = [True] * 30 + [True, False]  # the target seeds
    donor_baseline = [True] * 30 + [False, True]  # the same prompts from the donors' seeds
    kept = [True] * 31 + [False]

    def evaluate(i: int, plan: ReusePlan) -> cal.Evaluated:
        # reuse reproduces what its own noise gives without reuse
        return cal.Evaluated(donor_baseline[i] if kept[i] else baseline[i], 1, 0.25, 0.25, kept[i])

    chosen, [trial] = cal.sweep(
        4, [cal.CandidatePlan(3, 0)], baseline, evaluate, donor_baseline=donor_baseline
    )
    assert chosen == cal.CandidatePlan(3, 0) and (trial.lost, trial.gained) == (0, 0)
    # paired with the target seeds only, the same outputs lose a clip: churn, rejected at 32 pairs
    chosen, [trial] = cal.sweep(4, [cal.CandidatePlan(3, 0)], baseline, evaluate)
    assert chosen is None and trial.lost == 1


def test_the_paired_bound_charges_churn_that_a_net_count_would_let_pass() -> None:
    """Three clips lost and three gained nets to zero, but says the plan re-rolls fragile clips: rejected. No
    discordant clip, or only gains, passes; a single loss needs several gains to be forgiven."""
    tol = 0.01
    assert cal.paired_loss_bound(0, 0, 64) == 0.0
    assert cal.paired_loss_bound(3, 3, 64) > tol
    assert cal.paired_loss_bound(0, 1, 100) <= tol
    assert (
        cal.paired_loss_bound(0, 1, 32) < 0 and cal.paired_loss_bound(0, 5, 32) < 0
    )  # gains alone never fail
    assert cal.paired_loss_bound(1, 0, 100) > tol
    assert cal.paired_loss_bound(1, 1, 100) > tol
    assert cal.paired_loss_bound(1, 6, 100) <= tol
    baseline = [i % 2 == 0 for i in range(64)]

    def churn(i: int, plan: ReusePlan) -> tuple[bool, int, float, float]:
        # wrong where no reuse was right for i in {0, 2, 4}, right where it was wrong for i in {1, 3, 5}
        return (not baseline[i]) if i < 6 else baseline[i], 2, 0.5, 0.5

    chosen, [trial] = cal.sweep(4, [cal.CandidatePlan(2, 0)], baseline, churn)
    assert chosen is None and not trial.passed and (trial.lost, trial.gained) == (3, 3)
    # the net count would have called it even; it is stopped once no gain left could rescue it
    assert trial.wrong == sum(not b for b in baseline[: trial.evaluated])


def test_written_table_is_what_the_planner_uses(tmp_path: Path) -> None:
    facts = _facts()
    rows = cal.derive_rows(facts)
    chosen = {
        "same-prompt": cal.CandidatePlan(3, 0),
        "one-attribute": cal.CandidatePlan(0, 2, 4.0, 0.3),
        "two-attributes": None,
        "paraphrase": cal.CandidatePlan(1, 0),
    }
    regimes = []
    for name, n, _ in cal.regime_bounds([4, 50]):
        scaled = {
            k: (None if c is None else cal.CandidatePlan(c.k1 * n // 4, c.k2 * n // 4, c.alpha, c.threshold))
            for k, c in chosen.items()
        }
        table_rows = [
            cal.table_row(r, n, scaled.get(r.name), {"steps": float(n)} if r.calibrated else None)
            for r in rows
        ]
        regimes.append((name, n, table_rows))
    table = cal.build_table(regimes, "chorus bench quality --calibrate (test)", "test")
    path = tmp_path / "calibration.json"
    write_calibration(table, path)
    loaded = load_calibration(path)
    assert not loaded.provisional and loaded.source.endswith("(test)")
    assert [(r.name, r.max_steps) for r in loaded.regimes] == [("few-step", 8), ("many-step", 1000)]
    planner = Planner(loaded)
    for n in (4, 50):
        for f in facts:
            choice = planner.plan(f.similarity, word_diff(f.pair.donor_prompt, f.pair.target.prompt), n)
            spec = cal.route(rows, f.similarity, f.content_changes)
            cand = None if spec is None else chosen.get(spec.name)
            if spec is None or cand is None:
                assert not choice.plan.reuses
                continue
            assert choice.row == spec.name
            assert choice.plan.stage1_steps == cand.k1 * n // 4
            assert choice.plan.stage2_steps == cand.k2 * n // 4
            assert choice.plan.alpha == cand.alpha


def test_regime_bounds() -> None:
    assert cal.regime_bounds([50, 4]) == [("few-step", 4, 8), ("many-step", 50, 1000)]
    assert cal.regime_bounds([2]) == [("few-step", 2, 1000)]
    with pytest.raises(ValueError):
        cal.regime_bounds([4, 6])


def test_the_shipped_table_reuses_no_held_out_pair_changing_three_or_more_attributes_unverified() -> None:
    # Every pair of held-out prompts (a caption stream apart from the calibration's negatives), planned the way
    # the scheduler plans: MiniLM similarity and the word diff. Only one- and two-attribute changes were measured.
    prompts = world.eval_prompts(150, seed=5)
    vectors = np.asarray(MiniLMEmbedder().embed([p for p, _ in prompts]), dtype=np.float64)
    table = load_calibration()
    planner = Planner(table)

    def verified(row: str | None, steps: int) -> bool:
        return any(r.name == row and r.verified for r in table.regime_for(steps).rows)

    reused: Counter[int] = Counter()
    for a, b in itertools.combinations(range(len(prompts)), 2):
        (target, ta), (donor, tb) = prompts[a], prompts[b]
        changed = sum(x != y for x, y in zip(ta.as_dict().values(), tb.as_dict().values(), strict=True))
        for steps in (4, 50):
            choice = planner.plan(float(vectors[a] @ vectors[b]), word_diff(donor, target), steps)
            if choice.reuses:
                reused[changed] += 1
                # more changes reach only a verified row: each such donor is checked by the model first
                assert changed <= 2 or verified(choice.row, steps), (target, donor, steps, choice.reason)
                assert choice.plan.verification is not None or choice.plan.stage1_steps == 0
    assert reused[1] > 0  # the rows do apply to what they measured (two attributes: no plan passed)
