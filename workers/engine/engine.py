"""The staged denoising loop: Stage 1 (full reuse), Stage 2 (SRD + TGAA), Stage 3 (full repair steps).

See ``workers.engine`` for the public API. One ``Engine`` per ``ModelBundle``; it instruments the bundle's
transformer once (SRD hooks, cross-attention processors) and is not thread-safe: run one ``generate`` at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from producer.contract import GenerationRequest, ReusePlan
from workers.engine.bundle import ModelBundle, TextEncoding
from workers.engine.errors import CorruptTrajectory, DonorUnavailable
from workers.engine.masks import MaskSettings, build_mask, latent_mask, map_score, rows_for_positions
from workers.engine.srd import SRDContext, apply_srd_hooks, remove_srd_hooks
from workers.engine.tgaa import CrossAttnState, install_cross_attn_processors, restore_processors
from workers.engine.tokens import TokenDiff, diff_tokens
from workers.engine.trajectory import (
    DonorSource,
    StepRecord,
    Trajectory,
    TrajectoryMeta,
    check_compatible,
)

logger = logging.getLogger(__name__)

_DONOR_PROBLEMS = (DonorUnavailable, CorruptTrajectory)


@dataclass
class StepStat:
    index: int
    stage: int  # 1, 2 or 3 as actually run (a request whose donor fell away runs everything as stage 3)
    timestep: float
    active_fraction: float  # fraction of latent tokens computed (0 for stage 1, 1 for a full step)
    computed: bool  # whether a transformer pass ran
    tgaa: bool  # whether amplification was on for this step
    seconds: float  # wall time of the step, donor wait excluded
    donor_wait_seconds: float = 0.0
    fallback: str | None = None  # why this step was computed in full although the plan said otherwise


@dataclass
class GenerationOutput:
    request_id: str
    frames: np.ndarray  # uint8 (F, H, W, 3)
    trajectory: Trajectory
    steps: list[StepStat]
    plan: ReusePlan
    steps_requested: int
    steps_computed: int  # transformer passes run (a partial SRD step counts as one; CFG is one batched pass)
    tokens_computed_fraction: float  # mean over all requested steps of the computed token fraction
    stage_seconds: dict[int, float]  # denoising wall time per stage (1, 2, 3)
    encode_seconds: float  # prompt encoding
    decode_seconds: float
    fallback: str | None  # why (part of) the plan was not followed, if it was not
    donor_request_id: str | None  # the donor actually used (None if none)
    fps: int = 8

    @property
    def denoise_seconds(self) -> float:
        return sum(self.stage_seconds.values())

    def summary(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "frames": list(self.frames.shape),
            "steps_requested": self.steps_requested,
            "steps_computed": self.steps_computed,
            "tokens_computed_fraction": round(self.tokens_computed_fraction, 4),
            "stage_seconds": {str(k): round(v, 4) for k, v in self.stage_seconds.items()},
            "encode_seconds": round(self.encode_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "fallback": self.fallback,
            "donor": self.donor_request_id,
        }


def scheduler_hash(scheduler: Any) -> str:
    config = {k: v for k, v in dict(scheduler.config).items() if not k.startswith("_")}
    blob = json.dumps({"class": type(scheduler).__name__, "config": config}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class _Instrumentation:
    srd: SRDContext
    attn: CrossAttnState
    previous_processors: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.srd.deactivate()
        self.srd.clear_text_cache()
        self.attn.clear_amplification()
        self.attn.stop_maps()
        self.attn.clear_kv_cache()


_ATTR = "_chorus_instrumentation"


def instrument(transformer: Any) -> _Instrumentation:
    """Install SRD hooks and cross-attention processors on ``transformer`` once; later calls reuse them."""
    existing = getattr(transformer, _ATTR, None)
    if isinstance(existing, _Instrumentation):
        return existing
    inst = _Instrumentation(SRDContext(), CrossAttnState())
    apply_srd_hooks(transformer, inst.srd)
    inst.previous_processors = install_cross_attn_processors(transformer, inst.attn)
    setattr(transformer, _ATTR, inst)
    return inst


def uninstrument(transformer: Any) -> None:
    inst = getattr(transformer, _ATTR, None)
    if not isinstance(inst, _Instrumentation):
        return
    inst.reset()
    remove_srd_hooks(transformer)
    restore_processors(transformer, inst.previous_processors)
    delattr(transformer, _ATTR)


@dataclass
class _Run:
    """Per-request state of one ``generate`` call."""

    request: GenerationRequest
    plan: ReusePlan
    cond: TextEncoding
    text: torch.Tensor
    cfg: bool
    scheduler: Any
    timesteps: torch.Tensor
    latent_shape: tuple[int, int, int, int]
    grid: tuple[int, int, int]
    meta: TrajectoryMeta
    donor: DonorSource | None = None
    donor_meta: TrajectoryMeta | None = None
    diff: TokenDiff | None = None
    # the donor's latest attention maps read so far (step index, maps)
    donor_maps: tuple[int, torch.Tensor] | None = None
    own_prev_maps: torch.Tensor | None = None
    # (donor map rows, target map rows) of the prompt tokens both requests share
    map_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def seq_len(self) -> int:
        f, h, w = self.grid
        return f * h * w


class Engine:
    """Runs requests on one ``ModelBundle``. See ``generate``."""

    def __init__(
        self, bundle: ModelBundle, *, record_attn_maps: bool = True, cache_text: bool = True
    ) -> None:
        self.bundle = bundle
        self.record_attn_maps = record_attn_maps
        self._inst = instrument(bundle.transformer)
        self._inst.srd.cache_text = cache_text
        self._inst.attn.cache_kv = cache_text
        transformer: Any = bundle.transformer
        pt, ph, pw = (int(p) for p in transformer.config.patch_size)
        self.patch = (pt, ph, pw)

    def close(self) -> None:
        """Remove the instrumentation from the transformer (it then behaves like the plain diffusers model)."""
        uninstrument(self.bundle.transformer)

    # ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        request: GenerationRequest,
        plan: ReusePlan,
        donor: DonorSource | None = None,
        *,
        on_step: Callable[[StepRecord], None] | None = None,
        on_start: Callable[[Trajectory], None] | None = None,
        progress: bool = False,
    ) -> GenerationOutput:
        """Denoise ``request`` following ``plan``, reusing ``donor`` where the plan says so.

        ``on_start(trajectory)`` is called once the trajectory's metadata and initial latent are fixed (after
        Stage 1 was resolved, before the first computed step); ``on_step(record)`` after every step, in order.
        Raises ``IncompatibleDonor`` for a donor that can never serve this request; any other donor problem
        (``DonorUnavailable``, ``CorruptTrajectory``) only makes the engine compute more, and is reported in
        ``GenerationOutput.fallback`` and per step.
        """
        if plan.num_steps != request.num_steps:
            raise ValueError(f"plan covers {plan.num_steps} steps, request asks for {request.num_steps}")
        if request.model != self.bundle.spec.name:
            raise ValueError(f"request is for model {request.model!r}, engine runs {self.bundle.spec.name!r}")
        try:
            return self._generate(request, plan, donor, on_step, on_start, progress)
        finally:
            self._inst.reset()

    # ------------------------------------------------------------------------------------------------------
    def _generate(
        self,
        request: GenerationRequest,
        plan: ReusePlan,
        donor: DonorSource | None,
        on_step: Callable[[StepRecord], None] | None,
        on_start: Callable[[Trajectory], None] | None,
        progress: bool,
    ) -> GenerationOutput:
        b = self.bundle
        t_enc = time.perf_counter()
        cond = b.encode_prompt(request.prompt)
        cfg = request.guidance_scale > 1.0
        embeds = [cond.embeddings]
        if cfg:
            embeds.append(b.encode_prompt(request.negative_prompt or "").embeddings)
        text = torch.cat(embeds).to(b.device, b.dtype)
        encode_s = time.perf_counter() - t_enc

        scheduler = b.make_scheduler()
        sch_hash = scheduler_hash(scheduler)
        timesteps = self._set_timesteps(scheduler, request.num_steps)
        c, lf, lh, lw = b.latent_shape(request.num_frames, request.height, request.width)
        latent_shape = (c, lf, lh, lw)
        pt, ph, pw = self.patch
        grid = (lf // pt, lh // ph, lw // pw)
        gen = torch.Generator("cpu").manual_seed(request.seed)
        noise = torch.randn((1, *latent_shape), generator=gen, dtype=torch.float32)
        meta = TrajectoryMeta(
            request_id=request.request_id,
            model=request.model,
            weights_id=b.weights_id,
            num_frames=request.num_frames,
            height=request.height,
            width=request.width,
            latent_shape=latent_shape,
            token_grid=grid,
            num_steps=request.num_steps,
            scheduler=type(scheduler).__name__,
            scheduler_hash=sch_hash,
            timesteps=tuple(float(t) for t in timesteps.cpu()),
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            guidance_scale=request.guidance_scale,
            seed=request.seed,
            token_ids=tuple(cond.token_ids),
            tokens=tuple(cond.tokens),
            valid=tuple(cond.valid),
            dtype=str(b.dtype).removeprefix("torch."),
        )
        run = _Run(request, plan, cond, text, cfg, scheduler, timesteps, latent_shape, grid, meta)

        # --- resolve the donor and Stage 1 before anything is computed ------------------------------------
        fallback: list[str] = []
        k1, k2 = plan.stage1_steps, plan.stage2_steps
        stage1_records: list[StepRecord] = []
        x = noise.to(b.device)
        initial = noise
        stage1_s = 0.0
        if plan.reuses:
            if donor is None:
                fallback.append("the plan reuses a donor but none was given: computed in full")
            else:
                t1 = time.perf_counter()
                try:
                    run.donor_meta = donor.metadata()
                except _DONOR_PROBLEMS as exc:
                    fallback.append(f"donor metadata unavailable ({exc}): computed in full")
                if run.donor_meta is not None:
                    check_compatible(run.donor_meta, meta)  # IncompatibleDonor propagates: the engine refuses
                    run.donor = donor
                    run.diff = diff_tokens(
                        run.donor_meta.token_ids, run.donor_meta.valid, cond.token_ids, cond.valid
                    )
                    logger.info(
                        "request %s: donor %s, differing tokens donor=%s target=%s",
                        request.request_id,
                        run.donor_meta.request_id,
                        [run.donor_meta.tokens[p] for p in run.diff.donor_positions],
                        [cond.tokens[p] for p in run.diff.target_positions],
                    )
                    # Stage 2 mixes in the donor's outputs, so even with k1 = 0 the run starts from its noise
                    if k1 + k2 > 0:
                        try:
                            initial, x, stage1_records = self._replay_stage1(run, k1)
                        except _DONOR_PROBLEMS as exc:
                            fallback.append(
                                f"donor unavailable before stage 1 ended ({exc}): computed in full"
                            )
                            run.donor, run.donor_meta, run.diff = None, None, None
                            run.scheduler = b.make_scheduler()
                            run.timesteps = self._set_timesteps(run.scheduler, request.num_steps)
                            x, initial = noise.to(b.device), noise
                stage1_s = time.perf_counter() - t1
        if run.donor is None:
            k1 = k2 = 0
        else:
            run.meta = meta = dataclasses.replace(
                meta, initial_from=run.donor_meta.request_id if run.donor_meta else None
            )
        for fb in fallback:
            logger.info("request %s: %s", request.request_id, fb)

        traj = Trajectory(meta, initial.detach().cpu().reshape(latent_shape))
        if on_start is not None:
            on_start(traj)

        stats: list[StepStat] = []
        stage_seconds = {1: stage1_s, 2: 0.0, 3: 0.0}
        for rec in stage1_records:
            traj.append(rec)
            stats.append(StepStat(rec.index, 1, rec.timestep, 0.0, False, False, stage1_s / max(1, k1)))
            if on_step is not None:
                on_step(rec)

        bar_ctx = _progress(request.num_steps, request.request_id) if progress else nullcontext(None)
        with bar_ctx as advance:
            if advance is not None:
                advance(k1)
            for i in range(k1, request.num_steps):
                stage = 2 if i < k1 + k2 else 3
                if stage == 2:
                    x, rec, stat = self._stage2_step(run, i, x, stage2_index=i - k1)
                else:
                    tgaa = run.donor is not None and plan.tgaa_in_stage3
                    x, rec, stat = self._full_step(run, i, x, stage=3, tgaa=tgaa)
                if stat.fallback:
                    fallback.append(stat.fallback)
                stage_seconds[stage] += stat.seconds
                stats.append(stat)
                traj.append(rec)
                if on_step is not None:
                    on_step(rec)
                if advance is not None:
                    advance(1)

        t_dec = time.perf_counter()
        frames = b.decode(x.to(b.device))
        decode_s = time.perf_counter() - t_dec
        n = request.num_steps
        out = GenerationOutput(
            request_id=request.request_id,
            frames=frames,
            trajectory=traj,
            steps=stats,
            plan=plan,
            steps_requested=n,
            steps_computed=sum(1 for s in stats if s.computed),
            tokens_computed_fraction=sum(s.active_fraction for s in stats) / n,
            stage_seconds=stage_seconds,
            encode_seconds=encode_s,
            decode_seconds=decode_s,
            fallback="; ".join(fallback) if fallback else None,
            donor_request_id=run.donor_meta.request_id if run.donor is not None and run.donor_meta else None,
            fps=b.fps,
        )
        logger.info(
            "request %s done: %d/%d steps computed, token fraction %.3f, denoise %.2fs, decode %.2fs%s",
            request.request_id,
            out.steps_computed,
            n,
            out.tokens_computed_fraction,
            out.denoise_seconds,
            decode_s,
            f", fallback: {out.fallback}" if out.fallback else "",
        )
        return out

    # ------------------------------------------------------------------------------------------------------
    def _set_timesteps(self, scheduler: Any, num_steps: int) -> torch.Tensor:
        scheduler.set_timesteps(num_steps, device=self.bundle.device)
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        timesteps: torch.Tensor = scheduler.timesteps
        return timesteps

    def _check_shape(self, run: _Run, t: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(t.shape) != run.latent_shape:
            raise CorruptTrajectory(f"donor {what} has shape {tuple(t.shape)}, expected {run.latent_shape}")
        return t

    def _remember_donor_maps(self, run: _Run, rec: StepRecord) -> None:
        if rec.attn_maps is not None and run.donor_meta is not None:
            expect = (sum(run.donor_meta.valid), run.seq_len)
            if tuple(rec.attn_maps.shape) != expect:
                raise CorruptTrajectory(
                    f"donor attention maps have shape {tuple(rec.attn_maps.shape)}, expected {expect}"
                )
            if run.donor_maps is None or rec.index >= run.donor_maps[0]:
                run.donor_maps = (rec.index, rec.attn_maps)

    def _replay_stage1(self, run: _Run, k1: int) -> tuple[torch.Tensor, torch.Tensor, list[StepRecord]]:
        """Start from the donor's initial latent and advance the scheduler through its first k1 steps (so that a
        multistep scheduler holds the donor's history); the latent becomes the donor's latent after step k1."""
        assert run.donor is not None
        dev = self.bundle.device
        initial = self._check_shape(run, run.donor.initial_latent(), "initial latent")
        x = initial.to(dev, torch.float32)[None]
        records = []
        for i in range(k1):
            rec = run.donor.step(i)
            self._remember_donor_maps(run, rec)
            out = self._check_shape(run, rec.model_output, "model output").to(dev, torch.float32)[None]
            run.scheduler.step(out, run.timesteps[i], x, return_dict=False)
            x = self._check_shape(run, rec.latent_after, "latent").to(dev, torch.float32)[None]
            records.append(
                StepRecord(
                    i,
                    float(run.timesteps[i]),
                    rec.latent_after,
                    rec.model_output,
                    None,
                    stage=1,
                    active_fraction=0.0,
                )
            )
        logger.info("request %s: stage 1 reused %d donor steps", run.request.request_id, k1)
        return initial, x, records

    def _forward(
        self, run: _Run, x: torch.Tensor, t: torch.Tensor, active: torch.Tensor | None, record: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One transformer pass (CFG batched: row 0 conditional, row 1 unconditional) → (guided velocity, maps)."""
        b = self.bundle
        inst = self._inst
        batch = run.text.shape[0]
        inp = x.to(b.dtype).expand(batch, *x.shape[1:])
        ts = t.expand(batch)
        if active is not None:
            inst.srd.activate(active, run.seq_len)
        if record:
            inst.attn.start_maps(run.meta.valid_positions, cond_row=0, device=b.device)
        try:
            transformer: Any = b.transformer
            pred = transformer(
                hidden_states=inp, timestep=ts, encoder_hidden_states=run.text, return_dict=False
            )[0]
        finally:
            inst.srd.deactivate()
            maps = inst.attn.collect_maps() if record else None
        pred = pred.float()
        if run.cfg:
            cond, uncond = pred[0:1], pred[1:2]
            pred = uncond + run.request.guidance_scale * (cond - uncond)
        return pred, maps

    def _amplify(self, run: _Run, on: bool) -> bool:
        if not on or run.diff is None:
            self._inst.attn.clear_amplification()
            return False
        return self._inst.attn.set_amplification(
            list(run.diff.target_positions),
            run.plan.alpha,
            run.text.shape[0],
            run.text.shape[1],
            [0],
            self.bundle.device,
            self.bundle.dtype,
        )

    def _full_step(
        self,
        run: _Run,
        i: int,
        x: torch.Tensor,
        *,
        stage: int,
        tgaa: bool,
        fallback: str | None = None,
        donor_wait: float = 0.0,
    ) -> tuple[torch.Tensor, StepRecord, StepStat]:
        t0 = time.perf_counter()
        t = run.timesteps[i]
        amplified = self._amplify(run, tgaa)
        try:
            pred, maps = self._forward(run, x, t, None, self.record_attn_maps)
        finally:
            self._inst.attn.clear_amplification()
        x = run.scheduler.step(pred, t, x, return_dict=False)[0]
        rec = StepRecord(
            i,
            float(t),
            x[0].detach().cpu(),
            pred[0].detach().cpu(),
            maps.cpu() if maps is not None else None,
            stage=stage,
            active_fraction=1.0,
        )
        stat = StepStat(
            i, stage, float(t), 1.0, True, amplified, time.perf_counter() - t0, donor_wait, fallback
        )
        logger.debug(
            "request %s step %d stage %d: full%s",
            run.request.request_id,
            i,
            stage,
            " +TGAA" if amplified else "",
        )
        run.own_prev_maps = rec.attn_maps
        return x, rec, stat

    def _donor_maps_at(self, run: _Run, i: int) -> torch.Tensor | None:
        """The donor's maps at step i, else at the latest earlier step that had them (steps are read in order)."""
        if run.donor_maps is not None and run.donor_maps[0] <= i:
            return run.donor_maps[1]
        return None

    def _aligned_donor_maps(self, run: _Run, dmaps: torch.Tensor | None) -> torch.Tensor:
        """Donor maps re-indexed to this request's valid tokens (matched tokens only; zeros elsewhere)."""
        assert run.donor_meta is not None and run.diff is not None
        out = torch.zeros(sum(run.cond.valid), run.seq_len)
        if dmaps is None:
            return out
        if run.map_rows is None:
            drow = {p: r for r, p in enumerate(run.donor_meta.valid_positions)}
            trow = {p: r for r, p in enumerate(run.meta.valid_positions)}
            pairs = [(drow[d], trow[t]) for d, t in run.diff.matched if d in drow and t in trow]
            run.map_rows = (
                torch.tensor([p[0] for p in pairs], dtype=torch.long),
                torch.tensor([p[1] for p in pairs], dtype=torch.long),
            )
        src, dst = run.map_rows
        if src.numel():
            out[dst] = dmaps[src].float()
        return out

    def _stage2_step(
        self, run: _Run, i: int, x: torch.Tensor, stage2_index: int
    ) -> tuple[torch.Tensor, StepRecord, StepStat]:
        assert run.donor is not None and run.donor_meta is not None and run.diff is not None
        plan = run.plan
        t_wait = time.perf_counter()
        try:
            drec = run.donor.step(i)
            donor_out = self._check_shape(run, drec.model_output, "model output")
            self._remember_donor_maps(run, drec)
        except _DONOR_PROBLEMS as exc:
            wait = time.perf_counter() - t_wait
            reason = f"step {i}: donor step unavailable ({exc}): computed in full"
            logger.info("request %s: %s", run.request.request_id, reason)
            return self._full_step(run, i, x, stage=2, tgaa=True, fallback=reason, donor_wait=wait)
        wait = time.perf_counter() - t_wait

        t0 = time.perf_counter()
        t = run.timesteps[i]
        dmaps = self._donor_maps_at(run, i)
        score = self._score(run, dmaps)
        settings = MaskSettings(
            threshold=plan.mask_threshold,
            dilation=plan.mask_dilation,
            levels=plan.mask_levels,
            min_active_fraction=plan.min_active_fraction,
            max_active_fraction=plan.max_active_fraction,
        )
        mask, _ = build_mask(score, run.grid, settings, stage2_index)
        n_active = int(mask.sum())
        s_len = run.seq_len
        dev = self.bundle.device
        donor_out_d = donor_out.to(dev, torch.float32)[None]
        own_maps = self._aligned_donor_maps(run, dmaps) if self.record_attn_maps else None
        amplified = False
        if n_active == 0:
            pred = donor_out_d
        else:
            amplified = self._amplify(run, True)
            try:
                if n_active == s_len:
                    pred, maps = self._forward(run, x, t, None, self.record_attn_maps)
                    if maps is not None:
                        own_maps = maps.cpu()
                else:
                    idx = mask.nonzero().squeeze(1)
                    computed, maps = self._forward(run, x, t, idx.to(dev), self.record_attn_maps)
                    lm = latent_mask(mask, run.grid, self.patch).to(dev)
                    pred = torch.where(lm, computed, donor_out_d)
                    if maps is not None and own_maps is not None:
                        own_maps[:, idx] = maps.cpu()
            finally:
                self._inst.attn.clear_amplification()
        x = run.scheduler.step(pred, t, x, return_dict=False)[0]
        fraction = n_active / s_len
        rec = StepRecord(
            i,
            float(t),
            x[0].detach().cpu(),
            pred[0].detach().cpu(),
            own_maps,
            stage=2,
            active_fraction=fraction,
        )
        run.own_prev_maps = own_maps
        logger.debug(
            "request %s step %d stage 2: mask %d/%d tokens (%.3f)%s%s",
            run.request.request_id,
            i,
            n_active,
            s_len,
            fraction,
            " +TGAA" if amplified else "",
            " (no score: all allowed)" if score is None else "",
        )
        stat = StepStat(i, 2, float(t), fraction, n_active > 0, amplified, time.perf_counter() - t0, wait)
        return x, rec, stat

    def _score(self, run: _Run, dmaps: torch.Tensor | None) -> torch.Tensor | None:
        """Divergence score per latent token; None when differing tokens exist but none has a map yet."""
        assert run.diff is not None and run.donor_meta is not None
        d_rows = rows_for_positions(run.donor_meta.valid, run.diff.donor_positions)
        t_rows = rows_for_positions(run.cond.valid, run.diff.target_positions)
        sources = []
        missing = False
        for maps, rows in ((dmaps, d_rows), (run.own_prev_maps, t_rows)):
            if not rows:
                continue
            score = map_score(maps, rows) if maps is not None else None
            if score is None:
                missing = True
            else:
                sources.append(score)
        if sources:
            return torch.stack(sources).amax(dim=0)
        if missing:
            return None
        return torch.zeros(run.seq_len)  # prompts do not differ: nothing diverges


@contextmanager
def _progress(total: int, label: str) -> Iterator[Callable[[int], None]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]denoising[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=False,
    ) as bar:
        task = bar.add_task(label[:24], total=total)
        yield lambda n: bar.advance(task, n)
