"""Runs one request through the engine (optionally under cache-dit), reads it with the checker, and aggregates.

Everything the quality benchmark measures goes through ``Engine.generate`` (donors included), so the numbers
describe the code the workers run.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from producer.contract import GenerationRequest, ReusePlan, build_request
from workers.bench.cachedit import CacheDiTEngine, CacheRun
from workers.bench.meter import BlockMeter
from workers.engine.bundle import ModelBundle
from workers.engine.engine import Engine, GenerationOutput
from workers.engine.trajectory import DonorSource, Trajectory
from workers.toy import checker
from workers.toy.world import ATTRIBUTE_NAMES, Attributes

ACCURACY_KEYS: tuple[str, ...] = (*ATTRIBUTE_NAMES, "all")


@dataclass
class Outcome:
    """One generated clip, what the checker made of it, and what it cost."""

    correct: dict[str, bool]
    read: dict[str, str]
    steps_requested: int
    steps_computed: int
    tokens_fraction: float  # the engine's computed-token fraction, plus a thrown-away verification pass
    block_fraction: float  # measured block×token work / full work (see ``meter``)
    reused: bool  # a donor was actually used
    fallback: str | None = None
    cache: CacheRun | None = None
    frames: np.ndarray | None = None
    trajectory: Trajectory | None = None
    seconds: float = 0.0
    # The active token fraction of every computed Stage-2 step: what selective region denoising recomputed.
    stage2_fractions: tuple[float, ...] = ()
    # The attributes the donor's prompt changed (set by the suite for donor pairs), for per-change summaries.
    changed: tuple[str, ...] = ()
    # What the model's donor check decided (accepted, shortened, rejected, unverified); None: nothing checked.
    verification: str | None = None


def plan_label(plan: ReusePlan) -> str:
    if not plan.reuses:
        return "full"
    text = f"{plan.stage1_steps}/{plan.stage2_steps}/{plan.stage3_steps}"
    if plan.stage2_steps or plan.tgaa_in_stage3:
        text += f" a={plan.alpha:g} thr={plan.mask_threshold:g}"
    return text


def plan_dict(plan: ReusePlan) -> dict[str, Any]:
    return {
        "k1": plan.stage1_steps,
        "k2": plan.stage2_steps,
        "k3": plan.stage3_steps,
        "alpha": plan.alpha,
        "mask_threshold": plan.mask_threshold,
        "min_active_fraction": plan.min_active_fraction,
        "max_active_fraction": plan.max_active_fraction,
        "tgaa_in_stage3": plan.tgaa_in_stage3,
    }


class QualityRunner:
    """A bundle, its engine and a block meter; ``run`` makes one request and checks it."""

    def __init__(self, bundle: ModelBundle, guidance: float, judge: Sequence[str] = ATTRIBUTE_NAMES) -> None:
        unknown = [a for a in judge if a not in ATTRIBUTE_NAMES]
        if unknown or not judge:
            raise ValueError(f"judge: need attributes among {ATTRIBUTE_NAMES}, got {list(judge)}")
        self.bundle = bundle
        self.guidance = guidance
        self.judge = tuple(judge)
        self.engine = Engine(bundle)
        self.meter = BlockMeter(bundle.transformer)
        spec = bundle.spec
        self.shape = (spec.default_num_frames, spec.default_height, spec.default_width)
        transformer: Any = bundle.transformer
        pt, ph, pw = (int(p) for p in transformer.config.patch_size)
        _, lf, lh, lw = bundle.latent_shape(*self.shape)
        self.seq_len = (lf // pt) * (lh // ph) * (lw // pw)
        self._counter = 0

    def request(self, prompt: str, seed: int, steps: int) -> GenerationRequest:
        self._counter += 1
        frames, height, width = self.shape
        return build_request(
            request_id=f"q{self._counter}",
            prompt=prompt,
            model=self.bundle.spec.name,
            num_frames=frames,
            height=height,
            width=width,
            num_steps=steps,
            seed=seed,
            guidance_scale=self.guidance,
        )

    def run(
        self,
        prompt: str,
        seed: int,
        steps: int,
        expected: Attributes,
        *,
        plan: ReusePlan | None = None,
        donor: DonorSource | None = None,
        cached: CacheDiTEngine | None = None,
        keep_frames: bool = False,
        keep_trajectory: bool = False,
    ) -> Outcome:
        req = self.request(prompt, seed, steps)
        plan = plan or ReusePlan.full(steps)
        t0 = time.perf_counter()
        cache_run: CacheRun | None = None
        if cached is None:
            self.meter.reset()
            out: GenerationOutput = self.engine.generate(req, plan, donor)
            block_tokens = self.meter.tokens
        else:
            cache_run = cached.generate(req, plan, donor)
            out = cache_run.output
            block_tokens = cache_run.block_tokens
        seconds = time.perf_counter() - t0
        reading = checker.read_clip(out.frames)
        correct = checker.compare(reading, expected)
        # "all" = every *judged* attribute right (all four unless the benchmark was told otherwise)
        correct["all"] = all(correct[a] for a in self.judge)
        n_blocks = self.meter.num_blocks
        check = out.verification
        # a rejected or shortened donor's verification pass was computed and thrown away: it counts
        wasted = check.wasted_tokens_fraction / steps if check is not None else 0.0
        return Outcome(
            correct=correct,
            read=reading.attributes.as_dict(),
            steps_requested=steps,
            steps_computed=out.steps_computed,
            tokens_fraction=out.tokens_computed_fraction + wasted,
            block_fraction=block_tokens / (steps * n_blocks * self.seq_len),
            reused=out.donor_request_id is not None,
            fallback=out.fallback,
            cache=cache_run,
            frames=out.frames if keep_frames else None,
            trajectory=out.trajectory if keep_trajectory else None,
            seconds=seconds,
            stage2_fractions=tuple(s.active_fraction for s in out.steps if s.stage == 2 and s.computed),
            verification=check.decision if check is not None else None,
        )

    def close(self) -> None:
        self.meter.close()
        self.engine.close()


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


@dataclass
class Row:
    """Outcomes of one benchmark row, in target order (so they pair with the no-reuse row's)."""

    id: str
    method: str
    steps: int
    pair_class: str | None = None
    description: str = ""
    outcomes: list[Outcome] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, outcome: Outcome) -> None:
        # the row keeps only what it reports
        outcome.frames = None
        outcome.trajectory = None
        self.outcomes.append(outcome)

    def summary(self, baseline: Sequence[bool] | None = None) -> dict[str, Any]:
        """JSON-ready numbers; ``baseline`` is the no-reuse all-correct flag of the same targets, in order."""
        n = len(self.outcomes)
        acc = {k: _mean([float(o.correct[k]) for o in self.outcomes]) for k in ACCURACY_KEYS}
        all_ok = [o.correct["all"] for o in self.outcomes]
        lo, hi = wilson(sum(all_ok), n)
        out: dict[str, Any] = {
            "id": self.id,
            "method": self.method,
            "steps": self.steps,
            "pair_class": self.pair_class,
            "description": self.description,
            "n": n,
            "accuracy": {k: round(v, 4) for k, v in acc.items()},
            "all_correct_ci95": [round(lo, 4), round(hi, 4)],
            "steps_computed_mean": round(_mean([o.steps_computed for o in self.outcomes]), 3),
            "tokens_computed_fraction_mean": round(_mean([o.tokens_fraction for o in self.outcomes]), 4),
            "block_compute_fraction_mean": round(_mean([o.block_fraction for o in self.outcomes]), 4),
            "reused_fraction": round(_mean([float(o.reused) for o in self.outcomes]), 4),
            "fallbacks": sum(1 for o in self.outcomes if o.fallback),
            "seconds_mean": round(_mean([o.seconds for o in self.outcomes]), 4),
        }
        if baseline is not None:
            if len(baseline) != n:
                raise ValueError(f"row {self.id}: {n} outcomes but {len(baseline)} baseline flags")
            base = _mean([float(b) for b in baseline])
            out["no_reuse_all"] = round(base, 4)
            out["delta_all_vs_no_reuse"] = round(acc["all"] - base, 4)
            out["lost"] = sum(1 for b, o in zip(baseline, all_ok, strict=True) if b and not o)
            out["gained"] = sum(1 for b, o in zip(baseline, all_ok, strict=True) if o and not b)
        runs = [o.cache for o in self.outcomes if o.cache is not None]
        if runs:
            out["cachedit"] = {
                "cache_passes_mean": round(_mean([r.cache_passes for r in runs]), 3),
                "cached_steps_mean": round(_mean([len(r.cached_steps) for r in runs]), 3),
                "computed_steps_mean": round(_mean([r.computed_steps for r in runs]), 3),
                "uncached_subset_passes_mean": round(_mean([r.uncached_passes for r in runs]), 3),
                "block_calls_total": sum(r.block_calls for r in runs),
                "expected_block_calls_total": sum(r.expected_block_calls for r in runs),
                "skips_verified": all(r.skips_verified for r in runs),
            }
        stage2 = [f for o in self.outcomes for f in o.stage2_fractions]
        out["stage2_steps"] = len(stage2)
        out["stage2_active_fraction_mean"] = round(_mean(stage2), 4) if stage2 else None
        checks = Counter(o.verification for o in self.outcomes if o.verification is not None)
        if checks:
            out["verification"] = dict(sorted(checks.items()))
        if any(o.changed for o in self.outcomes):
            out["by_changed"] = _by_changed(self.outcomes, baseline)
        out.update(self.extra)
        return out


def _by_changed(outcomes: Sequence[Outcome], baseline: Sequence[bool] | None) -> dict[str, dict[str, Any]]:
    """Per set of changed attributes ("color", "shape+direction", …): how many, their all-attribute accuracy,
    what Stage 2 recomputed per step and the computed-token fraction — so a reader sees the masks follow the
    change (a color change touches the shape, a background change everything)."""
    groups: dict[str, list[int]] = {}
    for i, o in enumerate(outcomes):
        groups.setdefault("+".join(o.changed) or "none", []).append(i)
    summary: dict[str, dict[str, Any]] = {}
    for key, idx in sorted(groups.items()):
        stage2 = [f for i in idx for f in outcomes[i].stage2_fractions]
        entry: dict[str, Any] = {
            "n": len(idx),
            "all_correct": round(_mean([float(outcomes[i].correct["all"]) for i in idx]), 4),
            "stage2_steps": len(stage2),
            "stage2_active_fraction_mean": round(_mean(stage2), 4) if stage2 else None,
            "tokens_computed_fraction_mean": round(_mean([outcomes[i].tokens_fraction for i in idx]), 4),
        }
        checks = Counter(outcomes[i].verification for i in idx if outcomes[i].verification is not None)
        if checks:
            entry["verification"] = dict(sorted(checks.items()))
        if baseline is not None:
            entry["no_reuse_all"] = round(_mean([float(baseline[i]) for i in idx]), 4)
        summary[key] = entry
    return summary


ProgressFn = Callable[[int], None]
