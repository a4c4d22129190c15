"""``chorus generate``: one request through the engine, on a worker's settings. Heavy imports (torch, diffusers)
happen inside the command.

``chorus generate`` makes one video with any registry model, on the device/dtype/model directories of
``WorkerSettings`` (``CHORUS_DEVICE``, ``CHORUS_DTYPE``, ``CHORUS_WAN21_DIR``, ``CHORUS_TOY_WEIGHTS_DIR``), optionally
reusing a saved trajectory (``--donor``) with a plan (``--k1/--k2/--k3/--alpha``), and can save its own trajectory
(``--save-trajectory``) for a later ``--donor``.

Exit codes: 0 done; 2 bad input (contract, plan, donor file, incompatible donor, model not loadable).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from producer.catalog import ModelName
from producer.logs import quiet_transformers
from workers.cli_options import aliased

if TYPE_CHECKING:
    from producer.contract import GenerationRequest, ReusePlan, VerificationReport
    from workers.engine.bundle import ModelBundle
    from workers.engine.output import GenerationOutput
    from workers.engine.trajectory import Trajectory
    from workers.settings import WorkerSettings

_err = Console(stderr=True)


def _fail(message: str) -> NoReturn:
    _err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)  # one line, as scripts read it
    raise typer.Exit(code=2)


def _setup_logging(verbose: bool) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(name)s: %(message)s",
        handlers=[RichHandler(console=_err, show_path=False)],
        force=True,
    )


def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="What the video shows."),
    model: ModelName = typer.Option(ModelName.TOY, "--model", "-m", help="Registry model."),
    negative_prompt: str | None = typer.Option(None, help="Negative prompt (used when guidance > 1)."),
    num_steps: int | None = typer.Option(
        None, "--num-steps", "-n", help="Denoising steps (default: the model's)."
    ),
    steps: int | None = typer.Option(None, "--steps", hidden=True),
    seed: int = typer.Option(0, help="Noise seed."),
    num_frames: int | None = typer.Option(
        None, "--num-frames", help="Number of frames (default: the model's)."
    ),
    frames: int | None = typer.Option(None, "--frames", hidden=True),
    height: int | None = typer.Option(None, help="Height in pixels (default: the model's)."),
    width: int | None = typer.Option(None, help="Width in pixels (default: the model's)."),
    guidance_scale: float | None = typer.Option(
        None, "--guidance-scale", "-g", help="CFG scale (default: the model's)."
    ),
    guidance: float | None = typer.Option(None, "--guidance", hidden=True),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Video file (default chorus-<id>.<format>)."
    ),
    fmt: Literal["mp4", "gif"] | None = typer.Option(
        None, "--format", help="Video format (default: the output's suffix, else CHORUS_VIDEO_FORMAT)."
    ),
    fps: int | None = typer.Option(
        None, min=1, help="Frames per second of the video (default: the model's)."
    ),
    donor: Path | None = typer.Option(None, help="A trajectory file (from --save-trajectory) to reuse."),
    k1: int | None = typer.Option(
        None, help="Stage-1 steps: taken whole from the donor (default 20% of steps)."
    ),
    k2: int | None = typer.Option(
        None, help="Stage-2 steps: selective region denoising (default 40% of steps)."
    ),
    k3: int | None = typer.Option(None, help="Stage-3 steps: full repair (default: the rest)."),
    alpha: float = typer.Option(1.0, help="TGAA amplification of the differing prompt tokens (1 = off)."),
    mask_threshold: float = typer.Option(
        0.5, help="Stage-2 mask threshold on the normalized attention score."
    ),
    min_active: float = typer.Option(0.05, help="Minimum fraction of tokens recomputed in a Stage-2 step."),
    max_active: float = typer.Option(1.0, help="Maximum fraction of tokens recomputed in a Stage-2 step."),
    verify: bool = typer.Option(
        True,
        "--verify/--no-verify",
        help="Check the donor with the model before trusting its first k1 steps (accept, shorten or reject).",
    ),
    verify_accept: float = typer.Option(
        0.01, min=0.0, help="Verification: largest relative prediction change that keeps the whole plan."
    ),
    verify_shorten: float = typer.Option(
        0.03,
        min=0.0,
        help="Verification: largest change that keeps half of Stage 1; above, the donor is dropped.",
    ),
    save_trajectory: Path | None = typer.Option(None, help="Write this request's trajectory here."),
    trajectory_dtype: Literal["float32", "float16"] = typer.Option(
        "float16", help="Storage dtype of --save-trajectory."
    ),
    device: str | None = typer.Option(None, help="Torch device (default CHORUS_DEVICE)."),
    dtype: Literal["float32", "float16", "bfloat16"] | None = typer.Option(
        None, help="Torch dtype (default CHORUS_DTYPE)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log the engine's decisions (INFO)."),
) -> None:
    """Generate one video from a prompt, optionally reusing a saved trajectory."""
    _setup_logging(verbose)
    from workers.settings import WorkerSettings

    settings = WorkerSettings()
    request = _build_request(
        {"prompt": prompt, "model": model, "seed": seed},
        negative_prompt=negative_prompt,
        num_steps=aliased(num_steps, steps, "--num-steps", "--steps"),
        num_frames=aliased(num_frames, frames, "--num-frames", "--frames"),
        height=height,
        width=width,
        guidance_scale=aliased(guidance_scale, guidance, "--guidance-scale", "--guidance"),
    )
    stages = (k1, k2, k3)
    plan = _plan(request.num_steps, donor, stages, alpha, mask_threshold, (min_active, max_active))
    if verify and donor is not None and plan.stage1_steps > 0:
        plan = _verified(plan, verify_accept, verify_shorten)
    video_fmt = _video_format(fmt, output, settings.video_format)
    out_path = output or Path(f"chorus-{request.request_id[:8]}.{video_fmt}")
    # Checked before the model runs: a missing folder would otherwise lose the finished work.
    _writable(out_path, "--output")
    if save_trajectory is not None:
        _writable(save_trajectory, "--save-trajectory")

    donor_traj = _read_donor(donor) if donor is not None else None
    engine_settings = (model, device or settings.device, dtype or settings.dtype, settings)
    result, summary = _run_and_write(
        engine_settings,
        request,
        plan,
        donor_traj,
        out_path,
        video_fmt,
        fps,
        save_trajectory,
        trajectory_dtype,
        as_json,
    )
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    _print_summary(result, request, plan, donor_traj, summary, video_fmt, trajectory_dtype)


def _video_format(fmt: str | None, output: Path | None, default: str) -> str:
    """The format to write: ``--format``, else the output's suffix, else the setting; they must agree."""
    from workers.video import FORMATS

    suffix = output.suffix.lstrip(".").lower() if output is not None and output.suffix else None
    if fmt is not None and suffix in FORMATS and suffix != fmt:  # a .part or .tmp name is the caller's
        _fail(f"--format {fmt} disagrees with the output's suffix .{suffix}: name the file .{fmt}")
    if fmt is None and suffix is not None and suffix not in FORMATS:
        _fail(f"the output's suffix .{suffix} is not a format Chorus writes: name it .mp4 or .gif")
    return fmt or suffix or default  # CHORUS_VIDEO_FORMAT is checked by the settings


def _writable(path: Path, option: str) -> None:
    if path.is_dir():
        _fail(f"{option} {path} is a directory: name a file")
    if path.exists():  # written in place (/dev/null, say): the file's own permission counts, not its folder's
        if not os.access(path, os.W_OK):
            _fail(f"{option} {path} is not writable")
        return
    if not path.parent.is_dir():
        _fail(f"{option} {path}: the folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK):
        _fail(f"{option} {path}: the folder {path.parent} is not writable")
    try:  # what access() cannot tell (a root user, /proc, a read-only mount): create it, before any work
        path.open("xb").close()
        path.unlink()
    except OSError as exc:
        _fail(f"{option} {path}: cannot be written ({exc.strerror or exc})")


def _run_and_write(
    engine_settings: tuple[str, str, str, WorkerSettings],
    request: GenerationRequest,
    plan: ReusePlan,
    donor_traj: Trajectory | None,
    out_path: Path,
    video_fmt: str,
    fps: int | None,
    save_trajectory: Path | None,
    trajectory_dtype: Literal["float32", "float16"],
    quiet: bool,
) -> tuple[GenerationOutput, dict[str, Any]]:
    """Load the model, generate, write the video (and the trajectory if asked): the output and its summary."""
    from workers.engine.engine import Engine
    from workers.engine.errors import IncompatibleDonor
    from workers.results import reuse_kind, seed_honoured
    from workers.video import encode_video

    model, device, dtype, settings = engine_settings
    engine = Engine(_load(model, device, dtype, settings))
    try:
        result = engine.generate(request, plan, donor=donor_traj, progress=not quiet)
    except IncompatibleDonor as exc:
        _fail(str(exc))
    data = encode_video(result.frames, fmt=video_fmt, fps=fps or result.fps)
    try:  # checked before the work, but a disk can fill or a folder go meanwhile
        out_path.write_bytes(data)
        traj_bytes = None
        if save_trajectory is not None:
            traj_bytes = result.trajectory.save(save_trajectory, trajectory_dtype)
    except OSError as exc:
        _fail(f"cannot write {exc.filename or out_path}: {exc.strerror or exc}")
    reuse = reuse_kind(
        had_donor=result.donor_request_id is not None,
        steps_computed=result.steps_computed,
        steps_requested=result.steps_requested,
        tokens_computed_fraction=result.tokens_computed_fraction,
    )
    summary = {
        **result.summary(),
        "reuse": str(reuse),
        # as in a served result: False when the video started from a donor's noise of another seed
        "seed_honoured": seed_honoured(result.noise_seed, seed=request.seed),
        "model": model,
        "plan": plan.model_dump(),
        "output": str(out_path),
        "video_bytes": len(data),
        "trajectory": str(save_trajectory) if save_trajectory else None,
        "trajectory_bytes": traj_bytes,
    }
    return result, summary


def _build_request(fields: dict[str, Any], **optional: Any) -> GenerationRequest:
    """The request from the required fields and the options given (None: the model's default)."""
    from producer.contract import ContractError, build_request

    fields = {**fields, **{k: v for k, v in optional.items() if v is not None}}
    try:
        return build_request(**fields)
    except ContractError as exc:
        _fail("; ".join(str(i) for i in exc.issues))


def _plan(
    n: int,
    donor: Path | None,
    stages: tuple[int | None, int | None, int | None],
    alpha: float,
    mask_threshold: float,
    active: tuple[float, float],
) -> ReusePlan:
    """Full without a donor; else k1/k2/k3 as given, defaulting to 20% / 40% / the rest of the steps."""
    from pydantic import ValidationError

    from producer.contract import ReusePlan

    k1, k2, k3 = stages
    if donor is None:
        if any(v is not None for v in stages):
            _fail("--k1/--k2/--k3 need a --donor trajectory")
        return ReusePlan.full(n)
    s1 = k1 if k1 is not None else round(0.2 * n)
    s2 = k2 if k2 is not None else round(0.4 * n)
    s3 = k3 if k3 is not None else n - s1 - s2
    if s1 + s2 + s3 != n or min(s1, s2, s3) < 0:
        _fail(f"--k1 {s1} + --k2 {s2} + --k3 {s3} must add up to the {n} steps")
    try:
        return ReusePlan(
            stage1_steps=s1,
            stage2_steps=s2,
            stage3_steps=s3,
            alpha=alpha,
            mask_threshold=mask_threshold,
            min_active_fraction=active[0],
            max_active_fraction=active[1],
        )
    except ValidationError as exc:
        _fail(f"bad plan: {exc.errors()[0]['msg']}")


def _verified(plan: ReusePlan, accept_max: float, shorten_max: float) -> ReusePlan:
    from producer.contract import DonorVerification

    if shorten_max < accept_max:
        _fail(f"--verify-shorten {shorten_max} must be at least --verify-accept {accept_max}")
    return plan.model_copy(
        update={"verification": DonorVerification(accept_max=accept_max, shorten_max=shorten_max)}
    )


def _read_donor(path: Path) -> Trajectory:
    from workers.engine.errors import CorruptTrajectory
    from workers.engine.trajectory import Trajectory

    try:
        return Trajectory.load(path)
    except (OSError, CorruptTrajectory) as exc:
        _fail(f"cannot read donor trajectory {path}: {exc}")


def _load(model: str, device: str, dtype: str, settings: WorkerSettings) -> ModelBundle:
    from workers.engine.errors import ModelUnavailable
    from workers.engine.registry import load_bundle

    try:
        with _err.status(f"loading {model}…"), quiet_transformers():
            return load_bundle(
                model,
                device=device,
                dtype=dtype,
                wan21_dir=settings.wan21_dir,
                toy_weights_dir=settings.toy_weights_dir,
            )
    except (ModelUnavailable, ValueError) as exc:
        _fail(str(exc))


def _verification_line(report: VerificationReport, plan: ReusePlan) -> str:
    """One line on the model's check of the donor: what it measured, against which thresholds, and what it did."""
    if report.signal is None:
        return f"{report.decision}: the donor's output at step {report.step} could not be read; plan ran as given"
    limits = plan.verification
    bounds = f" (accept ≤ {limits.accept_max:g}, shorten ≤ {limits.shorten_max:g})" if limits else ""
    what = {
        "accepted": f"kept the donor's {report.stage1_steps} Stage-1 steps",
        "shortened": f"Stage 1 cut to {report.stage1_steps} steps",
        "rejected": "donor dropped, computed in full from this request's own noise",
    }.get(report.decision, report.decision)
    return f"{report.decision}: prediction change {report.signal:.4f}{bounds}; {what}"


def _print_summary(
    result: GenerationOutput,
    request: GenerationRequest,
    plan: ReusePlan,
    donor_traj: Trajectory | None,
    summary: dict[str, Any],
    video_fmt: str,
    trajectory_dtype: str,
) -> None:
    console = Console()
    table = Table(show_header=False, box=None)
    table.add_row(
        "video",
        f"{summary['output']} ({summary['video_bytes']:,} bytes, {video_fmt}, {result.frames.shape[0]} frames)",
    )
    seed = f"seed {request.seed}" + ("" if summary["seed_honoured"] else " (the donor's: another sample)")
    table.add_row("request", f"{request.request_id}  model {summary['model']}  {seed}")
    table.add_row(
        "steps",
        f"{result.steps_computed}/{result.steps_requested} computed, "
        f"{result.tokens_computed_fraction:.1%} of tokens",
    )
    stages = "  ".join(f"stage {k}: {v:.2f}s" for k, v in result.stage_seconds.items() if v > 0)
    table.add_row("time", f"{stages}  decode {result.decode_seconds:.2f}s")
    if donor_traj is not None:
        table.add_row(
            "donor",
            f"{donor_traj.meta.request_id} (k1={plan.stage1_steps} k2={plan.stage2_steps} "
            f"k3={plan.stage3_steps} α={plan.alpha})",
        )
    if result.verification is not None:
        table.add_row("verification", _verification_line(result.verification, plan))
    if result.fallback:
        table.add_row("fallback", escape(result.fallback))
    if summary["trajectory"] is not None:
        table.add_row(
            "trajectory",
            f"{summary['trajectory']} ({summary['trajectory_bytes']:,} bytes, {trajectory_dtype})",
        )
    console.print(table)
