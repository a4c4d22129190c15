"""Rectified-flow training of the toy model, its reference sampler, and accuracy evaluation with the checker.

Training pairs: a random attribute combination, a random caption for it from a pre-encoded pool
(``TRAIN_TEMPLATES``), and a fresh random placement rendered by the world. Evaluation uses held-out prompts
(``EVAL_TEMPLATES``) and fixed noise seeds, sampled with the scheduler the engine uses, read by the checker.

Auxiliary attribute loss (training only). Direction changes no clip-wide statistic: a left- and a right-moving
shape have the same colors and areas, only *where* things are in which frame differs. So the flow-matching loss
gives the text's direction word no first-order gradient: nothing pulls the direction into the token stream until
some later layer already combines it with position, and nothing builds that combination until the direction is
there (measured: after 400 steps of training at σ ≈ 1 with a fixed placement, swapping "left" for "right" changed
the prediction by 1e-4, a color swap by 0.1). Linear heads that read every attribute from the mean token after
block ``aux_block`` break that circle: cross-attention must carry each attribute into every token early. The heads
are thrown away; the saved model is the plain transformer.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workers.engine.bundle import ModelBundle
from workers.toy import checker, world
from workers.toy.model import (
    CONFIG_FILE,
    DEFAULT_TRANSFORMER_CONFIG,
    POSITION_PARAM,
    SCHEDULER_CONFIG,
    WEIGHTS_DIR,
    WEIGHTS_FILE,
    build_transformer,
    clips_to_latents,
    encode_prompts,
    latent_shape,
    latents_to_clips,
    make_scheduler,
)

LOG_FILE = "training_log.json"
CURVE_FILE = "loss_curve.png"
TRAIN_CONFIG_FILE = "train_config.json"
CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class TrainConfig:
    steps: int = 6000
    batch_size: int = 16
    lr: float = 2e-3
    warmup_steps: int = 200
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    caption_dropout: float = 0.1
    # σ ~ sigmoid(N(t_mean, t_std)) with probability 1 - t_uniform, else uniform(0, 1).
    t_mean: float = 1.0
    t_std: float = 1.0
    t_uniform: float = 0.1
    captions_per_combo: int = 32
    seed: int = 0
    threads: int = 1
    bf16: bool = True
    eval_interval: int = 1000
    eval_prompts: int = 48
    eval_steps: tuple[int, ...] = (4, 20)
    eval_guidance: float = 3.0
    log_interval: int = 25
    # "zero": adaLN-Zero style (every block starts as the identity, the output projection at zero);
    # "default": diffusers' initialization.
    init: str = "zero"
    # Couple each training clip to its noise: the shape's mid-clip position is read from the noise
    # (``coupled_mids``) instead of drawn independently, so the flow from noise to clip is nearly straight.
    coupling: bool = True
    # Start from these weights (a directory with config.json + model.safetensors) instead of a fresh init; the
    # transformer config is then the one stored there.
    init_from: str | None = None
    # Weight of the auxiliary attribute loss (module docstring); 0 = off.
    aux_weight: float = 0.3
    # Block whose output the attribute heads read (mean over tokens); the last one if the model has fewer.
    aux_block: int = 1
    # Share of training σ drawn uniformly from [0.9, 1], where the prompt is all the model has to go on.
    high_sigma: float = 0.0
    transformer: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_TRANSFORMER_CONFIG))


# --- sampling ---------------------------------------------------------------------------------------------


def seeded_noise(seeds: Sequence[int], shape: tuple[int, int, int, int]) -> torch.Tensor:
    """Initial noise: one ``torch.Generator().manual_seed(seed)`` draw of ``shape`` per seed, stacked."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(int(s))) for s in seeds])


@torch.no_grad()
def sample_latents(
    transformer: Any,
    cond: torch.Tensor,
    uncond: torch.Tensor,
    noise: torch.Tensor,
    steps: int,
    guidance: float,
) -> torch.Tensor:
    """Plain Euler sampling with classifier-free guidance: ``v = v_u + g·(v_c − v_u)``.

    ``cond`` is ``(B, L, D)``, ``uncond`` ``(1, L, D)``, ``noise`` ``(B, C, F, H, W)``.
    """
    param = next(transformer.parameters())
    scheduler = make_scheduler()
    scheduler.set_timesteps(steps)
    x = noise.to(device=param.device, dtype=torch.float32)
    cond = cond.to(device=param.device, dtype=param.dtype)
    uncond = uncond.to(device=param.device, dtype=param.dtype).expand(cond.shape[0], -1, -1)
    batch = x.shape[0]
    for t in scheduler.timesteps:
        if guidance == 1.0:
            v = transformer(x.to(param.dtype), t.expand(batch), cond, return_dict=False)[0].float()
        else:
            out = transformer(
                torch.cat([x, x]).to(param.dtype),
                t.expand(2 * batch),
                torch.cat([cond, uncond]),
                return_dict=False,
            )[0].float()
            v_c, v_u = out.chunk(2)
            v = v_u + guidance * (v_c - v_u)
        x = scheduler.step(v, t, x, return_dict=False)[0]
    return x


def sample_batch(
    bundle: ModelBundle, prompts: Sequence[str], seeds: Sequence[int], steps: int, guidance: float
) -> np.ndarray:
    """Clips for several prompts at once: uint8 ``(B, F, H, W, 3)``."""
    spec = bundle.spec
    shape = bundle.latent_shape(spec.default_num_frames, spec.default_height, spec.default_width)
    cond = torch.cat([bundle.encode_prompt(p).embeddings for p in prompts])
    uncond = bundle.encode_prompt("").embeddings
    latents = sample_latents(bundle.transformer, cond, uncond, seeded_noise(seeds, shape), steps, guidance)
    return latents_to_clips(latents)


def sample(bundle: ModelBundle, prompt: str, seed: int, steps: int, guidance: float) -> np.ndarray:
    """Reference sampler: one clip, uint8 ``(F, H, W, 3)``."""
    return sample_batch(bundle, [prompt], [seed], steps, guidance)[0]


# --- evaluation -------------------------------------------------------------------------------------------


def evaluate(
    transformer: Any,
    prompts: Sequence[tuple[str, world.Attributes]],
    steps_list: Sequence[int],
    guidance: float,
    seed_base: int = 1_000_000,
    batch_size: int = 64,
) -> dict[str, dict[str, float]]:
    """Per-attribute and all-correct accuracy of samples for ``prompts`` at each step count (noise seed of prompt
    ``i`` is ``seed_base + i``)."""
    shape = latent_shape(world.NUM_FRAMES, world.HEIGHT, world.WIDTH)
    uncond = encode_prompts([""])[0].embeddings
    cond_all = torch.cat([e.embeddings for e in encode_prompts([p for p, _ in prompts])])
    results: dict[str, dict[str, float]] = {}
    for steps in steps_list:
        scored: list[dict[str, bool]] = []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            noise = seeded_noise(range(seed_base + start, seed_base + start + len(chunk)), shape)
            latents = sample_latents(
                transformer, cond_all[start : start + len(chunk)], uncond, noise, steps, guidance
            )
            for clip, (_, attrs) in zip(latents_to_clips(latents), chunk, strict=True):
                scored.append(checker.compare(checker.read_clip(clip), attrs))
        results[f"steps{steps}"] = checker.accuracy(scored)
    return results


# --- training ---------------------------------------------------------------------------------------------


class CaptionPool:
    """Pre-encoded training captions: ``per_combo`` captions for every attribute combination."""

    def __init__(self, per_combo: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.combos = world.all_attributes()
        self.per_combo = per_combo
        captions = [world.make_caption(a, rng, "train") for a in self.combos for _ in range(per_combo)]
        self.captions = captions
        encodings = encode_prompts(captions)
        self.embeddings = torch.cat([e.embeddings for e in encodings]).to(torch.bfloat16)
        self.empty = encode_prompts([""])[0].embeddings

    def batch(
        self,
        rng: np.random.Generator,
        size: int,
        dropout: float,
        mids: list[tuple[int, int]] | None = None,
    ) -> tuple[np.ndarray, torch.Tensor, list[world.Attributes], torch.Tensor]:
        """Clips, caption embeddings (the empty prompt where dropped), attributes, and which captions were kept."""
        combo_idx = rng.integers(0, len(self.combos), size=size)
        caption_idx = combo_idx * self.per_combo + rng.integers(0, self.per_combo, size=size)
        attrs = [self.combos[int(i)] for i in combo_idx]
        if mids is None:
            params = [world.sample_params(a, rng) for a in attrs]
        else:
            params = [world.params_at(a, mx, my) for a, (mx, my) in zip(attrs, mids, strict=True)]
        clips = np.stack([world.render(p) for p in params])
        emb = self.embeddings[torch.from_numpy(caption_idx)].float()
        drop = torch.from_numpy(rng.random(size) < dropout)
        emb[drop] = self.empty[0]
        return clips, emb, attrs, ~drop


def init_weights(transformer: Any, mode: str) -> None:
    """Start every residual branch closed and the output at zero, as DiT's adaLN-Zero does: the per-block
    modulation (``scale_shift_table`` + projected timestep) starts at 0, so shift/scale/gate are 0 and
    self-attention and feed-forward add nothing; cross-attention (ungated in Wan) starts with a zero output
    projection."""
    if mode == "default":
        return
    if mode != "zero":
        raise ValueError(f"unknown init {mode!r}")
    with torch.no_grad():
        table = getattr(transformer.patch_embedding, POSITION_PARAM, None)
        if table is not None:
            # Small random positions, so the blocks can tell tokens apart from the first step.
            table.normal_(std=0.02)
        for module in (transformer.proj_out, transformer.condition_embedder.time_proj):
            module.weight.zero_()
            module.bias.zero_()
        for block in transformer.blocks:
            block.scale_shift_table.zero_()
            block.attn2.to_out[0].weight.zero_()
            block.attn2.to_out[0].bias.zero_()


def coupled_mids(noise: torch.Tensor) -> list[tuple[int, int]]:
    """Where the noise "wants" the shape: the center in ``MID_RANGE``² whose 15×15 window has the largest sum of
    the noise summed over channels and frames. A translation-equivariant, local reading of the noise, so the
    transformer can learn it, and uniform over the range by symmetry."""
    field = noise.sum(dim=(1, 2))[:, None]  # (B, 1, H, W)
    k = 2 * world.HALF_SIZE + 1
    window = torch.nn.functional.avg_pool2d(field, k, stride=1, padding=k // 2, count_include_pad=True)[:, 0]
    lo, hi = world.MID_RANGE
    region = window[:, lo : hi + 1, lo : hi + 1].flatten(1)
    idx = region.argmax(dim=1).tolist()
    width = hi - lo + 1
    return [(lo + i % width, lo + i // width) for i in idx]


def sample_sigmas(rng: torch.Generator, size: int, cfg: TrainConfig) -> torch.Tensor:
    logit = torch.randn(size, generator=rng) * cfg.t_std + cfg.t_mean
    sigmas = torch.sigmoid(logit)
    uniform = torch.rand(size, generator=rng)
    use_uniform = torch.rand(size, generator=rng) < cfg.t_uniform
    sigmas = torch.where(use_uniform, uniform, sigmas)
    if cfg.high_sigma > 0:
        high = 0.9 + 0.1 * torch.rand(size, generator=rng)
        sigmas = torch.where(torch.rand(size, generator=rng) < cfg.high_sigma, high, sigmas)
    return sigmas.clamp(1e-4, 1.0)


ATTRIBUTE_VALUES: dict[str, tuple[str, ...]] = {
    "color": tuple(world.FG_COLORS),
    "shape": world.SHAPES,
    "direction": world.DIRECTIONS,
    "background": tuple(world.BG_COLORS),
}


class AttributeHeads(torch.nn.Module):
    """One linear classifier per attribute on a ``(B, D)`` pooled hidden state (the auxiliary loss)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleDict(
            {name: torch.nn.Linear(width, len(values)) for name, values in ATTRIBUTE_VALUES.items()}
        )

    def loss(self, pooled: torch.Tensor, attributes: Sequence[world.Attributes]) -> torch.Tensor:
        """Sum over attributes of the cross-entropy of reading each attribute from ``pooled``."""
        total = pooled.new_zeros(())
        for name, head in self.heads.items():
            values = ATTRIBUTE_VALUES[name]
            target = torch.tensor([values.index(a.as_dict()[name]) for a in attributes], device=pooled.device)
            total = total + torch.nn.functional.cross_entropy(head(pooled), target)
        return total


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def save_weights(transformer: Any, config: dict[str, Any], out_dir: Path) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in transformer.state_dict().items()}
    save_file(state, str(out_dir / WEIGHTS_FILE))
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def plot_curve(log: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    if log["loss"]:
        steps, losses = zip(*log["loss"], strict=True)
        ax_loss.plot(steps, losses, lw=1)
        ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("flow-matching loss (mean over log interval)")
    ax_loss.grid(alpha=0.3)
    for key in ("steps" + str(s) for s in log["train_config"]["eval_steps"]):
        points = [(e["step"], e[key]["all"]) for e in log["evals"] if key in e]
        if points:
            xs, ys = zip(*points, strict=True)
            ax_acc.plot(xs, ys, marker="o", label=f"all-correct, {key[5:]} steps")
    ax_acc.set_ylim(0, 1.02)
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel(f"held-out accuracy (g={log['train_config']['eval_guidance']})")
    ax_acc.grid(alpha=0.3)
    ax_acc.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


ProgressFn = Callable[[int, float, dict[str, Any] | None], None]


def train(
    cfg: TrainConfig,
    out_dir: Path,
    progress: ProgressFn | None = None,
    resume: bool = False,
    command: str | None = None,
) -> dict[str, Any]:
    """Train, evaluating every ``eval_interval`` steps and at the end; writes weights (EMA), config, log, curve
    and a resumable checkpoint into ``out_dir``. Returns the log."""
    torch.set_num_threads(cfg.threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    run = _Training(cfg, out_dir, command)
    start_step = run.resume() if resume else 0
    (out_dir / TRAIN_CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    run.start()
    for step in range(start_step, cfg.steps):
        loss = run.step(step)
        run.record_loss(step, loss)
        result = None
        done = step + 1
        if done == cfg.steps or (cfg.eval_interval > 0 and done % cfg.eval_interval == 0):
            result = run.run_eval(done)
            run.checkpoint(done)
        if progress is not None:
            progress(done, loss, result)
    return run.finish()


def _initial_transformer(cfg: TrainConfig) -> Any:
    """The transformer to train: loaded from ``init_from`` (whose config then replaces ``cfg.transformer``), or
    built from ``cfg.transformer`` and initialised by ``cfg.init``."""
    if cfg.init_from is not None:
        from workers.toy.model import load_transformer

        init_dir = Path(cfg.init_from)
        cfg.transformer = json.loads((init_dir / CONFIG_FILE).read_text())
        return load_transformer(init_dir).float()
    transformer = build_transformer(cfg.transformer)
    init_weights(transformer, cfg.init)
    return transformer


class _Training:
    """The state of one ``train`` call (models, optimizer, random streams, log), built in the order that fixes
    what the seeded global RNG gives each part; one method per phase of the loop."""

    def __init__(self, cfg: TrainConfig, out_dir: Path, command: str | None) -> None:
        self.cfg = cfg
        self.out_dir = out_dir
        self.transformer = _initial_transformer(cfg)
        self.transformer.train()
        # A second build rather than a deepcopy: the position table's hook must belong to the copy.
        self.ema = build_transformer(cfg.transformer)
        self.ema.load_state_dict(self.transformer.state_dict())
        self.ema.eval().requires_grad_(False)
        self.heads = AttributeHeads(int(self.transformer.patch_embedding.out_channels))
        self.captured: dict[str, torch.Tensor] = {}
        if cfg.aux_weight > 0:
            if cfg.aux_block < 0:
                raise ValueError(f"aux_block must be ≥ 0, got {cfg.aux_block}")
            # A model with fewer blocks is read after its last one.
            aux_block = min(cfg.aux_block, len(self.transformer.blocks) - 1)
            self.transformer.blocks[aux_block].register_forward_hook(
                lambda _module, _args, output: self.captured.__setitem__("hidden", output)
            )
        self.optimizer = torch.optim.AdamW(
            [*self.transformer.parameters(), *self.heads.parameters()],
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(0.9, 0.99),
        )
        self.rng = np.random.default_rng(cfg.seed)
        self.trng = torch.Generator().manual_seed(cfg.seed)
        self.log: dict[str, Any] = {
            "train_config": asdict(cfg),
            "scheduler_config": SCHEDULER_CONFIG,
            "parameters": sum(p.numel() for p in self.transformer.parameters()),
            "command": command,
            "loss": [],
            "evals": [],
            "wall_s": 0.0,
        }
        self.checkpoint_path = out_dir / CHECKPOINT_FILE
        self.running: list[float] = []
        self.aux_running: list[float] = []

    def resume(self) -> int:
        """Continue from the checkpoint, if there is one; the step to start at."""
        if not self.checkpoint_path.exists():
            return 0
        state = torch.load(self.checkpoint_path, weights_only=False)
        self.transformer.load_state_dict(state["model"])
        self.ema.load_state_dict(state["ema"])
        self.heads.load_state_dict(state["heads"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng = state["rng"]
        self.trng.set_state(state["trng"])
        self.log = state["log"]
        step: int = state["step"]
        return step

    def start(self) -> None:
        """The caption pool, the held-out prompts and the clock (which goes on from a resumed run's)."""
        cfg = self.cfg
        self.pool = CaptionPool(cfg.captions_per_combo, cfg.seed)
        self.eval_set = world.eval_prompts(cfg.eval_prompts, seed=12345)
        self.ema_params = list(self.ema.parameters())
        self.model_params = list(self.transformer.parameters())
        self.t_start = time.time() - float(self.log["wall_s"])

    def step(self, step: int) -> float:
        """One optimizer step on a fresh batch, then the EMA update; the batch's flow-matching loss."""
        cfg = self.cfg
        shape = (cfg.batch_size, *latent_shape(world.NUM_FRAMES, world.HEIGHT, world.WIDTH))
        noise = torch.randn(shape, generator=self.trng)
        mids = coupled_mids(noise) if cfg.coupling else None
        clips, emb, attrs, kept = self.pool.batch(self.rng, cfg.batch_size, cfg.caption_dropout, mids)
        x0 = clips_to_latents(clips)
        sigma = sample_sigmas(self.trng, cfg.batch_size, cfg)
        s = sigma.view(-1, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        target = noise - x0
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            pred = self.transformer(xt, sigma * 1000.0, emb, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), target)
        total = loss
        if cfg.aux_weight > 0 and kept.any():
            # Only captioned samples: a dropped caption says nothing about the attributes.
            pooled = self.captured["hidden"].float().mean(dim=1)[kept]
            aux = self.heads.loss(pooled, [a for a, k in zip(attrs, kept.tolist(), strict=True) if k])
            self.aux_running.append(float(aux.detach()))
            total = loss + cfg.aux_weight * aux
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.model_params, cfg.grad_clip)
        self.optimizer.step()
        decay = min(cfg.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(self.ema_params, self.model_params, 1 - decay)
        return float(loss.detach())

    def record_loss(self, step: int, loss: float) -> None:
        """Every ``log_interval`` steps (and at the last): the mean losses into the log, and progress.json."""
        cfg, log = self.cfg, self.log
        self.running.append(loss)
        if len(self.running) == cfg.log_interval or step + 1 == cfg.steps:
            log["loss"].append([step + 1, float(np.mean(self.running))])
            self.running = []
            if self.aux_running:
                log.setdefault("aux_loss", []).append([step + 1, float(np.mean(self.aux_running))])
                self.aux_running = []
            status = {"step": step + 1, "steps": cfg.steps, "loss": log["loss"][-1][1]}
            status["wall_s"] = round(time.time() - self.t_start, 1)
            (self.out_dir / "progress.json").write_text(json.dumps(status) + "\n")

    def checkpoint(self, step: int) -> None:
        log, out_dir = self.log, self.out_dir
        log["wall_s"] = time.time() - self.t_start
        save_weights(self.ema, self.cfg.transformer, out_dir)
        (out_dir / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n")
        plot_curve(log, out_dir / CURVE_FILE)
        torch.save(
            {
                "model": self.transformer.state_dict(),
                "ema": self.ema.state_dict(),
                "heads": self.heads.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "rng": self.rng,
                "trng": self.trng.get_state(),
                "log": log,
                "step": step,
            },
            self.checkpoint_path,
        )

    def run_eval(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.time()
        result: dict[str, Any] = {"step": step}
        result.update(evaluate(self.ema, self.eval_set, cfg.eval_steps, cfg.eval_guidance))
        result["eval_s"] = round(time.time() - t0, 1)
        self.log["evals"].append(result)
        return result

    def finish(self) -> dict[str, Any]:
        self.log["wall_s"] = time.time() - self.t_start
        (self.out_dir / LOG_FILE).write_text(json.dumps(self.log, indent=1) + "\n")
        plot_curve(self.log, self.out_dir / CURVE_FILE)
        return self.log


def install_weights(run_dir: Path, target: Path = WEIGHTS_DIR) -> None:
    """Copy a run's final weights, config, log and curve to ``target`` (the committed ``workers/toy/weights``)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in (WEIGHTS_FILE, CONFIG_FILE, LOG_FILE, CURVE_FILE, TRAIN_CONFIG_FILE):
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, target / name)
