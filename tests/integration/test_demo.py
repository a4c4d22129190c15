"""``chorus demo`` end to end, as a user runs it (a subprocess), on a small setting.

- One family of six requests: every result arrives, ``summary.json`` is consistent with itself (its totals are
  those of its rows) and with the results (the reuse-off baseline has no donor; the same prompt with another seed
  reuses the family's first request), and the videos and the contact sheet are written.
- A second run over the same state directory finds its donor among the first run's requests.
- The README's demo, on the committed toy model, runs one family through.
- Without the toy model's weights, it says so and suggests the tiny random model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from producer.local.demo_stream import KINDS
from producer.local.demo_summary import DemoSummary, compute_totals
from workers.toy.model import WEIGHTS_DIR, WEIGHTS_FILE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHORUS = str(Path(sys.executable).with_name("chorus"))
MODEL = "tiny-random-wan"


def run_demo(
    *args: str, env: dict[str, str] | None = None, timeout: float = 480
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CHORUS, "demo", "--model", MODEL, "--interval", "0", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def test_demo_runs_end_to_end_and_a_second_run_reuses_the_first(tmp_path: Path) -> None:
    state, out1, out2 = tmp_path / "state", tmp_path / "out1", tmp_path / "out2"
    done = run_demo("--families", "1", "--state-dir", str(state), "--out", str(out1))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    summary = DemoSummary.model_validate_json((out1 / "summary.json").read_text())
    rows = {r.kind: r for r in summary.requests}
    assert list(rows) == list(KINDS)
    assert all(r.status == "done" for r in summary.requests)
    # The totals are those of the rows, and the rows those of the results.
    assert summary.totals == compute_totals(summary.requests)
    t = summary.totals
    assert (t.requests, t.done, t.failed, t.missing, t.eligible) == (6, 6, 0, 0, 5)
    assert t.hits == sum(r.hit for r in summary.requests)
    assert t.steps_saved == sum(r.steps_requested - r.steps_computed for r in summary.requests) > 0
    assert t.donors_from_earlier_runs == 0
    assert rows["baseline"].reuse == "off" and rows["baseline"].donor_request_id is None
    assert rows["baseline"].full_compute and t.full_compute_requests >= 1
    # Which member leads depends on the order the scheduler polls them in (they sit in different partitions),
    # but of two requests with the same prompt one reuses the other or both reuse a third, never neither.
    base, same = rows["base"], rows["new-seed"]
    assert base.hit or same.hit
    run_ids = {r.request_id for r in summary.requests}
    for r in summary.requests:
        if r.hit:
            assert r.donor_request_id in run_ids and r.donor_request_id != r.request_id
            assert r.donor_similarity is not None and r.donor_similarity > 0.9
            # a stage hit ran a plan; the new-seed request may instead be served the base's video (no plan)
            staged = (r.plan_k1 or 0) + (r.plan_k2 or 0) > 0 and r.fallback is None
            assert staged or (r.reuse_kind == "exact" and r.steps_computed == 0)
    # speedup per hit is over the hits a worker ran: on this model (random weights) only the new-seed request
    # reuses, served whole, so there may be none
    assert t.stream_speedup is not None and t.exact_hits >= 1
    assert t.speedup_per_hit is None or t.hits > t.exact_hits
    for r in summary.requests:
        assert r.video_mp4 is not None and r.video_gif is not None
        assert (out1 / r.video_mp4).read_bytes()[4:8] == b"ftyp"
        assert (out1 / r.video_gif).read_bytes()[:6] == b"GIF89a"
    with Image.open(out1 / "contact_sheet.png") as sheet:
        assert sheet.format == "PNG" and sheet.height > 6 * 96
    assert "hits" in done.stdout and "speedup per hit" in done.stdout
    assert set(summary.metrics_urls) == {"scheduler-0", "worker-0"}

    # The second run publishes the same prompts: its first request finds a donor among the first run's.
    again = run_demo("--families", "1", "--per-family", "1", "--state-dir", str(state), "--out", str(out2))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    second = DemoSummary.model_validate_json((out2 / "summary.json").read_text())
    (base,) = second.requests
    first_ids = {r.request_id for r in summary.requests}
    assert base.hit and base.donor_from_earlier_run and base.donor_request_id in first_ids
    assert second.totals.donors_from_earlier_runs == 1 and second.run_id != summary.run_id


@pytest.mark.skipif(not (WEIGHTS_DIR / WEIGHTS_FILE).exists(), reason="no committed toy weights")
def test_the_readme_demo_runs_the_committed_toy_model(tmp_path: Path) -> None:
    # What ./scripts/demo.sh runs, on the default model, with one family.
    dirs = ["--state-dir", str(tmp_path / "state"), "--out", str(tmp_path / "out")]
    done = subprocess.run(
        [CHORUS, "demo", "--families", "1", "--interval", "0", *dirs],
        capture_output=True,
        text=True,
        timeout=480,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = DemoSummary.model_validate_json((tmp_path / "out" / "summary.json").read_text())
    assert summary.model == "toy" and summary.totals.done == len(summary.requests) == len(KINDS)
    assert summary.totals.hits >= 1 and summary.totals.steps_saved > 0


def test_demo_without_toy_weights_says_so_and_suggests_the_tiny_model(tmp_path: Path) -> None:
    done = subprocess.run(
        [CHORUS, "demo", "--state-dir", str(tmp_path / "state"), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CHORUS_TOY_WEIGHTS_DIR": str(tmp_path)},
    )
    assert done.returncode == 2
    assert "weights" in done.stderr and "--model tiny-random-wan" in done.stderr
    assert not (tmp_path / "state").exists()
