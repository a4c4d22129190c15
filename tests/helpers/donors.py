"""Donor sources that misbehave on purpose."""

from __future__ import annotations

import dataclasses

import torch

from workers.engine import DonorUnavailable, StepRecord, Trajectory, TrajectoryMeta


@dataclasses.dataclass
class FlakyDonor:
    """Serves ``inner`` but raises ``DonorUnavailable`` for metadata / initial latent / steps as configured."""

    inner: Trajectory
    fail_metadata: bool = False
    fail_from_step: int | None = None
    fail_steps: frozenset[int] = frozenset()
    reads: list[int] = dataclasses.field(default_factory=list)

    def metadata(self) -> TrajectoryMeta:
        if self.fail_metadata:
            raise DonorUnavailable("leader's header was deleted")
        return self.inner.metadata()

    def initial_latent(self) -> torch.Tensor:
        return self.inner.initial_latent()

    def step(self, index: int) -> StepRecord:
        self.reads.append(index)
        if index in self.fail_steps or (self.fail_from_step is not None and index >= self.fail_from_step):
            raise DonorUnavailable(f"step {index} not uploaded")
        return self.inner.step(index)
