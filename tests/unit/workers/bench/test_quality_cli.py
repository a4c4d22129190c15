"""`chorus bench quality --quick` end to end on a tiny random toy model: JSON with the documented keys, a
calibration table the planner loads and uses, a contact sheet of the reported size."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image
from typer.testing import CliRunner

from chorus_sched.embedding import word_diff
from chorus_sched.planner import Planner, load_calibration
from producer.cli import app
from workers.bench.pairs import eval_targets
from workers.bench.suite_rows import SERVED

TOP_KEYS = {
    "format",
    "command",
    "started_at",
    "wall_s",
    "model",
    "settings",
    "calibration",
    "calibration_table",
    "pair_classes",
    "rows",
    "targets",
    "contact_sheets",
}
ROW_KEYS = {
    "id",
    "method",
    "steps",
    "pair_class",
    "description",
    "n",
    "accuracy",
    "all_correct_ci95",
    "steps_computed_mean",
    "tokens_computed_fraction_mean",
    "block_compute_fraction_mean",
    "reused_fraction",
    "fallbacks",
    "seconds_mean",
}


def test_quick_bench_with_calibration(tiny_toy_weights: Path, tmp_path: Path) -> None:
    table_path = tmp_path / "calibration.json"
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "quality",
            "--quick",
            "--json",
            "--calibrate",
            "--weights-dir",
            str(tiny_toy_weights),
            "--calibration-out",
            str(table_path),
            "--out-dir",
            str(tmp_path / "sheets"),
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report == json.loads(out.read_text())
    assert set(report) == TOP_KEYS and report["format"] == "chorus-bench-quality/1"
    assert report["model"]["weights_dir"] == str(tiny_toy_weights)
    methods = {r["method"] for r in report["rows"]}
    assert methods >= {"no-reuse", "cachedit", "chorus", "probe", "chorus+cachedit"}
    for row in report["rows"]:
        assert set(row) >= ROW_KEYS
        assert set(row["accuracy"]) == {"color", "shape", "direction", "background", "all"}
        if row["method"] != "no-reuse":
            assert {"no_reuse_all", "delta_all_vs_no_reuse", "lost", "gained"} <= set(row)
        if (
            "cachedit" in row["method"] and row["pair_class"] != "same-prompt"
        ):  # served whole: no cache-dit run
            assert row["cachedit"]["skips_verified"]
    assert set(report["pair_classes"]) == {
        "same-prompt",
        "one-attribute",
        "two-attributes",
        "paraphrase",
        "reworded-one-attribute",
    }
    assert report["pair_classes"]["same-prompt"]["similarity"]["min"] > 0.99
    assert "chorus_within_1pt_2" in report["targets"]

    # the calibration table: valid, measured, and the one the chorus rows planned with
    table = load_calibration(table_path)
    assert not table.provisional and "--calibrate" in table.source
    assert report["calibration_table"]["path"] == str(table_path)
    assert report["calibration"]["written_to"] == str(table_path)
    rows = {r.name: r for r in table.regimes[0].rows}
    assert rows["same-prompt"].measured is not None
    # the random model gets nothing right with or without reuse, so the most aggressive plan passes
    assert rows["same-prompt"].k1 == 0.5
    prompt = eval_targets(1)[0].prompt
    choice = Planner(table).plan(1.0, word_diff(prompt, prompt), 2)
    assert choice.row == "same-prompt" and choice.plan.stage1_steps == 1
    # the very same caption with another seed is served the donor's video (chorus_sched.exact): nothing computed
    # and no donor check, whatever the row's plan
    [same] = [r for r in report["rows"] if r["id"] == "chorus/same-prompt@2"]
    assert same["reused_fraction"] == 1.0 and same["steps_computed_mean"] == 0.0
    assert same["tokens_computed_fraction_mean"] == 0.0 and same["plans"] == {SERVED: same["n"]}
    assert "verification" not in same

    # the paraphrase row is verified; the negatives it admits were generated with it, and the benchmark's own
    # negatives were planned (and generated where the planner reuses)
    para = next(r for r in report["calibration"]["rows"] if r["name"] == "paraphrase")
    assert para["verified"] and sum(para["measured_negatives"].values()) > 0
    assert any(r.verified for r in table.regimes[0].rows)
    [negatives] = [r for r in report["rows"] if r["id"] == "chorus/negatives@2"]
    assert negatives["negative_pairs"] == 2 * 5 and negatives["planned_reuse"] == negatives["n"]
    assert 0 <= negatives["harmed"] <= negatives["kept_donor"] <= negatives["n"]

    [sheet] = report["contact_sheets"]
    with Image.open(sheet["path"]) as image:
        assert list(image.size) == sheet["size"]
