"""The SRD hooks compute a true subset: gathered tokens keep their 3-D RoPE positions and see only each other."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from workers.engine import Engine

GRID = (4, 8, 8)  # latent (4, 4, 16, 16) with patch (1, 2, 2)
S = 4 * 8 * 8


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, 4, 16, 16, generator=g)
    text = torch.randn(1, 16, 32, generator=g)
    return x, torch.tensor([700.0]), text


def _run(
    engine: Engine, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, idx: torch.Tensor | None
) -> torch.Tensor:
    ctx = engine._inst.srd
    if idx is not None:
        ctx.activate(idx, S)
    try:
        with torch.no_grad():
            return engine.bundle.transformer(
                hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False
            )[0]
    finally:
        ctx.deactivate()
        ctx.clear_text_cache()
        engine._inst.attn.clear_kv_cache()


def _expected_rope(rope: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of each token built directly from its (frame, row, column) coordinates."""
    _, h, w = GRID
    fi, hi, wi = positions // (h * w), (positions // w) % h, positions % w
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    cos_t, cos_h, cos_w = rope.freqs_cos.split(split, dim=1)
    sin_t, sin_h, sin_w = rope.freqs_sin.split(split, dim=1)
    cos = torch.cat([cos_t[fi], cos_h[hi], cos_w[wi]], dim=-1)
    sin = torch.cat([sin_t[fi], sin_h[hi], sin_w[wi]], dim=-1)
    return cos[None, :, None, :], sin[None, :, None, :]


def test_gathered_rope_positions_match_full_sequence_positions(engine):
    transformer = engine.bundle.transformer
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def probe(module, args, kwargs):
        rope = kwargs.get("rotary_emb", args[3] if len(args) > 3 else None)
        seen.append(rope)

    # attn1 is called as attn1(norm_hidden_states, None, None, rotary_emb)
    handles = [b.attn1.register_forward_pre_hook(probe, with_kwargs=True) for b in transformer.blocks]
    try:
        idx = torch.tensor(
            sorted(torch.randperm(S, generator=torch.Generator().manual_seed(1))[:37].tolist())
        )
        x, t, text = _inputs()
        _run(engine, x, t, text, idx)
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == len(transformer.blocks)
    full_cos, full_sin = transformer.rope(x)
    exp_cos, exp_sin = _expected_rope(transformer.rope, idx)
    torch.testing.assert_close(full_cos[:, idx], exp_cos)  # the decomposition above is the model's own layout
    torch.testing.assert_close(full_sin[:, idx], exp_sin)
    for cos, sin in seen:
        assert cos.shape == (1, 37, 1, transformer.config.attention_head_dim)
        assert torch.equal(cos, full_cos[:, idx]) and torch.equal(sin, full_sin[:, idx])


def test_gathering_every_token_equals_the_full_pass(engine):
    x, t, text = _inputs()
    full = _run(engine, x, t, text, None)
    gathered = _run(engine, x, t, text, torch.arange(S))
    torch.testing.assert_close(gathered, full, atol=1e-6, rtol=1e-6)


def test_subset_sees_only_itself_and_inactive_outputs_are_zero(engine):
    idx = torch.arange(0, S, 3)
    x, t, text = _inputs()
    out = _run(engine, x, t, text, idx)
    token_mask = torch.zeros(S, dtype=torch.bool)
    token_mask[idx] = True
    from workers.engine.masks import latent_mask

    lm = latent_mask(token_mask, GRID, (1, 2, 2))[0, 0]  # (F, H, W)
    assert (out[0][:, ~lm] == 0).all()
    assert (out[0][:, lm] != 0).any()
    # perturbing inactive tokens of the input changes nothing for the active ones
    x2 = x.clone()
    x2[0][:, ~lm] += torch.randn_like(x2[0][:, ~lm])
    out2 = _run(engine, x2, t, text, idx)
    assert torch.equal(out2, out)
    # ...while perturbing an active one does
    x3 = x.clone()
    x3[0][:, lm] += 1.0
    assert not torch.equal(_run(engine, x3, t, text, idx), out)


def test_wrong_sequence_length_is_caught(engine):
    x, t, text = _inputs()
    ctx = engine._inst.srd
    ctx.activate(torch.arange(5), S + 1)
    try:
        with pytest.raises(RuntimeError, match="expected"), torch.no_grad():
            engine.bundle.transformer(
                hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False
            )
    finally:
        ctx.deactivate()
        ctx.clear_text_cache()
