"""Training helpers: noise coupling, σ sampling, learning-rate schedule, initialization, reference sampler."""

from __future__ import annotations

import itertools
import json

import numpy as np
import torch

from workers.toy import model, train, world


def _noise(n: int, seed: int = 0) -> torch.Tensor:
    shape = model.latent_shape(world.NUM_FRAMES, world.HEIGHT, world.WIDTH)
    return torch.randn((n, *shape), generator=torch.Generator().manual_seed(seed))


def test_coupled_position_is_in_range_and_follows_the_noise() -> None:
    noise = _noise(256)
    mids = train.coupled_mids(noise)
    lo, hi = world.MID_RANGE
    assert all(lo <= x <= hi and lo <= y <= hi for x, y in mids)
    xs = [x for x, _ in mids]
    assert len(set(xs)) == hi - lo + 1  # every position is used
    # Adding a bright blob to the noise moves the chosen position onto it.
    bumped = noise[:1].clone()
    bumped[..., 14 - 7 : 14 + 8, 17 - 7 : 17 + 8] += 3.0
    assert train.coupled_mids(bumped) == [(17, 14)]


def test_sigmas_in_range_and_noisy_on_average() -> None:
    cfg = train.TrainConfig()
    s = train.sample_sigmas(torch.Generator().manual_seed(0), 20_000, cfg)
    assert float(s.min()) > 0 and float(s.max()) <= 1
    assert 0.6 < float(s.mean()) < 0.75  # logit-normal centered at 1.0 → mean σ ≈ 0.68


def test_lr_warmup_then_cosine() -> None:
    cfg = train.TrainConfig(steps=1000, warmup_steps=100, lr=1.0, min_lr_ratio=0.1)
    assert train.lr_at(0, cfg) == 0.01
    assert train.lr_at(99, cfg) == 1.0
    assert abs(train.lr_at(1000, cfg) - 0.1) < 1e-9
    lrs = [train.lr_at(s, cfg) for s in range(100, 1000)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_zero_init_makes_the_output_zero() -> None:
    cfg = dict(model.DEFAULT_TRANSFORMER_CONFIG, num_layers=1, num_attention_heads=2, attention_head_dim=12)
    t = model.build_transformer(cfg)
    train.init_weights(t, "zero")
    out = t(_noise(2), torch.tensor([500.0, 900.0]), torch.randn(2, model.TEXT_LEN, model.TEXT_DIM))[0]
    assert torch.count_nonzero(out) == 0


def test_reference_sampler_is_deterministic_per_seed() -> None:
    cfg = dict(model.DEFAULT_TRANSFORMER_CONFIG, num_layers=1, num_attention_heads=2, attention_head_dim=12)
    torch.manual_seed(0)
    t = model.build_transformer(cfg).eval()
    cond = torch.randn(2, model.TEXT_LEN, model.TEXT_DIM)
    uncond = torch.zeros(1, model.TEXT_LEN, model.TEXT_DIM)
    shape = model.latent_shape(world.NUM_FRAMES, world.HEIGHT, world.WIDTH)
    a = train.sample_latents(t, cond, uncond, train.seeded_noise([1, 2], shape), steps=3, guidance=2.0)
    b = train.sample_latents(t, cond, uncond, train.seeded_noise([1, 2], shape), steps=3, guidance=2.0)
    assert torch.equal(a, b)
    clips = model.latents_to_clips(a)
    assert clips.shape == (2, world.NUM_FRAMES, world.HEIGHT, world.WIDTH, 3) and clips.dtype == np.uint8


def test_fine_tuning_starts_from_the_given_weights(tmp_path) -> None:
    cfg = dict(model.DEFAULT_TRANSFORMER_CONFIG, num_layers=1, num_attention_heads=2, attention_head_dim=12)
    cfg["ffn_dim"] = 32
    src = tmp_path / "src"
    t = model.build_transformer(cfg)
    train.save_weights(t, cfg, src)
    run = train.TrainConfig(
        steps=1, batch_size=1, captions_per_combo=1, eval_interval=0, eval_prompts=1, eval_steps=(1,),
        lr=0.0, warmup_steps=1, init_from=str(src), transformer={"num_layers": 99},
    )  # fmt: skip
    train.train(run, tmp_path / "run")
    # The stored config replaces the given one, and with lr = 0 the weights come back unchanged.
    assert json.loads((tmp_path / "run" / model.CONFIG_FILE).read_text())["num_layers"] == 1
    tuned = model.load_transformer(tmp_path / "run")
    for (name, a), b in zip(t.state_dict().items(), tuned.state_dict().values(), strict=True):
        assert torch.equal(a.float(), b.float()), name


def test_high_sigma_share_lands_in_the_top_decile() -> None:
    gen = torch.Generator().manual_seed(0)
    all_high = train.sample_sigmas(gen, 5_000, train.TrainConfig(high_sigma=1.0))
    assert float(all_high.min()) >= 0.9 and float(all_high.max()) <= 1.0
    base = train.sample_sigmas(gen, 20_000, train.TrainConfig(high_sigma=0.0))
    half = train.sample_sigmas(gen, 20_000, train.TrainConfig(high_sigma=0.5))
    base_share = float((base >= 0.9).float().mean())
    assert abs(float((half >= 0.9).float().mean()) - (0.5 + 0.5 * base_share)) < 0.02


def test_attribute_heads_score_each_attribute_against_its_own_value() -> None:
    heads = train.AttributeHeads(width=8)
    attrs = [
        world.Attributes("red", "circle", "left", "black"),
        world.Attributes("blue", "square", "up", "gray"),
    ]
    pooled = torch.randn(2, 8)
    # Zeroed heads guess uniformly (the loss is the sum of log(#values)); trained ones read every value right.
    with torch.no_grad():
        for param in heads.parameters():
            param.zero_()
    uniform = float(heads.loss(pooled, attrs).detach())
    expected = sum(np.log(len(v)) for v in train.ATTRIBUTE_VALUES.values())
    assert abs(uniform - expected) < 1e-5
    optimizer = torch.optim.Adam(heads.parameters(), lr=0.1)
    for _ in range(100):
        optimizer.zero_grad()
        heads.loss(pooled, attrs).backward()
        optimizer.step()
    assert float(heads.loss(pooled, attrs).detach()) < 0.05


def test_training_with_the_auxiliary_loss_logs_it_and_saves_a_plain_model(tmp_path) -> None:
    cfg = dict(model.DEFAULT_TRANSFORMER_CONFIG, num_layers=2, num_attention_heads=2, attention_head_dim=12)
    cfg["ffn_dim"] = 32
    run = train.TrainConfig(
        steps=4, batch_size=4, captions_per_combo=1, eval_interval=0, eval_prompts=1, eval_steps=(1,),
        log_interval=2, caption_dropout=0.0, aux_weight=1.0, aux_block=5, transformer=cfg,
    )  # fmt: skip
    log = train.train(run, tmp_path)
    assert [step for step, _ in log["aux_loss"]] == [2, 4]
    assert all(np.isfinite(v) and v > 0 for _, v in log["aux_loss"])
    saved = model.load_transformer(tmp_path)
    # Only the transformer (with its position table) is saved: the heads are training-only.
    assert set(saved.state_dict()) == set(model.build_transformer(cfg).state_dict())
