"""What ``chorus demo`` reports: a row per request (``summarize``), the totals (``compute_totals``, a pure function of
the rows), ``summary.json``'s model (``DemoSummary``) and the table and totals printed at the end."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field
from rich.console import Console
from rich.markup import escape

from producer.local.demo_stream import DemoItem, Kind

if TYPE_CHECKING:
    from rich.table import Table

    from producer.contract import GenerationResult


class RequestSummary(BaseModel):
    request_id: str
    family: int
    kind: Kind
    prompt: str
    seed: int
    reuse: Literal["auto", "off"]
    status: str
    error: str | None = None
    donor_request_id: str | None = None
    donor_similarity: float | None = None
    donor_from_earlier_run: bool = False
    plan_k1: int | None = None
    plan_k2: int | None = None
    plan_k3: int | None = None
    hit: bool = False
    # What the video is (``ReuseKind``: exact, stage1, stage2, none).
    reuse_kind: str = "none"
    fallback: str | None = None
    steps_requested: int = 0
    steps_computed: int = 0
    tokens_computed_fraction: float = 0.0
    denoise_s: float = 0.0
    worker_s: float = Field(
        default=0.0, description="queue + fetch + denoise + decode + upload, per the worker"
    )
    latency_s: float | None = Field(default=None, description="published → result received, per the demo")
    video_mp4: str | None = None
    video_gif: str | None = None

    @property
    def full_compute(self) -> bool:
        return (
            self.status == "done"
            and self.steps_computed == self.steps_requested
            and self.tokens_computed_fraction >= 1.0
        )


class Totals(BaseModel):
    requests: int
    done: int
    failed: int
    missing: int
    eligible: int = Field(description="requests allowed to reuse (reuse: auto)")
    hits: int
    exact_hits: int = Field(default=0, description="hits served whole from a stored video (no worker)")
    hit_ratio: float
    donors_from_earlier_runs: int
    steps_requested: int
    steps_computed: int
    steps_saved: int
    token_steps_saved: float
    full_compute_requests: int
    full_compute_denoise_median_s: float | None
    hit_denoise_median_s: float | None = Field(description="median denoise time of the hits a worker ran")
    full_compute_denoise_mean_s: float | None
    hit_denoise_mean_s: float | None
    speedup_per_hit: float | None = Field(
        description="full-compute median / median denoise time of the hits a worker ran (None: none ran)"
    )
    stream_denoise_s: float
    stream_full_compute_estimate_s: float | None
    stream_speedup: float | None
    token_step_speedup: float | None


class DemoSummary(BaseModel):
    run_id: str
    started_at: datetime
    model: str
    num_steps: int
    embedder: str
    state_dir: str
    output_dir: str
    kafka: str
    s3: str
    metrics_urls: dict[str, str]
    metrics_up: dict[str, bool]
    log_files: dict[str, str]
    seconds: dict[str, float]
    speedup_note: str
    requests: list[RequestSummary]
    totals: Totals


SPEEDUP_NOTE = (
    "Full-compute time = the median worker-measured denoise time of this run's requests that computed every step "
    "(each family's reuse-off baseline, misses, and plans that saved nothing); medians, because other load on the machine makes single "
    "requests slow. Speedup per hit = that median / the median denoise time of the hits a worker ran (an exact hit, "
    "served whole, has none). Stream speedup = (done requests "
    "× the full-compute mean) / the stream's measured total denoise time. Token-step speedup = steps requested / "
    "(steps requested × tokens-computed fraction), summed over the stream: the compute the engine skipped."
)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _median(values: list[float]) -> float | None:
    import statistics

    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compute_totals(rows: list[RequestSummary]) -> Totals:
    """The totals of ``rows`` (a pure function of them, so ``summary.json`` can be checked against itself)."""
    done = [r for r in rows if r.status == "done"]
    full = [r.denoise_s for r in done if r.full_compute]
    hits = [r for r in done if r.hit]
    worked = [r.denoise_s for r in hits if r.reuse_kind != "exact"]
    full_median = _median(full)
    hit_median = _median(worked)
    full_mean = _mean(full)
    stream_denoise = sum(r.denoise_s for r in done)
    # A total compares with a total: the stream's measured sum against (requests × the full-compute mean).
    estimate = full_mean * len(done) if full_mean is not None else None
    requested = sum(r.steps_requested for r in done)
    token_steps = sum(r.steps_requested * r.tokens_computed_fraction for r in done)
    eligible = [r for r in rows if r.reuse == "auto"]
    return Totals(
        requests=len(rows),
        done=len(done),
        failed=sum(1 for r in rows if r.status not in ("done", "missing")),
        missing=sum(1 for r in rows if r.status == "missing"),
        eligible=len(eligible),
        hits=len(hits),
        exact_hits=sum(1 for r in hits if r.reuse_kind == "exact"),
        hit_ratio=len(hits) / len(eligible) if eligible else 0.0,
        donors_from_earlier_runs=sum(1 for r in hits if r.donor_from_earlier_run),
        steps_requested=requested,
        steps_computed=sum(r.steps_computed for r in done),
        steps_saved=sum(r.steps_requested - r.steps_computed for r in done),
        token_steps_saved=round(requested - token_steps, 6),
        full_compute_requests=len(full),
        full_compute_denoise_median_s=full_median,
        hit_denoise_median_s=hit_median,
        full_compute_denoise_mean_s=full_mean,
        hit_denoise_mean_s=_mean(worked),
        speedup_per_hit=_ratio(full_median, hit_median),
        stream_denoise_s=stream_denoise,
        stream_full_compute_estimate_s=estimate,
        stream_speedup=_ratio(estimate, stream_denoise),
        token_step_speedup=_ratio(float(requested), token_steps),
    )


def summarize(
    item: DemoItem, result: GenerationResult | None, latency_s: float | None, run_ids: set[str]
) -> RequestSummary:
    row = RequestSummary(
        request_id=item.request_id,
        family=item.family,
        kind=item.kind,
        prompt=item.prompt,
        seed=item.seed,
        reuse=item.reuse,
        status="missing" if result is None else result.status.value,
        latency_s=latency_s,
    )
    if result is None:
        return row
    t = result.timings
    plan = result.plan
    donor = result.donor
    return row.model_copy(
        update={
            "error": f"{result.error.code}: {result.error.message}" if result.error else None,
            "donor_request_id": donor.request_id if donor else None,
            "donor_similarity": donor.similarity if donor else None,
            "donor_from_earlier_run": bool(donor and donor.request_id not in run_ids),
            "plan_k1": plan.stage1_steps if plan else None,
            "plan_k2": plan.stage2_steps if plan else None,
            "plan_k3": plan.stage3_steps if plan else None,
            # A hit saves compute: a plan that recomputed everything is not one (GenerationResult.saved_compute).
            "hit": result.saved_compute,
            "reuse_kind": result.reuse.value,
            "fallback": result.fallback,
            "steps_requested": result.steps_requested,
            "steps_computed": result.steps_computed,
            "tokens_computed_fraction": result.tokens_computed_fraction,
            "denoise_s": t.denoise_s,
            "worker_s": t.queue_s + t.fetch_s + t.denoise_s + t.decode_s + t.upload_s,
        }
    )


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def request_table(summary: DemoSummary) -> Table:
    """One row per request: its donor (and similarity), plan, steps and tokens computed, denoise time, latency."""
    from rich.table import Table

    prefix = f"demo-{summary.run_id}-"

    def short(request_id: str) -> str:
        return request_id[len(prefix) :] if request_id.startswith(prefix) else request_id

    table = Table(
        title=f"chorus demo {summary.run_id}: {summary.model}, {summary.num_steps} steps "
        f"(request ids without the prefix {prefix})",
        show_lines=False,
    )
    for column, justify in (
        ("request", "left"),
        ("prompt", "left"),
        ("donor (similarity)", "left"),
        ("reuse (saved)", "left"),
        ("plan k1/k2/k3", "center"),
        ("steps computed", "right"),
        ("tokens", "right"),
        ("denoise s", "right"),
        ("latency s", "right"),
    ):
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for r in summary.requests:
        if r.status != "done":
            why = escape((r.error or r.status)[:80])
            table.add_row(escape(short(r.request_id)), escape(r.prompt), f"[red]{why}[/]", *[""] * 6)
            continue
        if r.donor_request_id is None:
            donor = "reuse off" if r.reuse == "off" else "-"
        else:
            mark = "[green]" if r.hit else "[yellow]"
            earlier = " [bold]earlier run[/]" if r.donor_from_earlier_run else ""
            donor = f"{mark}{escape(short(r.donor_request_id))} ({r.donor_similarity:.2f})[/]{earlier}"
            if r.fallback:
                donor += f" [yellow]fallback: {escape(r.fallback[:60])}[/]"
        table.add_row(
            escape(short(r.request_id)),
            escape(r.prompt),
            donor,
            _reuse_cell(r),
            "-" if r.plan_k1 is None else f"{r.plan_k1}/{r.plan_k2}/{r.plan_k3}",  # an exact hit runs no plan
            f"{r.steps_computed}/{r.steps_requested}",
            f"{r.tokens_computed_fraction:.0%}",
            f"{r.denoise_s:.3f}",
            _fmt(r.latency_s, ".2f"),
        )
    return table


def _reuse_cell(r: RequestSummary) -> str:
    """The result's reuse kind and the share of token-steps it did not compute; a plan that saved nothing says so."""
    saved = 1.0 - r.tokens_computed_fraction
    if r.hit:
        return f"[green]{escape(r.reuse_kind)}[/] ({saved:.0%})"
    if r.donor_request_id is not None:
        return "[yellow]saved nothing[/]"
    return "none"


def print_report(console: Console, summary: DemoSummary, sheet: Path | None, out: Path) -> None:
    """The table of requests, the totals and what was written."""
    console.print(request_table(summary))
    t = summary.totals
    console.print(
        f"[bold]hits[/] {t.hits}/{t.eligible} requests that may reuse ([bold]{t.hit_ratio:.0%}[/]), "
        f"{t.donors_from_earlier_runs} with a donor from an earlier run; "
        f"[bold]steps saved[/] {t.steps_saved} of {t.steps_requested} "
        f"({t.token_steps_saved:.1f} token-steps counting Stage 2's skipped tokens)"
    )
    console.print(
        f"[bold]full-compute denoise[/] {_fmt(t.full_compute_denoise_median_s, '.3f', ' s')} (median of "
        f"{t.full_compute_requests} full requests), [bold]with reuse[/] "
        f"{_fmt(t.hit_denoise_median_s, '.3f', ' s')} (median of {t.hits - t.exact_hits} hits a worker ran; "
        f"{t.exact_hits} served whole): "
        f"speedup per hit [bold]{_fmt(t.speedup_per_hit, '.2f', '×')}[/]; stream "
        f"{t.stream_denoise_s:.2f} s vs {_fmt(t.stream_full_compute_estimate_s, '.2f', ' s')} estimated all-full "
        f"(mean {_fmt(t.full_compute_denoise_mean_s, '.3f', ' s')} × {t.done}): "
        f"[bold]{_fmt(t.stream_speedup, '.2f', '×')}[/]; token-step speedup {_fmt(t.token_step_speedup, '.2f', '×')}"
    )
    console.print(f"[dim]{escape(SPEEDUP_NOTE)}[/]")
    if t.failed or t.missing:
        console.print(f"[red]{t.failed} failed, {t.missing} without a result[/]")
    console.print(
        f"wrote {escape(str(out / 'videos'))}/ (mp4 + gif), "
        + (f"{escape(str(sheet))}, " if sheet else "")
        + f"{escape(str(out / 'summary.json'))}; setup {summary.seconds['setup']:.1f} s, "
        f"stream {summary.seconds['stream']:.1f} s"
    )
