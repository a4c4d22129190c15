"""MP4 and GIF encoding of engine frames."""

from __future__ import annotations

import numpy as np
import pytest

from workers.video import encode_video, read_video, write_video


def _frames(f: int = 6, h: int = 32, w: int = 32) -> np.ndarray:
    frames = np.zeros((f, h, w, 3), dtype=np.uint8)
    for i in range(f):
        frames[i, :, : (i + 1) * w // f] = (200, 30, 30)  # a red bar growing frame by frame
    return frames


@pytest.mark.parametrize("fmt", ["mp4", "gif"])
def test_round_trip(tmp_path, fmt):
    frames = _frames()
    path = write_video(frames, tmp_path / f"v.{fmt}", fps=8)
    back = read_video(path)
    assert back.shape == frames.shape
    assert np.abs(back.astype(int) - frames.astype(int)).mean() < 8


def test_mp4_signature_and_odd_sizes():
    data = encode_video(_frames(3, 17, 23), fmt="mp4", fps=16)
    assert data[4:8] == b"ftyp"


def test_gif_signature():
    assert encode_video(_frames(2), fmt="gif").startswith(b"GIF8")


@pytest.mark.parametrize(
    ("frames", "fmt"),
    [
        (np.zeros((2, 8, 8), np.uint8), "mp4"),
        (np.zeros((2, 8, 8, 3), np.float32), "mp4"),
        (np.zeros((0, 8, 8, 3), np.uint8), "gif"),
        (np.zeros((1, 8, 8, 3), np.uint8), "webm"),
    ],
)
def test_bad_input(frames, fmt):
    with pytest.raises(ValueError):
        encode_video(frames, fmt=fmt)
