"""CLI commands of this package."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from workers.toy.train import TrainConfig


def train_toy(
    steps: int = typer.Option(6000, help="Optimizer steps (the committed weights: 6000, 49 min on 2 cores)."),
    batch_size: int = typer.Option(16, help="Clips per step."),
    lr: float = typer.Option(2e-3, help="Peak AdamW learning rate (linear warmup, cosine decay)."),
    out: Path | None = typer.Option(None, help="Run directory (default: runs/toy-<timestamp>)."),
    seed: int = typer.Option(0, help="Seed of initialization, data and noise."),
    eval_interval: int = typer.Option(
        1000, help="Evaluate (and checkpoint) every N steps; 0 = only at the end."
    ),
    eval_prompts: int = typer.Option(48, help="Held-out prompts sampled at each evaluation."),
    eval_steps: str = typer.Option("4,20", help="Comma-separated sampling step counts to evaluate."),
    eval_guidance: float = typer.Option(3.0, help="Classifier-free guidance scale used by evaluations."),
    threads: int = typer.Option(
        2,
        help="torch CPU threads: 2 ran 0.46 s/step alone on a 2-core machine; use 1 if the other core is busy "
        "(2 threads then ran 3-4x slower than 1).",
    ),
    bf16: bool = typer.Option(True, help="bf16 autocast for the forward pass (CPU; weights stay float32)."),
    layers: int = typer.Option(4, help="Transformer blocks."),
    heads: int = typer.Option(4, help="Attention heads."),
    head_dim: int = typer.Option(32, help="Channels per head."),
    ffn_dim: int = typer.Option(512, help="Feed-forward width."),
    patch: str = typer.Option("8,2,2", help="Patch size (frames, height, width)."),
    coupling: bool = typer.Option(
        True, help="Read each training clip's position from its noise (see train.py)."
    ),
    t_mean: float = typer.Option(
        1.0, help="Mean of the logit-normal training σ distribution (higher = noisier)."
    ),
    t_std: float = typer.Option(1.0, help="Standard deviation of the logit-normal training σ distribution."),
    t_uniform: float = typer.Option(0.1, help="Share of training σ drawn uniformly from (0, 1) instead."),
    high_sigma: float = typer.Option(0.0, help="Share of training σ drawn uniformly from [0.9, 1]."),
    aux_weight: float = typer.Option(
        0.3, help="Weight of the auxiliary attribute loss that carries the prompt into every token (0 = off)."
    ),
    aux_block: int = typer.Option(1, help="Block whose mean output the auxiliary attribute heads read."),
    positions: bool = typer.Option(
        True, help="Learned absolute-position table on the patch embedding (see workers/toy/model.py)."
    ),
    init_from: Path | None = typer.Option(
        None, help="Fine-tune from these weights (a directory with config.json and model.safetensors)."
    ),
    captions_per_combo: int = typer.Option(
        32, help="Pre-encoded training captions per attribute combination."
    ),
    resume: bool = typer.Option(False, help="Continue from the run directory's checkpoint."),
    install: bool = typer.Option(
        False, help="Copy the final weights, config, log and curve to workers/toy/weights."
    ),
) -> None:
    """Train the toy text-to-video model (rectified flow, CPU) and write safetensors weights, config, log, curve."""
    import shlex
    import sys
    import time

    from rich.console import Console

    from workers.toy import train as training
    from workers.toy.model import WEIGHTS_DIR

    console = Console()
    run_dir = out if out is not None else Path("runs") / time.strftime("toy-%Y%m%d-%H%M%S")
    transformer = _transformer_config(layers, heads, head_dim, ffn_dim, patch, positions)
    cfg = training.TrainConfig(
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        eval_interval=eval_interval,
        eval_prompts=eval_prompts,
        eval_steps=tuple(int(s) for s in eval_steps.split(",") if s.strip()),
        eval_guidance=eval_guidance,
        threads=threads,
        bf16=bf16,
        captions_per_combo=captions_per_combo,
        coupling=coupling,
        t_mean=t_mean,
        t_std=t_std,
        t_uniform=t_uniform,
        high_sigma=high_sigma,
        aux_weight=aux_weight,
        aux_block=aux_block,
        init_from=str(init_from) if init_from is not None else None,
        transformer=transformer,
    )
    command = shlex.join(["chorus", "train-toy", *sys.argv[2:]]) if len(sys.argv) > 1 else None
    console.print(f"[bold]train-toy[/] → {run_dir}")
    log = _train_with_progress(cfg, run_dir, resume, command, console)
    console.print(f"done in {log['wall_s'] / 60:.1f} min; weights in {run_dir}")
    if log["evals"]:
        console.print(f"final evaluation: {log['evals'][-1]}")
    if install:
        training.install_weights(run_dir)
        console.print(f"installed into {WEIGHTS_DIR}")


def _transformer_config(
    layers: int, heads: int, head_dim: int, ffn_dim: int, patch: str, positions: bool
) -> dict[str, Any]:
    """The default toy transformer config with the given sizes; the patch must tile the world's clips."""
    from workers.toy import world
    from workers.toy.model import DEFAULT_TRANSFORMER_CONFIG, POSITION_KEY

    transformer = dict(DEFAULT_TRANSFORMER_CONFIG)
    transformer.update(
        num_layers=layers, num_attention_heads=heads, attention_head_dim=head_dim, ffn_dim=ffn_dim
    )
    patch_size = [int(v) for v in patch.split(",")]
    if len(patch_size) != 3 or any(v <= 0 for v in patch_size):
        raise typer.BadParameter(f"--patch needs three positive sizes, got {patch!r}")
    dims = (world.NUM_FRAMES, world.HEIGHT, world.WIDTH)
    if any(d % p for d, p in zip(dims, patch_size, strict=True)):
        raise typer.BadParameter(f"--patch {patch} does not tile {dims[0]}×{dims[1]}×{dims[2]} clips")
    transformer["patch_size"] = patch_size
    if positions:
        transformer[POSITION_KEY] = [d // p for d, p in zip(dims, patch_size, strict=True)]
    else:
        transformer.pop(POSITION_KEY, None)
    return transformer


def _train_with_progress(
    cfg: TrainConfig, run_dir: Path, resume: bool, command: str | None, console: Console
) -> dict[str, Any]:
    """``train`` under a progress bar that shows the loss and each evaluation's all-correct accuracy."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from workers.toy import train as training

    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[acc]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("training", total=cfg.steps, loss=float("nan"), acc="")

        def update(step: int, loss: float, result: dict[str, Any] | None) -> None:
            fields: dict[str, Any] = {"loss": loss}
            if result is not None:
                accs = [f"{k[5:]}st {v['all']:.0%}" for k, v in result.items() if k.startswith("steps")]
                fields["acc"] = "all-correct " + ", ".join(accs)
                progress.console.print(f"step {step}: " + ", ".join(accs))
            progress.update(task, completed=step, **fields)

        return training.train(cfg, run_dir, progress=update, resume=resume, command=command)
