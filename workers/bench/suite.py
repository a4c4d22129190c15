"""The quality benchmark proper (``chorus bench quality``): see ``workers.bench.quality`` for the report layout.

Order of work for each step count N:

1. ``no-reuse``: every target of the evaluation set, full plan.
2. ``cachedit``: every target under cache-dit alone (one row per residual-diff threshold).
3. per pair class: each donor is generated first (full plan, through the same engine); then its target runs
   - ``chorus``: the plan the planner picks from the calibration table for this pair (similarity + word diff);
   - ``chorus-alpha1``: the same plan with α = 1 (TGAA off), where the plan has α > 1 and a Stage 2;
   - ``probe-alpha<α>``: a fixed plan (k1 = N/4, k2 = N/2, the rest Stage 3) at each ablation α, so the effect of
     TGAA shows even where the table chose no reuse (not run for ``same-prompt``: no token differs there);
   - ``chorus+cachedit``: the chorus plan under cache-dit (first threshold).
4. ``chorus`` over all pair classes pooled: the reuse-heavy set (every target has a donor).

A plan that does not reuse gives exactly the no-reuse (or cache-dit-alone) clip — the engine ignores the donor
and everything is seeded — so such outcomes are copied rather than recomputed; ``reused_fraction`` tells how many
requests of a row really used their donor.

Modules: this one (configuration, the ``Suite`` holding the runner and cache-dit engines, targets, the report),
``suite_calibration`` (``--calibrate``), ``suite_rows`` (the rows of one step count, one method per row kind),
``pair_facts`` (similarity and word changes of each pair).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chorus_sched.planner import CalibrationTable, Planner, load_calibration, write_calibration
from workers.bench import calibrate as cal
from workers.bench.cachedit import CacheDiTEngine, CacheDiTSettings
from workers.bench.pair_facts import class_report, pair_facts
from workers.bench.pairs import (
    EVAL_NEGATIVE_SEED_BASE,
    EVAL_NEGATIVE_SET_SEED,
    PAIR_CLASSES,
    Pair,
    eval_targets,
    make_negative_pairs,
    make_pairs,
)
from workers.bench.runner import Outcome, QualityRunner
from workers.bench.suite_calibration import Calibration
from workers.bench.suite_rows import PROBE_K1, PROBE_K2, StepCountBench
from workers.engine.bundle import ModelBundle
from workers.engine.trajectory import Trajectory
from workers.toy.world import ATTRIBUTE_NAMES

# PROBE_K1/PROBE_K2 are defined with the rows that use them; ``chorus bench quality`` reports them from here.
__all__ = [
    "ATTRIBUTE_CHANGING",
    "FORMAT",
    "PROBE_K1",
    "PROBE_K2",
    "ROW_KINDS",
    "TARGET_ALL_CORRECT",
    "BenchConfig",
    "Progress",
    "Suite",
    "dumps",
    "evaluate_targets",
    "run",
]

log = logging.getLogger(__name__)

FORMAT = "chorus-bench-quality/1"
ROW_KINDS: tuple[str, ...] = ("no-reuse", "chorus", "tgaa", "cachedit", "chorus-cachedit", "sheet")
ATTRIBUTE_CHANGING: tuple[str, ...] = ("one-attribute", "two-attributes", "reworded-one-attribute")
TARGET_ALL_CORRECT = {4: 0.90, 50: 0.95}


@dataclass
class BenchConfig:
    load_bundle: Callable[[], ModelBundle]
    weights: dict[str, Any]  # what the model is (dir, id, ...) for the report
    guidance: float
    guidance_source: str
    prompts: int = 64
    seeds: int = 1
    steps: tuple[int, ...] = (4, 50)
    rows: tuple[str, ...] = ROW_KINDS
    classes: tuple[str, ...] = PAIR_CLASSES
    ablation_alphas: tuple[float, ...] = (1.0, 2.0, 4.0)
    cachedit: tuple[CacheDiTSettings, ...] = (CacheDiTSettings(),)
    calibration_path: Path | None = None  # the table the chorus rows use (None: the packaged one)
    calibrate: bool = False
    calibration_out: Path | None = None
    calibration_prompts: int = 64
    calibration_seeds: int = 1
    negative_prompts: int = 256
    # negatives admitted by a verified row that are generated and measured with it
    verified_negatives: int = 64
    eval_negative_prompts: int = 32  # captions of the benchmark's own negatives (0: none)
    min_row_pairs: int = cal.MIN_ROW_PAIRS
    tolerance: float = 0.01
    grid: Callable[[int], tuple[list[float], list[float], list[float], list[float]]] = cal.default_grid
    out_dir: Path = Path("out/bench-quality")
    sheet_prompts: int = 4
    command: str = "chorus bench quality"
    quick: bool = False
    settings_report: dict[str, Any] = field(default_factory=dict)
    judge: tuple[str, ...] = ATTRIBUTE_NAMES


class Progress:
    """A rich progress display on stderr (or nothing)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: Any = None
        self._task: Any = None

    @contextmanager
    def phase(self, description: str, total: int) -> Iterator[Callable[[], None]]:
        if not self.enabled:
            yield lambda: None
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        with RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        ) as bar:
            task = bar.add_task(description, total=total)
            yield lambda: bar.advance(task)

    def log(self, message: str) -> None:
        if self.enabled:
            from rich.console import Console

            Console(stderr=True).print(message)


class Suite:
    """The benchmark's models and engines: one runner (``Engine.generate`` and the checker) and the cache-dit
    engines, shared by the calibration (``workers.bench.suite_calibration``) and the rows
    (``workers.bench.suite_rows``)."""

    def __init__(self, config: BenchConfig, progress: Progress) -> None:
        self.cfg = config
        self.progress = progress
        self.runner = QualityRunner(config.load_bundle(), config.guidance, config.judge)
        self._cached: dict[tuple[int, int], CacheDiTEngine] = {}

    def close(self) -> None:
        for engine in self._cached.values():
            engine.close()
        self._cached.clear()
        self.runner.close()

    def cached_engine(self, steps: int, which: int = 0) -> CacheDiTEngine:
        key = (steps, which)
        if key not in self._cached:
            self._cached[key] = CacheDiTEngine(self.cfg.load_bundle(), self.cfg.cachedit[which], steps)
        return self._cached[key]

    def donor(self, pair: Pair, steps: int, keep_frames: bool = False) -> tuple[Outcome, Trajectory]:
        out = self.runner.run(
            pair.donor_prompt,
            pair.donor_seed,
            steps,
            pair.donor.attributes,
            keep_frames=keep_frames,
            keep_trajectory=True,
        )
        assert out.trajectory is not None
        return out, out.trajectory

    def calibrate(self, ignorable: Sequence[str]) -> tuple[CalibrationTable, dict[str, Any]]:
        return Calibration(self, ignorable).run()

    def bench(self, planner: Planner, ignorable: Sequence[str]) -> dict[str, Any]:
        cfg = self.cfg
        targets = eval_targets(cfg.prompts, cfg.seeds)
        infos = pair_facts(make_pairs(targets, cfg.classes), ignorable)
        negatives = (
            pair_facts(
                make_negative_pairs(
                    eval_targets(
                        cfg.eval_negative_prompts,
                        set_seed=EVAL_NEGATIVE_SET_SEED,
                        seed_base=EVAL_NEGATIVE_SEED_BASE,
                    ),
                    seed=3,
                ),
                ignorable,
            )
            if cfg.eval_negative_prompts and "chorus" in cfg.rows
            else []
        )
        sheet_targets = {t.index for t in targets[: cfg.sheet_prompts]} if "sheet" in cfg.rows else set()
        rows: list[dict[str, Any]] = []
        sheets: list[dict[str, Any]] = []
        for n in cfg.steps:
            step_count = StepCountBench(self, n, targets, infos, planner, sheet_targets, negatives)
            rows.extend(step_count.run())
            if sheet_targets:
                sheet = step_count.sheet()
                if sheet is not None:
                    sheets.append(sheet)
        return {
            "pair_classes": class_report(infos, planner, cfg.steps),
            "rows": rows,
            "contact_sheets": sheets,
        }


def evaluate_targets(
    rows: Sequence[dict[str, Any]], steps: Sequence[int], tolerance: float, judge: Sequence[str]
) -> dict[str, Any]:
    """The issue's targets, judged on the measured rows ("all" = the judged attributes, see ``judged_on``)."""
    by_id = {r["id"]: r for r in rows}
    out: dict[str, Any] = {"judged_on": list(judge)}
    for n in steps:
        base = by_id.get(f"no-reuse@{n}")
        if base is not None and n in TARGET_ALL_CORRECT:
            goal = TARGET_ALL_CORRECT[n]
            out[f"no_reuse_all_correct_{n}"] = {
                "value": base["accuracy"]["all"],
                "target": goal,
                "met": base["accuracy"]["all"] >= goal,
            }
        pooled = by_id.get(f"chorus@{n}")
        if pooled is not None:
            out[f"chorus_within_1pt_{n}"] = {
                "value": pooled["accuracy"]["all"],
                "no_reuse": pooled["no_reuse_all"],
                "delta": pooled["delta_all_vs_no_reuse"],
                "reused_fraction": pooled["reused_fraction"],
                "met": pooled["delta_all_vs_no_reuse"] >= -tolerance - 1e-9,
            }
        tgaa: dict[str, Any] = {}
        for r in rows:
            if r["steps"] != n or r["method"] != "probe" or r["pair_class"] not in ATTRIBUTE_CHANGING:
                continue
            tgaa.setdefault(r["pair_class"], {})[f"alpha{r['plan']['alpha']:g}"] = r["accuracy"]["all"]
        if tgaa:
            out[f"tgaa_probe_all_correct_{n}"] = tgaa
    return out


def run(config: BenchConfig, progress: Progress) -> dict[str, Any]:
    t0 = time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    table_path = config.calibration_path
    table = load_calibration(table_path)
    ignorable = table.ignorable_words or list(cal.DEFAULT_IGNORABLE)
    suite = Suite(config, progress)
    report: dict[str, Any] = {
        "format": FORMAT,
        "command": config.command,
        "started_at": started,
        "model": {
            "name": suite.runner.bundle.spec.name,
            **config.weights,
            "guidance_scale": config.guidance,
            "guidance_source": config.guidance_source,
        },
        "settings": config.settings_report,
        "calibration": None,
    }
    try:
        if config.calibrate:
            out_path = config.calibration_out
            table, cal_report = suite.calibrate(ignorable)
            report["calibration"] = cal_report
            if out_path is not None:
                write_calibration(table, out_path)
                cal_report["written_to"] = str(out_path)
                table_path = out_path
                table = load_calibration(out_path)
                progress.log(f"calibration table written to {out_path}")
            else:  # written only where --calibration-out says: never over the packaged table by default
                cal_report["written_to"] = None
                cal_report["table"] = table.model_dump(mode="json", exclude_none=True)
                progress.log(
                    "calibration table not written (--calibration-out writes it); the report holds it"
                )
        if table_path:
            used = str(table_path)
        elif config.calibrate:
            used = "this run's calibration (not written; see calibration.table)"
        else:
            used = "packaged chorus_sched/calibration.json"
        report["calibration_table"] = {
            "path": used,
            "provisional": table.provisional,
            "source": table.source,
        }
        if config.rows:
            report.update(suite.bench(Planner(table), ignorable))
            report["targets"] = evaluate_targets(report["rows"], config.steps, config.tolerance, config.judge)
    finally:
        suite.close()
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    return report


def _clean(value: Any) -> Any:
    """NaN/inf (e.g. a mean over nothing) become null: the report is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def dumps(report: dict[str, Any]) -> str:
    return json.dumps(_clean(report), indent=1, allow_nan=False, default=str)
