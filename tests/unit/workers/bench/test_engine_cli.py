"""``chorus bench engine`` (``workers/bench/engine_cli.py``) on the tiny model."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from producer.cli import app

runner = CliRunner()


def test_bench_engine_json_tiny():
    r = runner.invoke(
        app,
        ["bench", "engine", "--json", "--configs", "tiny", "--num-steps", "3", "--repeats", "1", "--no-fail"],
    )
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    (cfg,) = report["configs"]
    assert cfg["config"] == "tiny" and cfg["full_step"]["wall_s"] > 0 and cfg["full_step"]["n"] == 2
    assert [row["active_fraction"] for row in cfg["srd"]] == [0.25, 0.5]
    assert all(row["achieved_active_fraction"] == row["active_fraction"] for row in cfg["srd"])
    assert all(row["step"]["n"] == 1 for row in cfg["srd"])
    assert set(cfg["transformer_pass"]) == {"full", "0.25", "0.5"}
    assert cfg["trajectory_bytes_per_request"]["float16"] < cfg["trajectory_bytes_per_request"]["float32"]
