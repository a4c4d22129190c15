"""What ``Engine.generate`` returns: the clip, its trajectory and per-step statistics.

Kept apart from the loop in ``workers.engine.engine`` so that code reading results (worker metrics, benchmarks)
does not need to know about it; ``workers.engine.engine`` re-exports both names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from producer.contract import ReusePlan, VerificationReport
from workers.engine.fallback import FallbackCause
from workers.engine.trajectory import Trajectory


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
    fallback_cause: FallbackCause | None = None  # what kind of fallback ``fallback`` is
    donor_gone: bool = False  # the donor proved unusable for good: it should not be offered again
    # The prompt's tokens the text encoder kept, and whether its budget cut the prompt (None: not counted).
    prompt_tokens_used: int | None = None
    prompt_truncated: bool = False
    # The model's check of the donor before its Stage 1 was trusted (``workers.engine.verify``), if one ran.
    verification: VerificationReport | None = None
    # The seed of the noise the video started from (``request_run.noise_seed``; None: not known).
    noise_seed: int | None = None

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
            "prompt_tokens_used": self.prompt_tokens_used,
            "prompt_truncated": self.prompt_truncated,
            "verification": self.verification.model_dump() if self.verification else None,
        }
