"""The calibration's bookkeeping for verified rows: which negatives are measured with a row, what the model's
check decided per class, and how many negatives kept their donor and lost an attribute."""

from __future__ import annotations

from workers.bench.pair_facts import PairFacts
from workers.bench.pairs import eval_targets, make_negative_pairs, make_pairs
from workers.bench.suite_calibration import (
    Checked,
    negative_harm,
    sample_by_class,
    target_key,
    verification_counts,
)


def _negatives() -> list[PairFacts]:
    return [PairFacts(p, 0.5, 6) for p in make_negative_pairs(eval_targets(4), seed=2)]


def test_sample_by_class_takes_from_every_class_in_turn() -> None:
    negatives = _negatives()  # 5 classes x 4 targets
    sample = sample_by_class(negatives, 7)
    classes = [f.pair.pair_class for f in sample]
    assert len(sample) == 7 and len(set(classes[:5])) == 5  # one of each before a second of any
    assert sorted(map(id, sample_by_class(negatives, 100))) == sorted(map(id, negatives))
    assert sample_by_class(negatives, 0) == []


def test_negative_harm_counts_kept_donors_that_lost_what_no_reuse_got_right() -> None:
    pairs = [PairFacts(p, 0.6, 6) for p in make_pairs(eval_targets(2), ["paraphrase"])]
    items = [*pairs, *_negatives()[:4]]
    baseline = [True, True, True, True, False, True]
    checked = {
        0: Checked("accepted", True, True),
        1: Checked("accepted", True, False),  # a paraphrase lost: not a negative, not counted here
        2: Checked("rejected", False, True),
        3: Checked("accepted", True, False),  # harmed
        4: Checked("shortened", True, False),  # kept its donor, but no reuse was wrong too
        # 5 not evaluated (the sweep stopped early)
    }
    harm = negative_harm(items, baseline, checked, first_negative=2)
    assert harm == {"negatives_measured": 3, "negatives_reused": 2, "negatives_harmed": 1}
    counts = verification_counts(items, checked)
    assert counts["paraphrase"] == {"accepted": 2}
    assert sum(sum(c.values()) for c in counts.values()) == 5


def test_targets_of_different_sets_do_not_collide() -> None:
    a, b = eval_targets(1)[0], eval_targets(1, set_seed=2, seed_base=4_000_000)[0]
    assert a.index == b.index and target_key(a) != target_key(b)
