"""One request's state inside ``Engine.generate``, and everything the request reads from its donor.

``RequestRun`` holds what the staged loop needs (text embeddings, scheduler, token grid, the donor and how the two
prompts differ) and reads the donor's outputs and attention maps for Stage 2; ``resolve_donor`` decides, before
the first computed step, whether the donor is used and replays its Stage 1. The loop itself is in
``workers.engine.engine``; keeping the donor side here lets each be read on its own, the way diffusers keeps a
pipeline's ``prepare_latents``/``encode_prompt`` helpers apart from its denoising loop.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from producer.contract import GenerationRequest, ReusePlan
from workers.engine.bundle import ModelBundle, TextEncoding
from workers.engine.errors import CorruptTrajectory, DonorUnavailable
from workers.engine.masks import map_score, rows_for_positions
from workers.engine.tokens import TokenDiff, diff_tokens
from workers.engine.trajectory import DonorSource, StepRecord, TrajectoryMeta, check_compatible

# Logged under the engine's name: these lines were always part of the engine's per-request log.
logger = logging.getLogger("workers.engine.engine")

# Donor problems that only make the engine compute more (``IncompatibleDonor`` is not one: it refuses the request).
DONOR_PROBLEMS = (DonorUnavailable, CorruptTrajectory)


def set_timesteps(scheduler: Any, num_steps: int, device: torch.device) -> torch.Tensor:
    scheduler.set_timesteps(num_steps, device=device)
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(0)
    timesteps: torch.Tensor = scheduler.timesteps
    return timesteps


@dataclass
class RequestRun:
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

    def check_shape(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(t.shape) != self.latent_shape:
            raise CorruptTrajectory(f"donor {what} has shape {tuple(t.shape)}, expected {self.latent_shape}")
        return t

    def remember_donor_maps(self, rec: StepRecord) -> None:
        if rec.attn_maps is not None and self.donor_meta is not None:
            expect = (sum(self.donor_meta.valid), self.seq_len)
            if tuple(rec.attn_maps.shape) != expect:
                raise CorruptTrajectory(
                    f"donor attention maps have shape {tuple(rec.attn_maps.shape)}, expected {expect}"
                )
            if self.donor_maps is None or rec.index >= self.donor_maps[0]:
                self.donor_maps = (rec.index, rec.attn_maps)

    def donor_maps_at(self, i: int) -> torch.Tensor | None:
        """The donor's maps at step i, else at the latest earlier step that had them (steps are read in order)."""
        if self.donor_maps is not None and self.donor_maps[0] <= i:
            return self.donor_maps[1]
        return None

    def aligned_donor_maps(self, dmaps: torch.Tensor | None) -> torch.Tensor:
        """Donor maps re-indexed to this request's valid tokens (matched tokens only; zeros elsewhere)."""
        assert self.donor_meta is not None and self.diff is not None
        out = torch.zeros(sum(self.cond.valid), self.seq_len)
        if dmaps is None:
            return out
        if self.map_rows is None:
            drow = {p: r for r, p in enumerate(self.donor_meta.valid_positions)}
            trow = {p: r for r, p in enumerate(self.meta.valid_positions)}
            pairs = [(drow[d], trow[t]) for d, t in self.diff.matched if d in drow and t in trow]
            self.map_rows = (
                torch.tensor([p[0] for p in pairs], dtype=torch.long),
                torch.tensor([p[1] for p in pairs], dtype=torch.long),
            )
        src, dst = self.map_rows
        if src.numel():
            out[dst] = dmaps[src].float()
        return out

    def score(self, dmaps: torch.Tensor | None) -> torch.Tensor | None:
        """Divergence score per latent token; None when differing tokens exist but none has a map yet."""
        assert self.diff is not None and self.donor_meta is not None
        d_rows = rows_for_positions(self.donor_meta.valid, self.diff.donor_positions)
        t_rows = rows_for_positions(self.cond.valid, self.diff.target_positions)
        sources = []
        missing = False
        for maps, rows in ((dmaps, d_rows), (self.own_prev_maps, t_rows)):
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
        return torch.zeros(self.seq_len)  # prompts do not differ: nothing diverges


@dataclass
class Stage1:
    """Where the denoising loop starts once the donor is resolved."""

    initial: (
        torch.Tensor
    )  # the trajectory's initial latent: this request's noise, or the donor's initial latent
    x: torch.Tensor  # the latent after Stage 1, on the device
    records: list[StepRecord]  # the donor steps replayed as Stage 1
    seconds: float  # donor metadata and Stage 1 replay
    stage1_steps: int  # k1 and k2 as they will run: 0 when no donor is used
    stage2_steps: int
    fallback: list[str]  # why the plan's reuse was (partly) dropped


def resolve_donor(
    run: RequestRun, donor: DonorSource | None, noise: torch.Tensor, bundle: ModelBundle
) -> Stage1:
    """Resolve the donor and Stage 1 before anything is computed.

    Raises ``IncompatibleDonor`` for a donor that can never serve the request; a donor that is unavailable or
    corrupt before Stage 1 ended is dropped (the request then runs in full from its own noise, on a fresh
    scheduler) and the reason is in ``Stage1.fallback``.
    """
    fallback: list[str] = []
    k1, k2 = run.plan.stage1_steps, run.plan.stage2_steps
    records: list[StepRecord] = []
    x, initial = noise.to(bundle.device), noise
    seconds = 0.0
    if run.plan.reuses and donor is None:
        fallback.append("the plan reuses a donor but none was given: computed in full")
    elif run.plan.reuses and donor is not None:
        t1 = time.perf_counter()
        # Stage 2 mixes in the donor's outputs, so even with k1 = 0 the run starts from its noise
        if _adopt(run, donor, fallback) and k1 + k2 > 0:
            try:
                initial, x, records = replay_stage1(run, k1, bundle.device)
            except DONOR_PROBLEMS as exc:
                fallback.append(f"donor unavailable before stage 1 ended ({exc}): computed in full")
                run.donor, run.donor_meta, run.diff = None, None, None
                run.scheduler = bundle.make_scheduler()
                run.timesteps = set_timesteps(run.scheduler, run.request.num_steps, bundle.device)
                x, initial = noise.to(bundle.device), noise
        seconds = time.perf_counter() - t1
    if run.donor is None:
        k1 = k2 = 0
    else:
        run.meta = dataclasses.replace(
            run.meta, initial_from=run.donor_meta.request_id if run.donor_meta else None
        )
    for fb in fallback:
        logger.info("request %s: %s", run.request.request_id, fb)
    return Stage1(initial, x, records, seconds, k1, k2, fallback)


def _adopt(run: RequestRun, donor: DonorSource, fallback: list[str]) -> bool:
    """Read the donor's metadata and diff the prompts; False (and a fallback reason) when it is unavailable."""
    try:
        run.donor_meta = donor.metadata()
    except DONOR_PROBLEMS as exc:
        fallback.append(f"donor metadata unavailable ({exc}): computed in full")
        return False
    check_compatible(run.donor_meta, run.meta)  # IncompatibleDonor propagates: the engine refuses
    run.donor = donor
    run.diff = diff_tokens(run.donor_meta.token_ids, run.donor_meta.valid, run.cond.token_ids, run.cond.valid)
    logger.info(
        "request %s: donor %s, differing tokens donor=%s target=%s",
        run.request.request_id,
        run.donor_meta.request_id,
        [run.donor_meta.tokens[p] for p in run.diff.donor_positions],
        [run.cond.tokens[p] for p in run.diff.target_positions],
    )
    return True


def replay_stage1(
    run: RequestRun, k1: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[StepRecord]]:
    """Start from the donor's initial latent and advance the scheduler through its first k1 steps (so that a
    multistep scheduler holds the donor's history); the latent becomes the donor's latent after step k1."""
    assert run.donor is not None
    initial = run.check_shape(run.donor.initial_latent(), "initial latent")
    x = initial.to(device, torch.float32)[None]
    records = []
    for i in range(k1):
        rec = run.donor.step(i)
        run.remember_donor_maps(rec)
        out = run.check_shape(rec.model_output, "model output").to(device, torch.float32)[None]
        run.scheduler.step(out, run.timesteps[i], x, return_dict=False)
        x = run.check_shape(rec.latent_after, "latent").to(device, torch.float32)[None]
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
