"""``chorus demo``: the whole serving path on embedded defaults, with a stream of similar prompts.

It starts an ``EmbeddedStack`` (Kafka and S3 stand-ins, ``chorus scheduler``, ``chorus worker``) over a state
directory, publishes a short stream of toy-world prompts in *families* — a base prompt, a ``reuse: off`` copy of
it that measures full computation in this run, the same prompt with another seed, two paraphrases that differ
only in function words or punctuation, and a one-attribute change — follows the results topic with live
progress, and then prints one row per request and the totals. Everything it shows is measured in the run:

- **hit**: the request reused a donor's trajectory (a donor was planned and used, no fallback);
- **steps saved**: transformer passes not run (``steps_requested − steps_computed``); **token-steps saved** also
  counts the tokens Stage 2 did not recompute (``steps_requested × (1 − tokens_computed_fraction)``);
- **speedup**: the full-compute denoise time is the median worker-measured denoise time of the requests of this
  run that computed every step (the ``reuse: off`` baseline of each family, and misses); the speedup of a hit is
  that median over the hits' median, and the stream's speedup is (requests × the full-compute mean) over the
  stream's measured total denoise time. Before the stream, one uncounted ``reuse: off`` request per worker process warms
  the model up.

It writes to the output directory the videos (``videos/<id>.mp4`` as the worker stored it, ``videos/<id>.gif``
made from it, 4× enlarged), ``contact_sheet.png`` (a few frames per request, labelled) and ``summary.json``.
State persists in the state directory (S3 snapshot, Qdrant index, ledger), so a second run finds donors from the
first; ``--fresh`` starts over.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import typer
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from producer.contract import GenerationRequest, GenerationResult
    from producer.local.stack import EmbeddedStack

log = logging.getLogger(__name__)

Kind = Literal["base", "baseline", "new-seed", "paraphrase", "terse", "attribute"]
# The members of a family, in the order the stream publishes them (all bases first, then all baselines, …), so
# every family's first request is dispatched before anything that may reuse it.
KINDS: tuple[Kind, ...] = ("base", "baseline", "new-seed", "paraphrase", "terse", "attribute")
KIND_HELP = {
    "base": "the family's first prompt",
    "baseline": "the base prompt with reuse off: full computation, measured in this run",
    "new-seed": "the base prompt with another seed",
    "paraphrase": "the base prompt with other function words",
    "terse": "the base prompt without function words",
    "attribute": "one attribute changed (direction or background)",
}
CONTACT_FRAMES = 4
GIF_SCALE = 4

# Used when the toy world's vocabulary cannot be imported.
_FALLBACK_VOCABULARY: dict[str, tuple[str, ...]] = {
    "color": ("red", "green", "blue", "yellow", "purple", "cyan"),
    "shape": ("circle", "square", "triangle"),
    "direction": ("left", "right", "up", "down"),
    "background": ("black", "white", "gray", "brown"),
}


# --- the stream ---------------------------------------------------------------------------------------------


class DemoItem(BaseModel):
    """One request of the stream and what it is meant to show."""

    model_config = ConfigDict(frozen=True)

    family: int
    kind: Kind
    request_id: str
    prompt: str
    seed: int
    reuse: Literal["auto", "off"]


def vocabulary() -> dict[str, tuple[str, ...]]:
    """Attribute values of the toy world (``workers.toy.world``), or a fixed copy if it cannot be imported."""
    try:
        from workers.toy import world
    except Exception:
        return dict(_FALLBACK_VOCABULARY)
    try:
        return {
            "color": tuple(world.FG_COLORS),
            "shape": tuple(world.SHAPES),
            "direction": tuple(world.DIRECTIONS),
            "background": tuple(world.BG_COLORS),
        }
    except AttributeError:
        return dict(_FALLBACK_VOCABULARY)


def _prompt(kind: Kind, a: dict[str, str]) -> str:
    if kind == "paraphrase":
        return f"the {a['color']} {a['shape']} moving {a['direction']} over a {a['background']} background"
    if kind == "terse":
        return f"{a['color']} {a['shape']} moving {a['direction']}, {a['background']} background"
    return f"a {a['color']} {a['shape']} moving {a['direction']} on a {a['background']} background"


def build_stream(families: int, per_family: int, *, seed: int, run_id: str) -> list[DemoItem]:
    """``families`` families of ``per_family`` members (the first ``per_family`` of ``KINDS``).

    The families' attributes come from ``seed`` alone, so every run with the same seed publishes the same prompts
    (a later run then finds donors from an earlier one); two families differ in at least two attributes. Request
    ids carry ``run_id``.
    """
    vocab = vocabulary()
    names = list(vocab)
    rng = random.Random(seed)
    combos = [dict(zip(names, values, strict=True)) for values in itertools.product(*vocab.values())]
    rng.shuffle(combos)
    chosen: list[dict[str, str]] = []
    for combo in combos:
        if all(sum(combo[n] != c[n] for n in names) >= 2 for c in chosen):
            chosen.append(combo)
        if len(chosen) == families:
            break
    if len(chosen) < families:
        raise ValueError(f"the toy world has room for {len(chosen)} distinct families, not {families}")
    items: list[DemoItem] = []
    for kind in KINDS[:per_family]:
        for f, attrs in enumerate(chosen):
            base_seed = seed * 1000 + f * 10
            prompt_attrs = dict(attrs)
            if kind == "attribute":
                # Alternate between a new direction and a new background across families.
                changed = "direction" if f % 2 == 0 else "background"
                options = [v for v in vocab[changed] if v != attrs[changed]]
                prompt_attrs[changed] = options[(seed + f) % len(options)]
            items.append(
                DemoItem(
                    family=f + 1,
                    kind=kind,
                    request_id=f"demo-{run_id}-f{f + 1}-{kind}",
                    prompt=_prompt(kind, prompt_attrs),
                    seed=base_seed + (1 if kind == "new-seed" else 0),
                    reuse="off" if kind == "baseline" else "auto",
                )
            )
    return items


# --- the summary ----------------------------------------------------------------------------------------------


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
    hit_ratio: float
    donors_from_earlier_runs: int
    steps_requested: int
    steps_computed: int
    steps_saved: int
    token_steps_saved: float
    full_compute_requests: int
    full_compute_denoise_median_s: float | None
    hit_denoise_median_s: float | None
    full_compute_denoise_mean_s: float | None
    hit_denoise_mean_s: float | None
    speedup_per_hit: float | None = Field(description="full-compute median / hit median denoise time")
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
    "(each family's reuse-off baseline, and misses); medians, because other load on the machine makes single "
    "requests slow. Speedup per hit = that median / the hits' median denoise time. Stream speedup = (done requests "
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
    full_median = _median(full)
    hit_median = _median([r.denoise_s for r in hits])
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
        hit_denoise_mean_s=_mean([r.denoise_s for r in hits]),
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
            "hit": bool(
                result.status.value == "done"
                and donor is not None
                and plan is not None
                and plan.reuses
                and result.fallback is None
            ),
            "fallback": result.fallback,
            "steps_requested": result.steps_requested,
            "steps_computed": result.steps_computed,
            "tokens_computed_fraction": result.tokens_computed_fraction,
            "denoise_s": t.denoise_s,
            "worker_s": t.queue_s + t.fetch_s + t.denoise_s + t.decode_s + t.upload_s,
        }
    )


# --- outputs --------------------------------------------------------------------------------------------------


def write_videos(
    stack: EmbeddedStack, rows: list[RequestSummary], results: dict[str, Any], out: Path
) -> None:
    """Download each video from the object store (mp4 as stored) and write a GIF of it, enlarged."""
    import numpy as np

    from workers.video import encode_video, read_video

    store = stack.object_store()
    videos = out / "videos"
    videos.mkdir(parents=True, exist_ok=True)
    for i, row in enumerate(rows):
        result = results.get(row.request_id)
        if result is None or result.video_uri is None:
            continue
        data = store.get(store.key_of(result.video_uri))
        suffix = Path(result.video_uri).suffix or ".mp4"
        stored = videos / f"{row.request_id}{suffix}"
        stored.write_bytes(data)
        frames = read_video(stored)
        gif = videos / f"{row.request_id}.gif"
        if suffix != ".gif":
            big = np.repeat(np.repeat(frames, GIF_SCALE, axis=1), GIF_SCALE, axis=2)
            gif.write_bytes(encode_video(big, fmt="gif"))
        rows[i] = row.model_copy(
            update={
                "video_mp4": str(stored.relative_to(out)) if suffix == ".mp4" else None,
                "video_gif": str(gif.relative_to(out)),
            }
        )


def write_contact_sheet(rows: list[RequestSummary], out: Path, path: Path) -> Path | None:
    """One row per request: a label, then ``CONTACT_FRAMES`` frames spread over the clip, enlarged."""
    import numpy as np
    from PIL import Image, ImageDraw

    from workers.video import read_video

    clips: list[tuple[RequestSummary, Any]] = []
    for row in rows:
        source = row.video_mp4 or row.video_gif
        if source is None:
            continue
        frames = read_video(out / source)
        picks = np.linspace(0, len(frames) - 1, CONTACT_FRAMES).round().astype(int)
        clips.append((row, frames[picks]))
        picked = ", ".join(str(int(i)) for i in picks)
        total_frames = len(frames)
    if not clips:
        return None
    tile = 96
    label_w, gap, pad = 330, 4, 8
    row_h = tile + gap
    width = label_w + CONTACT_FRAMES * (tile + gap) + pad
    sheet = Image.new("RGB", (width, pad * 2 + 18 + row_h * len(clips)), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text(
        (pad, pad),
        f"frames {picked} of {total_frames}, enlarged; green: the request reused its donor",
        fill="gray",
    )
    for r, (row, frames) in enumerate(clips):
        y = pad + 18 + r * row_h
        donor = (
            f"donor {row.donor_request_id} ({row.donor_similarity:.2f})"
            if row.donor_request_id and row.donor_similarity is not None
            else "no donor"
        )
        lines = [
            f"family {row.family} · {row.kind} · seed {row.seed}",
            row.prompt[:60],
            (f"HIT {donor}" if row.hit else donor if row.reuse == "auto" else "reuse off"),
            f"computed {row.steps_computed}/{row.steps_requested} steps, "
            f"{row.tokens_computed_fraction:.0%} tokens, {row.denoise_s:.2f} s",
        ]
        for j, text in enumerate(lines):
            draw.text((pad, y + 4 + 16 * j), text, fill="black" if j != 2 or not row.hit else "darkgreen")
        for k, frame in enumerate(frames):
            img = Image.fromarray(frame).resize((tile, tile), Image.Resampling.NEAREST)
            sheet.paste(img, (label_w + k * (tile + gap), y))
    sheet.save(path)
    return path


# --- the command ----------------------------------------------------------------------------------------------


def toy_weights_present() -> bool:
    """Whether the toy model's weights are where the worker will look (``CHORUS_TOY_WEIGHTS_DIR`` or the
    package's ``workers/toy/weights``)."""
    configured = os.environ.get("CHORUS_TOY_WEIGHTS_DIR")
    if configured:
        return (Path(configured) / "model.safetensors").is_file()
    try:
        import workers.toy as toy_pkg
    except ImportError:
        return False
    return (Path(toy_pkg.__file__).resolve().parent / "weights" / "model.safetensors").is_file()


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C does, so the stack is stopped (and S3 snapshotted) on the way out."""
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def demo(
    out: Path = typer.Option(
        Path("out/demo"), "--out", "-o", help="Output directory (videos, contact sheet, summary.json)."
    ),
    state_dir: Path = typer.Option(
        Path(".chorus"), "--state-dir", help="State kept between runs (donors, index, logs)."
    ),
    families: int = typer.Option(3, min=1, max=20, help="Families of similar prompts."),
    per_family: int = typer.Option(
        len(KINDS),
        min=1,
        max=len(KINDS),
        help="Requests per family: " + ", ".join(KINDS) + " (in that order).",
    ),
    model: str = typer.Option(
        "toy", help="Model to serve (the toy model, or tiny-random-wan: random weights)."
    ),
    steps: int | None = typer.Option(None, help="Denoising steps per request (default: the model's)."),
    seed: int = typer.Option(0, help="Chooses the families; the same seed publishes the same prompts."),
    fresh: bool = typer.Option(
        False, "--fresh", help="Wipe the state directory first (no donors from earlier runs)."
    ),
    concurrency: int = typer.Option(1, "--concurrency", "-c", min=1, max=16, help="Processes per worker."),
    workers: int = typer.Option(1, min=1, max=8, help="chorus worker processes."),
    embedder: str = typer.Option("minilm", help="Prompt embedder of the scheduler: minilm or hashing."),
    interval: float = typer.Option(0.2, min=0.0, help="Seconds between two published requests."),
    timeout: float = typer.Option(600.0, min=1.0, help="Seconds to wait for all results."),
    metrics_port: int = typer.Option(
        0, help="Metrics port of the scheduler; workers take the next ones (0: free ports)."
    ),
    keep_running: bool = typer.Option(
        False, "--keep-running", help="Leave the stack up afterwards, until Ctrl-C."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log what the demo does (stderr)."),
) -> None:
    """Run the whole serving path on embedded services with a stream of similar prompts, and show the reuse."""
    from producer.catalog import CATALOG
    from producer.logs import configure_logging

    # Not a terminal (a pipe, a log file): wide lines rather than a table folded to 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=180)
    err = Console(stderr=True)
    configure_logging("INFO" if verbose else "WARNING", "console")
    logging.getLogger("kafka").setLevel(logging.ERROR)
    if model not in CATALOG:
        err.print(
            f"[bold red]error:[/] unknown model {escape(model)!r} (known: {', '.join(sorted(CATALOG))})"
        )
        raise typer.Exit(code=2)
    if embedder not in ("minilm", "hashing"):
        err.print("[bold red]error:[/] --embedder must be minilm or hashing")
        raise typer.Exit(code=2)
    if model == "toy" and not toy_weights_present():
        err.print(
            "[bold red]error:[/] the toy model's weights are not there (workers/toy/weights/model.safetensors, "
            "or CHORUS_TOY_WEIGHTS_DIR): it is still being trained.\n"
            "Run the demo on the tiny random Wan model instead (same path, noise-like videos):\n"
            "  [bold]chorus demo --model tiny-random-wan[/]   (or ./scripts/demo.sh --model tiny-random-wan)"
        )
        raise typer.Exit(code=2)
    spec = CATALOG[model]
    num_steps = steps if steps is not None else spec.default_num_steps
    why = spec.num_steps.check(num_steps)
    if why is not None:
        err.print(f"[bold red]error:[/] --steps {why} for model {escape(model)}")
        raise typer.Exit(code=2)
    try:
        with _sigterm_exits():
            _run_demo(
                console,
                out=out,
                state_dir=state_dir,
                families=families,
                per_family=per_family,
                model=model,
                num_steps=num_steps,
                seed=seed,
                fresh=fresh,
                concurrency=concurrency,
                workers=workers,
                embedder=embedder,
                interval=interval,
                timeout=timeout,
                metrics_port=metrics_port,
                keep_running=keep_running,
            )
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]: the stack is stopped and its state kept")
        raise typer.Exit(code=130) from None
    except DemoFailed as exc:
        err.print(f"[bold red]demo failed:[/] {escape(str(exc))}")
        raise typer.Exit(code=1) from None


class DemoFailed(RuntimeError):
    pass


def _run_demo(
    console: Console,
    *,
    out: Path,
    state_dir: Path,
    families: int,
    per_family: int,
    model: str,
    num_steps: int,
    seed: int,
    fresh: bool,
    concurrency: int,
    workers: int,
    embedder: str,
    interval: float,
    timeout: float,
    metrics_port: int,
    keep_running: bool,
) -> DemoSummary:
    from producer.contract import build_request
    from producer.local.config import StackError, StackOptions
    from producer.local.stack import EmbeddedStack, wipe_state

    started_at = datetime.now(UTC)
    t0 = time.monotonic()
    run_id = started_at.strftime("%m%d%H%M%S") + uuid.uuid4().hex[:4]
    items = build_stream(families, per_family, seed=seed, run_id=run_id)
    requests = [
        build_request(
            request_id=i.request_id,
            prompt=i.prompt,
            model=model,
            num_steps=num_steps,
            seed=i.seed,
            reuse=i.reuse,
            tenant="demo",
        )
        for i in items
    ]
    if fresh:
        try:
            wipe_state(state_dir)
        except StackError as exc:
            raise DemoFailed(str(exc)) from None
    had_state = (state_dir / "s3" / "manifest.json").exists()
    options = StackOptions(
        state_dir=state_dir,
        models=[model],
        workers=workers,
        worker_concurrency=concurrency,
        embedder=embedder,
        scheduler_metrics_port=metrics_port,
        worker_metrics_port=metrics_port + 1 if metrics_port else 0,
    )
    console.print(
        f"[bold]chorus demo[/] run {run_id}: {len(items)} requests in {families} families, model "
        f"[bold]{escape(model)}[/], {num_steps} steps; state in {escape(str(state_dir))}"
        + (" (with donors from earlier runs)" if had_state else " (fresh)")
    )
    try:
        with console.status("starting Kafka and S3 stand-ins, the scheduler and the worker…"):
            stack = EmbeddedStack(options).start()
    except StackError as exc:
        raise DemoFailed(str(exc)) from None
    with stack:
        t_ready = time.monotonic()
        up = stack.metrics_up()
        console.print(
            f"stack ready in {t_ready - t0:.1f} s: Kafka {stack.kafka_address}, S3 {stack.s3_endpoint}"
        )
        for name, url in stack.metrics_urls.items():
            state = "[green]up[/]" if up.get(name) else "[yellow]not answering[/]"
            console.print(f"  metrics {name}: {url} ({state})   log: {escape(str(stack.log_files[name]))}")
        warmups = [
            build_request(
                request_id=f"demo-{run_id}-warmup-{i}",
                prompt="warm-up",
                model=model,
                num_steps=num_steps,
                reuse="off",
                tenant="demo",
            )
            for i in range(workers * concurrency)
        ]
        results, latencies = _publish_and_follow(console, stack, items, requests, interval, timeout, warmups)
        t_results = time.monotonic()
        run_ids = {i.request_id for i in items}
        rows = [summarize(i, results.get(i.request_id), latencies.get(i.request_id), run_ids) for i in items]
        out.mkdir(parents=True, exist_ok=True)
        with console.status("downloading videos, drawing the contact sheet…"):
            write_videos(stack, rows, results, out)
            sheet = write_contact_sheet(rows, out, out / "contact_sheet.png")
        try:
            stack.wait_idle(timeout_s=60)  # every result indexed as a donor before the stack stops
        except StackError as exc:
            log.warning("schedulers not idle", extra={"error": str(exc)})
        totals = compute_totals(rows)
        summary = DemoSummary(
            run_id=run_id,
            started_at=started_at,
            model=model,
            num_steps=num_steps,
            embedder=embedder,
            state_dir=str(stack.state_dir),
            output_dir=str(out.resolve()),
            kafka=stack.kafka_address,
            s3=stack.s3_endpoint,
            metrics_urls=stack.metrics_urls,
            metrics_up=stack.metrics_up(),
            log_files={k: str(v) for k, v in stack.log_files.items()},
            seconds={
                "setup": round(t_ready - t0, 3),
                "stream": round(t_results - t_ready, 3),
                "total": round(time.monotonic() - t0, 3),
            },
            speedup_note=SPEEDUP_NOTE,
            requests=rows,
            totals=totals,
        )
        (out / "summary.json").write_text(summary.model_dump_json(indent=2))
        _print_report(console, summary, sheet, out)
        if keep_running:
            _keep_running(console, stack)
        console.print("stopping the stack (the object store writes its snapshot)…")
    console.print(f"stack stopped; state kept in {escape(str(state_dir))} (a next run reuses its donors)")
    if totals.missing or totals.failed:
        raise DemoFailed(f"{totals.failed} request(s) failed and {totals.missing} got no result in time")
    return summary


def _publish_and_follow(
    console: Console,
    stack: EmbeddedStack,
    items: list[DemoItem],
    requests: list[GenerationRequest],
    interval: float,
    timeout: float,
    warmups: list[GenerationRequest],
) -> tuple[dict[str, GenerationResult], dict[str, float]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from producer.sdk import ChorusClient

    by_id = {i.request_id: i for i in items}
    sent_at: dict[str, float] = {}
    latencies: dict[str, float] = {}
    results: dict[str, GenerationResult] = {}
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    with ChorusClient(stack.producer_settings) as client, client.watch_results() as watcher, progress:
        if warmups:
            # Not counted: the first pass through a freshly loaded model is slower than the rest, and would
            # inflate whichever request happens to come first.
            warm_task = progress.add_task("warm-up  ", total=len(warmups))
            client.submit_many(warmups)
            for _ in watcher.wait([w.request_id for w in warmups], timeout_s=timeout):
                progress.advance(warm_task)
        sent_task = progress.add_task("published", total=len(requests))
        done_task = progress.add_task("results  ", total=len(requests))
        pending = [r.request_id for r in requests]

        def collect(wait_s: float) -> None:
            for result in watcher.wait(list(pending), timeout_s=wait_s):
                rid = result.request_id
                pending.remove(rid)
                results[rid] = result
                latencies[rid] = time.monotonic() - sent_at.get(rid, time.monotonic())
                progress.advance(done_task)
                console.print(_live_line(by_id[rid], result, latencies[rid]))

        for request in requests:
            client.submit(request)
            sent_at[request.request_id] = time.monotonic()
            progress.advance(sent_task)
            collect(interval)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            stack.check()
            collect(1.0)
    return results, latencies


def _live_line(item: DemoItem, result: GenerationResult, latency: float) -> str:
    if result.status.value != "done":
        why = f"{result.error.code}: {result.error.message}" if result.error else result.status.value
        return f"[red]✗[/] {escape(item.request_id)} {item.kind}: {escape(why[:160])}"
    if (
        result.donor is not None
        and result.plan is not None
        and result.plan.reuses
        and result.fallback is None
    ):
        what = f"[green]reused[/] {escape(result.donor.request_id)} (sim {result.donor.similarity:.2f})"
    elif result.fallback:
        what = f"[yellow]full[/] ({escape(result.fallback[:80])})"
    else:
        what = "full"
    return (
        f"[green]✓[/] {escape(item.request_id)} [dim]{item.kind}[/] {what}: "
        f"{result.steps_computed}/{result.steps_requested} steps, {result.timings.denoise_s:.2f} s denoise, "
        f"{latency:.1f} s end to end"
    )


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _print_report(console: Console, summary: DemoSummary, sheet: Path | None, out: Path) -> None:
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
            table.add_row(escape(short(r.request_id)), escape(r.prompt), f"[red]{why}[/]", "", "", "", "", "")
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
            f"{r.plan_k1}/{r.plan_k2}/{r.plan_k3}",
            f"{r.steps_computed}/{r.steps_requested}",
            f"{r.tokens_computed_fraction:.0%}",
            f"{r.denoise_s:.3f}",
            _fmt(r.latency_s, ".2f"),
        )
    console.print(table)
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
        f"{_fmt(t.hit_denoise_median_s, '.3f', ' s')} (median of {t.hits}): "
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


def _keep_running(console: Console, stack: EmbeddedStack) -> None:
    env_file = stack.state_dir / "stack.env"
    keys = sorted(
        k
        for k in stack.env
        if k.startswith("CHORUS_") and k not in ("CHORUS_INSTANCE_ID", "CHORUS_METRICS_PORT")
    )
    env_file.write_text("".join(f"{k}={json.dumps(stack.env[k])}\n" for k in keys))
    env_file.chmod(0o600)
    console.print(
        "[bold]the stack keeps running[/] (Ctrl-C stops it). Talk to it from another shell:\n"
        f"  set -a; . {escape(str(env_file))}; set +a\n"
        "  chorus produce --prompt 'a red circle moving left on a white background' "
        f"--model {escape(stack.options.models[0])} --wait"
    )
    try:
        while True:
            stack.check()
            time.sleep(1.0)
    except KeyboardInterrupt:
        console.print("stopping…")
