"""One request's state inside ``Engine.generate``, and everything the request reads from its donor.

``RequestRun`` holds what the staged loop needs (text embeddings, scheduler, token grid, the donor and how the two
prompts differ) and reads the donor's outputs and attention maps for Stage 2; ``resolve_donor`` decides, before
the first computed step, whether the donor is used and replays its Stage 1; ``prefetch_donor`` reads a finished
donor up front (what the worker does before the model is free), and ``run_fallback`` sums up what the run did not
reuse (``workers.engine.fallback``). The loop itself is in
``workers.engine.engine``; keeping the donor side here lets each be read on its own, the way diffusers keeps a
pipeline's ``prepare_latents``/``encode_prompt`` helpers apart from its denoising loop.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from producer.contract import GenerationRequest, ReusePlan, VerificationReport
from workers.engine.bundle import ModelBundle, TextEncoding
from workers.engine.errors import (
    CorruptTrajectory,
    DonorMissing,
    DonorUnavailable,
    DonorWaitExpired,
    IncompatibleDonor,
)
from workers.engine.fallback import Fallback, FallbackCause
from workers.engine.masks import map_score, rows_for_positions
from workers.engine.tokens import TokenDiff, diff_tokens
from workers.engine.trajectory import DonorSource, StepRecord, TrajectoryMeta, check_compatible

log = logging.getLogger(__name__)

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
    # whether a donor problem the run computed around was a leader that never came (a follower's wait ran out)
    waited_out: bool = False
    # (donor map rows, target map rows) of the differing prompt tokens, for ``score``
    score_rows: tuple[list[int], list[int]] | None = None
    # the donor's model output a Stage-2 step read last (step index, output): what verification compares with
    last_donor_output: tuple[int, torch.Tensor] | None = None
    # what donor verification measured and decided (``workers.engine.verify``), if it ran
    verification: VerificationReport | None = None

    def donor_problem(self, exc: Exception) -> None:
        """Note a donor problem the engine computes around."""
        if isinstance(exc, DonorWaitExpired):
            self.waited_out = True

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
        if self.score_rows is None:  # the same every step: the prompts do not change
            self.score_rows = (
                rows_for_positions(self.donor_meta.valid, self.diff.donor_positions),
                rows_for_positions(self.cond.valid, self.diff.target_positions),
            )
        d_rows, t_rows = self.score_rows
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
    # decided before the loop: the donor dropped before any of its steps was read, or verification's verdict
    decided: Fallback | None = None


class PrefetchableSource(DonorSource, Protocol):
    def prefetch(self, indices: Iterable[int]) -> None:
        """Download and verify the header and the given steps now (raises what the accessors raise)."""


@dataclass(frozen=True)
class PrefetchedDonor:
    """A finished donor read up front by ``prefetch_donor``: ``source`` holds everything the plan reads of it, or is
    None when the donor proved unusable (``fallback`` says why; the request runs in full)."""

    source: DonorSource | None
    fallback: Fallback | None = None


def donor_steps(plan: ReusePlan, num_steps: int) -> range:
    """The donor steps a plan reads: those of Stages 1 and 2, and the first step after Stage 1 when the donor is
    verified (``workers.engine.verify`` compares with the donor's output there)."""
    end = plan.stage1_steps + plan.stage2_steps
    if plan.verification is not None and plan.stage1_steps > 0:
        end = max(end, plan.stage1_steps + 1)
    return range(min(end, num_steps))


def prefetch_donor(
    donor: PrefetchableSource, plan: ReusePlan, num_steps: int, *, name: str
) -> PrefetchedDonor:
    """Read a finished donor's header and every step ``plan`` takes from it now, before the engine runs, so that a
    donor that is missing, corrupt or unreadable is found out up front and the request runs in full (a missing or
    corrupt one can never serve again: ``donor_gone``). ``name`` names the donor in the reason."""
    try:
        donor.prefetch(donor_steps(plan, num_steps))
    except DONOR_PROBLEMS as exc:
        cause = (
            FallbackCause.DONOR_CORRUPT
            if isinstance(exc, CorruptTrajectory)
            else FallbackCause.DONOR_UNAVAILABLE
        )
        message = f"donor {name} unusable ({exc}): computed in full"
        return PrefetchedDonor(
            None, Fallback(cause, message, isinstance(exc, DonorMissing | CorruptTrajectory))
        )
    return PrefetchedDonor(donor)


def resolve_donor(
    run: RequestRun,
    donor: DonorSource | PrefetchedDonor | None,
    noise: torch.Tensor,
    bundle: ModelBundle,
    *,
    refuse_incompatible: bool = True,
) -> Stage1:
    """Resolve the donor and Stage 1 before anything is computed.

    A donor that ``prefetch_donor`` found unusable, or that is unavailable or corrupt before Stage 1 ended, is
    dropped (the request then runs in full from its own noise, on a fresh scheduler) and the reason is in
    ``Stage1.fallback``. A donor that can never serve the request raises ``IncompatibleDonor``, or with
    ``refuse_incompatible=False`` is dropped the same way (and, a finished donor, reported gone).
    """
    fallback: list[str] = []
    decided: Fallback | None = None
    k1, k2 = run.plan.stage1_steps, run.plan.stage2_steps
    records: list[StepRecord] = []
    x, initial = noise.to(bundle.device), noise
    seconds = 0.0
    finished = isinstance(donor, PrefetchedDonor)
    if isinstance(donor, PrefetchedDonor):
        decided, donor = donor.fallback, donor.source
    if decided is not None:
        fallback.append(decided.message)
    elif run.plan.reuses and donor is None:
        decided = Fallback(
            FallbackCause.NO_DONOR_REF, "the plan reuses a donor but none was given: computed in full"
        )
        fallback.append(decided.message)
    elif run.plan.reuses and donor is not None:
        t1 = time.perf_counter()
        try:
            adopted = _adopt(run, donor, fallback)
        except IncompatibleDonor as exc:
            if refuse_incompatible:
                raise
            run.donor_meta, adopted = None, False
            message = f"incompatible donor ({exc}): computed in full"
            decided = Fallback(FallbackCause.DONOR_INCOMPATIBLE, message, donor_gone=finished)
            fallback.append(message)
        # Stage 2 mixes in the donor's outputs, so even with k1 = 0 the run starts from its noise
        if adopted and k1 + k2 > 0:
            try:
                initial, x, records = replay_stage1(run, k1, bundle.device)
            except DONOR_PROBLEMS as exc:
                run.donor_problem(exc)
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
        log.info("donor fallback", extra={"request_id": run.request.request_id, "fallback": fb})
    return Stage1(initial, x, records, seconds, k1, k2, fallback, decided)


def noise_seed(run: RequestRun) -> int | None:
    """The seed of the noise the run's trajectory starts from: the request's own, or its donor's when the run
    starts from the donor's initial latent (Stage 1 does, and so does a Stage-2-only plan, whose kept tokens are
    the donor's). None when that is not known: a donor that itself started from another's noise records only its
    own request's seed."""
    if run.meta.initial_from is None:
        return run.request.seed
    donor = run.donor_meta
    if donor is None or donor.initial_from is not None:
        return None
    return donor.seed


def run_fallback(run: RequestRun, decided: Fallback | None, reasons: Sequence[str]) -> Fallback | None:
    """What the run did not reuse, as one fallback: the donor dropped before any step was read (``decided``), else
    the donor problems the run computed around (a wait timeout when a leader never came)."""
    if not reasons:
        return None
    message = "; ".join(reasons)
    if decided is not None:
        return Fallback(decided.cause, message, decided.donor_gone)
    cause = FallbackCause.LEADER_WAIT_TIMEOUT if run.waited_out else FallbackCause.DONOR_STEP_UNAVAILABLE
    return Fallback(cause, message)


def _adopt(run: RequestRun, donor: DonorSource, fallback: list[str]) -> bool:
    """Read the donor's metadata and diff the prompts; False (and a fallback reason) when it is unavailable."""
    try:
        run.donor_meta = donor.metadata()
    except DONOR_PROBLEMS as exc:
        run.donor_problem(exc)
        fallback.append(f"donor metadata unavailable ({exc}): computed in full")
        return False
    check_compatible(run.donor_meta, run.meta)  # IncompatibleDonor propagates: the engine refuses
    run.donor = donor
    run.diff = diff_tokens(run.donor_meta.token_ids, run.donor_meta.valid, run.cond.token_ids, run.cond.valid)
    log.info(
        "donor adopted",
        extra={
            "request_id": run.request.request_id,
            "donor": run.donor_meta.request_id,
            "donor_tokens": [run.donor_meta.tokens[p] for p in run.diff.donor_positions],
            "target_tokens": [run.cond.tokens[p] for p in run.diff.target_positions],
        },
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
    if k1:
        log.info("stage 1 replayed from the donor", extra={"request_id": run.request.request_id, "steps": k1})
    else:  # a Stage-2-only plan: the donor's noise, none of its steps
        log.info("starting from the donor's initial latent", extra={"request_id": run.request.request_id})
    return initial, x, records
