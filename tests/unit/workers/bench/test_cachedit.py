"""cache-dit through the engine: cached steps really skip transformer blocks, and nothing changes when nothing is
cached."""

from __future__ import annotations

import math

import numpy as np

from producer.contract import GenerationRequest, ReusePlan, build_request
from workers.bench.cachedit import CacheDiTEngine, CacheDiTSettings
from workers.engine import Engine, load_bundle

MODEL = "tiny-random-wan"  # 2 blocks
STEPS = 8


def _request(
    prompt: str = "a red circle moving left on a white background", seed: int = 3
) -> GenerationRequest:
    return build_request(prompt=prompt, model=MODEL, num_steps=STEPS, seed=seed, guidance_scale=3.0)


def test_cached_steps_skip_the_middle_blocks() -> None:
    # a threshold no residual change reaches: every step after the warm-up is served from the cache
    engine = CacheDiTEngine(
        load_bundle(MODEL), CacheDiTSettings(residual_diff_threshold=100.0, max_warmup_steps=2), STEPS
    )
    try:
        for seed in (3, 4):  # the cache context starts afresh for every request
            run = engine.generate(_request(seed=seed), ReusePlan.full(STEPS))
            assert run.cached_steps == list(range(2, STEPS))
            assert run.cache_passes == STEPS and run.uncached_passes == 0
            # Fn = 1 of 2 blocks: a cached step runs one block, a computed one both
            assert run.block_calls == 2 * 2 + (STEPS - 2) * 1 == run.expected_block_calls
            assert run.skips_verified and run.computed_steps == 2
            assert run.block_tokens == run.block_calls * math.prod(run.output.trajectory.meta.token_grid)
    finally:
        engine.close()


def test_nothing_cached_is_the_plain_engine() -> None:
    plain = Engine(load_bundle(MODEL))
    engine = CacheDiTEngine(load_bundle(MODEL), CacheDiTSettings(residual_diff_threshold=0.0), STEPS)
    try:
        req = _request()
        reference = plain.generate(req, ReusePlan.full(STEPS))
        run = engine.generate(req, ReusePlan.full(STEPS))
        assert run.cached_steps == [] and run.block_calls == STEPS * 2 and run.skips_verified
        np.testing.assert_array_equal(run.output.frames, reference.frames)
    finally:
        engine.close()
        plain.close()


def test_chorus_plan_under_cache_dit_runs_subset_passes_outside_the_cache() -> None:
    plain = Engine(load_bundle(MODEL))
    engine = CacheDiTEngine(
        load_bundle(MODEL), CacheDiTSettings(residual_diff_threshold=100.0, max_warmup_steps=1), STEPS
    )
    try:
        donor = plain.generate(_request(seed=5), ReusePlan.full(STEPS)).trajectory
        plan = ReusePlan(stage1_steps=2, stage2_steps=3, stage3_steps=3, alpha=2.0, max_active_fraction=0.5)
        run = engine.generate(_request("a blue circle moving left on a white background"), plan, donor)
        out = run.output
        assert out.donor_request_id is not None and out.steps_computed == 6
        subset = sum(1 for s in out.steps if s.stage == 2 and 0 < s.active_fraction < 1)
        assert subset > 0 and run.uncached_passes == subset
        assert run.cache_passes == out.steps_computed - subset
        assert run.cached_steps == list(range(1, run.cache_passes))
        assert run.skips_verified
    finally:
        engine.close()
        plain.close()
