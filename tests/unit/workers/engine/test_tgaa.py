"""TGAA: log(α) on the differing prompt tokens' keys, conditional row only; α = 1 is exactly a no-op."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from producer.contract import ReusePlan
from workers.engine.tgaa import ChorusCrossAttnProcessor, CrossAttnState

D_POS = [2, 5]  # "differing" prompt positions
S, L = 24, 16


@pytest.fixture
def attn(plain_bundle):
    return plain_bundle.transformer.blocks[0].attn2


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, S, 64, generator=g), torch.randn(2, L, 64, generator=g)


def _manual(attn, hidden, text, bias_rows: dict[int, float], key_mask: torch.Tensor | None = None):
    """Cross-attention written out with explicit softmax weights, α applied by multiplying and renormalizing."""
    q = attn.norm_q(attn.to_q(hidden)).unflatten(2, (attn.heads, -1))
    k = attn.norm_k(attn.to_k(text)).unflatten(2, (attn.heads, -1))
    v = attn.to_v(text).unflatten(2, (attn.heads, -1))
    logits = torch.einsum("bshd,blhd->bhsl", q, k) / math.sqrt(q.shape[-1])
    if key_mask is not None:
        logits = logits + key_mask
    p = torch.softmax(logits, dim=-1)
    for row, alpha in bias_rows.items():
        w = torch.ones(L)
        w[D_POS] = alpha
        pr = p[row] * w
        p[row] = pr / pr.sum(-1, keepdim=True)
    o = torch.einsum("bhsl,blhd->bshd", p, v).flatten(2, 3)
    return attn.to_out[1](attn.to_out[0](o)), p


def _proc(alpha: float, cache_kv: bool = False) -> ChorusCrossAttnProcessor:
    state = CrossAttnState(cache_kv=cache_kv)
    state.set_amplification(D_POS, alpha, 2, L, [0], torch.device("cpu"), torch.float32)
    return ChorusCrossAttnProcessor(state, layer=0)


@torch.no_grad()
def test_alpha_one_is_exactly_the_diffusers_processor(attn):
    hidden, text = _inputs()
    proc = _proc(1.0)
    assert proc.state.bias is None
    assert torch.equal(proc(attn, hidden, text), WanAttnProcessor()(attn, hidden, text))


@torch.no_grad()
def test_no_differing_tokens_installs_nothing():
    state = CrossAttnState()
    assert not state.set_amplification([], 5.0, 2, L, [0], torch.device("cpu"), torch.float32)
    assert state.bias is None


@torch.no_grad()
def test_alpha_multiplies_attention_on_differing_keys_of_the_conditional_row(attn):
    hidden, text = _inputs()
    base = WanAttnProcessor()(attn, hidden, text)
    out = _proc(3.0)(attn, hidden, text)
    expected, _ = _manual(attn, hidden, text, {0: 3.0})
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    assert torch.equal(out[1], base[1])  # unconditional row untouched
    assert not torch.allclose(out[0], base[0])


@torch.no_grad()
def test_alpha_changes_only_queries_that_attend_the_differing_tokens(attn):
    hidden, text = _inputs()
    key_mask = torch.zeros(2, 1, S, L)
    key_mask[:, :, : S // 2, D_POS] = float(
        "-inf"
    )  # first half of the queries cannot see the differing tokens
    base = WanAttnProcessor()(attn, hidden, text, attention_mask=key_mask)
    out = _proc(4.0)(attn, hidden, text, attention_mask=key_mask)
    torch.testing.assert_close(out[0, : S // 2], base[0, : S // 2], atol=1e-6, rtol=1e-6)
    assert (out[0, S // 2 :] - base[0, S // 2 :]).abs().amax(dim=-1).min() > 1e-6


@torch.no_grad()
def test_recorded_maps_are_the_conditional_softmax_averaged_over_heads(attn):
    hidden, text = _inputs()
    proc = _proc(2.0)
    valid = [0, 1, 2, 3, 5, 7]
    proc.state.start_maps(valid, cond_row=0, device=torch.device("cpu"))
    proc(attn, hidden, text)
    maps = proc.state.collect_maps()
    _, p = _manual(attn, hidden, text, {0: 2.0})
    expected = p[0].mean(0)[:, valid].T  # (V, S)
    assert maps is not None
    torch.testing.assert_close(maps, expected, atol=1e-5, rtol=1e-4)
    assert proc.state.map_positions is None  # collecting stops recording


@torch.no_grad()
def test_text_kv_cache_reuses_projections_for_the_same_tensor(attn):
    hidden, text = _inputs()
    proc = _proc(1.0, cache_kv=True)
    a = proc(attn, hidden, text)
    cached = proc.state._kv[0]
    b = proc(attn, hidden, text)
    assert proc.state._kv[0] is cached and torch.equal(a, b)
    proc(attn, hidden, text.clone())  # another tensor → recomputed
    assert proc.state._kv[0] is not cached


def test_engine_alpha_changes_only_the_masked_region(engine, make_request):
    donor = engine.generate(make_request(num_steps=3, guidance_scale=3.0), ReusePlan.full(3))
    target = make_request("a blue circle moving left on a white background", num_steps=3, guidance_scale=3.0)
    outs = {}
    for alpha in (1.0, 4.0):
        plan = ReusePlan(
            stage1_steps=1,
            stage2_steps=1,
            stage3_steps=1,
            alpha=alpha,
            min_active_fraction=0.25,
            max_active_fraction=0.25,
        )
        outs[alpha] = engine.generate(target, plan, donor=donor.trajectory)
    assert outs[1.0].steps[1].tgaa is False and outs[4.0].steps[1].tgaa is True
    plain, amp = outs[1.0].trajectory.model_output(1), outs[4.0].trajectory.model_output(1)
    took_donor = (plain == donor.trajectory.model_output(1)).all(dim=0)
    assert took_donor.float().mean() == pytest.approx(0.75, abs=0.01)
    assert torch.equal(amp[:, took_donor], plain[:, took_donor])
    assert not torch.allclose(amp[:, ~took_donor], plain[:, ~took_donor])
