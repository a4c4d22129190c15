"""The toy bundle: committed weights load and sample; `chorus train-toy` runs end to end on a tiny setting."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from producer.cli import app
from workers.toy import model, train, world


def test_latent_roundtrip_is_exact() -> None:
    clips = np.stack([world.sample(s).clip for s in range(3)])
    latents = model.clips_to_latents(clips)
    assert latents.shape == (3, *model.latent_shape(world.NUM_FRAMES, world.HEIGHT, world.WIDTH))
    assert float(latents.min()) >= -1.0 and float(latents.max()) <= 1.0
    np.testing.assert_array_equal(model.latents_to_clips(latents), clips)
    np.testing.assert_array_equal(model.decode(latents[:1]), clips[0])


def test_prompt_encoding_is_padded_with_real_tokens_first() -> None:
    enc = model.encode_prompt("a red circle moving left on a gray background")
    assert enc.embeddings.shape == (1, model.TEXT_LEN, model.TEXT_DIM)
    assert len(enc.token_ids) == len(enc.tokens) == len(enc.valid) == model.TEXT_LEN
    n = sum(enc.valid)
    assert enc.valid == [True] * n + [False] * (model.TEXT_LEN - n)
    assert enc.tokens[0] == "[CLS]" and enc.tokens[n - 1] == "[SEP]" and "red" in enc.tokens[:n]
    assert torch.all(enc.embeddings[0, n:] == 0) and torch.all(enc.embeddings[0, :n].abs().sum(-1) > 0)
    empty = model.encode_prompt("")
    assert empty.tokens[:2] == ["[CLS]", "[SEP]"] and sum(empty.valid) == 2
    long = model.encode_prompt(" ".join(["red"] * 100))
    assert all(long.valid) and long.embeddings.shape[1] == model.TEXT_LEN


def test_scheduler_is_flow_match_euler_with_the_recorded_config() -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    s = model.make_scheduler()
    assert isinstance(s, FlowMatchEulerDiscreteScheduler)
    for key, value in model.SCHEDULER_CONFIG.items():
        assert s.config[key] == value  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.skipif(not (model.WEIGHTS_DIR / model.WEIGHTS_FILE).exists(), reason="no committed toy weights")
def test_committed_weights_load_and_sample() -> None:
    bundle = model.load_toy_bundle()
    assert bundle.spec.name == "toy"
    assert bundle.weights_id == model.sha256_file(model.WEIGHTS_DIR / model.WEIGHTS_FILE)
    params = sum(p.numel() for p in bundle.transformer.parameters())
    assert 1_000_000 <= params <= 5_000_000
    clip = train.sample(
        bundle, "a red square moving right on a black background", seed=0, steps=4, guidance=3.0
    )
    assert clip.shape == (world.NUM_FRAMES, world.HEIGHT, world.WIDTH, 3) and clip.dtype == np.uint8
    again = train.sample(
        bundle, "a red square moving right on a black background", seed=0, steps=4, guidance=3.0
    )
    np.testing.assert_array_equal(clip, again)


@pytest.mark.slow
def test_train_toy_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "train-toy",
            "--steps", "3",
            "--batch-size", "2",
            "--out", str(out),
            "--eval-interval", "2",
            "--eval-prompts", "2",
            "--eval-steps", "1,2",
            "--layers", "1",
            "--heads", "2",
            "--head-dim", "12",
            "--ffn-dim", "32",
            "--captions-per-combo", "1",
            "--threads", "1",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    for name in (
        model.WEIGHTS_FILE,
        model.CONFIG_FILE,
        train.LOG_FILE,
        train.CURVE_FILE,
        train.TRAIN_CONFIG_FILE,
    ):
        assert (out / name).is_file(), name
    log = json.loads((out / train.LOG_FILE).read_text())
    assert [e["step"] for e in log["evals"]] == [2, 3]
    assert set(log["evals"][-1]["steps1"]) == {"color", "shape", "direction", "background", "all"}
    assert len(log["loss"]) >= 1 and np.isfinite(log["loss"][-1][1])
    bundle = model.load_toy_bundle(weights_dir=out)
    clip = train.sample(bundle, "a blue ball sliding up, white backdrop", seed=1, steps=2, guidance=2.0)
    assert clip.shape == (world.NUM_FRAMES, world.HEIGHT, world.WIDTH, 3) and clip.dtype == np.uint8
    # Resuming a finished run does no more steps and keeps the log.
    result = CliRunner().invoke(
        app, ["train-toy", "--steps", "3", "--out", str(out), "--resume", "--captions-per-combo", "1",
              "--eval-prompts", "2", "--eval-steps", "1", "--layers", "1", "--heads", "2", "--head-dim", "12",
              "--ffn-dim", "32", "--batch-size", "2", "--threads", "1"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output


def _small(**extra: object) -> dict[str, object]:
    return dict(
        model.DEFAULT_TRANSFORMER_CONFIG, num_layers=1, num_attention_heads=2, attention_head_dim=12, **extra
    )


def _forward(t: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, *model.latent_shape(world.NUM_FRAMES, world.HEIGHT, world.WIDTH), generator=g)
    text = torch.randn(1, model.TEXT_LEN, model.TEXT_DIM, generator=g)
    with torch.no_grad():
        return t(x, torch.tensor([700.0]), text, return_dict=False)[0]


def test_position_table_is_a_saved_parameter_that_the_hook_adds(tmp_path: Path) -> None:
    torch.manual_seed(0)
    t = model.build_transformer(_small()).eval()
    table = getattr(t.patch_embedding, model.POSITION_PARAM)
    assert tuple(table.shape) == (1, 24, 1, 16, 16)
    assert f"patch_embedding.{model.POSITION_PARAM}" in t.state_dict()
    before = _forward(t)
    with torch.no_grad():
        table.normal_()
    after = _forward(t)
    assert not torch.allclose(before, after)
    # The table round-trips through the weights files and the reloaded model computes the same.
    train.save_weights(t, _small(), tmp_path)
    reloaded = model.load_transformer(tmp_path).eval()
    torch.testing.assert_close(_forward(reloaded), after)


def test_a_config_without_a_position_grid_builds_a_plain_wan_transformer(tmp_path: Path) -> None:
    cfg = _small()
    cfg.pop(model.POSITION_KEY)
    t = model.build_transformer(cfg)
    assert not hasattr(t.patch_embedding, model.POSITION_PARAM)
    assert not any("position" in k for k in t.state_dict())
    train.save_weights(t, cfg, tmp_path)
    torch.testing.assert_close(_forward(model.load_transformer(tmp_path).eval()), _forward(t.eval()))


def test_position_table_rejects_another_latent_size() -> None:
    t = model.build_transformer(_small()).eval()
    x = torch.randn(1, 3, world.NUM_FRAMES, 16, 16)
    with pytest.raises(ValueError, match="token grid"):
        t(x, torch.tensor([500.0]), torch.zeros(1, model.TEXT_LEN, model.TEXT_DIM))


def test_a_bad_position_grid_in_a_config_is_reported() -> None:
    with pytest.raises(ValueError, match=model.POSITION_KEY):
        model.build_transformer(_small(**{model.POSITION_KEY: [16, 16]}))
