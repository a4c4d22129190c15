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
  run that computed every step (the ``reuse: off`` baseline of each family, misses, and plans that saved nothing); the speedup of a hit is
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
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import typer
from rich.console import Console
from rich.markup import escape

from producer.catalog import ModelName
from producer.local.demo_outputs import write_contact_sheet, write_summary, write_videos
from producer.local.demo_stream import KINDS, build_stream, publish_and_follow
from producer.local.demo_summary import (
    SPEEDUP_NOTE,
    DemoSummary,
    RequestSummary,
    compute_totals,
    print_report,
    summarize,
)
from workers.cli_options import aliased

if TYPE_CHECKING:
    from producer.contract import GenerationRequest
    from producer.local.stack import EmbeddedStack

log = logging.getLogger(__name__)


def model_unavailable(model: str) -> str | None:
    """Why the stack's worker could not load ``model`` from this environment (``CHORUS_TOY_WEIGHTS_DIR``,
    ``CHORUS_WAN21_DIR``, ``CHORUS_DEVICE``), or None: checked before the stack starts, not after it."""
    from pydantic import ValidationError

    from workers.engine.errors import ModelUnavailable
    from workers.engine.registry import check_available
    from workers.settings import WorkerSettings

    try:
        settings = WorkerSettings()
    except ValidationError:
        return None  # the worker's own start reports a bad setting, in its words
    try:
        check_available(
            model,
            device=settings.device,
            wan21_dir=settings.wan21_dir,
            toy_weights_dir=settings.toy_weights_dir,
            count_gpus=False,
        )
    except ModelUnavailable as exc:
        return str(exc)
    return None


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
    model: ModelName = typer.Option(
        ModelName.TOY, help="Model to serve (the toy model, or tiny-random-wan: random weights)."
    ),
    num_steps: int | None = typer.Option(
        None, "--num-steps", help="Denoising steps per request (default: the model's)."
    ),
    steps: int | None = typer.Option(None, "--steps", hidden=True),
    seed: int = typer.Option(0, help="Chooses the families; the same seed publishes the same prompts."),
    fresh: bool = typer.Option(
        False, "--fresh", help="Wipe the state directory first (no donors from earlier runs)."
    ),
    concurrency: int = typer.Option(1, "--concurrency", "-c", min=1, max=16, help="Processes per worker."),
    workers: int = typer.Option(1, min=1, max=8, help="chorus worker processes."),
    embedder: Literal["minilm", "hashing"] = typer.Option("minilm", help="Prompt embedder of the scheduler."),
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
    from producer.logs import configure_logging

    # Not a terminal (a pipe, a log file): wide lines rather than a table folded to 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=180)
    err = Console(stderr=True)
    configure_logging("INFO" if verbose else "WARNING", "console")
    logging.getLogger("kafka").setLevel(logging.ERROR)
    steps_per_request = _num_steps(err, model, embedder, aliased(num_steps, steps, "--num-steps", "--steps"))
    run = DemoRun(
        out=out,
        state_dir=state_dir,
        families=families,
        per_family=per_family,
        model=model,
        num_steps=steps_per_request,
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
    try:
        with _sigterm_exits():
            _run_demo(console, run)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]: the stack is stopped and its state kept")
        raise typer.Exit(code=130) from None
    except DemoFailed as exc:
        err.print(f"[bold red]demo failed:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(code=1) from None


def _num_steps(err: Console, model: str, embedder: str, steps: int | None) -> int:
    """The steps per request; exits with status 2 on an unknown model or embedder, missing toy weights, or a
    step count the model does not take."""
    from producer.catalog import CATALOG

    if model not in CATALOG:
        err.print(
            f"[bold red]error:[/] unknown model {escape(model)!r} (known: {', '.join(sorted(CATALOG))})"
        )
        raise typer.Exit(code=2)
    if embedder not in ("minilm", "hashing"):
        err.print("[bold red]error:[/] --embedder must be minilm or hashing")
        raise typer.Exit(code=2)
    problem = model_unavailable(model)
    if problem is not None:
        err.print(
            f"[bold red]error:[/] cannot run the demo on {escape(model)}: {escape(problem)}", soft_wrap=True
        )
        if model != "tiny-random-wan":
            err.print(
                "Or run it on the tiny random Wan model (same path, noise-like videos):\n"
                "  [bold]chorus demo --model tiny-random-wan[/]   (or ./scripts/demo.sh --model tiny-random-wan)"
            )
        raise typer.Exit(code=2)
    spec = CATALOG[model]
    num_steps = steps if steps is not None else spec.default_num_steps
    why = spec.num_steps.check(num_steps)
    if why is not None:
        err.print(f"[bold red]error:[/] --num-steps {why} for model {escape(model)}")
        raise typer.Exit(code=2)
    return num_steps


class DemoFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class DemoRun:
    """What ``chorus demo`` was asked to do (its options, checked)."""

    out: Path
    state_dir: Path
    families: int
    per_family: int
    model: str
    num_steps: int
    seed: int
    fresh: bool
    concurrency: int
    workers: int
    embedder: str
    interval: float
    timeout: float
    metrics_port: int
    keep_running: bool


def _run_demo(console: Console, run: DemoRun) -> DemoSummary:
    from producer.local.config import StackError

    started_at = datetime.now(UTC)
    t0 = time.monotonic()
    run_id = started_at.strftime("%m%d%H%M%S") + uuid.uuid4().hex[:4]
    items = build_stream(run.families, run.per_family, seed=run.seed, run_id=run_id)
    requests = [_request(run, i.request_id, i.prompt, seed=i.seed, reuse=i.reuse) for i in items]
    _ready_output(run.out)  # before the stream, not after it: a bad --out lost the run's results
    stack = _start_stack(console, run, run_id, len(items))
    with stack:
        t_ready = time.monotonic()
        _print_stack(console, stack, t_ready - t0)
        warmups = [
            _request(run, f"demo-{run_id}-warmup-{i}", "warm-up", seed=None, reuse="off")
            for i in range(run.workers * run.concurrency)
        ]
        results, latencies = publish_and_follow(
            console, stack, items, requests, run.interval, run.timeout, warmups
        )
        t_results = time.monotonic()
        run_ids = {i.request_id for i in items}
        rows = [summarize(i, results.get(i.request_id), latencies.get(i.request_id), run_ids) for i in items]
        out = run.out  # made (and checked) by _ready_output before the stream
        with console.status("downloading videos, drawing the contact sheet…"):
            write_videos(stack, rows, results, out)
            sheet = write_contact_sheet(rows, out, out / "contact_sheet.png")
        try:
            stack.wait_idle(timeout_s=60)  # every result indexed as a donor before the stack stops
        except StackError as exc:
            log.warning("schedulers not idle", extra={"error": str(exc)})
        seconds = {"setup": round(t_ready - t0, 3), "stream": round(t_results - t_ready, 3)}
        summary = _summary(run, run_id, started_at, stack, rows, seconds, t0)
        write_summary(summary, out)
        print_report(console, summary, sheet, out)
        if run.keep_running:
            _keep_running(console, stack)
        console.print("stopping the stack (the object store writes its snapshot)…")
    console.print(f"stack stopped; state kept in {escape(str(run.state_dir))} (a next run reuses its donors)")
    totals = summary.totals
    if totals.missing or totals.failed:
        raise DemoFailed(f"{totals.failed} request(s) failed and {totals.missing} got no result in time")
    return summary


def _request(
    run: DemoRun, request_id: str, prompt: str, *, seed: int | None, reuse: Literal["auto", "off"]
) -> GenerationRequest:
    from producer.contract import build_request

    fields: dict[str, Any] = {"seed": seed} if seed is not None else {}
    return build_request(
        request_id=request_id,
        prompt=prompt,
        model=run.model,
        num_steps=run.num_steps,
        reuse=reuse,
        tenant="demo",
        **fields,
    )


def _ready_output(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DemoFailed(f"--out {out} is a file: name a folder for the videos and summary")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoFailed(f"cannot create --out {out}: {exc.strerror or exc}") from None
    if not os.access(out, os.W_OK):
        raise DemoFailed(f"--out {out} is not writable")


def _start_stack(console: Console, run: DemoRun, run_id: str, n_requests: int) -> EmbeddedStack:
    """Wipe the state first with ``--fresh``, say what runs, and start the stack; ``DemoFailed`` if it cannot."""
    from producer.local.config import StackError, StackOptions
    from producer.local.stack import EmbeddedStack, wipe_state
    from producer.local.state_lock import StateFolderLock

    if run.fresh:
        try:
            wipe_state(run.state_dir)
        except StackError as exc:
            raise DemoFailed(str(exc)) from None
    busy = StateFolderLock(run.state_dir)
    try:  # said before the header, which would describe a state this run cannot use
        if busy.held_elsewhere():
            busy.acquire()
            busy.release()  # let go of meanwhile: the stack takes it
    except StackError as exc:
        raise DemoFailed(str(exc)) from None
    had_state = (run.state_dir / "s3" / "manifest.json").exists()
    options = StackOptions(
        state_dir=run.state_dir,
        models=[run.model],
        workers=run.workers,
        worker_concurrency=run.concurrency,
        embedder=run.embedder,
        scheduler_metrics_port=run.metrics_port,
        worker_metrics_port=run.metrics_port + 1 if run.metrics_port else 0,
    )
    console.print(
        f"[bold]chorus demo[/] run {run_id}: {_count(n_requests, 'request')} in {_count(run.families, 'family')}, model "
        f"[bold]{escape(run.model)}[/], {run.num_steps} steps; state in {escape(str(run.state_dir))}"
        + (
            " (earlier runs' state kept: their videos answer identical requests, their donors similar ones)"
            if had_state
            else " (fresh)"
        )
    )
    try:
        with console.status("starting Kafka and S3 stand-ins, the scheduler and the worker…"):
            return EmbeddedStack(options).start()
    except StackError as exc:
        raise DemoFailed(str(exc)) from None


def _print_stack(console: Console, stack: EmbeddedStack, setup_s: float) -> None:
    up = stack.metrics_up()
    s3_url = stack.worker_settings.s3_url
    console.print(f"stack ready in {setup_s:.1f} s: Kafka {stack.kafka_address}, S3 {s3_url}")
    for name, url in stack.metrics_urls.items():
        state = "[green]up[/]" if up.get(name) else "[yellow]not answering[/]"
        console.print(f"  metrics {name}: {url} ({state})   log: {escape(str(stack.log_files[name]))}")


def _summary(
    run: DemoRun,
    run_id: str,
    started_at: datetime,
    stack: EmbeddedStack,
    rows: list[RequestSummary],
    seconds: dict[str, float],
    t0: float,
) -> DemoSummary:
    return DemoSummary(
        run_id=run_id,
        started_at=started_at,
        model=run.model,
        num_steps=run.num_steps,
        embedder=run.embedder,
        state_dir=str(stack.state_dir),
        output_dir=str(run.out.resolve()),
        kafka=stack.kafka_address,
        s3=stack.s3_endpoint,
        metrics_urls=stack.metrics_urls,
        metrics_up=stack.metrics_up(),
        log_files={k: str(v) for k, v in stack.log_files.items()},
        seconds={**seconds, "total": round(time.monotonic() - t0, 3)},
        speedup_note=SPEEDUP_NOTE,
        requests=rows,
        totals=compute_totals(rows),
    )


def _keep_running(console: Console, stack: EmbeddedStack) -> None:
    """Write the stack's env file, say how to use it, and wait for Ctrl-C; the file goes when the stack stops."""
    env_file = write_env_file(stack)
    shown = escape(shell_path(env_file))
    try:
        console.print(
            "[bold]the stack keeps running[/] (Ctrl-C stops it). Talk to it from another shell:\n"
            f"  {escape(chorus_for_shell())} produce --env-file {shown} "
            "--prompt 'a red circle moving left on a white background' "
            f"--model {escape(stack.options.models[0])} --wait\n"
            f"(or export its variables first: set -a; . {shown}; set +a)"
        )
        try:
            while True:
                stack.check()
                time.sleep(1.0)
        except KeyboardInterrupt:
            console.print("stopping…")
    finally:
        env_file.unlink(missing_ok=True)  # a stopped stack leaves no env file pointing at nothing


def write_env_file(stack: EmbeddedStack) -> Path:
    """``<state dir>/stack.env``: the stack's ``CHORUS_*`` client settings, for ``--env-file`` or ``set -a; .``."""
    env_file = stack.state_dir / "stack.env"
    keys = sorted(
        k
        for k in stack.env
        if k.startswith("CHORUS_") and k not in ("CHORUS_INSTANCE_ID", "CHORUS_METRICS_PORT")
    )
    env_file.write_text("".join(f"{k}={json.dumps(stack.env[k])}\n" for k in keys))
    env_file.chmod(0o600)
    return env_file


def shell_path(path: Path) -> str:
    """``path`` as typed in a shell here: relative to the working directory when below it."""
    absolute = path.absolute()
    try:
        text = str(absolute.relative_to(Path.cwd()))
    except ValueError:
        text = str(absolute)
    return shlex.quote(text)


def chorus_for_shell() -> str:
    """How to type the ``chorus`` command of this environment: ``chorus`` when that is on PATH and is this one,
    else its path (``.venv/bin/chorus``), else the interpreter running it."""
    from producer.local.processes import chorus_command

    argv = chorus_command()
    if len(argv) > 1:
        return " ".join(shlex.quote(a) for a in argv)
    script = Path(argv[0])
    found = shutil.which("chorus")
    if found is not None and Path(found).resolve() == script.resolve():
        return "chorus"
    return shell_path(script)


def _count(n: int, noun: str) -> str:
    """``n`` and the noun, plural unless one ("1 family", "3 families")."""
    plural = noun[:-1] + "ies" if noun.endswith("y") else noun + "s"
    return f"{n} {noun if n == 1 else plural}"
