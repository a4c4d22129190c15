"""One denoising step of a request, as the engine's loop runs it: a full step (Stage 3, or any step computed in
full) or a Stage-2 step (SRD on the divergence mask + TGAA), each returning the new latent, the step's record for
the trajectory and its statistics.

Kept apart from the loop (``workers.engine.engine``) so that the loop and donor verification
(``workers.engine.verify``), which runs a request's first computed step before committing to the donor, call the
very same code.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from workers.engine.bundle import ModelBundle
from workers.engine.instrumentation import Instrumentation
from workers.engine.masks import MaskSettings, build_mask, latent_mask
from workers.engine.output import StepStat
from workers.engine.request_run import DONOR_PROBLEMS, RequestRun
from workers.engine.trajectory import StepRecord

log = logging.getLogger(__name__)


class Stepper:
    """Runs single steps on one instrumented transformer (see the module docstring)."""

    def __init__(self, bundle: ModelBundle, inst: Instrumentation, *, record_attn_maps: bool) -> None:
        self.bundle = bundle
        self.inst = inst
        self.record_attn_maps = record_attn_maps
        transformer: Any = bundle.transformer
        pt, ph, pw = (int(p) for p in transformer.config.patch_size)
        self.patch = (pt, ph, pw)

    def step(
        self, run: RequestRun, i: int, x: torch.Tensor, stage1_steps: int, stage2_steps: int
    ) -> tuple[torch.Tensor, StepRecord, StepStat]:
        """Step ``i`` of a run whose Stage 1 covers ``stage1_steps`` and Stage 2 the next ``stage2_steps``."""
        if i < stage1_steps + stage2_steps:
            return self.stage2_step(run, i, x, stage2_index=i - stage1_steps)
        tgaa = run.donor is not None and run.plan.tgaa_in_stage3
        return self.full_step(run, i, x, stage=3, tgaa=tgaa)

    # ------------------------------------------------------------------------------------------------------
    def forward(
        self, run: RequestRun, x: torch.Tensor, t: torch.Tensor, active: torch.Tensor | None, record: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One transformer pass (CFG batched: row 0 conditional, row 1 unconditional) → (guided velocity, maps)."""
        b = self.bundle
        inst = self.inst
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

    def amplify(self, run: RequestRun, on: bool) -> bool:
        if not on or run.diff is None:
            self.inst.attn.clear_amplification()
            return False
        return self.inst.attn.set_amplification(
            list(run.diff.target_positions),
            run.plan.alpha,
            run.text.shape[0],
            run.text.shape[1],
            [0],
            self.bundle.device,
            self.bundle.dtype,
        )

    def full_step(
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
        amplified = self.amplify(run, tgaa)
        try:
            pred, maps = self.forward(run, x, t, None, self.record_attn_maps)
        finally:
            self.inst.attn.clear_amplification()
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

    def stage2_step(
        self, run: RequestRun, i: int, x: torch.Tensor, stage2_index: int
    ) -> tuple[torch.Tensor, StepRecord, StepStat]:
        assert run.donor is not None and run.donor_meta is not None and run.diff is not None
        plan = run.plan
        t_wait = time.perf_counter()
        try:
            drec = run.donor.step(i)
            donor_out = run.check_shape(drec.model_output, "model output")
            run.last_donor_output = (i, donor_out)
            run.remember_donor_maps(drec)
        except DONOR_PROBLEMS as exc:
            wait = time.perf_counter() - t_wait
            run.donor_problem(exc)
            reason = f"step {i}: donor step unavailable ({exc}): computed in full"
            log.info("donor fallback", extra={"request_id": run.request.request_id, "fallback": reason})
            return self.full_step(run, i, x, stage=2, tgaa=True, fallback=reason, donor_wait=wait)
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
        pred, own_maps, amplified = self.masked_prediction(run, x, t, mask, donor_out_d, own_maps)
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

    def masked_prediction(
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
        amplified = self.amplify(run, True)
        try:
            if n_active == run.seq_len:
                pred, maps = self.forward(run, x, t, None, self.record_attn_maps)
                if maps is not None:
                    own_maps = maps.cpu()
            else:
                idx = mask.nonzero().squeeze(1)
                computed, maps = self.forward(run, x, t, idx.to(dev), self.record_attn_maps)
                lm = latent_mask(mask, run.grid, self.patch).to(dev)
                pred = torch.where(lm, computed, donor_out)
                if maps is not None and own_maps is not None:
                    own_maps[:, idx] = maps.cpu()
        finally:
            self.inst.attn.clear_amplification()
        return pred, own_maps, amplified
