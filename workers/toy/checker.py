"""Reads a toy-world clip's attributes back from its pixels alone.

Deterministic and model-agnostic: it sees only a uint8 ``(F, H, W, 3)`` array.

1. Background: the per-channel median of all pixels (the shape covers under a quarter of the frame), snapped to
   the nearest background palette color.
2. Foreground color: every pixel votes for its nearest color among that background color and the foreground
   palette; the foreground color with the most votes wins.
3. Shape mask: each pixel is foreground when it is closer to the read foreground color than to the background one.
4. Shape: for every frame, the best intersection-over-union of the mask with each shape's ideal mask over a window
   of centers and sizes around the mask's centroid; the shape with the highest mean best-IoU over frames wins.
5. Direction: a least-squares line through the per-frame mask centroids; the dominant axis and its sign.
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
    Attributes,
    shape_mask,
)

# Frames whose mask has fewer pixels than this are ignored for shape and motion.
MIN_AREA = 12
HALF_SIZES = tuple(range(HALF_SIZE - 2, HALF_SIZE + 3))

_FG_NAMES = list(FG_COLORS)
_FG_RGB = np.asarray([FG_COLORS[n] for n in _FG_NAMES], dtype=np.float32)
_BG_NAMES = list(BG_COLORS)
_BG_RGB = np.asarray([BG_COLORS[n] for n in _BG_NAMES], dtype=np.float32)


@dataclass
class Reading:
    """What the checker read, plus the evidence it used."""

    attributes: Attributes
    # Mean best IoU per shape (higher is better); the chosen shape has the highest.
    shape_scores: dict[str, float] = field(default_factory=dict)
    # Least-squares motion in px/frame.
    velocity: tuple[float, float] = (0.0, 0.0)
    # RGB distance between the measured median color and the palette color it was snapped to.
    color_error: float = 0.0
    background_error: float = 0.0
    # Frames whose mask was large enough to read shape and motion from.
    frames_used: int = 0


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


def _best_ious(mask: np.ndarray, height: int, width: int) -> dict[str, float]:
    """Best IoU of one frame's mask with each shape over centers near its centroid and a range of sizes."""
    ys, xs = np.nonzero(mask)
    my, mx = float(ys.mean()), float(xs.mean())
    # A triangle's centroid sits below its bounding-box center by about a third of the half size.
    cxs = np.arange(round(mx) - 2, round(mx) + 3)
    cys = np.arange(round(my) - 5, round(my) + 3)
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


def read_clip(clip: np.ndarray) -> Reading:
    """Read color, shape, direction and background from a uint8 ``(F, H, W, 3)`` clip."""
    if clip.ndim != 4 or clip.shape[-1] != 3:
        raise ValueError(f"expected (F, H, W, 3), got {clip.shape}")
    pixels = clip.astype(np.float32)
    num_frames, height, width, _ = pixels.shape
    flat = pixels.reshape(-1, 3)

    bg_index, bg_error = _nearest(np.median(flat, axis=0), _BG_RGB)
    bg_rgb = _BG_RGB[bg_index]
    # Every pixel votes for its nearest color among the background and all foreground colors; the foreground
    # color with most votes wins (noise around the background spreads its few votes over many colors).
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

    d_fg = np.linalg.norm(pixels - fg_rgb, axis=-1)
    d_bg = np.linalg.norm(pixels - bg_rgb, axis=-1)
    masks = d_fg < d_bg  # (F, H, W)

    totals = dict.fromkeys(SHAPES, 0.0)
    centroids: list[tuple[float, float, float]] = []
    for f in range(num_frames):
        if masks[f].sum() < MIN_AREA:
            continue
        for shape, score in _best_ious(masks[f], height, width).items():
            totals[shape] += score
        ys, xs = np.nonzero(masks[f])
        centroids.append((float(f), float(xs.mean()), float(ys.mean())))
    used = len(centroids)
    shape_scores = {s: (v / used if used else 0.0) for s, v in totals.items()}
    shape = max(SHAPES, key=lambda s: shape_scores[s])

    vx = vy = 0.0
    if used >= 2:
        t = np.asarray([c[0] for c in centroids])
        t = t - t.mean()
        denom = float((t * t).sum())
        vx = float((t * np.asarray([c[1] for c in centroids])).sum() / denom)
        vy = float((t * np.asarray([c[2] for c in centroids])).sum() / denom)
    if abs(vx) >= abs(vy):
        direction = "right" if vx > 0 else "left"
    else:
        direction = "down" if vy > 0 else "up"

    return Reading(
        attributes=Attributes(
            color=_FG_NAMES[fg_index], shape=shape, direction=direction, background=_BG_NAMES[bg_index]
        ),
        shape_scores=shape_scores,
        velocity=(vx, vy),
        color_error=fg_error,
        background_error=bg_error,
        frames_used=used,
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
