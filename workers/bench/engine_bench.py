"""``chorus bench engine``: what a full denoising step and an SRD step cost on this machine.

For each config (``tiny``: the ``tiny-random-wan`` registry model at its catalog default shape; ``toy2``: random
weights of the toy-world-v2 transformer — Wan-like (2, 4, 4) patches, 256 tokens, MiniLM text, CFG 2 — with the
toy's own text encoder, sampler and decoder; ``mid``: a Wan2.1-1.3B-width transformer with 2 blocks at a CPU-sized
token count, CFG on as in Wan) it runs, through the real ``Engine.generate``:

1. a warm-up request (not measured);
2. ``rounds`` times: a full request, then for each active fraction ``f`` a request reusing it as donor with a
   colour-swapped prompt (Stage 1 = 1 step, every other step Stage 2 with the active fraction pinned to ``f`` by
   ``min_active_fraction = max_active_fraction = f``, TGAA α = 2, attention maps recorded as always).

Step time = the engine's per-step wall time (``StepStat.seconds``: mask building, transformer pass, donor mixing,
scheduler step) and the process CPU time between ``on_step`` callbacks. The first computed step of each request
also projects the prompt (text embedder and cross-attention K/V, cached for the later steps); it is excluded from
the step medians and reported as ``first_computed_step``. ``ratio_*`` = median SRD step / median full step;
the target is ``f + slack`` (0.1 for ``tiny`` and ``mid``, 0.15 for ``toy2`` as its issue asks; ``meets_target``
is judged on the median wall-time ratio; ``ratio_cpu`` and ``ratio_wall_min`` — the ratio of the fastest samples —
are given because other load on a shared machine only ever adds time). Also reported: interleaved transformer
passes alone (full vs gathered subsets), the plain uninstrumented diffusers forward on the same input, the bytes
of one request's trajectory, a request's prompt encoding with and without the engine's prompt cache, and what
model-verified donors cost when the check accepts and when it rejects (``_time_verification``).
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

FRACTIONS = (0.25, 0.5)


@dataclass(frozen=True)
class EngineWorkload:
    """One workload of ``chorus bench engine``: a model shape (frames, size) and its guidance scale."""

    name: str
    description: str
    num_frames: int
    height: int
    width: int
    guidance_scale: float
    target_slack: float = 0.1  # an SRD step at active fraction f should cost at most f + this of a full step


CONFIGS: dict[str, EngineWorkload] = {
    "tiny": EngineWorkload("tiny", "tiny-random-wan at its catalog default shape", 8, 32, 32, 1.0),
    "toy2": EngineWorkload(
        "toy2",
        "toy-world-v2 shape, random weights: patch (2,4,4), 4 heads x 32, 4 blocks, ffn 512, MiniLM 384-d text "
        "(32 tokens), position table, 8x32x32 pixels = 256 tokens, CFG 2",
        8,
        32,
        32,
        2.0,
        target_slack=0.15,
    ),
    "mid": EngineWorkload(
        "mid",
        "Wan2.1-1.3B width (12 heads x 128, ffn 8960, 4096-d text, 512 text tokens), 2 blocks, CFG 5",
        4,
        256,
        256,
        5.0,
    ),
}


# The toy-world-v2 transformer (issue 16) as ``workers.toy.model.build_transformer`` builds it: 8×32×32 RGB
# pixels as latent, (2, 4, 4) patches → a (4, 8, 8) grid of 256 tokens, each covering 2 frames like Wan's; the
# learned absolute-position table is part of the shape because its hook runs on every pass.
TOY2_TRANSFORMER: dict[str, Any] = {
    "patch_size": [2, 4, 4],
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "in_channels": 3,
    "out_channels": 3,
    "text_dim": 384,
    "freq_dim": 256,
    "ffn_dim": 512,
    "num_layers": 4,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 64,
    "_chorus_position_grid": [4, 8, 8],
}


def _toy2_bundle() -> Any:
    """Random weights of the toy-world-v2 shape with the toy's own text encoder (MiniLM), sampler and decoder."""
    from producer.catalog import CATALOG
    from workers.engine.bundle import ModelBundle
    from workers.toy import model as toy

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = toy.build_transformer(TOY2_TRANSFORMER)
        # a trained table is not zero; random values keep the hook's add from being a no-op
        transformer.patch_embedding.chorus_position.data.normal_(0.0, 0.02)
    transformer.eval().requires_grad_(False)
    return ModelBundle(
        spec=CATALOG["toy"],
        transformer=transformer,
        make_scheduler=toy.make_scheduler,
        encode_prompt=toy.encode_prompt,
        latent_shape=toy.latent_shape,
        decode=toy.decode,
        weights_id="bench-toy2:random-seed0",
    )


def _bundle(name: str) -> Any:
    from producer.catalog import CATALOG
    from producer.logs import quiet_transformers
    from workers.engine.registry import MID_CONFIG, build_random_wan_bundle, load_bundle

    with quiet_transformers():  # the benchmark's own progress, not a "Loading weights" bar per model
        if name == "tiny":
            return load_bundle("tiny-random-wan")
        if name == "toy2":
            return _toy2_bundle()
        return build_random_wan_bundle(MID_CONFIG, spec=CATALOG["tiny-random-wan"], name="bench-mid-wan")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


@dataclass
class _Samples:
    wall: list[float]
    cpu: list[float]

    @classmethod
    def empty(cls) -> _Samples:
        return cls([], [])

    def summary(self) -> dict[str, float]:
        return {
            "wall_s": round(_median(self.wall), 5),
            "cpu_s": round(_median(self.cpu), 5),
            "wall_min_s": round(min(self.wall, default=float("nan")), 5),
            "n": len(self.wall),
        }


class _StepClock:
    """Per-step wall time from the engine (``StepStat.seconds``) and process CPU time between ``on_step`` calls."""

    def __init__(self) -> None:
        self.cpu: dict[int, float] = {}
        self._last = 0.0

    def start(self, _traj: Any) -> None:
        self._last = time.process_time()

    def step(self, rec: Any) -> None:
        now = time.process_time()
        self.cpu[rec.index] = now - self._last
        self._last = now


def _timed(engine: Any, request: Any, plan: Any, donor: Any, stage: int) -> tuple[Any, _Samples, _Samples]:
    """Run one request; the wall and CPU time of its computed steps of ``stage``: (output, first, the rest)."""
    clock = _StepClock()
    out = engine.generate(request, plan, donor=donor, on_start=clock.start, on_step=clock.step)
    chosen = [s for s in out.steps if s.stage == stage and s.computed]
    # the first computed step of a request also projects the prompt (text embedder, cross-attention K/V);
    # later steps reuse that, so it is reported apart
    first, rest = _Samples.empty(), _Samples.empty()
    for k, s in enumerate(chosen):
        target = first if k == 0 else rest
        target.wall.append(s.seconds)
        target.cpu.append(clock.cpu[s.index])
    return out, first, rest


@dataclass
class _RequestTimes:
    """Step times of whole requests over all rounds (full steps, and SRD steps per active fraction)."""

    full: _Samples
    full_first: _Samples
    srd: dict[float, _Samples]
    achieved: dict[float, list[float]]  # active fractions the SRD steps really had
    traj_bytes: dict[str, int]  # size of one full request's trajectory
    last_full: Any  # the last full request's output (its trajectory is the donor, its metadata the shape)


def _time_requests(
    engine: Any,
    config: EngineWorkload,
    requests: tuple[Any, Any],
    steps: int,
    repeats: int,
    fractions: tuple[float, ...],
    log: Callable[[str], None],
) -> _RequestTimes:
    """``repeats`` rounds of: a full request, then per fraction an SRD request reusing it as donor."""
    from producer.contract import ReusePlan

    donor_req, target_req = requests
    times = _RequestTimes(
        _Samples.empty(),
        _Samples.empty(),
        {f: _Samples.empty() for f in fractions},
        {f: [] for f in fractions},
        {},
        None,
    )
    for r in range(repeats):
        log(f"{config.name}: round {r + 1}/{repeats}: full request")
        out, first, rest = _timed(engine, donor_req, ReusePlan.full(steps), None, 3)
        times.last_full = out
        times.full.wall += rest.wall
        times.full.cpu += rest.cpu
        times.full_first.wall += first.wall
        times.full_first.cpu += first.cpu
        if not times.traj_bytes:
            traj = out.trajectory
            times.traj_bytes = {
                "float32": len(traj.to_bytes("float32")),
                "float16": len(traj.to_bytes("float16")),
                "payload_float32": traj.nbytes("float32"),
            }
        for f in fractions:
            log(f"{config.name}: round {r + 1}/{repeats}: SRD at active fraction {f}")
            plan = ReusePlan(
                stage1_steps=1,
                stage2_steps=steps - 1,
                stage3_steps=0,
                alpha=2.0,
                min_active_fraction=f,
                max_active_fraction=f,
            )
            o, _, rest = _timed(engine, target_req, plan, out.trajectory, 2)
            times.srd[f].wall += rest.wall
            times.srd[f].cpu += rest.cpu
            times.achieved[f].extend(s.active_fraction for s in o.steps if s.stage == 2)
    return times


def _time_passes(
    engine: Any,
    bundle: Any,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    meta: Any,
    repeats: int,
    fractions: tuple[float, ...],
) -> dict[str, _Samples]:
    """Transformer passes alone, interleaved (full, then each fraction, per round): the SRD hooks' own scaling,
    less exposed to other load on the machine than whole requests."""
    x, ts, text = inputs
    seq = meta.num_tokens
    inst = engine._inst
    passes = {"full": _Samples.empty(), **{str(f): _Samples.empty() for f in fractions}}

    def one_pass(idx: torch.Tensor | None) -> tuple[float, float]:
        if idx is not None:
            inst.srd.activate(idx, seq)
        inst.attn.start_maps(meta.valid_positions, cond_row=0, device=bundle.device)
        w, c = time.perf_counter(), time.process_time()
        try:
            with torch.no_grad():
                bundle.transformer(
                    hidden_states=x, timestep=ts, encoder_hidden_states=text, return_dict=False
                )
        finally:
            inst.srd.deactivate()
            inst.attn.collect_maps()
        return time.perf_counter() - w, time.process_time() - c

    gen = torch.Generator().manual_seed(0)
    subsets = {f: torch.randperm(seq, generator=gen)[: round(f * seq)].sort().values for f in fractions}
    one_pass(None)
    for _ in range(max(3, 2 * repeats)):
        for key, idx in (("full", None), *((str(f), subsets[f]) for f in fractions)):
            w, c = one_pass(idx)
            passes[key].wall.append(w)
            passes[key].cpu.append(c)
    inst.reset()
    return passes


def _time_plain_forward(
    bundle: Any, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], repeats: int
) -> _Samples:
    """The plain diffusers transformer (call after ``Engine.close``: hooks and processors removed)."""
    x, ts, text = inputs
    plain = _Samples.empty()
    with torch.no_grad():
        for _ in range(max(2, repeats)):
            w, c = time.perf_counter(), time.process_time()
            bundle.transformer(hidden_states=x, timestep=ts, encoder_hidden_states=text, return_dict=False)
            plain.wall.append(time.perf_counter() - w)
            plain.cpu.append(time.process_time() - c)
    return plain


def _time_encoding(engine: Any, requests: tuple[Any, ...], repeats: int) -> dict[str, Any]:
    """A request's prompt encoding (its prompt and, with CFG, the negative prompt: ``Engine.encode_request``) with
    an empty prompt cache — what every request paid before the engine cached encodings — and with both cached."""
    uncached, cached = _Samples.empty(), _Samples.empty()
    for _ in range(max(3, repeats)):
        for request in requests:
            engine.prompt_cache.clear()
            for samples in (uncached, cached):
                w, c = time.perf_counter(), time.process_time()
                engine.encode_request(request)
                samples.wall.append(time.perf_counter() - w)
                samples.cpu.append(time.process_time() - c)
    engine.prompt_cache.clear()
    return {"uncached": uncached.summary(), "cached": cached.summary()}


def _time_verification(
    engine: Any, donor: Any, target: Any, steps: int, repeats: int, full_step: _Samples
) -> dict[str, Any]:
    """What model-verified donors cost (``workers.engine.verify``) on a Stage-1 plan (k1 = N/2, the rest in full):
    the request trusting its donor, verified and accepted (the check is its first computed step), verified and
    rejected (the check is thrown away and every step computed), and the same request without reuse, interleaved
    per round. Thresholds force each decision (accept everything / reject everything): on random weights only the
    cost means anything. The extra cost of a variant is given in full steps, from the process CPU time of whole
    requests (wall time on a shared machine mostly measures the other load)."""
    from producer.contract import DonorVerification, ReusePlan

    k1 = steps // 2

    def plan(policy: DonorVerification | None) -> Any:
        return ReusePlan(stage1_steps=k1, stage2_steps=0, stage3_steps=steps - k1, verification=policy)

    runs = {
        "trusted": (plan(None), donor),
        "accepted": (plan(DonorVerification(accept_max=1e30)), donor),
        "rejected": (plan(DonorVerification(accept_max=0.0)), donor),
        "no_reuse": (ReusePlan.full(steps), None),
    }
    request = {name: _Samples.empty() for name in runs}
    wasted: list[float] = []
    for _ in range(max(3, repeats)):
        for name, (p, d) in runs.items():
            w, c = time.perf_counter(), time.process_time()
            out = engine.generate(target, p, donor=d)
            request[name].wall.append(time.perf_counter() - w)
            request[name].cpu.append(time.process_time() - c)
            if name == "rejected":
                wasted.append(out.verification.wasted_seconds)
    cpu = {name: _median(v.cpu) for name, v in request.items()}
    step_cpu = _median(full_step.cpu)
    return {
        "stage1_steps": k1,
        "steps": steps,
        "request": {name: v.summary() for name, v in request.items()},
        "reject_wasted_wall_s": round(_median(wasted), 5),
        "accept_extra_cpu_full_steps": round((cpu["accepted"] - cpu["trusted"]) / step_cpu, 3),
        "reject_extra_cpu_full_steps": round((cpu["rejected"] - cpu["no_reuse"]) / step_cpu, 3),
        "rejected_vs_no_reuse_cpu": round(cpu["rejected"] / cpu["no_reuse"], 3),
    }


def _describe(config: EngineWorkload, bundle: Any, meta: Any, batch: int, steps: int) -> dict[str, Any]:
    """The report's ``transformer`` and ``request`` sections: what was timed."""
    cfg_t = bundle.transformer.config
    return {
        "transformer": {
            "layers": int(cfg_t.num_layers),
            "heads": int(cfg_t.num_attention_heads),
            "head_dim": int(cfg_t.attention_head_dim),
            "ffn_dim": int(cfg_t.ffn_dim),
            "text_dim": int(cfg_t.text_dim),
            "parameters": sum(p.numel() for p in bundle.transformer.parameters()),
        },
        "request": {
            "num_frames": config.num_frames,
            "height": config.height,
            "width": config.width,
            "latent_shape": list(meta.latent_shape),
            "tokens": meta.num_tokens,
            "text_tokens": len(meta.token_ids),
            "guidance_scale": config.guidance_scale,
            "cfg_batch": batch,
            "steps": steps,
        },
    }


def _srd_rows(
    times: _RequestTimes, passes: dict[str, _Samples], fractions: tuple[float, ...], slack: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per active fraction: the SRD step against the full step, and the SRD pass against the full pass."""
    full_sum = times.full.summary()
    pass_full = passes["full"].summary()
    rows: list[dict[str, Any]] = []
    transformer_pass: dict[str, Any] = {"full": pass_full}
    for f in fractions:
        step = times.srd[f].summary()
        ratio_wall = step["wall_s"] / full_sum["wall_s"]
        ratio_cpu = step["cpu_s"] / full_sum["cpu_s"]
        ratio_min = step["wall_min_s"] / full_sum["wall_min_s"]
        rows.append(
            {
                "active_fraction": f,
                "achieved_active_fraction": round(_median(times.achieved[f]), 4),
                "step": step,
                "ratio_wall": round(ratio_wall, 4),
                "ratio_cpu": round(ratio_cpu, 4),
                "ratio_wall_min": round(ratio_min, 4),
                "target_ratio": round(f + slack, 4),
                # judged on the median wall-time ratio
                "meets_target": bool(ratio_wall <= f + slack),
            }
        )
        p = passes[str(f)].summary()
        transformer_pass[str(f)] = {
            **p,
            "ratio_wall": round(p["wall_s"] / pass_full["wall_s"], 4),
            "ratio_cpu": round(p["cpu_s"] / pass_full["cpu_s"], 4),
            "ratio_wall_min": round(p["wall_min_s"] / pass_full["wall_min_s"], 4),
        }
    return rows, transformer_pass


def run_config(
    config: EngineWorkload,
    *,
    steps: int = 4,
    repeats: int = 3,
    fractions: tuple[float, ...] = FRACTIONS,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    from producer.contract import ReusePlan, build_request
    from workers.engine.engine import Engine

    t_build = time.perf_counter()
    bundle = _bundle(config.name)
    engine = Engine(bundle)
    build_s = time.perf_counter() - t_build
    common = {
        "model": bundle.spec.name,
        "num_frames": config.num_frames,
        "height": config.height,
        "width": config.width,
        "num_steps": steps,
        "guidance_scale": config.guidance_scale,
    }
    donor_req = build_request(prompt="a red circle moving left on a white background", seed=1, **common)
    target_req = build_request(prompt="a blue circle moving left on a white background", seed=2, **common)

    log(f"{config.name}: warm-up")
    engine.generate(donor_req, ReusePlan.full(steps))
    times = _time_requests(engine, config, (donor_req, target_req), steps, repeats, fractions, log)

    encoding = _time_encoding(engine, (donor_req, target_req), repeats)
    log(f"{config.name}: donor verification")
    verification = _time_verification(
        engine, times.last_full.trajectory, target_req, steps, repeats, times.full
    )

    log(f"{config.name}: interleaved transformer passes")
    meta = times.last_full.trajectory.meta
    batch = 2 if config.guidance_scale > 1.0 else 1
    x = torch.randn(batch, *meta.latent_shape)
    text = torch.cat([bundle.encode_prompt(donor_req.prompt).embeddings] * batch)
    ts = torch.full((batch,), 500.0)
    passes = _time_passes(engine, bundle, (x, ts, text), meta, repeats, fractions)

    # the plain diffusers transformer (hooks and processors removed) on the same input, for reference
    engine.close()
    plain = _time_plain_forward(bundle, (x, ts, text), repeats)

    srd, transformer_pass = _srd_rows(times, passes, fractions, config.target_slack)
    return {
        "config": config.name,
        "description": config.description,
        **_describe(config, bundle, meta, batch, steps),
        "rounds": repeats,
        "build_seconds": round(build_s, 3),
        "full_step": times.full.summary(),
        "first_computed_step": times.full_first.summary(),
        "srd": srd,
        "transformer_pass": transformer_pass,
        "plain_transformer_forward": plain.summary(),
        "trajectory_bytes_per_request": times.traj_bytes,
        "prompt_encoding": encoding,
        "verification": verification,
    }


def run_bench(
    configs: list[str], *, steps: int = 4, repeats: int = 3, log: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown bench config(s) {unknown} (known: {', '.join(CONFIGS)})")
    return {
        "benchmark": "engine",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": "cpu",
        },
        "target": "SRD step at active fraction f costs at most f + slack of a full step (per config: target_ratio)",
        "configs": [run_config(CONFIGS[c], steps=steps, repeats=repeats, log=log) for c in configs],
    }
