"""The toy world: determinism, geometry, captions that say what the clip shows."""

from __future__ import annotations

import re

import numpy as np
import pytest

from workers.toy import world


def test_same_seed_same_clip_and_caption() -> None:
    for seed in (0, 1, 12345):
        a, b = world.sample(seed), world.sample(seed)
        assert a.caption == b.caption
        assert a.params == b.params
        np.testing.assert_array_equal(a.clip, b.clip)
    assert not np.array_equal(world.sample(0).clip, world.sample(1).clip)


def test_clip_format_and_colors() -> None:
    for seed in range(50):
        s = world.sample(seed)
        assert s.clip.shape == (world.NUM_FRAMES, world.HEIGHT, world.WIDTH, 3)
        assert s.clip.dtype == np.uint8
        colors = {tuple(int(v) for v in c) for c in s.clip.reshape(-1, 3)}
        assert colors == {world.FG_COLORS[s.attributes.color], world.BG_COLORS[s.attributes.background]}


def test_palettes_are_disjoint_and_far_apart() -> None:
    assert not set(world.FG_COLORS.values()) & set(world.BG_COLORS.values())
    assert not set(world.FG_COLORS) & set(world.BG_COLORS)
    fg = np.asarray(list(world.FG_COLORS.values()), dtype=float)
    bg = np.asarray(list(world.BG_COLORS.values()), dtype=float)
    assert np.linalg.norm(fg[:, None] - bg[None], axis=-1).min() > 100
    d = np.linalg.norm(fg[:, None] - fg[None], axis=-1)
    assert d[~np.eye(len(fg), dtype=bool)].min() > 100


def test_world_size() -> None:
    assert len(world.SHAPES) >= 3 and len(world.DIRECTIONS) == 4
    assert len(world.BG_COLORS) >= 4 and len(world.FG_COLORS) >= 5
    assert len(world.all_attributes()) == len(world.FG_COLORS) * 3 * 4 * len(world.BG_COLORS)


@pytest.mark.parametrize("seed", range(40))
def test_shape_stays_mostly_inside_and_moves_the_stated_way(seed: int) -> None:
    s = world.sample(seed)
    dx, dy = world.DIRECTION_VECTORS[s.attributes.direction]
    centers = s.params.centers()
    full_area = world.shape_mask(s.attributes.shape, 16, 16, world.HALF_SIZE).sum()
    for f, frame in enumerate(s.clip):
        mask = np.all(frame == np.asarray(world.FG_COLORS[s.attributes.color]), axis=-1)
        # At most 2 px of the shape are cut off, only in the first/last frames; the middle is whole.
        assert mask.sum() >= 0.7 * full_area
        if 2 <= f <= 5:
            assert mask.sum() == full_area
    steps = np.diff(np.asarray(centers), axis=0)
    np.testing.assert_array_equal(steps, np.tile([dx * world.SPEED, dy * world.SPEED], (len(steps), 1)))


def test_position_is_independent_of_direction() -> None:
    rng = np.random.default_rng(0)
    mids: dict[str, list[tuple[float, float]]] = {d: [] for d in world.DIRECTIONS}
    for _ in range(4000):
        a = world.sample_attributes(rng)
        c = np.asarray(world.sample_params(a, rng).centers())
        mids[a.direction].append(tuple(c.mean(axis=0)))
    for d, points in mids.items():
        mean = np.asarray(points).mean(axis=0)
        np.testing.assert_allclose(mean, [15.5, 15.5], atol=0.4, err_msg=d)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def test_captions_name_exactly_the_attributes() -> None:
    color_words = {w: name for name, ws in world.COLOR_WORDS.items() for w in ws}
    shape_words = {w: name for name, ws in world.SHAPE_WORDS.items() for w in ws}
    splits: tuple[world.Split, ...] = ("train", "eval")
    for split in splits:
        for seed in range(300):
            rng = np.random.default_rng(seed)
            attrs = world.sample_attributes(rng)
            caption = world.make_caption(attrs, rng, split)
            words = _words(caption)
            colors = {color_words[w] for w in words if w in color_words}
            assert colors == {attrs.color, attrs.background}, caption
            assert {shape_words[w] for w in words if w in shape_words} == {attrs.shape}, caption
            direction_hits = {
                d
                for d, phrases in world.DIRECTION_WORDS.items()
                if any(re.search(rf"\b{re.escape(p)}\b", caption) for p in phrases)
            }
            assert direction_hits == {attrs.direction}, caption


def test_eval_templates_are_held_out() -> None:
    assert not set(world.TRAIN_TEMPLATES) & set(world.EVAL_TEMPLATES)
    train_captions = {world.sample(seed, "train").caption for seed in range(3000)}
    prompts = world.eval_prompts(200)
    assert len(prompts) == 200
    assert not {p for p, _ in prompts} & train_captions
    # Every attribute value is covered.
    for name in world.ATTRIBUTE_NAMES:
        seen = {getattr(a, name) for _, a in prompts}
        assert len(seen) >= 3
    assert world.eval_prompts(20, seed=3) == world.eval_prompts(20, seed=3)


def test_params_at_centers_the_middle_of_the_motion() -> None:
    a = world.Attributes("red", "square", "right", "black")
    c = np.asarray(world.params_at(a, 14, 17).centers())
    np.testing.assert_allclose(c.mean(axis=0), [14, 17])
