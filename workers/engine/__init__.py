"""Chorus' staged reuse engine (no Kafka, Celery, S3, Redis or Qdrant in here).

Public API — the worker, the benchmark and the demo call exactly this::

    from workers.engine import Engine, load_bundle, Trajectory, DonorUnavailable, IncompatibleDonor

    bundle = load_bundle("tiny-random-wan", device="cpu", dtype="float32")   # or wan21_dir=..., toy_weights_dir=...
    engine = Engine(bundle)                                                  # one per bundle; not thread-safe
    leader = engine.generate(request_a, ReusePlan.full(request_a.num_steps), on_step=upload_step)
    plan = ReusePlan(stage1_steps=2, stage2_steps=4, stage3_steps=2, alpha=2.0)
    out = engine.generate(request_b, plan, donor=leader.trajectory)          # any DonorSource
    out.frames                    # uint8 (F, H, W, 3)
    out.steps_computed, out.tokens_computed_fraction, out.fallback, out.stage_seconds, out.decode_seconds
    out.verification              # the model's check of the donor (plan.verification), if one ran
    blob = out.trajectory.to_bytes("float16"); Trajectory.from_bytes(blob)  # or encode_header / encode_step

Signatures
    load_bundle(name, *, device="cpu", dtype="float32", wan21_dir=None, toy_weights_dir=None) -> ModelBundle
    Engine(bundle, *, record_attn_maps=True, cache_text=True, prompt_cache_size=64, text_cache_bytes=1 GiB)
    Engine.generate(request, plan, donor=None, *, on_step=None, on_start=None, progress=False,
                    refuse_incompatible=True) -> GenerationOutput
    prefetch_donor(source, plan, num_steps, *, name) -> PrefetchedDonor   (request_run: read a finished donor now)
    Engine.close()   # removes the hooks/processors from the transformer
    DonorSource (Protocol): metadata() -> TrajectoryMeta; initial_latent() -> Tensor; step(i) -> StepRecord
        (each MAY block and MAY raise DonorUnavailable / CorruptTrajectory → the engine falls back, never fails)
    Trajectory(meta, initial, steps): a DonorSource; to_bytes/from_bytes, save/load, from_parts, nbytes
    encode_header(traj) / decode_header(bytes); encode_step(record) / decode_step(bytes)   (streamed form)
    errors: EngineError > DonorError > {DonorUnavailable, CorruptTrajectory, IncompatibleDonor}; ModelUnavailable

Behaviour
    Stage 1 (k1 steps): nothing computed; the scheduler is replayed through the donor's first k1 model outputs
    (so multistep schedulers such as UniPC hold the donor's history) and the latent becomes the donor's latent
    after step k1. Stage 2 (k2 steps): a token-guided mask (``masks``) selects latent tokens; only those run
    through the transformer (``srd`` hooks), the rest take the donor's model output; TGAA (``tgaa``) amplifies the
    target's differing prompt tokens by α on the conditional branch. Stage 3: full steps (TGAA if
    ``plan.tgaa_in_stage3``). Donor unavailable before Stage 1 ends → every step in full; a Stage-2 step whose
    donor data is unavailable → that step in full. Incompatible donor → ``IncompatibleDonor`` (raised), or with
    ``refuse_incompatible=False`` every step in full. The engine alone decides each fallback: ``out.fallback`` says
    why, ``out.fallback_cause`` what kind it is (``fallback.FallbackCause``), ``out.donor_gone`` whether the donor
    can never serve again. With ``plan.verification`` set and k1 > 0, the donor is checked by the model first
    (``verify``): the first computed step on the donor's latent is compared with the donor's recorded output there;
    accepted, it is that step (no extra cost); otherwise Stage 1 is shortened or the donor dropped (a fallback of
    cause ``verification_shortened`` / ``verification_rejected``), and ``out.verification`` says what and why.
    Prompt encodings are cached per (weights id, prompt) in a bounded LRU (``prompt_cache``), and so are the
    transformer's text projection and cross-attention keys and values per text row (``text_side``).

Modules: ``registry`` (models), ``engine`` (the loop), ``steps`` (one full or Stage-2 step), ``request_run``
(per-request state, donor resolution and Stage 1, donor reads), ``verify`` (model-verified donors),
``prompt_cache`` (prompt encodings), ``text_side`` (the transformer's prompt-only work across requests), ``output`` (``GenerationOutput``, ``StepStat``), ``instrumentation`` (installs
the hooks and processors), ``srd`` (gather/scatter hooks, rotary-table cache), ``tgaa`` (attn2 processor:
amplification, map recording, text K/V cache), ``masks``, ``tokens`` (prompt diff), ``trajectory`` (records,
metadata, serialization), ``errors``, ``fallback`` (why a planned reuse did not happen), ``bundle`` (the model
interface). The commands that run it live
above it: ``chorus generate`` in ``workers/generate.py``, ``chorus bench engine`` in ``workers/bench/engine_cli.py``.

Attributes are imported lazily so that ``import workers.engine`` (e.g. by the CLI) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "load_bundle": "workers.engine.registry",
    "LOADERS": "workers.engine.registry",
    "Engine": "workers.engine.engine",
    "GenerationOutput": "workers.engine.output",
    "StepStat": "workers.engine.output",
    "DonorSource": "workers.engine.trajectory",
    "Trajectory": "workers.engine.trajectory",
    "TrajectoryMeta": "workers.engine.trajectory",
    "StepRecord": "workers.engine.trajectory",
    "encode_step": "workers.engine.trajectory",
    "decode_step": "workers.engine.trajectory",
    "encode_header": "workers.engine.trajectory",
    "decode_header": "workers.engine.trajectory",
    "check_compatible": "workers.engine.trajectory",
    "ModelBundle": "workers.engine.bundle",
    "TextEncoding": "workers.engine.bundle",
    "EngineError": "workers.engine.errors",
    "DonorError": "workers.engine.errors",
    "DonorUnavailable": "workers.engine.errors",
    "CorruptTrajectory": "workers.engine.errors",
    "IncompatibleDonor": "workers.engine.errors",
    "ModelUnavailable": "workers.engine.errors",
}

__all__ = [
    "LOADERS",
    "CorruptTrajectory",
    "DonorError",
    "DonorSource",
    "DonorUnavailable",
    "Engine",
    "EngineError",
    "GenerationOutput",
    "IncompatibleDonor",
    "ModelBundle",
    "ModelUnavailable",
    "StepRecord",
    "StepStat",
    "TextEncoding",
    "Trajectory",
    "TrajectoryMeta",
    "check_compatible",
    "decode_header",
    "decode_step",
    "encode_header",
    "encode_step",
    "load_bundle",
]

if TYPE_CHECKING:
    from workers.engine.bundle import ModelBundle, TextEncoding
    from workers.engine.engine import Engine
    from workers.engine.errors import (
        CorruptTrajectory,
        DonorError,
        DonorUnavailable,
        EngineError,
        IncompatibleDonor,
        ModelUnavailable,
    )
    from workers.engine.output import GenerationOutput, StepStat
    from workers.engine.registry import LOADERS, load_bundle
    from workers.engine.trajectory import (
        DonorSource,
        StepRecord,
        Trajectory,
        TrajectoryMeta,
        check_compatible,
        decode_header,
        decode_step,
        encode_header,
        encode_step,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'workers.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
