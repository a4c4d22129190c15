"""Contact sheet: for a few prompts, the frames of each method side by side, labelled.

One *group* per prompt: a header line (the target prompt, and the donor's prompt when there is one), then one
row per method: a label cell (method name and what the checker read) and the clip's frames left to right,
each enlarged ``scale`` times with nearest-neighbour so single pixels stay visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

LABEL_WIDTH = 330
HEADER_HEIGHT = 30
GAP = 4
BACKGROUND = (255, 255, 255)
TEXT = (20, 20, 20)
GOOD = (0, 120, 0)
BAD = (190, 0, 0)


@dataclass(frozen=True)
class SheetRow:
    label: str  # method, e.g. "no reuse" or "Chorus 1/2/1 α=2"
    frames: np.ndarray  # uint8 (F, H, W, 3)
    detail: str = ""  # second label line, e.g. what the checker read
    correct: bool | None = None  # colours the detail line (None: neutral)


@dataclass(frozen=True)
class SheetGroup:
    title: str
    subtitle: str
    rows: Sequence[SheetRow]


def sheet_size(groups: Sequence[SheetGroup], scale: int) -> tuple[int, int]:
    """(width, height) in pixels of the sheet ``render_sheet`` draws for ``groups``."""
    frames, height, width = 0, 0, 0
    for g in groups:
        for r in g.rows:
            f, h, w, _ = r.frames.shape
            frames, height, width = max(frames, f), max(height, h), max(width, w)
    cell_w, cell_h = width * scale, height * scale
    total_w = LABEL_WIDTH + frames * (cell_w + GAP) + GAP
    total_h = GAP + sum(HEADER_HEIGHT + len(g.rows) * (cell_h + GAP) for g in groups)
    return total_w, total_h


def render_sheet(groups: Sequence[SheetGroup], scale: int = 3) -> Image.Image:
    if not groups or not any(g.rows for g in groups):
        raise ValueError("nothing to draw")
    size = sheet_size(groups, scale)
    sheet = Image.new("RGB", size, BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    cell_h = max(r.frames.shape[1] for g in groups for r in g.rows) * scale
    cell_w = max(r.frames.shape[2] for g in groups for r in g.rows) * scale
    y = GAP
    for g in groups:
        draw.text((GAP, y + 2), g.title, fill=TEXT, font=font)
        draw.text((GAP, y + 15), g.subtitle, fill=(90, 90, 90), font=font)
        y += HEADER_HEIGHT
        for row in g.rows:
            draw.text((GAP, y + 4), row.label, fill=TEXT, font=font)
            if row.detail:
                colour = TEXT if row.correct is None else (GOOD if row.correct else BAD)
                draw.text((GAP, y + 20), row.detail, fill=colour, font=font)
            for i, frame in enumerate(row.frames):
                img = Image.fromarray(np.ascontiguousarray(frame)).resize(
                    (frame.shape[1] * scale, frame.shape[0] * scale), Image.Resampling.NEAREST
                )
                sheet.paste(img, (LABEL_WIDTH + i * (cell_w + GAP), y))
            y += cell_h + GAP
    return sheet


def write_sheet(groups: Sequence[SheetGroup], path: Path, scale: int = 3) -> tuple[int, int]:
    """Render and save as PNG; returns the image size."""
    image = render_sheet(groups, scale)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG", optimize=True)
    return image.size
