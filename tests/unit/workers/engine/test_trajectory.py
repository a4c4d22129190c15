"""Trajectory serialization: whole and per-step forms round-trip to the same data; corruption is detected."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.contract import ReusePlan
from workers.engine import (
    CorruptTrajectory,
    DonorUnavailable,
    StepRecord,
    Trajectory,
    TrajectoryMeta,
    decode_header,
    decode_step,
    encode_header,
    encode_step,
)


@pytest.fixture(scope="module")
def traj(engine) -> Trajectory:
    from producer.contract import build_request

    request = build_request(
        prompt="a red circle moving left",
        model="tiny-random-wan",
        num_frames=2,
        height=32,
        width=32,
        num_steps=3,
        seed=1,
    )
    donor = engine.generate(request, ReusePlan.full(3)).trajectory
    other = build_request(
        prompt="a blue circle moving left",
        model="tiny-random-wan",
        num_frames=2,
        height=32,
        width=32,
        num_steps=3,
        seed=2,
    )
    return engine.generate(
        other, ReusePlan(stage1_steps=1, stage2_steps=1, stage3_steps=1), donor=donor
    ).trajectory


def _assert_equal(a: Trajectory, b: Trajectory, atol: float = 0.0) -> None:
    assert a.meta == b.meta
    torch.testing.assert_close(a.initial, b.initial, atol=atol, rtol=0)
    assert len(a.steps) == len(b.steps)
    for x, y in zip(a.steps, b.steps, strict=True):
        assert x.scalars() == y.scalars()
        for name, t in x.tensors().items():
            torch.testing.assert_close(t, y.tensors()[name], atol=atol, rtol=0)


def test_whole_round_trip_fp32_is_exact(traj, tmp_path):
    back = Trajectory.from_bytes(traj.to_bytes())
    _assert_equal(back, traj)
    assert back.steps[0].attn_maps is None and back.steps[1].attn_maps is not None
    n = traj.save(tmp_path / "t.safetensors")
    assert n == (tmp_path / "t.safetensors").stat().st_size
    _assert_equal(Trajectory.load(tmp_path / "t.safetensors"), traj)


def test_fp16_round_trip_is_close_and_half_the_size(traj):
    blob16 = traj.to_bytes("float16")
    back = Trajectory.from_bytes(blob16)
    _assert_equal(back, traj, atol=2e-3 * max(1.0, float(traj.initial.abs().max())))
    assert back.initial.dtype == torch.float32
    assert traj.nbytes("float16") * 2 == traj.nbytes("float32")
    assert len(blob16) < 0.6 * len(traj.to_bytes())
    assert traj.nbytes("float32") < len(traj.to_bytes()) < traj.nbytes("float32") + 20_000


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_streamed_form_equals_whole_form(traj, dtype):
    parts = [encode_step(r, dtype) for r in traj.steps]
    streamed = Trajectory.from_parts(encode_header(traj, storage_dtype=dtype), parts)
    whole = Trajectory.from_bytes(traj.to_bytes(dtype))
    _assert_equal(streamed, whole)
    assert streamed.to_bytes() == whole.to_bytes()  # deterministic bytes
    meta, initial = decode_header(encode_header(traj.meta, traj.initial))
    assert meta == traj.meta and torch.equal(initial, traj.initial)


def test_trajectory_is_a_donor_source_that_reports_missing_steps(traj):
    partial = Trajectory(traj.meta, traj.initial, traj.steps[:1])
    assert partial.step(0) is traj.steps[0]
    with pytest.raises(DonorUnavailable):
        partial.step(1)
    with pytest.raises(IndexError):
        partial.step(99)
    with pytest.raises(ValueError):
        partial.append(traj.steps[2])


def _flip(blob: bytes, at: int) -> bytes:
    b = bytearray(blob)
    b[at] ^= 0x01
    return bytes(b)


def test_corruption_is_detected(traj):
    whole = traj.to_bytes()
    step = encode_step(traj.steps[1])
    header = encode_header(traj)
    cases = {
        "tensor byte flipped": lambda: Trajectory.from_bytes(_flip(whole, len(whole) - 10)),
        "step tensor byte flipped": lambda: decode_step(_flip(step, len(step) - 3)),
        "header tensor byte flipped": lambda: decode_header(_flip(header, len(header) - 1)),
        "truncated": lambda: Trajectory.from_bytes(whole[: len(whole) // 2]),
        "garbage": lambda: decode_step(b"not a trajectory at all"),
        "empty": lambda: decode_step(b""),
        "step given as trajectory": lambda: Trajectory.from_bytes(step),
        "trajectory given as step": lambda: decode_step(whole),
    }
    for name, call in cases.items():
        with pytest.raises(CorruptTrajectory):
            call()
            pytest.fail(name)


def test_metadata_tampering_is_detected(traj):
    blob = encode_step(traj.steps[1])
    at = blob.index(b"2", blob.index(b"stage"))  # the stage number inside the (escaped) JSON header
    tampered = blob[:at] + b"3" + blob[at + 1 :]
    with pytest.raises(CorruptTrajectory, match="sha256"):
        decode_step(tampered)


def test_compat_key_names_model_shape_steps_scheduler(traj):
    key = traj.meta.compat_key
    assert key.startswith("tiny-random-wan|") and "|f2|32x32|" in key and "|s3|" in key
    assert dataclasses.replace(traj.meta, num_steps=4).compat_key != key
    assert TrajectoryMeta.from_json(traj.meta.to_json()) == traj.meta
    with pytest.raises(CorruptTrajectory):
        TrajectoryMeta.from_json('{"model": 1}')


finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@st.composite
def records(draw):
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=4)))
    n = 1
    for s in shape:
        n *= s
    lat = torch.tensor(draw(st.lists(finite, min_size=n, max_size=n))).reshape(shape)
    out = torch.tensor(draw(st.lists(finite, min_size=n, max_size=n))).reshape(shape)
    maps = None
    if draw(st.booleans()):
        v, s = draw(st.integers(1, 3)), draw(st.integers(1, 5))
        maps = torch.tensor(
            draw(st.lists(st.floats(0, 1, width=32), min_size=v * s, max_size=v * s))
        ).reshape(v, s)
    return StepRecord(
        index=draw(st.integers(0, 999)),
        timestep=draw(st.floats(0, 1000, allow_nan=False)),
        latent_after=lat,
        model_output=out,
        attn_maps=maps,
        stage=draw(st.sampled_from([1, 2, 3])),
        active_fraction=draw(st.floats(0, 1)),
    )


@settings(max_examples=80, deadline=None)
@given(rec=records())
def test_step_encoding_round_trips(rec):
    back = decode_step(encode_step(rec))
    assert back.scalars() == rec.scalars()
    for name, t in rec.tensors().items():
        assert torch.equal(back.tensors()[name], t)
    half = decode_step(encode_step(rec, "float16"))
    for name, t in rec.tensors().items():
        torch.testing.assert_close(half.tensors()[name], t.half().float())


@settings(max_examples=80, deadline=None)
@given(blob=st.binary(max_size=300))
def test_decoding_arbitrary_bytes_raises_only_corrupt_trajectory(blob):
    for decode in (decode_step, decode_header, Trajectory.from_bytes):
        with pytest.raises(CorruptTrajectory):
            decode(blob)


def test_compat_key_in_metadata_is_checked(traj):
    text = traj.meta.to_json().replace('"compat_key": "tiny-random-wan|', '"compat_key": "toy|')
    with pytest.raises(CorruptTrajectory, match="compat_key"):
        TrajectoryMeta.from_json(text)
