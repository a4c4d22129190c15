"""The toy world: one colored shape moving in one direction over a solid background.

Every clip is ``NUM_FRAMES × HEIGHT × WIDTH × 3`` uint8 and is a pure function of its ``ClipParams``; a seed
determines the params (and a caption) through ``numpy.random.default_rng(seed)``, so the same seed always gives the
same clip and caption.

The design favours learnability and exact checking:

* foreground colors and background colors come from two disjoint palettes whose closest pair is far apart, so a
  color word alone says whether it names the shape or the background, and a pixel's color says whether it belongs to
  the shape;
* shapes are large (15 px across on a 32 px frame) and move fast (2 px per frame, 14 px over the clip);
* where the shape is carries no information about what it is or where it goes: the mid-clip position is drawn
  from a range symmetric about the frame center, the same for every direction. Here the seed picks the position;
  in training the position is read from the diffusion noise instead (``workers.toy.train.coupled_mids``).
* that range is narrow (4 px per axis, 16 placements): from pure noise the model can only predict the average
  over placements, and the wider the spread the more that average blurs a square's corners into a circle's
  outline. Measured: fine-tuning a model trained on an 8 px range on this one raised shape accuracy from 46% to
  69% (4 steps) and from 42% to 75% (20 steps) in 500 steps.

Captions come from templates filled with synonyms. ``TRAIN_TEMPLATES`` are used for training;
``EVAL_TEMPLATES`` (different word orders and connectives) are held apart for evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

NUM_FRAMES = 8
HEIGHT = 32
WIDTH = 32

# Foreground palette (the shape). Closest pair: blue/purple, ≈135 apart in RGB.
FG_COLORS: dict[str, tuple[int, int, int]] = {
    "red": (225, 35, 35),
    "green": (35, 185, 50),
    "blue": (35, 75, 235),
    "yellow": (245, 215, 30),
    "purple": (165, 45, 215),
    "cyan": (30, 210, 215),
}
# Background palette; disjoint from the foreground one (closest fg/bg pair: red/brown, ≈123 apart; closest
# bg/bg pair: black/brown, ≈101 apart).
BG_COLORS: dict[str, tuple[int, int, int]] = {
    "black": (15, 15, 15),
    "white": (240, 240, 240),
    "gray": (128, 128, 128),
    "brown": (105, 60, 25),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
# Unit motion per direction as (dx, dy) in image coordinates (y grows downwards).
DIRECTION_VECTORS: dict[str, tuple[int, int]] = {
    "left": (-1, 0),
    "right": (1, 0),
    "up": (0, -1),
    "down": (0, 1),
}

HALF_SIZE = 7  # a shape spans 2·7+1 = 15 px
SPEED = 2  # px per frame
# Mid-clip center of the shape, the same inclusive pixel range in both axes (symmetric about the frame center
# 15.5). The shape stays fully inside the frame in every frame.
MID_RANGE = (14, 17)

Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Attributes:
    color: str
    shape: str
    direction: str
    background: str

    def as_dict(self) -> dict[str, str]:
        return {
            "color": self.color,
            "shape": self.shape,
            "direction": self.direction,
            "background": self.background,
        }


ATTRIBUTE_NAMES: tuple[str, ...] = ("color", "shape", "direction", "background")


def all_attributes() -> list[Attributes]:
    """Every attribute combination, in a fixed order."""
    return [Attributes(c, s, d, b) for c in FG_COLORS for s in SHAPES for d in DIRECTIONS for b in BG_COLORS]


@dataclass(frozen=True)
class ClipParams:
    attributes: Attributes
    # Center of the shape in the first frame (pixel coordinates, x to the right, y down).
    start_x: int
    start_y: int
    half_size: int = HALF_SIZE
    speed: int = SPEED

    def centers(self) -> list[tuple[int, int]]:
        dx, dy = DIRECTION_VECTORS[self.attributes.direction]
        return [
            (self.start_x + dx * self.speed * f, self.start_y + dy * self.speed * f)
            for f in range(NUM_FRAMES)
        ]


def sample_attributes(rng: np.random.Generator) -> Attributes:
    return Attributes(
        color=str(rng.choice(list(FG_COLORS))),
        shape=str(rng.choice(SHAPES)),
        direction=str(rng.choice(DIRECTIONS)),
        background=str(rng.choice(list(BG_COLORS))),
    )


def params_at(attributes: Attributes, mid_x: int, mid_y: int) -> ClipParams:
    """The clip whose shape is centered at ``(mid_x, mid_y)`` half-way through its motion."""
    dx, dy = DIRECTION_VECTORS[attributes.direction]
    half_travel = SPEED * (NUM_FRAMES - 1) // 2
    return ClipParams(
        attributes=attributes, start_x=mid_x - dx * half_travel, start_y=mid_y - dy * half_travel
    )


def sample_params(attributes: Attributes, rng: np.random.Generator) -> ClipParams:
    """Place the shape independently of what it is and where it goes: the mid-clip center is uniform over
    ``MID_RANGE`` in both axes (symmetric about the frame center)."""
    mid_x, mid_y = (int(v) for v in rng.integers(MID_RANGE[0], MID_RANGE[1] + 1, size=2))
    return params_at(attributes, mid_x, mid_y)


_YY, _XX = np.mgrid[0:HEIGHT, 0:WIDTH]


def shape_mask(
    shape: str, cx: float, cy: float, half_size: float, height: int = HEIGHT, width: int = WIDTH
) -> np.ndarray:
    """Boolean ``(height, width)`` mask of a shape centered at ``(cx, cy)`` (its bounding box's center)."""
    yy, xx = (_YY, _XX) if (height, width) == (HEIGHT, WIDTH) else np.mgrid[0:height, 0:width]
    r = half_size
    if shape == "circle":
        return (xx - cx) ** 2 + (yy - cy) ** 2 <= (r + 0.5) ** 2
    if shape == "square":
        return (np.abs(xx - cx) <= r) & (np.abs(yy - cy) <= r)
    if shape == "triangle":
        # Pointing up: apex at (cx, cy - r), base row at cy + r spanning cx ± r.
        depth = yy - (cy - r)  # 0 at the apex row, 2r at the base row
        return (depth >= 0) & (depth <= 2 * r) & (np.abs(xx - cx) <= depth / 2 + 0.5)
    raise ValueError(f"unknown shape {shape!r}")


def render(params: ClipParams) -> np.ndarray:
    """The clip as uint8 ``(NUM_FRAMES, HEIGHT, WIDTH, 3)``."""
    a = params.attributes
    clip = np.empty((NUM_FRAMES, HEIGHT, WIDTH, 3), dtype=np.uint8)
    clip[:] = np.asarray(BG_COLORS[a.background], dtype=np.uint8)
    fg = np.asarray(FG_COLORS[a.color], dtype=np.uint8)
    for f, (cx, cy) in enumerate(params.centers()):
        clip[f][shape_mask(a.shape, cx, cy, params.half_size)] = fg
    return clip


# --- captions ---------------------------------------------------------------------------------------------

COLOR_WORDS: dict[str, tuple[str, ...]] = {
    "red": ("red",),
    "green": ("green",),
    "blue": ("blue",),
    "yellow": ("yellow",),
    "purple": ("purple", "violet"),
    "cyan": ("cyan", "turquoise"),
    "black": ("black",),
    "white": ("white",),
    "gray": ("gray", "grey"),
    "brown": ("brown",),
}
SHAPE_WORDS: dict[str, tuple[str, ...]] = {
    "circle": ("circle", "ball", "disc", "dot"),
    "square": ("square", "box", "block"),
    "triangle": ("triangle",),
}
# How a motion in each direction is phrased after a verb ("moving ___").
DIRECTION_WORDS: dict[str, tuple[str, ...]] = {
    "left": ("left", "to the left", "leftward", "leftwards"),
    "right": ("right", "to the right", "rightward", "rightwards"),
    "up": ("up", "upward", "upwards", "toward the top"),
    "down": ("down", "downward", "downwards", "toward the bottom"),
}
VERBS_ING: tuple[str, ...] = ("moving", "sliding", "drifting", "gliding", "traveling", "heading")
VERBS_3RD: tuple[str, ...] = ("moves", "slides", "drifts", "glides", "travels", "heads")
BACKDROP_WORDS: tuple[str, ...] = ("background", "backdrop")

# Fields: {color} {shape} {dir} {bg} {ving} {v3} {backdrop}
TRAIN_TEMPLATES: tuple[str, ...] = (
    "a {color} {shape} moving {dir} on a {bg} background",
    "a {color} {shape} {ving} {dir} on a {bg} {backdrop}",
    "{color} {shape} {ving} {dir}, {bg} {backdrop}",
    "a {color} {shape} {ving} {dir} against a {bg} {backdrop}",
    "the {color} {shape} {v3} {dir} over a {bg} {backdrop}",
    "{bg} {backdrop}, {color} {shape} {ving} {dir}",
    "a {color} {shape} on a {bg} {backdrop}, {ving} {dir}",
    "{color} {shape}, {bg} {backdrop}, {ving} {dir}",
    "a {color} {shape} that {v3} {dir} in front of a {bg} {backdrop}",
    "a {bg} {backdrop} with a {color} {shape} {ving} {dir}",
    "video of a {color} {shape} {ving} {dir} on {bg}",
    "{color} {shape} {ving} {dir} on {bg}",
)
EVAL_TEMPLATES: tuple[str, ...] = (
    "on a {bg} {backdrop}, a {color} {shape} is {ving} {dir}",
    "a single {color} {shape} {ving} {dir} across a plain {bg} {backdrop}",
    "there is a {color} {shape} and it {v3} {dir}; the {backdrop} is {bg}",
    "{ving} {dir}, a {color} {shape} on {bg}",
    "clip of a {color} {shape} {ving} {dir} with a {bg} {backdrop} behind it",
)


def make_caption(attributes: Attributes, rng: np.random.Generator, split: Split = "train") -> str:
    templates = TRAIN_TEMPLATES if split == "train" else EVAL_TEMPLATES
    template = str(rng.choice(templates))
    direction = str(rng.choice(DIRECTION_WORDS[attributes.direction]))
    fields = {
        "color": str(rng.choice(COLOR_WORDS[attributes.color])),
        "shape": str(rng.choice(SHAPE_WORDS[attributes.shape])),
        "dir": direction,
        "bg": str(rng.choice(COLOR_WORDS[attributes.background])),
        "ving": str(rng.choice(VERBS_ING)),
        "v3": str(rng.choice(VERBS_3RD)),
        "backdrop": str(rng.choice(BACKDROP_WORDS)),
    }
    return template.format(**fields)


@dataclass(frozen=True)
class Sample:
    seed: int
    params: ClipParams
    caption: str
    clip: np.ndarray

    @property
    def attributes(self) -> Attributes:
        return self.params.attributes


def sample(seed: int, split: Split = "train") -> Sample:
    """The clip and caption of one seed: attributes, placement and caption all drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    attributes = sample_attributes(rng)
    params = sample_params(attributes, rng)
    caption = make_caption(attributes, rng, split)
    return Sample(seed=seed, params=params, caption=caption, clip=render(params))


def eval_prompts(n: int, seed: int = 0) -> list[tuple[str, Attributes]]:
    """``n`` held-out evaluation prompts (``EVAL_TEMPLATES``) with their attributes, cycling through all
    attribute combinations in a seeded random order so every value is covered evenly."""
    rng = np.random.default_rng(seed)
    combos = all_attributes()
    order: list[int] = []
    while len(order) < n:
        order.extend(int(i) for i in rng.permutation(len(combos)))
    return [(make_caption(combos[i], rng, "eval"), combos[i]) for i in order[:n]]
