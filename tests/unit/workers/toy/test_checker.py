"""The checker reads every attribute of ground-truth renders, clean and degraded."""

from __future__ import annotations

import numpy as np
import pytest

from workers.toy import checker, world


def _degrade(clip: np.ndarray, rng: np.random.Generator, noise: float, blur: bool) -> np.ndarray:
    x = clip.astype(np.float64)
    if blur:  # separable [1, 2, 1] / 4 blur in both spatial axes
        for axis in (1, 2):
            x = 0.25 * np.roll(x, 1, axis) + 0.5 * x + 0.25 * np.roll(x, -1, axis)
    x = x + rng.normal(0.0, noise, x.shape)
    return np.clip(np.round(x), 0, 255).astype(np.uint8)


def _accuracy(n: int, seed0: int, noise: float = 0.0, blur: bool = False) -> dict[str, float]:
    rng = np.random.default_rng(seed0)
    results = []
    for seed in range(seed0, seed0 + n):
        s = world.sample(seed)
        clip = _degrade(s.clip, rng, noise, blur) if (noise or blur) else s.clip
        results.append(checker.compare(checker.read_clip(clip), s.attributes))
    return checker.accuracy(results)


def test_reads_clean_renders() -> None:
    acc = _accuracy(1000, seed0=50_000)
    assert all(v >= 0.99 for v in acc.values()), acc
    assert acc["all"] == 1.0, acc


@pytest.mark.slow
def test_reads_noisy_blurred_renders() -> None:
    acc = _accuracy(1000, seed0=60_000, noise=20.0, blur=True)
    assert all(v >= 0.99 for v in acc.values()), acc


def test_reads_heavily_degraded_renders() -> None:
    acc = _accuracy(200, seed0=70_000, noise=35.0, blur=True)
    assert all(v >= 0.99 for v in acc.values()), acc


def test_every_combination_is_read() -> None:
    rng = np.random.default_rng(0)
    for attrs in world.all_attributes():
        clip = world.render(world.sample_params(attrs, rng))
        assert checker.read_clip(clip).attributes == attrs


def test_deterministic_and_reports_evidence() -> None:
    clip = world.sample(7).clip
    a, b = checker.read_clip(clip), checker.read_clip(clip)
    assert a == b
    assert a.frames_used == world.NUM_FRAMES
    assert a.shape_scores[a.attributes.shape] == pytest.approx(1.0)
    # Frames cut off at the border shift the centroid a little.
    assert abs(max(a.velocity, key=abs)) == pytest.approx(world.SPEED, rel=0.1)


def test_compare_and_accuracy() -> None:
    a = world.Attributes("red", "circle", "left", "gray")
    b = world.Attributes("red", "square", "left", "gray")
    assert checker.compare(a, a)["all"]
    r = checker.compare(b, a)
    assert r == {"color": True, "shape": False, "direction": True, "background": True, "all": False}
    assert checker.accuracy([r, checker.compare(a, a)])["shape"] == 0.5


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        checker.read_clip(np.zeros((8, 32, 32), dtype=np.uint8))
