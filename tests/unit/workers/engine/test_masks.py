"""Mask building: threshold, dilation, coarse-to-fine, [min, max] clamp; prompt token diffs."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.masks import (
    MaskSettings,
    build_mask,
    latent_mask,
    map_score,
    pool_factor,
    rows_for_positions,
)
from workers.engine.tokens import diff_tokens

GRID = (2, 8, 8)
N = 128


def _peak(f: int, h: int, w: int) -> torch.Tensor:
    s = torch.zeros(GRID)
    s[f, h, w] = 1.0
    return s.flatten()


def test_threshold_and_dilation_without_pooling():
    fine = MaskSettings(threshold=0.5, dilation=0, levels=1)
    mask, _ = build_mask(_peak(0, 3, 3), GRID, fine, 0)
    assert mask.sum() == 1 and mask.reshape(GRID)[0, 3, 3]
    mask, _ = build_mask(_peak(0, 3, 3), GRID, MaskSettings(threshold=0.5, dilation=1, levels=1), 0)
    m = mask.reshape(GRID)
    assert m.sum() == 9 and m[0, 2:5, 2:5].all() and not m[1].any()  # spatial only, same frame


def test_coarse_to_fine_shrinks_the_mask_step_by_step():
    s = _peak(1, 5, 6)
    cfg = MaskSettings(threshold=0.5, dilation=0, levels=3)
    sizes = [int(build_mask(s, GRID, cfg, j)[0].sum()) for j in range(4)]
    assert [pool_factor(j, 3) for j in range(4)] == [4, 2, 1, 1]
    assert sizes == [16, 4, 1, 1]
    coarse = build_mask(s, GRID, cfg, 0)[0]
    fine = build_mask(s, GRID, cfg, 2)[0]
    assert (coarse | fine).equal(coarse)  # the fine mask lies inside the coarse one


def test_no_score_means_everything_up_to_the_maximum():
    mask, _ = build_mask(None, GRID, MaskSettings(max_active_fraction=1.0), 0)
    assert mask.all()
    mask, _ = build_mask(None, GRID, MaskSettings(max_active_fraction=0.5), 0)
    assert mask.sum() == N // 2


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    threshold=st.floats(0, 1),
    lo=st.floats(0, 1),
    hi=st.floats(0, 1),
    dilation=st.integers(0, 3),
    levels=st.integers(1, 4),
    j=st.integers(0, 5),
)
def test_active_fraction_is_clamped_and_keeps_the_best_tokens(seed, threshold, lo, hi, dilation, levels, j):
    lo, hi = min(lo, hi), max(lo, hi)
    score = torch.rand(N, generator=torch.Generator().manual_seed(seed))
    cfg = MaskSettings(
        threshold=threshold, dilation=dilation, levels=levels, min_active_fraction=lo, max_active_fraction=hi
    )
    mask, processed = build_mask(score, GRID, cfg, j)
    k = int(mask.sum())
    k_max = math.floor(hi * N + 1e-9)
    assert min(k_max, math.ceil(lo * N - 1e-9)) <= k <= k_max
    assert processed is not None
    if 0 < k < N:  # every active token scores at least as high as every inactive one
        assert processed[mask].min() >= processed[~mask].max()


def test_map_score_normalizes_each_token_then_takes_the_max():
    maps = torch.tensor([[0.1, 0.2, 0.4, 0.0], [0.5, 0.0, 0.0, 0.25]])
    torch.testing.assert_close(map_score(maps, [0]), torch.tensor([0.25, 0.5, 1.0, 0.0]))
    torch.testing.assert_close(map_score(maps, [0, 1]), torch.tensor([1.0, 0.5, 1.0, 0.5]))
    assert map_score(maps, []) is None


def test_rows_for_positions_skips_padding():
    valid = [True, True, False, True, False]
    assert rows_for_positions(valid, [0, 3, 2]) == [0, 2]


def test_latent_mask_expands_patches():
    m = torch.zeros(2 * 2 * 2, dtype=torch.bool)
    m[3] = True  # frame 0, row 1, column 1
    lm = latent_mask(m, (2, 2, 2), (1, 2, 2))
    assert lm.shape == (1, 1, 2, 4, 4)
    assert lm[0, 0, 0, 2:4, 2:4].all() and lm.sum() == 4


def test_diff_of_a_color_swap():
    d = diff_tokens(
        [5, 6, 7, 1, 0, 0], [True] * 4 + [False] * 2, [5, 9, 7, 1, 0, 0], [True] * 4 + [False] * 2
    )
    assert d.donor_positions == (1,) and d.target_positions == (1,)
    assert (0, 0) in d.matched and (3, 3) in d.matched and not d.identical


tokens = st.lists(st.integers(0, 6), max_size=12)


@settings(max_examples=200, deadline=None)
@given(a=tokens, b=tokens, pad_a=st.integers(0, 3), pad_b=st.integers(0, 3))
def test_diff_tokens_partitions_both_prompts(a, b, pad_a, pad_b):
    ids_a, valid_a = a + [0] * pad_a, [True] * len(a) + [False] * pad_a
    ids_b, valid_b = b + [0] * pad_b, [True] * len(b) + [False] * pad_b
    d = diff_tokens(ids_a, valid_a, ids_b, valid_b)
    matched_a = [p for p, _ in d.matched]
    matched_b = [q for _, q in d.matched]
    assert sorted(matched_a + list(d.donor_positions)) == list(range(len(a)))
    assert sorted(matched_b + list(d.target_positions)) == list(range(len(b)))
    assert all(ids_a[p] == ids_b[q] for p, q in d.matched)
    assert matched_a == sorted(matched_a) and matched_b == sorted(matched_b)  # order-preserving alignment
    assert d.identical == (a == b)
