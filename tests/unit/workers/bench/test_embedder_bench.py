"""``chorus bench embedder``: bfloat16 MiniLM against float32 on the quality benchmark's pairs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from producer.cli import app


@pytest.mark.slow
def test_embedder_bench_reports_cpu_shifts_and_the_decisions_that_differ(tmp_path) -> None:
    out = tmp_path / "embedder.json"
    result = CliRunner().invoke(app, ["bench", "embedder", "--captions", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["command"].startswith("chorus bench embedder")  # argv is the runner's, not a shell's
    assert report["decisions"] == 2 * report["pairs"] > 0
    assert 0 < report["similarity_shift"]["max"] <= report["tolerance"] == report["margin_applied"]
    assert report["reuses_more"]["into_unverified_rows"] == 0  # the margin's promise
    auto = report["machine"]["auto"]  # what auto picked here, timed only where the CPU has the instructions
    assert auto["numbers"] in ("float32", "bfloat16")
    assert (auto["probe_timings"] is not None) == report["machine"]["bf16_hardware"]
    for precision in ("float32", "bfloat16"):
        assert set(report["cpu_ms_per_prompt"][precision]) == {"batch_32", "batch_1"}
    counted = sum(v for k, v in report["reuses_less"].items() if k != "total")
    assert counted == report["reuses_less"]["total"]
