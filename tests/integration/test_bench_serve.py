"""``chorus bench serve`` through its Python API on the embedded stack, scaled down: the tiny random model, a
short mixed trace. Both passes are served in full; the no-reuse pass computes everything and reuses nothing, the
reuse pass computes no more than it; the report has the documented shape and the figure is drawn."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.bench.serve.harness import FORMAT, ServeOptions, run_serve
from workers.bench.serve.plot import write_png
from workers.bench.serve.trace import Variant

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_short_trace_both_ways(tmp_path: Path) -> None:
    options = ServeOptions(models=("tiny",), requests=8, state_dir=tmp_path / "state", timeout_s=120)
    report = run_serve(options, say=lambda _: None, progress=lambda _label, _n: lambda: None)
    assert report["format"] == FORMAT and report["ok"], report
    assert report["machine"]["cores"] >= 1
    (entry,) = report["models"]
    on, off = entry["reuse"], entry["no_reuse"]
    assert on["requests"] == off["requests"] == 8
    assert on["status"]["done"] == off["status"]["done"] == 8
    assert off["hits"] == 0 and off["reuse"]["exact"] == 0 and off["steps_computed"] == off["steps_requested"]
    assert entry["trace"]["variants"][str(Variant.EXACT)] >= 1
    # Whether the repeat is answered exactly depends on which of the two the scheduler reads first (their keys
    # may land on different partitions); that reuse never costs token-steps does not.
    assert on["token_steps_computed"] <= off["token_steps_computed"]
    assert set(on["worker_phase_s"]) >= {
        "queue",
        "prepare",
        "fetch",
        "denoise",
        "decode",
        "upload",
        "publish",
        "deliver",
    }
    assert on["worker_phase_s"]["publish"] > 0  # read from the worker's own histogram
    assert on["worker_phase_s"]["denoise"] > 0 and on["scheduler"]["total_ms_per_request"] > 0
    assert entry["compare"]["throughput_ratio"] is not None
    assert len(entry["latencies_s"]["auto"]) == len(entry["latencies_s"]["off"]) == 8
    assert write_png(report, tmp_path / "serve.png").stat().st_size > 0
