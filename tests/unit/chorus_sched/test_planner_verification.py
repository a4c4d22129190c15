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
