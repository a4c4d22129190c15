from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chorus_sched.embedding import word_diff
from chorus_sched.planner import (
    CalibrationError,
    CalibrationTable,
    Planner,
    default_calibration_path,
    load_calibration,
    parse_calibration,
    write_calibration,
)

RED = "a red circle moving left on a white background"
BLUE = "a blue circle moving left on a white background"


def row(
    name: str, min_similarity: float, max_changes: int, k1: float, k2: float, **extra: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "min_similarity": min_similarity,
        "max_content_changes": max_changes,
        "k1": k1,
        "k2": k2,
        **extra,
    }


def table(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "format": "chorus-calibration/1",
        "provisional": False,
        "source": "test",
        "embedder": "hashing-384",
        "ignorable_words": ["a", "on", "the"],
        "regimes": [
            {"name": "few", "max_steps": 8, "rows": [row("same", 0.95, 0, 0.5, 0.0)]},
            {
                "name": "many",
                "max_steps": 1000,
                "rows": [row("same", 0.95, 0, 0.4, 0.2), row("one", 0.8, 1, 0.1, 0.2, alpha=2.0)],
            },
        ],
    }
    data.update(overrides)
    return data


def test_the_shipped_table_is_the_measured_one() -> None:
    shipped = load_calibration()
    assert default_calibration_path().name == "calibration.json"
    assert shipped.provisional is False and shipped.embedder == "all-minilm-l6-v2"
    assert shipped.source.startswith("chorus bench quality") and "--calibrate" in shipped.source
    # two measured regimes (calibrated at 4 and at 50 steps) cover every step count the catalog allows
    regimes = [shipped.regime_for(n).name for n in (1, 4, 8, 9, 50, 1000)]
    assert regimes == ["few-step"] * 3 + ["many-step"] * 3
    for regime in shipped.regimes:
        reusing = [r for r in regime.rows if r.k1 > 0 or r.k2 > 0]
        assert reusing
        for r in reusing:
            # accepted on enough measured pairs; the paired loss bound against no reuse on the same targets and
            # seeds (or the donor's own clip, where the donor was kept) within 1 point
            assert r.measured is not None and r.measured["pairs"] >= 8
            assert r.measured["loss_bound"] <= 0.01


def test_shipped_table_reuses_only_the_changes_it_measured() -> None:
    planner = Planner(load_calibration())
    same = planner.plan(1.0, word_diff(RED, RED), 4)
    assert same.reuses and same.row == "same-prompt" and same.plan.stage1_steps == 3
    assert planner.plan(1.0, word_diff(RED, RED), 50).plan.stage1_steps == 45
    swap = planner.plan(0.84, word_diff(RED, BLUE), 4)
    assert swap.reuses and swap.row == "one-attribute"
    assert swap.plan.stage1_steps == 0 and swap.plan.stage2_steps == 3 and swap.plan.alpha == 4.0
    # the same swap below every measured one-attribute similarity: refused, not handed to a wider row
    low = planner.plan(0.5, word_diff(RED, BLUE), 4)
    assert not low.reuses and "'unmeasured-small-change' admits similarity 0.500" in low.reason
    three = "a green square moving up on a white background"
    assert not planner.plan(0.8, word_diff(RED, three), 4).reuses
    # a paraphrase in other words (6 content words differ): the verified row, which the worker's model check
    # guards; below its calibrated similarity floor, refused
    paraphrase = "a crimson disc gliding leftward across a pale white backdrop"
    verified = planner.plan(0.75, word_diff(RED, paraphrase), 4)
    assert (
        verified.row == "paraphrase" and verified.plan.stage1_steps == 2 and verified.plan.stage2_steps == 0
    )
    assert verified.plan.verification is not None and verified.plan.verification.accept_max == 0.016
    assert not planner.plan(0.65, word_diff(RED, paraphrase), 4).reuses
    # at 50 steps the many-step regime's own verified row: a longer Stage 1, a lower floor, the same check
    many = planner.plan(0.65, word_diff(RED, paraphrase), 50)
    assert many.row == "paraphrase" and many.plan.stage1_steps == 35 and many.plan.verification is not None
    assert not planner.plan(0.3, word_diff(RED, paraphrase), 50).reuses
    # one rewording of three words is as many changes as three attributes: the blocker refuses it, unchecked
    short = "red ball drifting to the left, white backdrop"
    assert not planner.plan(0.9, word_diff(RED, short), 4).reuses


def test_first_admitting_row_decides_and_fractions_round_down() -> None:
    planner = Planner(CalibrationTable.model_validate(table()))
    choice = planner.plan(0.97, word_diff("a red circle", "red circle"), 10)  # only an ignorable word differs
    assert choice.row == "same" and choice.regime == "many"
    assert (choice.plan.stage1_steps, choice.plan.stage2_steps, choice.plan.stage3_steps) == (4, 2, 4)
    choice = planner.plan(0.9, word_diff(RED, BLUE), 10)
    assert choice.row == "one" and choice.plan.alpha == 2.0
    assert (choice.plan.stage1_steps, choice.plan.stage2_steps) == (1, 2)
    refused = planner.plan(0.79, word_diff(RED, BLUE), 10)
    assert not refused.reuses and "no many row admits similarity 0.790" in refused.reason


def test_a_row_whose_fractions_round_to_nothing_gives_a_full_plan() -> None:
    planner = Planner(CalibrationTable.model_validate(table()))
    choice = planner.plan(1.0, word_diff(RED, RED), 1)
    assert not choice.reuses
    assert choice.plan.stage3_steps == 1
    assert "round to no reused step at N=1" in choice.reason


fractions = st.floats(0.0, 1.0, allow_nan=False)


@given(
    k1=fractions,
    k2=fractions,
    n=st.integers(1, 1000),
    similarity=st.floats(-1.0, 1.0, allow_nan=False),
    changes=st.integers(0, 3),
)
def test_every_plan_covers_n_steps_with_stage3_at_least_one(
    k1: float, k2: float, n: int, similarity: float, changes: int
) -> None:
    if k1 + k2 >= 1.0:
        with pytest.raises(CalibrationError, match="k1 \\+ k2 must be below 1"):
            parse_calibration(
                json.dumps(
                    table(regimes=[{"name": "all", "max_steps": 1000, "rows": [row("r", -1.0, 3, k1, k2)]}])
                )
            )
        return
    data = table(regimes=[{"name": "all", "max_steps": 1000, "rows": [row("r", -1.0, 3, k1, k2)]}])
    planner = Planner(parse_calibration(json.dumps(data)))
    target = " ".join(["x"] * changes) + " red circle"
    choice = planner.plan(similarity, word_diff("red circle", target), n)
    plan = choice.plan
    assert plan.num_steps == n
    assert plan.stage3_steps >= 1
    assert plan.stage1_steps <= k1 * n and plan.stage2_steps <= k2 * n


def write(tmp_path: Path, content: str) -> Path:
    path = tmp_path / "calibration.json"
    path.write_text(content)
    return path


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
        ("[]", "not a valid calibration table"),
        (json.dumps(table(format="chorus-calibration/2")), "format"),
        (json.dumps(table(regimes=[])), "regimes"),
        (json.dumps(table(extra_field=1)), "extra_field"),
        (
            json.dumps(table(regimes=[{"name": "all", "max_steps": 50, "rows": []}])),
            "the last regime must reach max_steps 1000",
        ),
        (
            json.dumps(
                table(
                    regimes=[
                        {"name": "a", "max_steps": 1000, "rows": []},
                        {"name": "b", "max_steps": 8, "rows": []},
                    ]
                )
            ),
            "strictly increasing max_steps",
        ),
        (
            json.dumps(
                table(
                    regimes=[
                        {
                            "name": "all",
                            "max_steps": 1000,
                            "rows": [row("loose", 0.5, 2, 0.1, 0.1), row("strict", 0.9, 0, 0.5, 0.1)],
                        }
                    ]
                )
            ),
            "row 'strict' can never apply",
        ),
        (
            json.dumps(
                table(
                    regimes=[
                        {"name": "all", "max_steps": 1000, "rows": [row("r", 0.9, 0, 0.2, 0.1, alpha=0.5)]}
                    ]
                )
            ),
            "alpha",
        ),
        (
            json.dumps(
                table(
                    regimes=[
                        {
                            "name": "all",
                            "max_steps": 1000,
                            "rows": [
                                row("r", 0.9, 0, 0.2, 0.1, min_active_fraction=0.9, max_active_fraction=0.1)
                            ],
                        }
                    ]
                )
            ),
            "min_active_fraction exceeds max_active_fraction",
        ),
    ],
)
def test_a_bad_file_is_a_clear_error_naming_the_file(tmp_path: Path, content: str, message: str) -> None:
    path = write(tmp_path, content)
    with pytest.raises(CalibrationError) as excinfo:
        load_calibration(path)
    assert str(path) in str(excinfo.value)
    assert message in str(excinfo.value)


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="cannot read the calibration table"):
        load_calibration(tmp_path / "nope.json")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=16,
)


@given(st.one_of(st.text(max_size=200), json_values.map(json.dumps)))
def test_any_text_either_loads_or_fails_with_calibration_error(text: str) -> None:
    try:
        parse_calibration(text)
    except CalibrationError as exc:
        assert str(exc).startswith("<calibration>: ")


@given(
    st.lists(
        st.tuples(st.floats(0.0, 0.49), st.floats(0.0, 0.49), st.floats(1.0, 20.0)),
        min_size=1,
        max_size=4,
    )
)
def test_written_tables_load_back_equal(rows: list[tuple[float, float, float]]) -> None:
    import tempfile

    data = table(
        regimes=[
            {
                "name": "all",
                "max_steps": 1000,
                "rows": [
                    row(f"r{i}", 0.99 - 0.1 * i, i, k1, k2, alpha=a) for i, (k1, k2, a) in enumerate(rows)
                ],
            }
        ]
    )
    original = CalibrationTable.model_validate(data)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sub" / "calibration.json"
        write_calibration(original, path)
        assert load_calibration(path) == original
        assert [p.name for p in path.parent.iterdir()] == ["calibration.json"]  # no temporary left behind


def test_an_embedders_margin_raises_every_threshold_and_survives_the_gate() -> None:
    planner = Planner(CalibrationTable.model_validate(table()))
    assert planner.plan(0.803, word_diff(RED, BLUE), 10).row == "one"  # 0.8 admits it
    wide = planner.widened(0.005)
    refused = wide.plan(0.803, word_diff(RED, BLUE), 10)
    assert (
        refused.row is None and "unverified rows take it less the embedder's margin 0.005" in refused.reason
    )
    admitted = wide.plan(0.806, word_diff(RED, BLUE), 10)
    assert admitted.row == "one" and "0.806 less the embedder's margin 0.005 ≥ 0.8" in admitted.reason
    assert wide.widened(0.001) is wide and planner.widened(0.0) is planner  # only ever wider
    assert wide.gated(_AlwaysGate()).similarity_margin == 0.005
    with pytest.raises(ValueError, match="≥ 0"):
        Planner(planner.table, similarity_margin=-0.1)


class _AlwaysGate:
    def allows(self, model: str, regime: str, similarity: float, stage1_steps: int) -> bool:
        return True

    def chosen(self, model: str, regime: str, similarity: float, stage1_steps: int) -> None:
        return None
