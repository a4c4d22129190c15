"""The toy world (v2): two shapes side by side, each with its own color and shape, moving up or down together over
a solid background.

Every clip is ``NUM_FRAMES × HEIGHT × WIDTH × 3`` uint8 and a pure function of its ``ClipParams``; a seed
determines the params (and a caption) through ``numpy.random.default_rng(seed)``.

Why this world: Chorus' Stage 2 recomputes only the latent tokens where the new prompt diverges from the donor's.
That can only pay when a prompt edit changes *part* of the clip, as "a red car" → "a blue car" does in a real
video. Here each element is described on its own ("a red circle on the left and a blue square on the right"), so
changing one element's color or shape changes one element's pixels (about 8% of each frame); changing the
direction moves both elements; changing the background changes every pixel. Which words change what, the planner
has to learn from calibration; nothing tells it. Attribute binding matters: "a red circle on the left and a blue
square on the right" and "a blue circle on the left and a red square on the right" are different clips.

The design favours learnability and exact checking:

* foreground and background colors come from two disjoint palettes far apart, so a pixel's color says whether it
  belongs to an element;
* the elements sit in fixed columns (centers at x = 8 and x = 23, 9 px wide, 6 px apart) and share one row; they
  move 2 px per frame (14 px over the clip), up or down. The row's mid-clip height is drawn from a narrow range
  (4 values) that says nothing about what the elements are; in training it is read from the diffusion noise
  (``workers.toy.train.coupled_mids``), so the flow from noise to clip is nearly straight.

Captions come from templates filled with synonyms; every template names which element is on which side.
``TRAIN_TEMPLATES`` are used for training; ``EVAL_TEMPLATES`` (other word orders and connectives) are held apart
for evaluation and benchmarks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

NUM_FRAMES = 8
HEIGHT = 32
WIDTH = 32

# Foreground palette (the elements). Closest pair: blue/purple, ≈135 apart in RGB.
FG_COLORS: dict[str, tuple[int, int, int]] = {
    "red": (225, 35, 35),
    "green": (35, 185, 50),
    "blue": (35, 75, 235),
    "yellow": (245, 215, 30),
    "purple": (165, 45, 215),
    "cyan": (30, 210, 215),
}
# Background palette; disjoint from the foreground one (closest fg/bg pair: red/brown, ≈123 apart).
BG_COLORS: dict[str, tuple[int, int, int]] = {
    "black": (15, 15, 15),
    "white": (240, 240, 240),
    "gray": (128, 128, 128),
    "brown": (105, 60, 25),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
DIRECTIONS: tuple[str, ...] = ("up", "down")
# Vertical motion per direction (y grows downwards).
DIRECTION_DY: dict[str, int] = {"up": -1, "down": 1}

HALF_SIZE = 4  # an element spans 2·4+1 = 9 px
SPEED = 2  # px per frame
# The elements' columns: fixed centers, mirror images about the frame's center line x = 15.5. Each stays inside
# its half of the frame (left spans x 4..12, right 19..27), so the checker reads each half on its own.
LEFT_X = 8
RIGHT_X = 23
SPLIT_X = 16
# Mid-clip center row of both elements (inclusive range).
MID_RANGE = (14, 17)

# The attributes a caption describes, with their values, in a fixed order.
ATTRIBUTE_VALUES: dict[str, tuple[str, ...]] = {
    "left_color": tuple(FG_COLORS),
    "left_shape": SHAPES,
    "right_color": tuple(FG_COLORS),
    "right_shape": SHAPES,
    "direction": DIRECTIONS,
    "background": tuple(BG_COLORS),
}
ATTRIBUTE_NAMES: tuple[str, ...] = tuple(ATTRIBUTE_VALUES)
# Attributes that belong to one element (a change of one of these is local); the others are global.
ELEMENT_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "left": ("left_color", "left_shape"),
    "right": ("right_color", "right_shape"),
}

Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Attributes:
    left_color: str
    left_shape: str
    right_color: str
    right_shape: str
    direction: str
    background: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    def replace(self, **changes: str) -> Attributes:
        return Attributes(**{**self.as_dict(), **changes})


def all_attributes() -> list[Attributes]:
    """Every attribute combination, in a fixed order."""
    import itertools

    return [Attributes(*values) for values in itertools.product(*ATTRIBUTE_VALUES.values())]


@dataclass(frozen=True)
class ClipParams:
    attributes: Attributes
    # Center row of both elements in the first frame (pixel coordinates, y down).
    start_y: int
    half_size: int = HALF_SIZE
    speed: int = SPEED

    def rows(self) -> list[int]:
        dy = DIRECTION_DY[self.attributes.direction]
        return [self.start_y + dy * self.speed * f for f in range(NUM_FRAMES)]


def sample_attributes(rng: np.random.Generator) -> Attributes:
    return Attributes(*(str(rng.choice(values)) for values in ATTRIBUTE_VALUES.values()))


def params_at(attributes: Attributes, mid_y: int) -> ClipParams:
    """The clip whose elements are centered on row ``mid_y`` half-way through their motion."""
    half_travel = SPEED * (NUM_FRAMES - 1) // 2
    return ClipParams(attributes=attributes, start_y=mid_y - DIRECTION_DY[attributes.direction] * half_travel)


def sample_params(attributes: Attributes, rng: np.random.Generator) -> ClipParams:
    """The mid-clip row uniform over ``MID_RANGE``, independent of the attributes."""
    return params_at(attributes, int(rng.integers(MID_RANGE[0], MID_RANGE[1] + 1)))


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
    elements = ((LEFT_X, a.left_shape, a.left_color), (RIGHT_X, a.right_shape, a.right_color))
    for f, cy in enumerate(params.rows()):
        for cx, shape, color in elements:
            clip[f][shape_mask(shape, cx, cy, params.half_size)] = np.asarray(FG_COLORS[color], np.uint8)
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
    "up": ("up", "upward", "upwards", "toward the top"),
    "down": ("down", "downward", "downwards", "toward the bottom"),
}
VERBS_ING: tuple[str, ...] = ("moving", "sliding", "drifting", "gliding", "traveling", "heading")
VERBS_PLURAL: tuple[str, ...] = ("move", "slide", "drift", "glide", "travel", "head")
BACKDROP_WORDS: tuple[str, ...] = ("background", "backdrop")

# Template fields: one per attribute (named as the attribute) plus the filler words {ving} {vp} {backdrop}.
# Every template says which element is on which side; some name the right one first.
TRAIN_TEMPLATES: tuple[str, ...] = (
    "a {left_color} {left_shape} on the left and a {right_color} {right_shape} on the right, "
    "{ving} {direction} on a {background} {backdrop}",
    "a {left_color} {left_shape} to the left of a {right_color} {right_shape}, both {ving} {direction} "
    "on a {background} {backdrop}",
    "a {right_color} {right_shape} to the right of a {left_color} {left_shape}, {ving} {direction} "
    "against a {background} {backdrop}",
    "{background} {backdrop}, {left_color} {left_shape} on the left, {right_color} {right_shape} on the right, "
    "{ving} {direction}",
    "on the left a {left_color} {left_shape}, on the right a {right_color} {right_shape}; "
    "they {vp} {direction} over a {background} {backdrop}",
    "on the right a {right_color} {right_shape}, on the left a {left_color} {left_shape}, "
    "{ving} {direction} on {background}",
    "a {background} {backdrop} with a {left_color} {left_shape} at left and a {right_color} {right_shape} "
    "at right {ving} {direction}",
    "left: {left_color} {left_shape}, right: {right_color} {right_shape}, {ving} {direction}, "
    "{background} {backdrop}",
    "a {right_color} {right_shape} on the right and a {left_color} {left_shape} on the left {vp} "
    "{direction} in front of a {background} {backdrop}",
    "video of a {left_color} {left_shape} left of a {right_color} {right_shape}, {ving} {direction} "
    "on {background}",
)
EVAL_TEMPLATES: tuple[str, ...] = (
    "on a {background} {backdrop}, a {left_color} {left_shape} on the left side and a {right_color} "
    "{right_shape} on the right side are {ving} {direction}",
    "two shapes {ving} {direction} across a plain {background} {backdrop}: a {right_color} {right_shape} "
    "at the right, a {left_color} {left_shape} at the left",
    "there is a {left_color} {left_shape} to the left and a {right_color} {right_shape} to the right, "
    "and they {vp} {direction}; the {backdrop} is {background}",
    "{ving} {direction}, a {left_color} {left_shape} (left) and a {right_color} {right_shape} (right) "
    "on {background}",
    "clip with a {right_color} {right_shape} on its right and a {left_color} {left_shape} on its left, "
    "{ving} {direction}, {background} {backdrop} behind them",
)


# The words for each attribute's values.
ATTRIBUTE_WORDS: dict[str, dict[str, tuple[str, ...]]] = {
    "left_color": COLOR_WORDS,
    "left_shape": SHAPE_WORDS,
    "right_color": COLOR_WORDS,
    "right_shape": SHAPE_WORDS,
    "direction": DIRECTION_WORDS,
    "background": COLOR_WORDS,
}


def attribute_word(attribute: str, value: str, rng: np.random.Generator) -> str:
    """A word (or phrase) that names ``value`` of ``attribute`` in a caption."""
    return str(rng.choice(ATTRIBUTE_WORDS[attribute][value]))


def draw_fields(attributes: Attributes, rng: np.random.Generator) -> dict[str, str]:
    """Words for every template field: one per attribute, plus the filler words."""
    fields = {name: attribute_word(name, value, rng) for name, value in attributes.as_dict().items()}
    fields["ving"] = str(rng.choice(VERBS_ING))
    fields["vp"] = str(rng.choice(VERBS_PLURAL))
    fields["backdrop"] = str(rng.choice(BACKDROP_WORDS))
    return fields


def plain_caption(attributes: Attributes, template: str = TRAIN_TEMPLATES[0]) -> str:
    """``template`` filled with the first word of every value (no synonyms): two plain captions differ only in
    the words of the attributes that differ."""
    fields = {name: ATTRIBUTE_WORDS[name][value][0] for name, value in attributes.as_dict().items()}
    return template.format(**fields, ving=VERBS_ING[0], vp=VERBS_PLURAL[0], backdrop=BACKDROP_WORDS[0])


def make_caption(attributes: Attributes, rng: np.random.Generator, split: Split = "train") -> str:
    templates = TRAIN_TEMPLATES if split == "train" else EVAL_TEMPLATES
    template = str(rng.choice(templates))
    return template.format(**draw_fields(attributes, rng))


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


def balanced_attributes(n: int, rng: np.random.Generator) -> list[Attributes]:
    """``n`` attribute combinations whose every attribute's values are balanced (counts differ by ≤ 1 in every
    prefix), each attribute drawn independently of the others."""
    columns: dict[str, list[str]] = {}
    for name, values in ATTRIBUTE_VALUES.items():
        column: list[str] = []
        while len(column) < n:
            column.extend(str(values[int(i)]) for i in rng.permutation(len(values)))
        columns[name] = column[:n]
    return [Attributes(**{name: col[i] for name, col in columns.items()}) for i in range(n)]


def eval_prompts(n: int, seed: int = 0) -> list[tuple[str, Attributes]]:
    """``n`` held-out evaluation prompts (``EVAL_TEMPLATES``) with their attributes; every attribute's values are
    covered evenly."""
    rng = np.random.default_rng(seed)
    return [(make_caption(a, rng, "eval"), a) for a in balanced_attributes(n, rng)]
