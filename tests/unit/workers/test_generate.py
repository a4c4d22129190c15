"""``chorus generate`` (``workers/generate.py``) on the tiny model."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from producer.cli import app
from workers.video import read_video

runner = CliRunner()
SMALL = ["-m", "tiny-random-wan", "-n", "4", "--frames", "4", "--height", "32", "--width", "32"]


def test_generate_then_reuse(tmp_path):
    video = tmp_path / "a.mp4"
    traj = tmp_path / "a.safetensors"
    r = runner.invoke(
        app,
        [
            "generate",
            "-p",
            "a red circle moving left",
            *SMALL,
            "-o",
            str(video),
            "--save-trajectory",
            str(traj),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["steps_computed"] == 4 and summary["trajectory_bytes"] == traj.stat().st_size
    assert (summary["reuse"], summary["seed_honoured"]) == ("none", True)
    assert read_video(video).shape == (4, 32, 32, 3)

    gif = tmp_path / "b.gif"
    r = runner.invoke(
        app,
        [
            "generate",
            "-p",
            "a blue circle moving left",
            *SMALL,
            "-o",
            str(gif),
            "--donor",
            str(traj),
            "--k1",
            "1",
            "--k2",
            "2",
            "--alpha",
            "2",
            "--max-active",
            "0.5",
            "--no-verify",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["donor"] is not None and summary["steps_computed"] == 3
    assert (summary["reuse"], summary["seed_honoured"]) == ("stage1", True)  # the donor's seed is this one's
    assert summary["tokens_computed_fraction"] <= (0 + 0.5 + 0.5 + 1) / 4 + 1e-9
    assert summary["verification"] is None
    assert gif.read_bytes().startswith(b"GIF8")


def _reuse(tmp_path, *extra):
    traj = tmp_path / "donor.safetensors"
    if not traj.exists():
        args = ["generate", "-p", "a red circle", *SMALL, "-o", str(tmp_path / "d.mp4"), "--save-trajectory"]
        assert runner.invoke(app, [*args, str(traj)]).exit_code == 0
    args = ["generate", "-p", "a blue circle", *SMALL, "-o", str(tmp_path / "t.mp4"), "--donor", str(traj)]
    return runner.invoke(app, [*args, "--k1", "2", "--k2", "1", *extra])


def test_generate_checks_the_donor_with_the_model_and_says_what_it_decided(tmp_path):
    r = _reuse(tmp_path, "--verify-accept", "1000", "--verify-shorten", "1000", "--json")
    assert r.exit_code == 0, r.output
    accepted = json.loads(r.stdout)
    assert accepted["verification"]["decision"] == "accepted" and accepted["steps_computed"] == 2

    r = _reuse(tmp_path, "--verify-accept", "0", "--verify-shorten", "0")
    assert r.exit_code == 0, r.output
    assert "rejected: prediction change" in r.output and "computed in full" in r.output
    assert "4/4 computed" in r.output

    r = _reuse(tmp_path, "--verify-accept", "0.5", "--verify-shorten", "0.1")
    assert r.exit_code == 2 and "--verify-shorten" in r.output


def test_generate_rejects_bad_input(tmp_path):
    r = runner.invoke(app, ["generate", "-p", "x", "-m", "tiny-random-wan", "--height", "17"])
    assert r.exit_code == 2 and "multiple of 16" in r.output
    r = runner.invoke(app, ["generate", "-p", "x", *SMALL, "--k1", "1"])
    assert r.exit_code == 2 and "--donor" in r.output
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    r = runner.invoke(app, ["generate", "-p", "x", *SMALL, "--donor", str(bad)])
    assert r.exit_code == 2 and "cannot read donor" in r.output
    r = runner.invoke(app, ["generate", "-p", "x", *SMALL, "--format", "avi"])
    assert r.exit_code == 2


def test_generate_refuses_outputs_and_devices_it_cannot_use_before_the_model_runs(tmp_path):
    missing = tmp_path / "no-such-folder"
    cases = [
        (
            ["-o", str(missing / "v.mp4")],
            f"--output {missing / 'v.mp4'}: the folder {missing} does not exist",
        ),
        (
            ["-o", str(tmp_path / "v.mp4"), "--save-trajectory", str(missing / "t.safetensors")],
            "--save-trajectory",
        ),
        (["-o", str(tmp_path)], "is a directory"),
        (["-o", "/proc/chorus-video.mp4"], "/proc/chorus-video.mp4: cannot be written"),  # even for root
        (["-o", str(tmp_path / "v.avi")], "the output's suffix .avi is not a format Chorus writes"),
        (
            ["--format", "gif", "-o", str(tmp_path / "v.mp4")],
            "--format gif disagrees with the output's suffix",
        ),
        (["--device", "banana"], "device 'banana' is not a torch device"),
        # refused here with or without CUDA: built without it, or fewer than 100 devices
        (["-o", str(tmp_path / "v.mp4"), "--device", "cuda:99"], "device 'cuda:99'"),
    ]
    for extra, says in cases:
        r = runner.invoke(app, ["generate", "-p", "x", *SMALL, *extra])
        assert r.exit_code == 2, (extra, r.output)
        assert says in r.output and len(r.output.strip().splitlines()) == 1, (extra, r.output)
        assert "Traceback" not in r.output
    r = runner.invoke(app, ["generate", "-p", "x", *SMALL, "--fps", "0"])  # 0 was taken as "the model's"
    assert r.exit_code == 2 and "--fps" in r.output
    # the trajectory folder was checked before any work: no video was written for the run that named it
    assert not (tmp_path / "v.mp4").exists()


def test_generate_says_when_the_video_starts_from_another_seeds_donor(tmp_path):
    r = _reuse(tmp_path, "--seed", "2", "--no-verify", "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert (summary["reuse"], summary["seed_honoured"]) == ("stage1", False)  # the donor was seed 0
    r = _reuse(tmp_path, "--seed", "2", "--no-verify")
    assert r.exit_code == 0 and "seed 2 (the donor's: another sample)" in " ".join(r.output.split())


def test_a_stage_2_only_reuse_starts_from_the_donors_noise_and_says_so(tmp_path):
    # k1 = 0: no step of the donor's is replayed, but the kept tokens are the donor's, grown from its noise
    r = _reuse(
        tmp_path, "--seed", "2", "--k1", "0", "--k2", "2", "--max-active", "0.5", "--no-verify", "--json"
    )
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["steps_computed"] == 4 and summary["tokens_computed_fraction"] < 1.0
    assert (summary["reuse"], summary["seed_honoured"]) == ("stage2", False)  # the donor was seed 0
    r = _reuse(
        tmp_path, "--seed", "0", "--k1", "0", "--k2", "2", "--max-active", "0.5", "--no-verify", "--json"
    )
    assert r.exit_code == 0 and json.loads(r.stdout)["seed_honoured"] is True  # the same seed's noise


def test_a_donor_that_started_from_another_donor_cannot_vouch_for_its_noise(tmp_path):
    _reuse(tmp_path)  # the first donor, seed 0
    second = tmp_path / "second.safetensors"
    r = _reuse(tmp_path, "--no-verify", "--save-trajectory", str(second))
    assert r.exit_code == 0, r.output
    args = ["generate", "-p", "a green circle", *SMALL, "-o", str(tmp_path / "g.mp4"), "--donor", str(second)]
    r = runner.invoke(app, [*args, "--k1", "2", "--k2", "1", "--no-verify", "--json"])
    assert r.exit_code == 0, r.output
    # its record names only its own request's seed (0), not the seed of the noise it started from
    assert json.loads(r.stdout)["seed_honoured"] is False


def test_generate_with_the_toy_model_prints_only_its_own_lines(tmp_path):
    """A fresh process, as a user runs it: no transformers progress bar while MiniLM loads, no diffusers warning
    about casting a float32 model to float32, no tokenizer warning for a prompt longer than BERT's positions."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    long_prompt = " ".join(["1 2 3 4 5 6 7 8 9 0"] * 95)  # > 512 tokens, < 2000 characters
    run = subprocess.run(
        [
            str(Path(sys.executable).parent / "chorus"),
            "generate",
            "-p",
            long_prompt,
            "-o",
            str(tmp_path / "t.mp4"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "COLUMNS": "200"},
    )
    assert run.returncode == 0, run.stderr
    said = run.stdout + run.stderr
    for noise in ("Loading weights", "should be kept in float32", "Token indices sequence length"):
        assert noise not in said, said
    assert "prompt truncated" in said  # what the user does need to know
