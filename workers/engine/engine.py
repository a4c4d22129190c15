"""The staged denoising loop: Stage 1 (full reuse), Stage 2 (SRD + TGAA), Stage 3 (full repair steps).

See ``workers.engine`` for the public API. One ``Engine`` per ``ModelBundle``; it instruments the bundle's
transformer once (SRD hooks, cross-attention processors) and is not thread-safe: run one ``generate`` at a time.

A request runs in the order of a diffusers pipeline's ``__call__``: encode the prompt, prepare the latents (and the
scheduler), resolve the donor (Stage 1, ``workers.engine.request_run``), the denoising loop with step callbacks
(Stages 2 and 3), decode.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from producer.contract import GenerationRequest, ReusePlan
from workers.engine.bundle import ModelBundle, TextEncoding
from workers.engine.fallback import Fallback
from workers.engine.instrumentation import instrument, uninstrument
from workers.engine.masks import MaskSettings, build_mask, latent_mask
from workers.engine.output import GenerationOutput, StepStat
from workers.engine.request_run import (
    DONOR_PROBLEMS,
    PrefetchedDonor,
    RequestRun,
    Stage1,
    resolve_donor,
    run_fallback,
    set_timesteps,
)
from workers.engine.trajectory import DonorSource, StepRecord, Trajectory, TrajectoryMeta

# GenerationOutput, StepStat and instrument lived here before their modules were split off; importers still use
# this module for them.
__all__ = ["Engine", "GenerationOutput", "StepStat", "instrument", "scheduler_hash", "uninstrument"]

log = logging.getLogger(__name__)


def scheduler_hash(scheduler: Any) -> str:
    config = {k: v for k, v in dict(scheduler.config).items() if not k.startswith("_")}
    blob = json.dumps({"class": type(scheduler).__name__, "config": config}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class _Denoised:
    """What the denoising loop leaves for decoding and the output."""

    x: torch.Tensor
    stats: list[StepStat]
    stage_seconds: dict[int, float]
    fallback: list[str]
    decided: Fallback | None  # the donor dropped before any of its steps was read


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
        donor: DonorSource | PrefetchedDonor | None = None,
        *,
        on_step: Callable[[StepRecord], None] | None = None,
        on_start: Callable[[Trajectory], None] | None = None,
        progress: bool = False,
        refuse_incompatible: bool = True,
    ) -> GenerationOutput:
        """Denoise ``request`` following ``plan``, reusing ``donor`` where the plan says so.

        ``on_start(trajectory)`` is called once the trajectory's metadata and initial latent are fixed (after
        Stage 1 was resolved, before the first computed step); ``on_step(record)`` after every step, in order.
        Raises ``IncompatibleDonor`` for a donor that can never serve this request (with
        ``refuse_incompatible=False`` it computes in full instead); any other donor problem (``DonorUnavailable``,
        ``CorruptTrajectory``, a ``PrefetchedDonor`` found unusable) only makes the engine compute more. Every
        fallback is decided here and reported in ``GenerationOutput.fallback`` (with its ``fallback_cause`` and
        ``donor_gone``) and per step.
        """
        if plan.num_steps != request.num_steps:
            raise ValueError(f"plan covers {plan.num_steps} steps, request asks for {request.num_steps}")
        if request.model != self.bundle.spec.name:
            raise ValueError(f"request is for model {request.model!r}, engine runs {self.bundle.spec.name!r}")
        try:
            return self._generate(request, plan, donor, on_step, on_start, progress, refuse_incompatible)
        finally:
            self._inst.reset()

    # ------------------------------------------------------------------------------------------------------
    def _generate(
        self,
        request: GenerationRequest,
        plan: ReusePlan,
        donor: DonorSource | PrefetchedDonor | None,
        on_step: Callable[[StepRecord], None] | None,
        on_start: Callable[[Trajectory], None] | None,
        progress: bool,
        refuse_incompatible: bool,
    ) -> GenerationOutput:
        t_enc = time.perf_counter()
        cond, text = self._encode_prompt(request)
        encode_s = time.perf_counter() - t_enc
        run, noise = self._prepare(request, plan, cond, text)
        # the donor and Stage 1 are resolved before anything is computed
        start = resolve_donor(run, donor, noise, self.bundle, refuse_incompatible=refuse_incompatible)
        traj = Trajectory(run.meta, start.initial.detach().cpu().reshape(run.latent_shape))
        if on_start is not None:
            on_start(traj)
        denoised = self._denoise(run, start, traj, on_step, progress)
        return self._finish(run, traj, denoised, encode_s)

    def _encode_prompt(self, request: GenerationRequest) -> tuple[TextEncoding, torch.Tensor]:
        """The prompt's encoding, and the text the transformer sees (CFG: the negative prompt as a second row)."""
        b = self.bundle
        cond = b.encode_prompt(request.prompt)
        if cond.truncated:
            # What diffusers pipelines warn too: the video follows only the start of this prompt.
            log.warning(
                "prompt truncated to the text encoder's budget",
                extra={
                    "request_id": request.request_id,
                    "model": request.model,
                    "prompt_tokens": cond.prompt_tokens,
                    "tokens_used": cond.used_tokens,
                },
            )
        embeds = [cond.embeddings]
        if request.guidance_scale > 1.0:
            embeds.append(b.encode_prompt(request.negative_prompt or "").embeddings)
        return cond, torch.cat(embeds).to(b.device, b.dtype)

    def _prepare(
        self, request: GenerationRequest, plan: ReusePlan, cond: TextEncoding, text: torch.Tensor
    ) -> tuple[RequestRun, torch.Tensor]:
        """The scheduler with its timesteps, the seeded initial noise and the trajectory's metadata."""
        b = self.bundle
        scheduler = b.make_scheduler()
        sch_hash = scheduler_hash(scheduler)
        timesteps = set_timesteps(scheduler, request.num_steps, b.device)
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
        cfg = request.guidance_scale > 1.0
        run = RequestRun(request, plan, cond, text, cfg, scheduler, timesteps, latent_shape, grid, meta)
        return run, noise

    def _denoise(
        self,
        run: RequestRun,
        start: Stage1,
        traj: Trajectory,
        on_step: Callable[[StepRecord], None] | None,
        progress: bool,
    ) -> _Denoised:
        """Record Stage 1's replayed steps, then compute Stage 2 and Stage 3; every step goes to the trajectory
        and to ``on_step``, in order."""
        k1, k2 = start.stage1_steps, start.stage2_steps
        done = _Denoised(start.x, [], {1: start.seconds, 2: 0.0, 3: 0.0}, list(start.fallback), start.decided)

        def record(rec: StepRecord, stat: StepStat) -> None:
            done.stats.append(stat)
            traj.append(rec)
            if on_step is not None:
                on_step(rec)

        for rec in start.records:
            record(rec, StepStat(rec.index, 1, rec.timestep, 0.0, False, False, start.seconds / max(1, k1)))

        n = run.request.num_steps
        bar_ctx = _progress(n, run.request.request_id) if progress else nullcontext(None)
        with bar_ctx as advance:
            if advance is not None:
                advance(k1)
            for i in range(k1, n):
                stage = 2 if i < k1 + k2 else 3
                if stage == 2:
                    done.x, rec, stat = self._stage2_step(run, i, done.x, stage2_index=i - k1)
                else:
                    tgaa = run.donor is not None and run.plan.tgaa_in_stage3
                    done.x, rec, stat = self._full_step(run, i, done.x, stage=3, tgaa=tgaa)
                if stat.fallback:
                    done.fallback.append(stat.fallback)
                done.stage_seconds[stage] += stat.seconds
                record(rec, stat)
                if advance is not None:
                    advance(1)
        return done

    def _finish(
        self, run: RequestRun, traj: Trajectory, done: _Denoised, encode_s: float
    ) -> GenerationOutput:
        """Decode the final latent and sum the run up."""
        b, request, stats = self.bundle, run.request, done.stats
        t_dec = time.perf_counter()
        frames = b.decode(done.x.to(b.device))
        decode_s = time.perf_counter() - t_dec
        n = request.num_steps
        fallback = run_fallback(run, done.decided, done.fallback)
        out = GenerationOutput(
            request_id=request.request_id,
            frames=frames,
            trajectory=traj,
            steps=stats,
            plan=run.plan,
            steps_requested=n,
            steps_computed=sum(1 for s in stats if s.computed),
            tokens_computed_fraction=sum(s.active_fraction for s in stats) / n,
            stage_seconds=done.stage_seconds,
            encode_seconds=encode_s,
            decode_seconds=decode_s,
            fallback=fallback.message if fallback else None,
            donor_request_id=run.donor_meta.request_id if run.donor is not None and run.donor_meta else None,
            fps=b.fps,
            fallback_cause=fallback.cause if fallback else None,
            donor_gone=fallback.donor_gone if fallback else False,
            prompt_tokens_used=run.cond.used_tokens if run.cond.prompt_tokens is not None else None,
            prompt_truncated=run.cond.truncated,
        )
        log.info(
            "request denoised",
            extra={
                "request_id": request.request_id,
                "steps_computed": out.steps_computed,
                "steps_requested": n,
                "tokens_computed_fraction": round(out.tokens_computed_fraction, 3),
                "denoise_s": round(out.denoise_seconds, 2),
                "decode_s": round(decode_s, 2),
                "fallback": out.fallback,
            },
        )
        return out

    # ------------------------------------------------------------------------------------------------------
    def _forward(
        self, run: RequestRun, x: torch.Tensor, t: torch.Tensor, active: torch.Tensor | None, record: bool
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

    def _amplify(self, run: RequestRun, on: bool) -> bool:
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
        run: RequestRun,
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
        log.debug(
            "step computed in full",
            extra={"request_id": run.request.request_id, "step": i, "stage": stage, "tgaa": amplified},
        )
        run.own_prev_maps = rec.attn_maps
        return x, rec, stat

    def _stage2_step(
        self, run: RequestRun, i: int, x: torch.Tensor, stage2_index: int
    ) -> tuple[torch.Tensor, StepRecord, StepStat]:
        assert run.donor is not None and run.donor_meta is not None and run.diff is not None
        plan = run.plan
        t_wait = time.perf_counter()
        try:
            drec = run.donor.step(i)
            donor_out = run.check_shape(drec.model_output, "model output")
            run.remember_donor_maps(drec)
        except DONOR_PROBLEMS as exc:
            wait = time.perf_counter() - t_wait
            run.donor_problem(exc)
            reason = f"step {i}: donor step unavailable ({exc}): computed in full"
            log.info("donor fallback", extra={"request_id": run.request.request_id, "fallback": reason})
            return self._full_step(run, i, x, stage=2, tgaa=True, fallback=reason, donor_wait=wait)
        wait = time.perf_counter() - t_wait

        t0 = time.perf_counter()
        t = run.timesteps[i]
        dmaps = run.donor_maps_at(i)
        score = run.score(dmaps)
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
        donor_out_d = donor_out.to(self.bundle.device, torch.float32)[None]
        own_maps = run.aligned_donor_maps(dmaps) if self.record_attn_maps else None
        pred, own_maps, amplified = self._masked_prediction(run, x, t, mask, donor_out_d, own_maps)
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
        log.debug(
            "stage 2 step computed on its mask",
            extra={
                "request_id": run.request.request_id,
                "step": i,
                "tokens_computed": n_active,
                "tokens": s_len,
                "active_fraction": round(fraction, 3),
                "tgaa": amplified,
                "scored": score is not None,  # no score yet: every token allowed
            },
        )
        stat = StepStat(i, 2, float(t), fraction, n_active > 0, amplified, time.perf_counter() - t0, wait)
        return x, rec, stat

    def _masked_prediction(
        self,
        run: RequestRun,
        x: torch.Tensor,
        t: torch.Tensor,
        mask: torch.Tensor,
        donor_out: torch.Tensor,
        own_maps: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """A Stage 2 step's velocity: computed (with TGAA) on the mask's tokens, the donor's output elsewhere —
        the donor's alone for an empty mask, one plain pass for a full one. Returns it with this request's maps
        (the donor's aligned maps, the computed tokens' columns overwritten) and whether TGAA was on."""
        n_active = int(mask.sum())
        if n_active == 0:
            return donor_out, own_maps, False
        dev = self.bundle.device
        amplified = self._amplify(run, True)
        try:
            if n_active == run.seq_len:
                pred, maps = self._forward(run, x, t, None, self.record_attn_maps)
                if maps is not None:
                    own_maps = maps.cpu()
            else:
                idx = mask.nonzero().squeeze(1)
                computed, maps = self._forward(run, x, t, idx.to(dev), self.record_attn_maps)
                lm = latent_mask(mask, run.grid, self.patch).to(dev)
                pred = torch.where(lm, computed, donor_out)
                if maps is not None and own_maps is not None:
                    own_maps[:, idx] = maps.cpu()
        finally:
            self._inst.attn.clear_amplification()
        return pred, own_maps, amplified


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
