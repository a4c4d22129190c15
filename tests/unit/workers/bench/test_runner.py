"""The runner: one request through the engine, checked, with its measured compute."""

from __future__ import annotations

import pytest

from producer.contract import ReusePlan
from workers.bench.runner import QualityRunner, Row, wilson
from workers.engine import load_bundle
from workers.toy.world import Attributes

EXPECTED = Attributes("red", "circle", "left", "white")


def test_runner_checks_and_measures_and_judges_chosen_attributes() -> None:
    runner = QualityRunner(load_bundle("tiny-random-wan"), 1.0, judge=("background",))
    try:
        donor = runner.run(
            "a red circle moving left on a white background", 1, 4, EXPECTED, keep_trajectory=True
        )
        assert donor.trajectory is not None and donor.frames is None
        assert donor.correct["all"] == donor.correct["background"]
        assert donor.steps_computed == 4 and donor.block_fraction == 1.0 and not donor.reused
        plan = ReusePlan(stage1_steps=2, stage2_steps=0, stage3_steps=2)
        out = runner.run(
            "a red circle moving left on a white background",
            2,
            4,
            EXPECTED,
            plan=plan,
            donor=donor.trajectory,
        )
        assert out.reused and out.steps_computed == 2 and out.block_fraction == pytest.approx(0.5)
        row = Row("chorus@4", "chorus", 4)
        row.add(out)
        summary = row.summary([donor.correct["all"]])
        assert summary["n"] == 1 and summary["steps_computed_mean"] == 2.0
        assert summary["delta_all_vs_no_reuse"] == summary["accuracy"]["all"] - float(donor.correct["all"])
    finally:
        runner.close()
    with pytest.raises(ValueError):
        QualityRunner(load_bundle("tiny-random-wan"), 1.0, judge=("size",))


def test_wilson_interval() -> None:
    lo, hi = wilson(60, 64)
    assert 0.84 < lo < 0.86 and 0.97 < hi < 0.98
    assert wilson(0, 0) == (0.0, 1.0)
