"""cache-dit (intra-request DBCache) on the toy Wan transformer, driven through Chorus' own engine.

cache-dit counts denoising steps per *pipeline call*: ``enable_cache`` wraps the pipeline class's ``__call__`` so
that every call starts a fresh cache context, and every transformer call inside it is one step. Called on a bare
transformer it keeps one persistent context and reports nothing useful (FINDINGS, "cache-dit on a bare Wan
transformer"). So the toy model is wrapped as a diffusers ``DiffusionPipeline`` whose ``__call__`` is one
``Engine.generate``: cache-dit sees a pipeline, the request runs through exactly the same loop (noise, CFG batch,
scheduler, decode) as the no-reuse and Chorus rows, and a Chorus plan can be combined with it.

DBCache on a 4-block model: ``Fn_compute_blocks`` blocks always run, then the relative L1 change of their residual
since the last computed step decides whether the middle blocks run or their cached residual is reused;
``Bn_compute_blocks`` trailing blocks always run. With Fn=1, Bn=0 a cached step runs 1 of 4 blocks.

With a Chorus plan, Stage 1 never calls the transformer; Stage-2 passes over a token subset run *outside* the
cache (cache-dit compares residuals of whole sequences, a subset's cannot be compared to the last full step's)
and do not advance cache-dit's step counter; every full pass (Stage 3, or a Stage-2 step whose mask covers every
token) goes through DBCache.

Skipping is verified per request, not assumed: a forward hook on every block counts the calls, which must equal
``passes × blocks − cached × (blocks − Fn − Bn)`` for the cached steps cache-dit reports.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from producer.contract import GenerationRequest, ReusePlan
from workers.bench.meter import BlockMeter
from workers.engine.bundle import ModelBundle
from workers.engine.engine import Engine
from workers.engine.instrumentation import instrument
from workers.engine.output import GenerationOutput
from workers.engine.trajectory import DonorSource

# cache-dit logs INFO to stdout by default; the benchmark's stdout is JSON.
os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "WARNING")

log = logging.getLogger(__name__)

_ids = itertools.count()


def _quiet_cache_dit() -> None:
    """Send cache-dit's console log to stderr (it installs a stdout handler when imported)."""
    import cache_dit.logger as cd_logger

    handler = getattr(cd_logger, "_default_handler", None)
    if isinstance(handler, logging.StreamHandler) and handler.stream is not sys.stderr:
        handler.setStream(sys.stderr)
        handler.flush = sys.stderr.flush  # type: ignore[method-assign]


@dataclass(frozen=True)
class CacheDiTSettings:
    """DBCache settings. ``max_warmup_steps`` None: ``max(1, min(8, N // 4))`` for N steps (cache-dit's default 8
    would leave a 4-step request nothing to cache)."""

    fn_compute_blocks: int = 1
    bn_compute_blocks: int = 0
    residual_diff_threshold: float = 0.08
    max_warmup_steps: int | None = None
    max_continuous_cached_steps: int = -1

    def warmup_for(self, num_steps: int) -> int:
        if self.max_warmup_steps is not None:
            return self.max_warmup_steps
        return max(1, min(8, num_steps // 4))

    def describe(self, num_steps: int) -> dict[str, Any]:
        return {
            "cache_type": "DBCache",
            "Fn_compute_blocks": self.fn_compute_blocks,
            "Bn_compute_blocks": self.bn_compute_blocks,
            "residual_diff_threshold": self.residual_diff_threshold,
            "max_warmup_steps": self.warmup_for(num_steps),
            "max_continuous_cached_steps": self.max_continuous_cached_steps,
            "enable_separate_cfg": False,
        }


@dataclass
class CacheRun:
    """One request under cache-dit, with its measured accounting."""

    output: GenerationOutput
    cached_steps: list[int]  # cache-dit's step indices (counting only passes through the cache) served cached
    cache_passes: int  # full transformer passes that went through DBCache
    uncached_passes: int  # Stage-2 subset passes run outside the cache
    block_calls: int
    block_tokens: int
    expected_block_calls: int
    residual_diffs: dict[str, float] = field(default_factory=dict)

    @property
    def computed_steps(self) -> int:
        """Passes that ran every block (cache-dit "executed and not cached", plus subset passes)."""
        return self.cache_passes - len(self.cached_steps) + self.uncached_passes

    @property
    def skips_verified(self) -> bool:
        """The counted block calls match cache-dit's report, and a cached step really ran fewer blocks."""
        return self.block_calls == self.expected_block_calls


def _pipeline_class() -> type:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    class EnginePipeline(DiffusionPipeline):
        """A diffusers pipeline whose call is one ``Engine.generate`` (so cache-dit scopes its cache per request)."""

        def __init__(self, transformer: Any) -> None:
            super().__init__()
            self.register_modules(transformer=transformer)
            self.chorus_engine: Engine | None = None

        def __call__(
            self, request: GenerationRequest, plan: ReusePlan, donor: DonorSource | None = None
        ) -> GenerationOutput:
            assert self.chorus_engine is not None
            return self.chorus_engine.generate(request, plan, donor)

    # cache-dit patches ``__call__`` on the pipeline's *class*: one class per instance keeps them apart.
    return type(f"EnginePipeline{next(_ids)}", (EnginePipeline,), {})


class CacheDiTEngine:
    """``Engine.generate`` with cache-dit's DBCache on the bundle's transformer (which it patches: give it a
    bundle of its own). ``close()`` removes cache-dit and the engine's instrumentation."""

    def __init__(self, bundle: ModelBundle, settings: CacheDiTSettings, num_steps: int) -> None:
        import cache_dit
        from cache_dit import BlockAdapter, DBCacheConfig, ForwardPattern

        _quiet_cache_dit()
        transformer: Any = bundle.transformer
        self.num_blocks = len(transformer.blocks)
        if settings.fn_compute_blocks + settings.bn_compute_blocks >= self.num_blocks:
            raise ValueError(
                f"Fn + Bn = {settings.fn_compute_blocks + settings.bn_compute_blocks} leaves no block of "
                f"{self.num_blocks} to cache"
            )
        self.bundle = bundle
        self.settings = settings
        self.num_steps = num_steps
        self._transformer = transformer
        self._plain_forward = transformer.forward
        self.pipe = _pipeline_class()(transformer)
        adapter = BlockAdapter(
            pipe=self.pipe,
            transformer=transformer,
            blocks=transformer.blocks,
            forward_pattern=ForwardPattern.Pattern_2,
            has_separate_cfg=False,
        )
        config = DBCacheConfig(
            Fn_compute_blocks=settings.fn_compute_blocks,
            Bn_compute_blocks=settings.bn_compute_blocks,
            residual_diff_threshold=settings.residual_diff_threshold,
            max_warmup_steps=settings.warmup_for(num_steps),
            max_continuous_cached_steps=settings.max_continuous_cached_steps,
            enable_separate_cfg=False,
        )
        cache_dit.enable_cache(adapter, cache_config=config)
        self._cached_forward = transformer.forward
        # The engine instruments the blocks after cache-dit checked their forward signatures.
        self.engine = Engine(bundle)
        self.pipe.chorus_engine = self.engine
        self._srd = instrument(transformer).srd
        transformer.forward = self._route
        self.meter = BlockMeter(transformer)
        self._cache_passes = 0
        self._uncached_passes = 0

    def _route(self, *args: Any, **kwargs: Any) -> Any:
        if self._srd.active_index is not None:
            self._uncached_passes += 1
            return self._plain_forward(*args, **kwargs)
        self._cache_passes += 1
        return self._cached_forward(*args, **kwargs)

    def generate(
        self, request: GenerationRequest, plan: ReusePlan, donor: DonorSource | None = None
    ) -> CacheRun:
        import cache_dit

        if request.num_steps != self.num_steps:
            raise ValueError(f"this cache-dit engine was set up for {self.num_steps} steps")
        self.meter.reset()
        self._cache_passes = self._uncached_passes = 0
        out = self.pipe(request=request, plan=plan, donor=donor)
        stats = cache_dit.summary(self.pipe, logging=False)
        cached = [int(s) for s in stats[0].cached_steps] if stats else []
        diffs = {str(k): float(v) for k, v in (stats[0].residual_diffs or {}).items()} if stats else {}
        skipped = self.num_blocks - self.settings.fn_compute_blocks - self.settings.bn_compute_blocks
        expected = (self._cache_passes + self._uncached_passes) * self.num_blocks - len(cached) * skipped
        run = CacheRun(
            output=out,
            cached_steps=cached,
            cache_passes=self._cache_passes,
            uncached_passes=self._uncached_passes,
            block_calls=self.meter.calls,
            block_tokens=self.meter.tokens,
            expected_block_calls=expected,
            residual_diffs=diffs,
        )
        if not run.skips_verified:
            log.warning(
                "cache-dit accounting mismatch",
                extra={"block_calls": run.block_calls, "expected": expected, "cached_steps": len(cached)},
            )
        return run

    def close(self) -> None:
        import cache_dit

        self.meter.close()
        self._transformer.forward = self._cached_forward
        cache_dit.disable_cache(self.pipe)
        self.engine.close()
