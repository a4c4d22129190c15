"""The calibration table's ``verification`` thresholds reach the plans that reuse Stage 1 (and only those)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from chorus_sched.embedding import word_diff
from chorus_sched.planner import (
    CalibrationError,
    Planner,
    VerificationThresholds,
    parse_calibration,
    write_calibration,
)

RED = "a red circle moving left on a white background"


def _table(**extra: Any) -> dict[str, Any]:
    rows = [
        {"name": "same", "min_similarity": 0.95, "max_content_changes": 0, "k1": 0.5, "k2": 0.0},
        {"name": "near", "min_similarity": 0.9, "max_content_changes": 1, "k1": 0.0, "k2": 0.5},
    ]
    return {
        "format": "chorus-calibration/1",
        "provisional": False,
        "source": "test",
        "embedder": "hashing-384",
        "regimes": [
            {"name": "few", "max_steps": 8, "rows": rows},
            {"name": "many", "max_steps": 1000, "rows": rows},
        ],
        **extra,
    }


def _verification(planner: Planner, steps: int, similarity: float = 1.0) -> Any:
    return planner.plan(similarity, word_diff(RED, RED), steps).plan.verification


def test_a_table_without_the_section_verifies_stage1_plans_with_the_defaults() -> None:
    planner = Planner(parse_calibration(json.dumps(_table())))
    default = VerificationThresholds()
    policy = _verification(planner, 4)
    assert policy is not None
    assert (policy.accept_max, policy.shorten_max, policy.shorten_fraction) == (
        default.accept_max,
        default.shorten_max,
        default.shorten_fraction,
    )
    # a Stage-2-only plan commits to no donor step: nothing to verify
    near = planner.plan(0.92, word_diff(RED, RED.replace("red", "blue")), 4)
    assert near.reuses and near.plan.stage1_steps == 0 and near.plan.verification is None


def test_regime_thresholds_override_the_table_and_can_switch_it_off(tmp_path: Path) -> None:
    data = _table(verification={"accept_max": 0.02, "shorten_max": 0.02})  # no shorten band
    data["regimes"][1]["verification"] = {"enabled": False}
    path = tmp_path / "table.json"
    write_calibration(parse_calibration(json.dumps(data)), path)  # the section survives a round trip
    planner = Planner(parse_calibration(path.read_text()))
    few = _verification(planner, 4)
    assert few is not None and few.accept_max == 0.02 and few.shorten_max == 0.02
    assert _verification(planner, 50) is None


def test_a_shorten_band_below_the_accept_bound_is_refused() -> None:
    with pytest.raises(CalibrationError, match="shorten_max must not be below accept_max"):
        parse_calibration(json.dumps(_table(verification={"accept_max": 0.05, "shorten_max": 0.01})))


def _with_verified_row(**extra: Any) -> dict[str, Any]:
    table = _table(**extra)
    loose = {
        "name": "reworded",
        "min_similarity": 0.3,
        "max_content_changes": 9,
        "k1": 0.75,
        "k2": 0.0,
        "verified": True,
    }
    for regime in table["regimes"]:
        regime["rows"] = [*regime["rows"], loose]
    return table


def test_a_verified_row_applies_only_while_the_worker_checks_donors() -> None:
    other_words = "a crimson ring drifting leftward over a pale backdrop"
    on = Planner(parse_calibration(json.dumps(_with_verified_row())))
    choice = on.plan(0.5, word_diff(other_words, RED), 4)
    assert choice.row == "reworded" and choice.plan.stage1_steps == 3
    assert choice.plan.verification is not None and "verifies the donor" in choice.reason
    off = Planner(parse_calibration(json.dumps(_with_verified_row(verification={"enabled": False}))))
    refused = off.plan(0.5, word_diff(other_words, RED), 4)
    assert not refused.reuses and refused.row is None
    # rows that stand on similarity alone still reuse without the check
    assert off.plan(1.0, word_diff(RED, RED), 4).reuses


def test_a_verified_row_without_a_stage1_is_refused() -> None:
    table = _with_verified_row()
    table["regimes"][0]["rows"][-1].update({"k1": 0.0, "k2": 0.5})
    with pytest.raises(CalibrationError, match="verified row needs a Stage 1"):
        parse_calibration(json.dumps(table))


def test_a_row_s_own_thresholds_override_the_regime_s() -> None:
    table = _with_verified_row(verification={"accept_max": 0.02, "shorten_max": 0.05})
    table["regimes"][0]["rows"][-1]["verification"] = {"accept_max": 0.008, "shorten_max": 0.008}
    planner = Planner(parse_calibration(json.dumps(table)))
    own = planner.plan(0.5, word_diff("a crimson ring drifting leftward over a pale backdrop", RED), 4)
    assert own.plan.verification is not None
    assert (own.plan.verification.accept_max, own.plan.verification.shorten_max) == (0.008, 0.008)
    table_wide = _verification(planner, 4)
    assert table_wide is not None and table_wide.accept_max == 0.02


def test_the_embedders_margin_leaves_a_verified_rows_floor_to_the_model_check() -> None:
    other_words = "a crimson ring drifting leftward over a pale backdrop"
    wide = Planner(parse_calibration(json.dumps(_with_verified_row()))).widened(0.005)
    at_floor = wide.plan(0.302, word_diff(other_words, RED), 4)  # 0.3 admits it; the margin is not applied
    assert at_floor.row == "reworded" and "margin" not in at_floor.reason
