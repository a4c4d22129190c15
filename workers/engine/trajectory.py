"""A request's denoising trajectory: what a later request needs to reuse its work.

Per step ``i`` (0-based, in scheduler order) a ``StepRecord`` holds

- ``latent_after``: the latent after step ``i`` (``(C, F', H', W')``, float32, no batch dimension);
- ``model_output``: the velocity the scheduler consumed at step ``i`` (after classifier-free guidance);
- ``attn_maps``: ``(V, S)`` cross-attention maps, one row per *valid* prompt token of this request (in prompt
  order, padding dropped) over the ``S = F'/pt · H'/ph · W'/pw`` latent tokens: the softmax attention probability
  of each latent token on that prompt token, averaged over heads and blocks, conditional branch only. ``None``
  where the step was not computed (Stage 1).

plus ``TrajectoryMeta`` (model, weights, shape, scheduler hash, prompt, token ids, ...) and the initial latent.

Two serialized forms, both safetensors with a sha256 over tensors and metadata:

- whole: ``Trajectory.to_bytes()`` / ``Trajectory.from_bytes()`` (``save``/``load`` for files);
- streamed: ``encode_header(traj)`` once, then ``encode_step(record)`` per finished step; a reader rebuilds with
  ``decode_header`` + ``decode_step`` (or ``Trajectory.from_parts``). Both forms decode to the same data, and
  ``decode_head`` reads either as a trajectory's first object (a header, or the whole trajectory).

``storage_dtype="float16"`` halves the size; decoding always returns float32 tensors. Anything that does not
decode or does not match its checksum raises ``CorruptTrajectory``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from workers.engine.errors import CorruptTrajectory, DonorUnavailable, IncompatibleDonor

log = logging.getLogger(__name__)

StorageDType = Literal["float32", "float16"]
FORMAT_VERSION = 1
_STORAGE: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class TrajectoryMeta:
    """Everything about a trajectory except its tensors. JSON-serializable."""

    request_id: str
    model: str
    weights_id: str
    num_frames: int
    height: int
    width: int
    latent_shape: tuple[int, ...]
    token_grid: tuple[int, int, int]
    num_steps: int
    scheduler: str
    scheduler_hash: str
    timesteps: tuple[float, ...]
    prompt: str
    negative_prompt: str | None
    guidance_scale: float
    seed: int
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    valid: tuple[bool, ...]
    dtype: str
    # request id of the donor whose initial latent and Stage-1 steps this trajectory starts with, if any
    initial_from: str | None = None
    format_version: int = FORMAT_VERSION

    @property
    def compat_key(self) -> str:
        """Equal keys ⇔ the trajectories are interchangeable (model, weights, shape, steps, scheduler)."""
        c, f, h, w = self.latent_shape
        return (
            f"{self.model}|w:{self.weights_id[:16]}|f{self.num_frames}|{self.height}x{self.width}"
            f"|l{c}x{f}x{h}x{w}|s{self.num_steps}|sch:{self.scheduler_hash[:16]}"
        )

    @property
    def valid_positions(self) -> list[int]:
        """Positions (in the padded prompt) of the rows of ``attn_maps``."""
        return [i for i, v in enumerate(self.valid) if v]

    @property
    def num_tokens(self) -> int:
        f, h, w = self.token_grid
        return f * h * w

    def to_json(self) -> str:
        """JSON of every field plus the derived ``compat_key`` (checked, not trusted, when read back)."""
        return json.dumps({**asdict(self), "compat_key": self.compat_key}, sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> TrajectoryMeta:
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise TypeError("metadata is not an object")
            claimed_key = raw.pop("compat_key", None)
            names = {f.name for f in fields(cls)}
            unknown = set(raw) - names
            if unknown:
                raise TypeError(f"unknown metadata fields {sorted(unknown)}")
            for key in ("latent_shape", "token_grid", "timesteps", "token_ids", "tokens", "valid"):
                raw[key] = tuple(raw[key])
            meta = cls(**raw)
            if claimed_key is not None and claimed_key != meta.compat_key:
                raise ValueError(
                    f"compat_key {claimed_key!r} does not match the fields ({meta.compat_key!r})"
                )
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptTrajectory(f"trajectory metadata does not decode: {exc}") from None
        if meta.format_version != FORMAT_VERSION:
            raise CorruptTrajectory(f"unsupported trajectory format_version {meta.format_version}")
        return meta


def check_compatible(donor: TrajectoryMeta, target: TrajectoryMeta) -> None:
    """Raise ``IncompatibleDonor`` naming every difference that makes ``donor`` unusable for ``target``."""
    problems = []
    for name in ("model", "weights_id", "num_frames", "height", "width", "latent_shape", "num_steps"):
        a, b = getattr(donor, name), getattr(target, name)
        if a != b:
            problems.append(f"{name}: donor {a!r} != request {b!r}")
    if donor.scheduler != target.scheduler or donor.scheduler_hash != target.scheduler_hash:
        problems.append(
            f"scheduler: donor {donor.scheduler}#{donor.scheduler_hash[:12]} != "
            f"request {target.scheduler}#{target.scheduler_hash[:12]}"
        )
    elif not problems and any(
        not math.isclose(a, b, rel_tol=0, abs_tol=1e-4)
        for a, b in zip(donor.timesteps, target.timesteps, strict=False)
    ):
        problems.append("timesteps differ")
    if problems:
        raise IncompatibleDonor(
            f"donor {donor.request_id} cannot serve request {target.request_id}: " + "; ".join(problems)
        )


@dataclass
class StepRecord:
    """What one denoising step leaves behind (see the module docstring). Tensors live on the CPU."""

    index: int
    timestep: float
    latent_after: torch.Tensor
    model_output: torch.Tensor
    attn_maps: torch.Tensor | None = None
    stage: int = 3
    # fraction of latent tokens this request computed at this step (0 for Stage 1, 1 for a full step)
    active_fraction: float = 1.0

    def scalars(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "timestep": self.timestep,
            "stage": self.stage,
            "active_fraction": self.active_fraction,
            "has_maps": self.attn_maps is not None,
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"latent_after": self.latent_after, "model_output": self.model_output}
        if self.attn_maps is not None:
            out["attn_maps"] = self.attn_maps
        return out


@runtime_checkable
class DonorSource(Protocol):
    """Where the engine reads a donor trajectory from.

    Any method MAY block (a streaming source waiting for a still-running leader to upload a step) and MAY raise
    ``DonorUnavailable`` (or ``CorruptTrajectory``); the engine then falls back to computing in full. The engine
    reads ``metadata()`` first, ``initial_latent()`` and ``step(i)`` for ``i < k1`` before Stage 2, then
    ``step(i)`` for each Stage-2 step in increasing order (and, for the mask, the nearest earlier step that has
    attention maps — it caches those, so each step is normally read once).
    """

    def metadata(self) -> TrajectoryMeta: ...

    def initial_latent(self) -> torch.Tensor: ...

    def step(self, index: int) -> StepRecord: ...


@dataclass
class Trajectory:
    """An in-memory trajectory; a ``DonorSource``. Built step by step by ``Engine.generate``."""

    meta: TrajectoryMeta
    initial: torch.Tensor
    steps: list[StepRecord] = field(default_factory=list)

    # --- DonorSource -------------------------------------------------------------------------------
    def metadata(self) -> TrajectoryMeta:
        return self.meta

    def initial_latent(self) -> torch.Tensor:
        return self.initial

    def step(self, index: int) -> StepRecord:
        if not 0 <= index < self.meta.num_steps:
            raise IndexError(f"step {index} out of range 0..{self.meta.num_steps - 1}")
        if index >= len(self.steps):
            raise DonorUnavailable(f"step {index} of {self.meta.request_id} is not recorded yet")
        return self.steps[index]

    # --- convenience ---------------------------------------------------------------------------------
    def latent_after(self, index: int) -> torch.Tensor:
        return self.step(index).latent_after

    def model_output(self, index: int) -> torch.Tensor:
        return self.step(index).model_output

    def attn_maps(self, index: int) -> torch.Tensor | None:
        return self.step(index).attn_maps

    @property
    def complete(self) -> bool:
        return len(self.steps) == self.meta.num_steps

    def append(self, record: StepRecord) -> None:
        if record.index != len(self.steps):
            raise ValueError(f"expected step {len(self.steps)}, got {record.index}")
        self.steps.append(record)

    def nbytes(self, storage_dtype: StorageDType = "float32") -> int:
        """Tensor payload bytes when stored in ``storage_dtype`` (the serialized size adds a small header)."""
        item = _item_size(storage_dtype)
        n = self.initial.numel()
        for rec in self.steps:
            n += sum(t.numel() for t in rec.tensors().values())
        return n * item

    # --- whole-trajectory serialization ------------------------------------------------------------
    def to_bytes(self, storage_dtype: StorageDType = "float32") -> bytes:
        tensors = {"initial_latent": _store(self.initial, storage_dtype)}
        for rec in self.steps:
            for name, t in rec.tensors().items():
                tensors[f"steps.{rec.index}.{name}"] = _store(t, storage_dtype)
        meta = {
            "chorus.format": "trajectory/1",
            "chorus.meta": self.meta.to_json(),
            "chorus.steps": json.dumps([r.scalars() for r in self.steps]),
            "chorus.storage_dtype": storage_dtype,
        }
        return _seal(tensors, meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> Trajectory:
        return cls._from_opened(*_open(data, "trajectory/1"))

    @classmethod
    def _from_opened(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> Trajectory:
        tmeta = TrajectoryMeta.from_json(meta["chorus.meta"])
        try:
            scalars = json.loads(meta["chorus.steps"])
            traj = cls(tmeta, _need(tensors, "initial_latent"))
            for s in scalars:
                i = int(s["index"])
                traj.append(
                    StepRecord(
                        index=i,
                        timestep=float(s["timestep"]),
                        latent_after=_need(tensors, f"steps.{i}.latent_after"),
                        model_output=_need(tensors, f"steps.{i}.model_output"),
                        attn_maps=_need(tensors, f"steps.{i}.attn_maps") if s["has_maps"] else None,
                        stage=int(s["stage"]),
                        active_fraction=float(s["active_fraction"]),
                    )
                )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptTrajectory(f"trajectory steps do not decode: {exc}") from None
        return traj

    def save(self, path: Path, storage_dtype: StorageDType = "float32") -> int:
        """Write the whole trajectory to ``path``; returns the number of bytes written."""
        data = self.to_bytes(storage_dtype)
        Path(path).write_bytes(data)
        return len(data)

    @classmethod
    def load(cls, path: Path) -> Trajectory:
        return cls.from_bytes(Path(path).read_bytes())

    @classmethod
    def from_parts(cls, header: bytes, steps: Iterable[bytes]) -> Trajectory:
        meta, initial = decode_header(header)
        traj = cls(meta, initial)
        for blob in steps:
            traj.append(decode_step(blob))
        return traj


# --- per-step (streamed) serialization ------------------------------------------------------------------


def encode_header(
    traj: Trajectory | TrajectoryMeta,
    initial: torch.Tensor | None = None,
    *,
    storage_dtype: StorageDType = "float32",
) -> bytes:
    """The metadata + initial latent of a trajectory, uploaded once before its steps."""
    if isinstance(traj, Trajectory):
        meta, initial = traj.meta, traj.initial
    else:
        meta = traj
        if initial is None:
            raise ValueError("encode_header(meta, initial): initial latent required")
    return _seal(
        {"initial_latent": _store(initial, storage_dtype)},
        {"chorus.format": "header/1", "chorus.meta": meta.to_json(), "chorus.storage_dtype": storage_dtype},
    )


def decode_header(data: bytes) -> tuple[TrajectoryMeta, torch.Tensor]:
    tensors, meta = _open(data, "header/1")
    return TrajectoryMeta.from_json(meta["chorus.meta"]), _need(tensors, "initial_latent")


def expected_nbytes(meta: TrajectoryMeta, storage_dtype: StorageDType = "float32") -> int:
    """``nbytes`` of the finished trajectory ``meta`` describes: the initial latent, two latents and the attention
    maps per step (known before any step is run)."""
    latent = math.prod(meta.latent_shape)
    maps = sum(meta.valid) * meta.num_tokens
    return _item_size(storage_dtype) * (latent * (1 + 2 * meta.num_steps) + maps * meta.num_steps)


def decode_head(data: bytes) -> tuple[TrajectoryMeta, torch.Tensor, list[StepRecord] | None]:
    """What a stored trajectory's first object holds: a header (its steps stored one by one beside it: ``None``)
    or the whole trajectory, steps included (a small one, packed by ``workers.donors``)."""
    tensors, meta = _open(data, "header/1", "trajectory/1")
    if meta["chorus.format"] == "trajectory/1":
        whole = Trajectory._from_opened(tensors, meta)
        return whole.meta, whole.initial, whole.steps
    return TrajectoryMeta.from_json(meta["chorus.meta"]), _need(tensors, "initial_latent"), None


def encode_step(record: StepRecord, storage_dtype: StorageDType = "float32") -> bytes:
    """One finished step, self-contained and checksummed."""
    tensors = {name: _store(t, storage_dtype) for name, t in record.tensors().items()}
    meta = {
        "chorus.format": "step/1",
        "chorus.step": json.dumps(record.scalars()),
        "chorus.storage_dtype": storage_dtype,
    }
    return _seal(tensors, meta)


def decode_step(data: bytes) -> StepRecord:
    tensors, meta = _open(data, "step/1")
    try:
        s = json.loads(meta["chorus.step"])
        return StepRecord(
            index=int(s["index"]),
            timestep=float(s["timestep"]),
            latent_after=_need(tensors, "latent_after"),
            model_output=_need(tensors, "model_output"),
            attn_maps=_need(tensors, "attn_maps") if s["has_maps"] else None,
            stage=int(s["stage"]),
            active_fraction=float(s["active_fraction"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptTrajectory(f"step record does not decode: {exc}") from None


# --- internals ------------------------------------------------------------------------------------------


def _item_size(storage_dtype: StorageDType) -> int:
    return torch.empty((), dtype=_STORAGE[storage_dtype]).element_size()


def _store(t: torch.Tensor, storage_dtype: StorageDType) -> torch.Tensor:
    return t.detach().to("cpu", _STORAGE[storage_dtype]).contiguous()


def _digest(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    for key in sorted(meta):
        h.update(f"{key}={meta[key]}\n".encode())
    return h.hexdigest()


def _seal(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    # One metadata entry (a sorted JSON object) keeps the serialized bytes deterministic.
    sealed = {**meta, "chorus.sha256": _digest(tensors, meta)}
    return st_save(tensors, metadata={"chorus": json.dumps(sealed, sort_keys=True, ensure_ascii=False)})


def _open(data: bytes, *expected_formats: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        meta = json.loads(header["__metadata__"]["chorus"])
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise TypeError("metadata is not a string map")
        tensors = st_load(data)
    except Exception as exc:  # any parse failure of foreign bytes is corruption
        raise CorruptTrajectory(
            f"not a readable chorus safetensors blob ({type(exc).__name__}: {exc})"
        ) from None
    fmt = meta.get("chorus.format")
    if fmt not in expected_formats:
        raise CorruptTrajectory(
            f"expected a chorus {' or '.join(expected_formats)} blob, found format {fmt!r}"
        )
    claimed = meta.pop("chorus.sha256", None)
    if claimed is None:
        raise CorruptTrajectory("blob carries no sha256")
    actual = _digest(tensors, meta)
    if actual != claimed:
        raise CorruptTrajectory(f"sha256 mismatch: blob says {claimed[:16]}…, content is {actual[:16]}…")
    stored = meta.get("chorus.storage_dtype")
    if stored not in _STORAGE:
        raise CorruptTrajectory(f"unknown storage dtype {stored!r}")
    return {k: v.to(torch.float32) for k, v in tensors.items()}, meta


def _need(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise CorruptTrajectory(f"tensor {name!r} missing") from None
