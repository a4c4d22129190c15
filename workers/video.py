"""Encode uint8 frames ``(F, H, W, 3)`` as MP4 (H.264, in process with PyAV's bundled FFmpeg) or GIF (Pillow).

``encode_video(frames, fmt="mp4", fps=8) -> bytes`` is what the workers upload; ``write_video`` writes a file.
H.264 in yuv420p needs even sides, so odd-sized frames are padded by repeating the last row/column.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Literal

import numpy as np

log = logging.getLogger(__name__)

VideoFormat = Literal["mp4", "gif"]
FORMATS: tuple[VideoFormat, ...] = ("mp4", "gif")
CONTENT_TYPES: dict[str, str] = {"mp4": "video/mp4", "gif": "image/gif"}


def _check(frames: np.ndarray) -> np.ndarray:
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be (F, H, W, 3), got {frames.shape}")
    if frames.shape[0] == 0:
        raise ValueError("no frames")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8, got {frames.dtype}")
    return np.ascontiguousarray(frames)


# x264's "veryfast" preset at the same CRF: about the size of "medium"'s file (toy clips: 3.9 vs 4.0 kB) for 30-40%
# less encoding time. Frames this small gain nothing from x264's threads: starting them cost more than they gave
# (8 toy frames of 32x32: 2.1 ms on one thread, 3.6 ms on x264's own count, 2 cores).
_X264_PRESET = "veryfast"
_ONE_THREAD_MAX_PIXELS = 256 * 256


def _encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    # In process (PyAV, libx264): spawning an ffmpeg process per video cost ~70 ms, half of a toy request.
    import av

    _, h, w, _ = frames.shape
    pad_h, pad_w = h % 2, w % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    # +faststart moves the index to the front (players start before the end arrives); it rewrites the file,
    # so the muxer needs a path, not a buffer.
    with tempfile.TemporaryDirectory(prefix="chorus-video-") as tmp:
        path = Path(tmp) / "video.mp4"
        with av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
            stream = container.add_stream("libx264", rate=fps)
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": "18", "preset": _X264_PRESET}
            if w * h <= _ONE_THREAD_MAX_PIXELS:
                stream.thread_count = 1
            for frame in frames:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode(None))
        return path.read_bytes()


def _encode_gif(frames: np.ndarray, fps: int) -> bytes:
    import imageio.v3 as iio

    data = iio.imwrite("<bytes>", frames, extension=".gif", duration=round(1000 / fps), loop=0)
    return bytes(data)


def encode_video(frames: np.ndarray, fmt: str = "mp4", fps: int = 8) -> bytes:
    """The frames as an ``fmt`` ("mp4" or "gif") file, in memory."""
    frames = _check(frames)
    if fps <= 0:
        raise ValueError("fps must be positive")
    if fmt == "mp4":
        data = _encode_mp4(frames, fps)
    elif fmt == "gif":
        data = _encode_gif(frames, fps)
    else:
        raise ValueError(f"unknown video format {fmt!r} (known: {', '.join(FORMATS)})")
    log.debug("frames encoded", extra={"frames": list(frames.shape), "format": fmt, "bytes": len(data)})
    return data


def write_video(frames: np.ndarray, path: Path, *, fmt: str | None = None, fps: int = 8) -> Path:
    """Write the frames to ``path``; the format defaults to the path's suffix (mp4 when it has none)."""
    path = Path(path)
    fmt = fmt or (path.suffix.lstrip(".").lower() or "mp4")
    path.write_bytes(encode_video(frames, fmt=fmt, fps=fps))
    return path


def read_video(path: Path) -> np.ndarray:
    """Decode a video file back to uint8 frames (for tests and checks)."""
    import imageio.v3 as iio

    path = Path(path)
    if path.suffix.lower() == ".mp4":
        import imageio_ffmpeg

        reader = imageio_ffmpeg.read_frames(str(path))
        meta = reader.__next__()
        w, h = meta["size"]
        frames = [np.frombuffer(f, dtype=np.uint8).reshape(h, w, 3) for f in reader]
        return np.stack(frames)
    arr = iio.imread(path, index=None)
    return np.asarray(arr)[..., :3]
