"""The runner: one request through the engine, checked, with its measured compute."""

from __future__ import annotations

import pytest

from producer.contract import ReusePlan
from workers.bench.runner import Outcome, QualityRunner, Row, wilson
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


def _outcome(ok: bool, changed: tuple[str, ...], stage2: tuple[float, ...]) -> Outcome:
    correct = {"color": True, "shape": True, "direction": True, "background": True, "all": ok}
    return Outcome(
        correct=correct,
        read={},
        steps_requested=4,
        steps_computed=3,
        tokens_fraction=0.5,
        block_fraction=0.5,
        reused=True,
        stage2_fractions=stage2,
        changed=changed,
    )


def test_row_summary_reports_what_stage_2_recomputed_per_changed_attribute() -> None:
    row = Row("chorus/one-attribute@4", "chorus", 4, "one-attribute")
    row.add(_outcome(True, ("color",), (0.2, 0.3)))
    row.add(_outcome(False, ("color",), (0.4,)))
    row.add(_outcome(True, ("background",), (1.0, 1.0)))
    row.add(_outcome(True, ("background",), ()))
    summary = row.summary([True, True, True, False])
    assert summary["stage2_steps"] == 5
    assert summary["stage2_active_fraction_mean"] == pytest.approx((0.2 + 0.3 + 0.4 + 2.0) / 5)
    by = summary["by_changed"]
    assert set(by) == {"color", "background"}
    assert by["color"]["stage2_active_fraction_mean"] == pytest.approx(0.3)
    assert by["color"]["all_correct"] == 0.5 and by["color"]["no_reuse_all"] == 1.0
    assert by["background"]["stage2_active_fraction_mean"] == 1.0 and by["background"]["n"] == 2
    plain = Row("no-reuse@4", "no-reuse", 4)
    plain.add(_outcome(True, (), ()))
    assert "by_changed" not in plain.summary() and plain.summary()["stage2_active_fraction_mean"] is None
