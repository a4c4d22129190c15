"""The evaluation set and donor pair classes."""

from __future__ import annotations

from collections import Counter

from chorus_sched.embedding import word_diff
from chorus_sched.planner import load_calibration
from workers.bench.pairs import NEGATIVE_CLASSES, PAIR_CLASSES, eval_targets, make_negative_pairs, make_pairs
from workers.toy import world

IGNORABLE = frozenset(load_calibration().ignorable_words)


def test_eval_targets_use_held_out_templates_and_cover_values_evenly() -> None:
    targets = eval_targets(24, 2)
    assert len(targets) == 48 and [t.index for t in targets] == list(range(48))
    assert len({t.seed for t in targets}) == 48
    assert all(t.caption.template in world.EVAL_TEMPLATES for t in targets)
    for name in world.ATTRIBUTE_NAMES:
        counts = Counter(getattr(t.attributes, name) for t in targets[::2])
        assert len(counts) > 1 and max(counts.values()) - min(counts.values()) <= 1
    assert set(Counter(t.attributes.color for t in targets)) == set(world.FG_COLORS)
    assert targets == eval_targets(24, 2)  # deterministic
    calibration = eval_targets(24, 2, set_seed=1, seed_base=3_000_000)
    assert not {t.seed for t in targets} & {t.seed for t in calibration}


def test_pair_classes_differ_exactly_as_named() -> None:
    targets = eval_targets(16)
    pairs = make_pairs(targets)
    assert Counter(p.pair_class for p in pairs) == dict.fromkeys(PAIR_CLASSES, 16)
    for p in pairs:
        t = p.target
        assert p.donor_seed != t.seed
        changes = word_diff(p.donor_prompt, t.prompt).content_changes(IGNORABLE)
        differ = {k for k, v in p.donor.attributes.as_dict().items() if v != t.attributes.as_dict()[k]}
        assert differ == set(p.changed)
        if p.pair_class == "same-prompt":
            assert p.donor_prompt == t.prompt and changes == 0
        elif p.pair_class in ("one-attribute", "two-attributes"):
            assert p.donor.template == t.caption.template
            assert len(p.changed) == (1 if p.pair_class == "one-attribute" else 2)
            assert changes == len(p.changed)
        elif p.pair_class == "paraphrase":
            assert p.donor.attributes == t.attributes and p.donor_prompt != t.prompt
            assert p.donor.template != t.caption.template
        else:
            assert len(p.changed) == 1 and p.donor.template != t.caption.template
    assert pairs == make_pairs(targets)
    # every attribute gets changed in the one-attribute class
    assert {p.changed[0] for p in pairs if p.pair_class == "one-attribute"} == set(world.ATTRIBUTE_NAMES)


def test_negative_pairs_change_what_no_class_measures() -> None:
    targets = eval_targets(16)
    pairs = make_negative_pairs(targets, seed=3)
    assert Counter(p.pair_class for p in pairs) == dict.fromkeys(NEGATIVE_CLASSES, 16)
    wanted = {
        "three-attributes": (3, False),
        "four-attributes": (4, False),
        "reworded-two-attributes": (2, True),
        "reworded-three-attributes": (3, True),
        "reworded-four-attributes": (4, True),
    }
    for p in pairs:
        t = p.target
        count, reworded = wanted[p.pair_class]
        differ = {k for k, v in p.donor.attributes.as_dict().items() if v != t.attributes.as_dict()[k]}
        assert differ == set(p.changed) and len(differ) == count
        assert p.donor_seed != t.seed
        changes = word_diff(p.donor_prompt, t.prompt).content_changes(IGNORABLE)
        if reworded:
            assert p.donor.template != t.caption.template and changes > count
        else:
            # the same words but the changed attributes': beyond the two-attribute class, within the blocker
            assert p.donor.template == t.caption.template and changes == count
    assert pairs == make_negative_pairs(targets, seed=3)
    assert pairs != make_negative_pairs(targets, seed=4)
