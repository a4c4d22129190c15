"""Token-guided divergence masks for Stage 2 (selective region denoising).

Which latent tokens must be recomputed at a Stage-2 step is read off cross-attention maps of the prompt tokens
that differ between donor and target:

1. *score*: for each differing token, its ``(S,)`` attention map normalized by its own maximum; the score of a
   latent token is the maximum over the differing tokens. Sources: the donor's maps at this step (rows of the
   donor-side differing tokens, e.g. "red" in "a red circle" → "a blue circle") and the target's own maps from its
   previous computed step (rows of the target-side differing tokens, "blue").
2. *coarse-to-fine*: at the ``j``-th Stage-2 step the score is max-pooled over ``p×p`` spatial blocks with
   ``p = 2**max(0, levels-1-j)`` (blocky, generous masks first, token-exact masks later).
3. *dilation*: max-pool with a ``(2r+1)×(2r+1)`` spatial window (the same as dilating the thresholded mask).
4. *threshold*: active where the pooled, dilated score ``> threshold``.
5. *clamp*: the active fraction is clamped to ``[min_active_fraction, max_active_fraction]`` by keeping the
   highest-scoring tokens (ties broken by token order).

With no score at all (no differing token has a map yet) every token is active, up to the maximum fraction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MaskSettings:
    threshold: float = 0.5
    dilation: int = 1
    levels: int = 3
    min_active_fraction: float = 0.0
    max_active_fraction: float = 1.0


def rows_for_positions(valid: Sequence[bool], positions: Sequence[int]) -> list[int]:
    """Map positions in a padded prompt to row indices of its ``(V, S)`` attention maps (valid tokens only)."""
    row_of: dict[int, int] = {}
    for pos, v in enumerate(valid):
        if v:
            row_of[pos] = len(row_of)
    return [row_of[p] for p in positions if p in row_of]


def map_score(maps: torch.Tensor, rows: Sequence[int]) -> torch.Tensor | None:
    """Per-latent-token score in [0, 1] from the given rows of ``(V, S)`` maps; None when there are no rows."""
    if not rows:
        return None
    sel = maps[list(rows)].float()
    peak = sel.amax(dim=1, keepdim=True).clamp_min(1e-12)
    return (sel / peak).amax(dim=0)


def pool_factor(stage2_index: int, levels: int) -> int:
    return 2 ** max(0, levels - 1 - stage2_index)


def build_mask(
    score: torch.Tensor | None,
    grid: tuple[int, int, int],
    settings: MaskSettings,
    stage2_index: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(mask (S,) bool, processed score (S,) or None)`` for the ``stage2_index``-th Stage-2 step."""
    f, h, w = grid
    n = f * h * w
    # the maximum wins when both bounds fall between the same two integers
    k_max = max(0, math.floor(settings.max_active_fraction * n + 1e-9))
    k_min = min(k_max, math.ceil(settings.min_active_fraction * n - 1e-9))
    if score is None:
        mask = torch.zeros(n, dtype=torch.bool)
        mask[:k_max] = True
        return mask, None
    if score.numel() != n:
        raise ValueError(f"score has {score.numel()} entries, grid {grid} has {n}")
    s = score.detach().float().cpu().reshape(1, 1, f, h, w)
    p = pool_factor(stage2_index, settings.levels)
    if p > 1:
        coarse = F.max_pool3d(s, kernel_size=(1, p, p), stride=(1, p, p), ceil_mode=True)
        s = coarse.repeat_interleave(p, dim=3).repeat_interleave(p, dim=4)[..., :h, :w]
    r = settings.dilation
    if r > 0:
        s = F.max_pool3d(s, kernel_size=(1, 2 * r + 1, 2 * r + 1), stride=1, padding=(0, r, r))
    flat = s.reshape(n)
    mask = flat > settings.threshold
    k = int(mask.sum())
    target = min(max(k, k_min), k_max)
    if target != k:
        order = torch.argsort(-flat, stable=True)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[order[:target]] = True
    return mask, flat


def latent_mask(token_mask: torch.Tensor, grid: tuple[int, int, int], patch: Sequence[int]) -> torch.Tensor:
    """Expand a ``(S,)`` token mask to a ``(1, 1, F', H', W')`` mask over latent elements."""
    f, h, w = grid
    pt, ph, pw = patch
    # one broadcast copy instead of three repeat_interleave passes (this runs on every Stage-2 step)
    m = token_mask.reshape(f, 1, h, 1, w, 1).expand(f, pt, h, ph, w, pw)
    return m.reshape(f * pt, h * ph, w * pw)[None, None]
