"""The staged denoising loop: Stage 1 (full reuse), Stage 2 (SRD + TGAA), Stage 3 (full repair steps).

See ``workers.engine`` for the public API. One ``Engine`` per ``ModelBundle``; it instruments the bundle's
transformer once (SRD hooks, cross-attention processors) and is not thread-safe: run one ``generate`` at a time.

A request runs in the order of a diffusers pipeline's ``__call__``: encode the prompt (``prompt_cache``), prepare
the latents (and the scheduler), resolve the donor (Stage 1, ``workers.engine.request_run``) and, where the plan
asks, verify it (``workers.engine.verify``), the denoising loop with step callbacks (Stages 2 and 3, one step at
a time by ``workers.engine.steps``), decode.
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
from workers.engine.output import GenerationOutput, StepStat
from workers.engine.prompt_cache import DEFAULT_PROMPT_CACHE_SIZE, PromptCache
from workers.engine.request_run import (
    PrefetchedDonor,
    RequestRun,
    Stage1,
    noise_seed,
    resolve_donor,
    run_fallback,
    set_timesteps,
)
from workers.engine.steps import Stepper
from workers.engine.text_side import DEFAULT_TEXT_CACHE_BYTES, RowKey, TextSideCache
from workers.engine.trajectory import DonorSource, StepRecord, Trajectory, TrajectoryMeta
from workers.engine.verify import PendingStep, verify_donor

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
        self,
        bundle: ModelBundle,
        *,
        record_attn_maps: bool = True,
        cache_text: bool = True,
        prompt_cache_size: int = DEFAULT_PROMPT_CACHE_SIZE,
        text_cache_bytes: int = DEFAULT_TEXT_CACHE_BYTES,
    ) -> None:
        self.bundle = bundle
        self.record_attn_maps = record_attn_maps
        self._inst = instrument(bundle.transformer)
        self._inst.srd.cache_text = cache_text
        self._inst.attn.cache_kv = cache_text
        self._steps = Stepper(bundle, self._inst, record_attn_maps=record_attn_maps)
        self.patch = self._steps.patch
        # prompt → TextEncoding, shared by the requests this engine runs (0: encode every prompt every time)
        self.prompt_cache = PromptCache(prompt_cache_size)
        # prompt → the transformer's text projection and cross-attention K/V (as many prompts, at most this size)
        self.text_cache = TextSideCache(prompt_cache_size, text_cache_bytes) if cache_text else None

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
        cond, text = self.encode_request(request)
        encode_s = time.perf_counter() - t_enc
        run, noise = self._prepare(request, plan, cond, text)
        self._inst.srd.text_rows.begin(self.text_cache, run.text, self._row_keys(request, run.cfg))
        # the donor and Stage 1 are resolved before anything is computed, and, where the plan asks, verified by
        # computing the first step (kept as that step when the donor passes)
        start = resolve_donor(run, donor, noise, self.bundle, refuse_incompatible=refuse_incompatible)
        start, pending = verify_donor(self._steps, run, start, noise)
        traj = Trajectory(run.meta, start.initial.detach().cpu().reshape(run.latent_shape))
        if on_start is not None:
            on_start(traj)
        denoised = self._denoise(run, start, traj, on_step, progress, pending)
        return self._finish(run, traj, denoised, encode_s)

    def encode_request(self, request: GenerationRequest) -> tuple[TextEncoding, torch.Tensor]:
        """The prompt's encoding, and the text the transformer sees (CFG: the negative prompt as a second row);
        encodings come from the engine's prompt cache when it has them."""
        b = self.bundle
        cond = self.prompt_cache.get(b.weights_id, request.prompt, b.encode_prompt)
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
            embeds.append(
                self.prompt_cache.get(b.weights_id, request.negative_prompt or "", b.encode_prompt).embeddings
            )
        return cond, torch.cat(embeds).to(b.device, b.dtype)

    def _row_keys(self, request: GenerationRequest, cfg: bool) -> list[RowKey]:
        """The text batch's rows as ``encode_request`` stacks them: the prompt, then (CFG) the negative prompt."""
        wid = self.bundle.weights_id
        keys = [(wid, request.prompt)]
        if cfg:
            keys.append((wid, request.negative_prompt or ""))
        return keys

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
        pending: PendingStep | None,
    ) -> _Denoised:
        """Record Stage 1's replayed steps (and the first computed step, when verification already ran it), then
        compute the rest; every step goes to the trajectory and to ``on_step``, in order."""
        k1, k2 = start.stage1_steps, start.stage2_steps
        done = _Denoised(start.x, [], {1: start.seconds, 2: 0.0, 3: 0.0}, list(start.fallback), start.decided)

        def record(rec: StepRecord, stat: StepStat) -> None:
            if stat.fallback:
                done.fallback.append(stat.fallback)
            if stat.stage != 1:  # Stage 1's time is the donor resolution's, counted once (start.seconds)
                done.stage_seconds[stat.stage] += stat.seconds
            done.stats.append(stat)
            traj.append(rec)
            if on_step is not None:
                on_step(rec)

        for rec in start.records:
            record(rec, StepStat(rec.index, 1, rec.timestep, 0.0, False, False, start.seconds / max(1, k1)))
        if pending is not None:
            done.x = pending.x
            record(pending.record, pending.stat)
        first = k1 + (pending is not None)

        n = run.request.num_steps
        bar_ctx = _progress(n, run.request.request_id) if progress else nullcontext(None)
        with bar_ctx as advance:
            if advance is not None:
                advance(first)
            for i in range(first, n):
                done.x, rec, stat = self._steps.step(run, i, done.x, k1, k2)
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
            verification=run.verification,
            noise_seed=noise_seed(run),
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
                "verification": out.verification.decision if out.verification else None,
            },
        )
        return out


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
