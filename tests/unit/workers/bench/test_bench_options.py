"""The benchmarks' options (issue 19): the contract's names with the older ones as hidden aliases, repeatable
lists that still take the comma form, a calibration written only where asked, and ``bench engine``'s exit code
and progress."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from producer.cli import app
from workers.bench import engine_cli
from workers.bench.quality import DEFAULT_STEPS, _as_given

runner = CliRunner()

_QUALITY_DEFAULTS: dict[str, Any] = {
    "num_steps": None,
    "steps": None,
    "guidance_scale": None,
    "guidance": None,
    "rows": ["no-reuse", "chorus"],
    "classes": ["same-prompt"],
    "ablation_alphas": ["1"],
    "cachedit_thresholds": ["0.08"],
    "judge": ["color"],
}


def test_quality_lists_repeat_or_take_commas_and_old_names_still_work() -> None:
    given = _as_given(
        **{
            **_QUALITY_DEFAULTS,
            "num_steps": ["4", "20,50"],
            "rows": ["chorus,tgaa", "sheet"],
            "judge": ["color", "shape"],
            "guidance": 3.0,
        }
    )
    assert given["steps"] == "4,20,50" and given["rows"] == "chorus,tgaa,sheet"
    assert given["judge"] == "color,shape" and given["guidance"] == 3.0
    assert _as_given(**{**_QUALITY_DEFAULTS, "steps": ["8"]})["steps"] == "8"
    assert _as_given(**_QUALITY_DEFAULTS)["steps"] == DEFAULT_STEPS
    assert _as_given(**{**_QUALITY_DEFAULTS, "rows": [""]})["rows"] == ""  # '' still means no rows


def test_quality_refuses_a_value_under_both_names() -> None:
    result = runner.invoke(app, ["bench", "quality", "--num-steps", "4", "--steps", "8"])
    assert result.exit_code == 2
    assert "give --num-steps once" in result.output


def test_quality_says_up_front_that_cache_dit_rows_need_the_bench_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(  # as installed without the bench extra
        importlib.util, "find_spec", lambda name, *a: None if name == "cache_dit" else find_spec(name, *a)
    )
    result = runner.invoke(app, ["bench", "quality", "--quick", "--rows", "no-reuse,cachedit"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    said = " ".join(result.output.split())
    assert "needs cache-dit" in said and "--rows no-reuse" in said


def test_calibrating_without_calibration_out_writes_no_table(tiny_toy_weights: Path, tmp_path: Path) -> None:
    from chorus_sched.planner import default_calibration_path

    packaged = default_calibration_path()
    before = packaged.read_bytes()
    result = runner.invoke(
        app,
        [
            "bench",
            "quality",
            "--quick",
            "--json",
            "--calibrate",
            "--rows",
            "",
            "--weights-dir",
            str(tiny_toy_weights),
            "--out-dir",
            str(tmp_path / "sheets"),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert packaged.read_bytes() == before
    assert report["calibration"]["written_to"] is None
    assert report["calibration"]["table"]["regimes"]
    assert "not written" in report["calibration_table"]["path"]


def _report(meets: list[bool]) -> dict[str, Any]:
    row = {"ratio_wall": 0.9, "ratio_cpu": 0.9, "target_ratio": 0.35, "step": {"wall_s": 0.1}}
    srd = [{**row, "active_fraction": f, "meets_target": m} for f, m in zip((0.25, 0.5), meets, strict=True)]
    return {
        "configs": [
            {
                "config": "tiny",
                "request": {"tokens": 8},
                "full_step": {"wall_s": 0.1},
                "srd": srd,
                "transformer_pass": {"0.25": {"ratio_wall": 0.5}, "0.5": {"ratio_wall": 0.6}},
                "trajectory_bytes_per_request": {"float32": 8, "float16": 4},
            }
        ]
    }


@pytest.mark.parametrize(
    ("meets", "args", "code"),
    [([True, True], [], 0), ([True, False], [], 1), ([True, False], ["--no-fail"], 0)],
)
def test_bench_engine_fails_when_a_row_misses_its_target_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, meets: list[bool], args: list[str], code: int
) -> None:
    from workers.bench import engine_bench

    monkeypatch.setattr(engine_bench, "run_bench", lambda names, **_: _report(meets))
    result = runner.invoke(app, ["bench", "engine", "--configs", "tiny", *args])
    assert result.exit_code == code, result.output
    assert ("missed the target" in result.output) == (not all(meets))
    assert ("tiny at f=0.5" in result.output) == (not all(meets))


def test_bench_engine_configs_repeat_and_old_names_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.bench import engine_bench

    seen: dict[str, Any] = {}

    def run_bench(names: list[str], *, steps: int, repeats: int, log: Any) -> dict[str, Any]:
        seen.update(names=names, steps=steps, repeats=repeats)
        return _report([True, True])

    monkeypatch.setattr(engine_bench, "run_bench", run_bench)
    result = runner.invoke(app, ["bench", "engine", "--configs", "tiny", "--configs", "mid", "--steps", "5"])
    assert result.exit_code == 0, result.output
    assert seen == {"names": ["tiny", "mid"], "steps": 5, "repeats": 3}
    result = runner.invoke(app, ["bench", "engine", "--configs", "tiny,mid", "--num-steps", "6"])
    assert result.exit_code == 0, result.output
    assert seen == {"names": ["tiny", "mid"], "steps": 6, "repeats": 3}


def test_the_progress_bar_counts_every_phase_the_bench_logs() -> None:
    from workers.bench.engine_bench import run_bench

    messages: list[str] = []
    run_bench(["tiny"], steps=3, repeats=2, log=messages.append)
    assert len(messages) == engine_cli.phase_count(1, 2)
    with engine_cli._progress(1, 2, enabled=True) as log:  # the bar takes them all
        for message in messages:
            log(message)
