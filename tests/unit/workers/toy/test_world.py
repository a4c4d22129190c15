"""The toy world: determinism, geometry, captions that say what the clip shows."""

from __future__ import annotations

import itertools
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
        a = s.attributes
        assert s.clip.shape == (world.NUM_FRAMES, world.HEIGHT, world.WIDTH, 3)
        assert s.clip.dtype == np.uint8
        colors = {tuple(int(v) for v in c) for c in s.clip.reshape(-1, 3)}
        expected = {
            world.FG_COLORS[a.left_color],
            world.FG_COLORS[a.right_color],
            world.BG_COLORS[a.background],
        }
        assert colors == expected


def test_palettes_are_disjoint_and_far_apart() -> None:
    assert not set(world.FG_COLORS.values()) & set(world.BG_COLORS.values())
    assert not set(world.FG_COLORS) & set(world.BG_COLORS)
    fg = np.asarray(list(world.FG_COLORS.values()), dtype=float)
    bg = np.asarray(list(world.BG_COLORS.values()), dtype=float)
    assert np.linalg.norm(fg[:, None] - bg[None], axis=-1).min() > 100
    d = np.linalg.norm(fg[:, None] - fg[None], axis=-1)
    assert d[~np.eye(len(fg), dtype=bool)].min() > 100


def test_world_size() -> None:
    assert len(world.SHAPES) >= 3 and len(world.DIRECTIONS) == 2
    assert len(world.BG_COLORS) >= 4 and len(world.FG_COLORS) >= 5
    expected = len(world.FG_COLORS) ** 2 * len(world.SHAPES) ** 2 * 2 * len(world.BG_COLORS)
    assert len(world.all_attributes()) == len(set(world.all_attributes())) == expected


@pytest.mark.parametrize("seed", range(40))
def test_elements_stay_inside_their_halves_and_move_the_stated_way(seed: int) -> None:
    s = world.sample(seed)
    a = s.attributes
    rows = s.params.rows()
    for f, frame in enumerate(s.clip):
        for color, shape, cx, columns in (
            (a.left_color, a.left_shape, world.LEFT_X, slice(0, world.SPLIT_X)),
            (a.right_color, a.right_shape, world.RIGHT_X, slice(world.SPLIT_X, None)),
        ):
            mask = np.zeros(frame.shape[:2], dtype=bool)
            mask[:, columns] = np.all(frame[:, columns] == np.asarray(world.FG_COLORS[color]), axis=-1)
            expected = world.shape_mask(shape, cx, rows[f], world.HALF_SIZE)
            # Whole and in its own half in every frame (where the two colors differ the masks are exact).
            assert expected[:, columns].sum() == expected.sum()
            if a.left_color != a.right_color:
                np.testing.assert_array_equal(mask, expected)
    steps = np.diff(np.asarray(rows))
    assert set(steps.tolist()) == {world.DIRECTION_DY[a.direction] * world.SPEED}


def test_a_change_of_one_element_stays_in_its_part_of_the_frame() -> None:
    """What Stage 2 relies on: one element's color changes its own pixels only; the background changes all."""
    a = world.Attributes("red", "circle", "blue", "square", "down", "white")
    base = world.render(world.params_at(a, 15))
    recolored = world.render(world.params_at(a.replace(left_color="green"), 15))
    changed = np.any(base != recolored, axis=-1)
    assert 0 < changed.mean() < 0.1 and not changed[:, :, world.SPLIT_X :].any()
    new_background = world.render(world.params_at(a.replace(background="black"), 15))
    assert np.any(base != new_background, axis=-1).mean() > 0.8


def test_position_is_independent_of_the_attributes() -> None:
    rng = np.random.default_rng(0)
    mids: dict[str, list[float]] = {d: [] for d in world.DIRECTIONS}
    for _ in range(4000):
        a = world.sample_attributes(rng)
        mids[a.direction].append(float(np.mean(world.sample_params(a, rng).rows())))
    for d, points in mids.items():
        assert np.mean(points) == pytest.approx(15.5, abs=0.2), d


def test_captions_name_exactly_the_attributes() -> None:
    """Each element's color and shape words sit next to each other, on the side the caption gives them."""
    color_words = {w: name for name, ws in world.COLOR_WORDS.items() for w in ws}
    shape_words = {w: name for name, ws in world.SHAPE_WORDS.items() for w in ws}
    splits: tuple[world.Split, ...] = ("train", "eval")
    for split in splits:
        for seed in range(300):
            rng = np.random.default_rng(seed)
            a = world.sample_attributes(rng)
            caption = world.make_caption(a, rng, split)
            words = re.findall(r"[a-z]+", caption.lower())
            pairs = {
                (color_words[w], shape_words[n])
                for w, n in itertools.pairwise(words)
                if w in color_words and n in shape_words
            }
            assert pairs == {(a.left_color, a.left_shape), (a.right_color, a.right_shape)}, caption
            colors = [color_words[w] for w in words if w in color_words]
            assert sorted(colors) == sorted([a.left_color, a.right_color, a.background]), caption
            direction_hits = {
                d
                for d, phrases in world.DIRECTION_WORDS.items()
                if any(re.search(rf"\b{re.escape(p)}\b", caption) for p in phrases)
            }
            assert direction_hits == {a.direction}, caption


def test_every_template_names_both_sides() -> None:
    for template in (*world.TRAIN_TEMPLATES, *world.EVAL_TEMPLATES):
        assert "left" in template and "right" in template, template
        fields = set(re.findall(r"{(\w+)}", template))
        assert set(world.ATTRIBUTE_NAMES) <= fields, template


def test_eval_templates_are_held_out() -> None:
    assert not set(world.TRAIN_TEMPLATES) & set(world.EVAL_TEMPLATES)
    train_captions = {world.sample(seed, "train").caption for seed in range(3000)}
    prompts = world.eval_prompts(200)
    assert len(prompts) == 200
    assert not {p for p, _ in prompts} & train_captions
    # Every attribute value is covered.
    for name in world.ATTRIBUTE_NAMES:
        seen = {getattr(a, name) for _, a in prompts}
        assert seen == set(world.ATTRIBUTE_VALUES[name])
    assert world.eval_prompts(20, seed=3) == world.eval_prompts(20, seed=3)


def test_params_at_centers_the_middle_of_the_motion() -> None:
    a = world.Attributes("red", "square", "blue", "circle", "up", "black")
    assert np.mean(world.params_at(a, 14).rows()) == 14


def test_plain_captions_differ_only_in_the_changed_words() -> None:
    a = world.Attributes("red", "square", "blue", "circle", "up", "black")
    b = a.replace(right_color="green")
    diff = set(world.plain_caption(a).split()) ^ set(world.plain_caption(b).split())
    assert diff == {"blue", "green"}
