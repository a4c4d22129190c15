from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from workers.toy.model import DEFAULT_TRANSFORMER_CONFIG, build_transformer

# A toy-architecture model small enough for tests: random weights (the checker reads noise), 2 blocks.
TINY_TOY = {
    **DEFAULT_TRANSFORMER_CONFIG,
    "num_layers": 2,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "ffn_dim": 64,
    "freq_dim": 32,
}


@pytest.fixture(scope="session")
def tiny_toy_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-toy")
    torch.manual_seed(0)
    transformer = build_transformer(TINY_TOY)
    save_file(
        {k: v.contiguous() for k, v in transformer.state_dict().items()}, str(out / "model.safetensors")
    )
    (out / "config.json").write_text(json.dumps(TINY_TOY))
    return out
