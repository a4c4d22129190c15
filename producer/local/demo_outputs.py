"""What ``chorus demo`` writes to its output directory: the videos (``videos/<id>.mp4`` as the worker stored it and
a GIF made from it, enlarged), ``contact_sheet.png`` (a few frames per request, labelled) and ``summary.json``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from producer.local.demo_summary import DemoSummary, RequestSummary

if TYPE_CHECKING:
    from producer.local.stack import EmbeddedStack

CONTACT_FRAMES = 4
GIF_SCALE = 4


def write_videos(
    stack: EmbeddedStack, rows: list[RequestSummary], results: dict[str, Any], out: Path
) -> None:
    """Download each video from the object store (mp4 as stored) and write a GIF of it, enlarged."""
    import numpy as np

    from workers.video import encode_video, read_video

    store = stack.object_store()
    videos = out / "videos"
    videos.mkdir(parents=True, exist_ok=True)
    for i, row in enumerate(rows):
        result = results.get(row.request_id)
        if result is None or result.video_uri is None:
            continue
        data = store.get(store.key_of(result.video_uri))
        suffix = Path(result.video_uri).suffix or ".mp4"
        stored = videos / f"{row.request_id}{suffix}"
        stored.write_bytes(data)
        frames = read_video(stored)
        gif = videos / f"{row.request_id}.gif"
        if suffix != ".gif":
            big = np.repeat(np.repeat(frames, GIF_SCALE, axis=1), GIF_SCALE, axis=2)
            gif.write_bytes(encode_video(big, fmt="gif"))
        rows[i] = row.model_copy(
            update={
                "video_mp4": str(stored.relative_to(out)) if suffix == ".mp4" else None,
                "video_gif": str(gif.relative_to(out)),
            }
        )


def write_contact_sheet(rows: list[RequestSummary], out: Path, path: Path) -> Path | None:
    """One row per request: a label, then ``CONTACT_FRAMES`` frames spread over the clip, enlarged."""
    import numpy as np
    from PIL import Image, ImageDraw

    from workers.video import read_video

    clips: list[tuple[RequestSummary, Any]] = []
    for row in rows:
        source = row.video_mp4 or row.video_gif
        if source is None:
            continue
        frames = read_video(out / source)
        picks = np.linspace(0, len(frames) - 1, CONTACT_FRAMES).round().astype(int)
        clips.append((row, frames[picks]))
        picked = ", ".join(str(int(i)) for i in picks)
        total_frames = len(frames)
    if not clips:
        return None
    tile = 96
    label_w, gap, pad = 330, 4, 8
    row_h = tile + gap
    width = label_w + CONTACT_FRAMES * (tile + gap) + pad
    sheet = Image.new("RGB", (width, pad * 2 + 18 + row_h * len(clips)), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text(
        (pad, pad),
        f"frames {picked} of {total_frames}, enlarged; green: the request reused its donor",
        fill="gray",
    )
    for r, (row, frames) in enumerate(clips):
        y = pad + 18 + r * row_h
        donor = (
            f"donor {row.donor_request_id} ({row.donor_similarity:.2f})"
            if row.donor_request_id and row.donor_similarity is not None
            else "no donor"
        )
        lines = [
            f"family {row.family} · {row.kind} · seed {row.seed}",
            row.prompt[:60],
            (
                f"EXACT: the video of {row.donor_request_id}"
                if row.reuse_kind == "exact"
                else f"HIT {donor}"
                if row.hit
                else donor
                if row.reuse == "auto"
                else "reuse off"
            ),
            f"computed {row.steps_computed}/{row.steps_requested} steps, "
            f"{row.tokens_computed_fraction:.0%} tokens, {row.denoise_s:.2f} s",
        ]
        for j, text in enumerate(lines):
            draw.text((pad, y + 4 + 16 * j), text, fill="black" if j != 2 or not row.hit else "darkgreen")
        for k, frame in enumerate(frames):
            img = Image.fromarray(frame).resize((tile, tile), Image.Resampling.NEAREST)
            sheet.paste(img, (label_w + k * (tile + gap), y))
    sheet.save(path)
    return path


def write_summary(summary: DemoSummary, out: Path) -> Path:
    """Write ``summary.json`` into ``out``; returns its path."""
    path = out / "summary.json"
    path.write_text(summary.model_dump_json(indent=2))
    return path
