"""Every catalog model has a loader; Wan2.1 loads from a local directory and runs end to end."""

from __future__ import annotations

import importlib

import pytest
import torch

from producer.catalog import CATALOG
from producer.contract import ReusePlan, build_request
from tests.helpers.wan_fixture import build_random_wan_dir
from workers.engine import LOADERS, Engine, ModelUnavailable, load_bundle
from workers.engine import registry as registry_module


def test_every_catalog_model_has_a_loader():
    assert set(LOADERS) == set(CATALOG)


def test_unknown_model():
    with pytest.raises(ModelUnavailable, match="unknown model"):
        load_bundle("sdxl")


def test_tiny_model_is_deterministic():
    a, b = load_bundle("tiny-random-wan"), load_bundle("tiny-random-wan")
    assert a.weights_id == b.weights_id
    for (name, p), (_, q) in zip(
        a.transformer.state_dict().items(), b.transformer.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), name
    enc = a.encode_prompt("A red circle, moving left")
    assert enc.tokens[:5] == ["a", "red", "circle", ",", "moving"]
    assert enc.embeddings.shape == (1, 16, 32) and sum(enc.valid) == 7
    assert (enc.embeddings[0, 7:] == 0).all()
    assert a.latent_shape(8, 32, 32) == (4, 8, 8, 8)
    frames = a.decode(torch.zeros(1, 4, 2, 8, 8))
    assert frames.shape == (2, 32, 32, 3) and frames.dtype.name == "uint8"


def test_toy_loader_reports_a_missing_module(monkeypatch):
    real = importlib.import_module

    def fake(name, *args, **kwargs):
        if name == "workers.toy.model":
            raise ModuleNotFoundError("No module named 'workers.toy.model'", name="workers.toy.model")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(registry_module.importlib, "import_module", fake)
    with pytest.raises(ModelUnavailable, match="not built yet"):
        load_bundle("toy")


def test_toy_loader_reports_missing_weights(monkeypatch, tmp_path):
    import types

    def load_toy_bundle(device, dtype, weights_dir):
        raise FileNotFoundError(f"{weights_dir}/config.json")

    fake_module = types.SimpleNamespace(load_toy_bundle=load_toy_bundle)
    real = importlib.import_module
    monkeypatch.setattr(
        registry_module.importlib,
        "import_module",
        lambda name, *a, **k: fake_module if name == "workers.toy.model" else real(name, *a, **k),
    )
    with pytest.raises(ModelUnavailable, match="weights are missing"):
        load_bundle("toy", toy_weights_dir=tmp_path)


def test_wan21_needs_a_directory(tmp_path):
    with pytest.raises(ModelUnavailable, match="CHORUS_WAN21_DIR"):
        load_bundle("wan2.1-t2v-1.3b")
    with pytest.raises(ModelUnavailable, match="does not exist"):
        load_bundle("wan2.1-t2v-1.3b", wan21_dir=tmp_path / "nope")
    (tmp_path / "transformer").mkdir()
    with pytest.raises(ModelUnavailable, match="missing"):
        load_bundle("wan2.1-t2v-1.3b", wan21_dir=tmp_path)


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("wan21")
    pipe = build_random_wan_dir(path)
    return path, pipe


def test_wan21_random_pipeline_end_to_end(wan_dir):
    path, pipe = wan_dir
    bundle = load_bundle("wan2.1-t2v-1.3b", device="cpu", dtype="float32", wan21_dir=path)
    assert type(bundle.make_scheduler()).__name__ == "UniPCMultistepScheduler"
    assert bundle.weights_id.startswith("wan21:")
    engine = Engine(bundle)
    request = build_request(
        prompt="a red circle moving left",
        negative_prompt="blurry",
        model="wan2.1-t2v-1.3b",
        num_frames=5,
        height=128,
        width=128,
        num_steps=4,
        seed=3,
        guidance_scale=5.0,
    )
    out = engine.generate(request, ReusePlan.full(4))
    assert out.frames.shape == (5, 128, 128, 3)
    assert out.trajectory.meta.latent_shape == (16, 2, 16, 16)
    assert out.trajectory.meta.tokens[:2] == ("a", "red")

    # the same computation as diffusers' own WanPipeline (sequential CFG branches)
    with torch.no_grad():
        latents = pipe(
            prompt=request.prompt,
            negative_prompt="blurry",
            num_frames=5,
            height=128,
            width=128,
            num_inference_steps=4,
            guidance_scale=5.0,
            generator=torch.Generator("cpu").manual_seed(3),
            output_type="latent",
        ).frames
    torch.testing.assert_close(out.trajectory.latent_after(3), latents[0], atol=1e-4, rtol=1e-4)

    # the UniPC multistep history survives Stage 1 replay: a self-donor reproduces the run
    again = engine.generate(
        request,
        ReusePlan(stage1_steps=2, stage2_steps=1, stage3_steps=1, min_active_fraction=1.0),
        donor=out.trajectory,
    )
    torch.testing.assert_close(
        again.trajectory.latent_after(3), out.trajectory.latent_after(3), atol=1e-6, rtol=1e-6
    )
    # and a real partial reuse runs through the same path
    other = build_request(
        prompt="a blue circle moving left",
        negative_prompt="blurry",
        model="wan2.1-t2v-1.3b",
        num_frames=5,
        height=128,
        width=128,
        num_steps=4,
        seed=4,
        guidance_scale=5.0,
    )
    part = engine.generate(
        other,
        ReusePlan(stage1_steps=1, stage2_steps=2, stage3_steps=1, alpha=2.0, max_active_fraction=0.5),
        donor=out.trajectory,
    )
    assert part.fallback is None and part.steps[1].active_fraction <= 0.5 and part.steps[1].tgaa
