"""The attribute-sensitivity probe: swapped pairs differ in one attribute; a text-blind model reads 0."""

from __future__ import annotations

import torch

from workers.toy import model, probe


def test_pairs_differ_in_exactly_the_named_attribute() -> None:
    for name, pairs in probe.swapped_pairs(8).items():
        assert len(pairs) == 8
        for a, b in pairs:
            diff = {k for k, v in a.as_dict().items() if b.as_dict()[k] != v}
            assert diff == {name}


def test_sensitivity_is_zero_for_a_text_blind_model_and_positive_otherwise() -> None:
    torch.manual_seed(0)
    cfg = dict(model.DEFAULT_TRANSFORMER_CONFIG, num_layers=1, num_attention_heads=2, attention_head_dim=12)
    t = model.build_transformer(cfg).eval()
    result = probe.attribute_sensitivity(t, sigmas=[1.0, 0.5], prompts=2)
    assert set(result) == {"color", "shape", "direction", "background"}
    assert all(v > 0 for row in result.values() for v in row.values())
    # Closing every cross-attention output makes the prediction independent of the prompt.
    with torch.no_grad():
        for block in t.blocks:
            block.attn2.to_out[0].weight.zero_()
            block.attn2.to_out[0].bias.zero_()
    blind = probe.attribute_sensitivity(t, sigmas=[1.0], prompts=2)
    assert all(v == 0.0 for row in blind.values() for v in row.values())
