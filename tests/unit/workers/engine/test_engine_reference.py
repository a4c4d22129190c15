"""The engine without reuse is a plain denoising loop; its instrumentation changes nothing by itself."""

from __future__ import annotations

import pytest
import torch

from producer.contract import ReusePlan
from tests.helpers.reference import reference_denoise
from workers.engine import Engine


@pytest.mark.parametrize("guidance", [1.0, 3.5])
def test_no_reuse_plan_equals_reference_loop(engine, plain_bundle, make_request, guidance):
    request = make_request(guidance_scale=guidance, negative_prompt="blurry" if guidance > 1 else None)
    out = engine.generate(request, ReusePlan.full(request.num_steps))
    expected = reference_denoise(plain_bundle, request)
    for i, x in enumerate(expected):
        torch.testing.assert_close(out.trajectory.latent_after(i), x[0], atol=2e-6, rtol=1e-5)
    assert out.steps_computed == request.num_steps
    assert out.tokens_computed_fraction == 1.0
    assert out.fallback is None
    assert out.frames.dtype.name == "uint8"
    assert out.frames.shape == (request.num_frames, request.height, request.width, 3)
    ref_frames = plain_bundle.decode(expected[-1])
    assert abs(out.frames.astype(int) - ref_frames.astype(int)).max() <= 1


def test_instrumented_transformer_matches_plain(engine, tiny_bundle, plain_bundle):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 4, 16, 16, generator=g)
    text = torch.randn(2, 16, 32, generator=g)
    t = torch.tensor([500.0, 500.0])
    with torch.no_grad():
        a = tiny_bundle.transformer(
            hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False
        )[0]
        b = plain_bundle.transformer(
            hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False
        )[0]
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_close_removes_instrumentation(plain_bundle):
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    eng = Engine(plain_bundle)
    assert not isinstance(plain_bundle.transformer.blocks[0].attn2.processor, WanAttnProcessor)
    eng.close()
    assert isinstance(plain_bundle.transformer.blocks[0].attn2.processor, WanAttnProcessor)
    assert not hasattr(plain_bundle.transformer, "_chorus_instrumentation")
    Engine(plain_bundle).close()  # installs again cleanly


def test_plan_must_match_request(engine, make_request):
    request = make_request()
    with pytest.raises(ValueError, match="plan covers"):
        engine.generate(request, ReusePlan.full(request.num_steps + 1))
