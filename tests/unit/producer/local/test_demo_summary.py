"""The demo's request table says what each video is and what it saved; a planned donor that saved nothing is no hit."""

from __future__ import annotations

from datetime import UTC, datetime

from rich.console import Console

from producer.local.demo_summary import DemoSummary, RequestSummary, compute_totals, request_table


def _row(request_id: str, **fields: object) -> RequestSummary:
    base: dict[str, object] = dict(
        request_id=f"demo-r1-{request_id}",
        family=1,
        kind="base",
        prompt="a red circle moving left on a black background",
        seed=0,
        reuse="auto",
        status="done",
        steps_requested=4,
        steps_computed=4,
        tokens_computed_fraction=1.0,
    )
    base.update(fields)
    return RequestSummary.model_validate(base)


def _render(rows: list[RequestSummary]) -> str:
    summary = DemoSummary(
        run_id="r1",
        started_at=datetime.now(UTC),
        model="toy",
        num_steps=4,
        embedder="minilm",
        state_dir="s",
        output_dir="o",
        kafka="k",
        s3="s3",
        metrics_urls={},
        metrics_up={},
        log_files={},
        seconds={"setup": 1.0, "stream": 1.0},
        speedup_note="",
        requests=rows,
        totals=compute_totals(rows),
    )
    console = Console(width=300, record=True)
    console.print(request_table(summary))
    return console.export_text()


def test_each_row_names_its_reuse_kind_and_saving() -> None:
    rows = [
        _row("f1-base"),
        _row("f1-exact", hit=True, reuse_kind="exact", steps_computed=0, tokens_computed_fraction=0.0),
        _row(
            "f1-new-seed",
            hit=True,
            reuse_kind="stage1",
            denoise_s=0.05,
            donor_request_id="demo-r1-f1-base",
            donor_similarity=1.0,
            steps_computed=1,
            tokens_computed_fraction=0.25,
        ),
        _row("f1-attribute", donor_request_id="demo-r1-f1-base", donor_similarity=0.8),
    ]
    lines = {line.split()[1]: line for line in _render(rows).splitlines() if "f1-" in line}
    assert "exact (100%)" in lines["f1-exact"]
    assert "stage1 (75%)" in lines["f1-new-seed"]
    assert "saved nothing" in lines["f1-attribute"]
    assert "none" in lines["f1-base"]
    totals = compute_totals(rows)
    assert (totals.hits, totals.exact_hits) == (2, 1)
    # the exact hit had no worker: the hit median is the new-seed's denoise time alone
    assert totals.hit_denoise_median_s == 0.05
