"""Reads a toy-world clip's attributes back from its pixels alone.

Deterministic and model-agnostic: it sees only a uint8 ``(F, H, W, 3)`` array.

1. Background: the per-channel median of all pixels (the two elements cover under a fifth of the frame), snapped
   to the nearest background palette color.
2. Each element is read from its own half of the frame (left: ``x < SPLIT_X``; right: the rest):
   a. color: every pixel of the half votes for its nearest color among the background color and the foreground
      palette; the foreground color with the most votes wins;
   b. mask: a pixel is foreground when it is closer to that color than to the background;
   c. shape: per frame, the best intersection-over-union of the mask with each shape's ideal mask over a window of
      centers and sizes around the mask's centroid; the shape with the highest mean over frames wins.
3. Direction: a least-squares line through the per-frame centroid rows of both elements' masks; its sign.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from workers.toy.world import (
    ATTRIBUTE_NAMES,
    BG_COLORS,
    FG_COLORS,
    HALF_SIZE,
    SHAPES,
    SPLIT_X,
    Attributes,
    shape_mask,
)

# Frames whose element mask has fewer pixels than this are ignored for its shape and the motion.
MIN_AREA = 8
HALF_SIZES = tuple(range(HALF_SIZE - 1, HALF_SIZE + 2))

_FG_NAMES = list(FG_COLORS)
_FG_RGB = np.asarray([FG_COLORS[n] for n in _FG_NAMES], dtype=np.float32)
_BG_NAMES = list(BG_COLORS)
_BG_RGB = np.asarray([BG_COLORS[n] for n in _BG_NAMES], dtype=np.float32)


@dataclass
class ElementReading:
    """What the checker read of one element, with its evidence."""

    color: str
    shape: str
    # Mean best IoU per shape (higher is better); the chosen shape has the highest.
    shape_scores: dict[str, float] = field(default_factory=dict)
    # RGB distance between the median color of the pixels that voted for it and its palette color.
    color_error: float = 0.0
    # Per used frame: (frame, centroid row).
    rows: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Reading:
    """What the checker read, plus the evidence it used."""

    attributes: Attributes
    left: ElementReading
    right: ElementReading
    # Least-squares vertical motion in px/frame (negative = up).
    velocity: float = 0.0
    background_error: float = 0.0

    @property
    def frames_used(self) -> int:
        return min(len(self.left.rows), len(self.right.rows))


@functools.cache
def _template_bank(shape: str, half_size: int, height: int, width: int) -> np.ndarray:
    """float32 ``(height*width, height*width)``: row ``cy*width + cx`` is the shape's mask centered at (cx, cy)."""
    bank = np.empty((height * width, height * width), dtype=np.float32)
    for cy in range(height):
        for cx in range(width):
            bank[cy * width + cx] = shape_mask(shape, cx, cy, half_size, height, width).reshape(-1)
    return bank


def _nearest(rgb: np.ndarray, palette: np.ndarray) -> tuple[int, float]:
    d = np.linalg.norm(palette - rgb[None, :], axis=1)
    i = int(np.argmin(d))
    return i, float(d[i])


def _best_ious(mask: np.ndarray) -> dict[str, float]:
    """Best IoU of one frame's mask with each shape over centers near its centroid and a range of sizes."""
    height, width = mask.shape
    ys, xs = np.nonzero(mask)
    my, mx = float(ys.mean()), float(xs.mean())
    # A triangle's centroid sits below its bounding-box center by about a third of the half size.
    cxs = np.arange(round(mx) - 2, round(mx) + 3)
    cys = np.arange(round(my) - 3, round(my) + 3)
    cxs = cxs[(cxs >= 0) & (cxs < width)]
    cys = cys[(cys >= 0) & (cys < height)]
    rows = (cys[:, None] * width + cxs[None, :]).reshape(-1)
    flat = mask.reshape(-1).astype(np.float32)
    area = float(flat.sum())
    best: dict[str, float] = {}
    for shape in SHAPES:
        score = 0.0
        for r in HALF_SIZES:
            templates = _template_bank(shape, r, height, width)[rows]
            inter = templates @ flat
            union = templates.sum(axis=1) + area - inter
            score = max(score, float((inter / union).max()))
        best[shape] = score
    return best


def _read_element(pixels: np.ndarray, columns: slice, bg_rgb: np.ndarray) -> ElementReading:
    """Color, shape and per-frame centroid rows of the element in ``pixels[:, :, columns]``."""
    num_frames, height, width, _ = pixels.shape
    half = pixels[:, :, columns]
    flat = half.reshape(-1, 3)
    # Noise around the background spreads its few votes over many colors; the element's pixels agree.
    options = np.concatenate([bg_rgb[None, :], _FG_RGB])
    nearest = np.argmin(np.linalg.norm(flat[:, None, :] - options[None, :, :], axis=-1), axis=1)
    votes = np.bincount(nearest, minlength=len(options))[1:]
    if votes.sum() == 0:
        # No pixel is nearer a foreground color than the background: take the farthest pixels' color.
        far = flat[np.argsort(-np.linalg.norm(flat - bg_rgb, axis=1))[:16]]
        fg_index, fg_error = _nearest(np.median(far, axis=0), _FG_RGB)
    else:
        fg_index = int(np.argmax(votes))
        fg_error = float(np.linalg.norm(np.median(flat[nearest == fg_index + 1], axis=0) - _FG_RGB[fg_index]))
    fg_rgb = _FG_RGB[fg_index]
    # The mask is drawn on the whole frame width (zero outside the half) so the template bank's coordinates hold.
    masks = np.zeros((num_frames, height, width), dtype=bool)
    masks[:, :, columns] = np.linalg.norm(half - fg_rgb, axis=-1) < np.linalg.norm(half - bg_rgb, axis=-1)
    totals = dict.fromkeys(SHAPES, 0.0)
    rows: list[tuple[int, float]] = []
    for f in range(num_frames):
        if masks[f].sum() < MIN_AREA:
            continue
        for shape, score in _best_ious(masks[f]).items():
            totals[shape] += score
        rows.append((f, float(np.nonzero(masks[f])[0].mean())))
    scores = {s: (v / len(rows) if rows else 0.0) for s, v in totals.items()}
    return ElementReading(
        color=_FG_NAMES[fg_index],
        shape=max(SHAPES, key=lambda s: scores[s]),
        shape_scores=scores,
        color_error=fg_error,
        rows=rows,
    )


def _vertical_velocity(rows: list[tuple[int, float]]) -> float:
    """Least-squares slope of centroid row over frame (px/frame); 0 with fewer than two frames."""
    if len({f for f, _ in rows}) < 2:
        return 0.0
    t = np.asarray([f for f, _ in rows], dtype=np.float64)
    y = np.asarray([r for _, r in rows], dtype=np.float64)
    t = t - t.mean()
    return float((t * (y - y.mean())).sum() / (t * t).sum())


def read_clip(clip: np.ndarray) -> Reading:
    """Read both elements, the direction and the background from a uint8 ``(F, H, W, 3)`` clip."""
    if clip.ndim != 4 or clip.shape[-1] != 3:
        raise ValueError(f"expected (F, H, W, 3), got {clip.shape}")
    pixels = clip.astype(np.float32)
    bg_index, bg_error = _nearest(np.median(pixels.reshape(-1, 3), axis=0), _BG_RGB)
    bg_rgb = _BG_RGB[bg_index]
    left = _read_element(pixels, slice(0, SPLIT_X), bg_rgb)
    right = _read_element(pixels, slice(SPLIT_X, None), bg_rgb)
    velocity = _vertical_velocity(left.rows + right.rows)
    return Reading(
        attributes=Attributes(
            left_color=left.color,
            left_shape=left.shape,
            right_color=right.color,
            right_shape=right.shape,
            direction="down" if velocity > 0 else "up",
            background=_BG_NAMES[bg_index],
        ),
        left=left,
        right=right,
        velocity=velocity,
        background_error=bg_error,
    )


def compare(read: Attributes | Reading, expected: Attributes) -> dict[str, bool]:
    """Per-attribute correctness plus ``all``."""
    if isinstance(read, Reading):
        read = read.attributes
    got, want = read.as_dict(), expected.as_dict()
    result = {name: got[name] == want[name] for name in ATTRIBUTE_NAMES}
    result["all"] = all(result.values())
    return result


def accuracy(results: list[dict[str, bool]]) -> dict[str, float]:
    """Mean of each key of ``compare`` results."""
    if not results:
        return {}
    return {k: float(np.mean([r[k] for r in results])) for k in results[0]}
