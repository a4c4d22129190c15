"""The contact sheet has the size its layout promises."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from workers.bench.contact import (
    GAP,
    HEADER_HEIGHT,
    LABEL_WIDTH,
    SheetGroup,
    SheetRow,
    sheet_size,
    write_sheet,
)


def test_sheet_size(tmp_path: Path) -> None:
    clip = np.zeros((8, 32, 32, 3), dtype=np.uint8)
    clip[:, 8:16, 8:16] = (255, 0, 0)
    groups = [
        SheetGroup(
            "a red square", "donor: a blue square", [SheetRow("no reuse", clip, "all correct", True)] * 3
        ),
        SheetGroup("another", "", [SheetRow("Chorus 1/2/1", clip, "wrong: color", False)] * 2),
    ]
    scale = 3
    expected = (LABEL_WIDTH + 8 * (32 * scale + GAP) + GAP, GAP + 2 * HEADER_HEIGHT + 5 * (32 * scale + GAP))
    assert sheet_size(groups, scale) == expected
    path = tmp_path / "sheet.png"
    assert write_sheet(groups, path, scale) == expected
    with Image.open(path) as image:
        assert image.size == expected
        # the first frame of the first row is where the layout says, enlarged with nearest-neighbour
        y0, x0 = GAP + HEADER_HEIGHT, LABEL_WIDTH
        assert image.getpixel((x0 + 8 * scale + 1, y0 + 8 * scale + 1)) == (255, 0, 0)
        assert image.getpixel((x0 + 1, y0 + 1)) == (0, 0, 0)
