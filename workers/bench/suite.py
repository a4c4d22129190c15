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
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from chorus_sched.embedding import MiniLMEmbedder, token_diff
from chorus_sched.planner import CalibrationTable, Planner, load_calibration, write_calibration
from producer.contract import ReusePlan
from workers.bench import calibrate as cal
from workers.bench.cachedit import CacheDiTEngine, CacheDiTSettings
from workers.bench.contact import SheetGroup, SheetRow, write_sheet
from workers.bench.pairs import (
    CALIBRATION_SEED_BASE,
    CALIBRATION_SET_SEED,
    NEGATIVE_CLASSES,
    NEGATIVE_SEED_BASE,
    NEGATIVE_SET_SEED,
    PAIR_CLASSES,
    Pair,
    Target,
    eval_targets,
    make_negative_pairs,
    make_pairs,
)
from workers.bench.runner import Outcome, Row, Runner, plan_dict, plan_label
from workers.engine.bundle import ModelBundle
from workers.engine.trajectory import Trajectory
from workers.toy.world import ATTRIBUTE_NAMES

logger = logging.getLogger(__name__)

FORMAT = "chorus-bench-quality/1"
ROW_KINDS: tuple[str, ...] = ("no-reuse", "chorus", "tgaa", "cachedit", "chorus-cachedit", "sheet")
SHEET_CLASSES: tuple[str, ...] = ("one-attribute", "two-attributes", "paraphrase", "same-prompt")
ATTRIBUTE_CHANGING: tuple[str, ...] = ("one-attribute", "two-attributes", "reworded-one-attribute")
PROBE_K1, PROBE_K2 = 0.25, 0.5
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


@dataclass
class PairInfo:
    pair: Pair
    similarity: float
    changes: int


def pair_facts(pairs: Sequence[Pair], ignorable: Sequence[str]) -> list[PairInfo]:
    """MiniLM similarity and content-word changes of every pair — what the scheduler computes."""
    embedder = MiniLMEmbedder()
    texts = sorted({p.donor_prompt for p in pairs} | {p.target.prompt for p in pairs})
    vectors = dict(zip(texts, np.asarray(embedder.embed(texts), dtype=np.float64), strict=True))
    ign = frozenset(w.casefold() for w in ignorable)
    out = []
    for p in pairs:
        sim = float(np.clip(vectors[p.donor_prompt] @ vectors[p.target.prompt], -1.0, 1.0))
        out.append(PairInfo(p, sim, token_diff(p.donor_prompt, p.target.prompt).content_changes(ign)))
    return out


def class_report(infos: Sequence[PairInfo], planner: Planner | None, steps: Sequence[int]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for cls in dict.fromkeys(i.pair.pair_class for i in infos):
        group = [i for i in infos if i.pair.pair_class == cls]
        sims = [i.similarity for i in group]
        changes = [i.changes for i in group]
        entry: dict[str, Any] = {
            "n": len(group),
            "similarity": {
                "mean": round(float(np.mean(sims)), 4),
                "min": round(min(sims), 4),
                "max": round(max(sims), 4),
            },
            "content_changes": {
                "mean": round(float(np.mean(changes)), 3),
                "min": min(changes),
                "max": max(changes),
            },
        }
        if planner is not None:
            for n in steps:
                chosen = Counter(
                    planner.plan(i.similarity, token_diff(i.pair.donor_prompt, i.pair.target.prompt), n).row
                    or "none"
                    for i in group
                )
                entry[f"planner_rows_{n}"] = dict(sorted(chosen.items()))
        report[cls] = entry
    return report


def _copy_outcome(o: Outcome) -> Outcome:
    c = copy.copy(o)
    c.reused = False
    return c


class Suite:
    def __init__(self, config: BenchConfig, progress: Progress) -> None:
        self.cfg = config
        self.progress = progress
        self.runner = Runner(config.load_bundle(), config.guidance, config.judge)
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

    # ------------------------------------------------------------------------------------------------------
    def calibrate(self, ignorable: Sequence[str]) -> tuple[CalibrationTable, dict[str, Any]]:
        cfg = self.cfg
        targets = eval_targets(
            cfg.calibration_prompts,
            cfg.calibration_seeds,
            set_seed=CALIBRATION_SET_SEED,
            seed_base=CALIBRATION_SEED_BASE,
        )
        negative_targets = (
            eval_targets(cfg.negative_prompts, set_seed=NEGATIVE_SET_SEED, seed_base=NEGATIVE_SEED_BASE)
            if cfg.negative_prompts
            else []
        )
        everything = pair_facts(
            make_pairs(targets, cfg.classes, seed=1) + make_negative_pairs(negative_targets, seed=2),
            ignorable,
        )
        infos = [i for i in everything if i.pair.pair_class in cfg.classes]
        negatives = [i for i in everything if i.pair.pair_class in NEGATIVE_CLASSES]
        facts = [cal.PairFacts(i.pair, i.similarity, i.changes) for i in infos]
        specs = cal.derive_rows(
            facts,
            [cal.PairFacts(i.pair, i.similarity, i.changes) for i in negatives],
            cfg.min_row_pairs,
        )
        kept = {s.name for s in specs}
        dropped = [s.name for s in cal.class_rows(facts) if s.name not in kept]
        negatives_at: dict[str, Counter[str]] = {s.name: Counter() for s in specs}
        for info in negatives:
            spec = cal.route(specs, info.similarity, info.changes)
            if spec is not None:
                negatives_at[spec.name][info.pair.pair_class] += 1
        routed: dict[str, list[PairInfo]] = {s.name: [] for s in specs}
        for info in infos:
            spec = cal.route(specs, info.similarity, info.changes)
            if spec is not None:
                routed[spec.name].append(info)
        report: dict[str, Any] = {
            "set": {
                "prompts": cfg.calibration_prompts,
                "seeds": cfg.calibration_seeds,
                "set_seed": CALIBRATION_SET_SEED,
                "seed_base": CALIBRATION_SEED_BASE,
            },
            "tolerance": cfg.tolerance,
            "rows": [
                {
                    "name": s.name,
                    "min_similarity": s.min_similarity,
                    "max_content_changes": s.max_content_changes,
                    "drawn_from": list(s.classes),
                    "negatives_max_similarity": s.negatives_max_similarity,
                    "routed_pairs": dict(Counter(i.pair.pair_class for i in routed[s.name])),
                    "routed_negatives": dict(negatives_at[s.name]),
                }
                for s in specs
            ],
            "min_row_pairs": cfg.min_row_pairs,
            "dropped_rows": dropped,
            "negative_set": {
                "prompts": cfg.negative_prompts,
                "set_seed": NEGATIVE_SET_SEED,
                "classes": list(NEGATIVE_CLASSES),
            },
            "pair_classes": class_report(infos, None, []),
            "negative_classes": class_report(negatives, None, []) if negatives else {},
            "regimes": [],
        }
        regimes: list[tuple[str, int, list[Any]]] = []
        for name, n, _ in cal.regime_bounds(cfg.steps):
            with self.progress.phase(f"calibration N={n}: no reuse", len(targets)) as tick:
                base: dict[int, bool] = {}
                for t in targets:
                    base[t.index] = self.runner.run(t.prompt, t.seed, n, t.attributes).correct["all"]
                    tick()
            rows = []
            regime_report: dict[str, Any] = {"name": name, "steps": n, "rows": []}
            for spec in specs:
                items = routed[spec.name]
                if not spec.calibrated or not items:
                    rows.append(cal.table_row(spec, n, None, None))
                    regime_report["rows"].append({"name": spec.name, "chosen": None, "pairs": len(items)})
                    continue
                items = sorted(
                    items, key=lambda i: (i.pair.target.index, PAIR_CLASSES.index(i.pair.pair_class))
                )
                donors: list[Trajectory] = []
                with self.progress.phase(f"calibration N={n} {spec.name}: donors", len(items)) as tick:
                    for info in items:
                        donors.append(self.donor(info.pair, n)[1])
                        tick()
                baseline = [base[i.pair.target.index] for i in items]

                def evaluate(
                    k: int,
                    plan: ReusePlan,
                    items: list[PairInfo] = items,
                    donors: list[Trajectory] = donors,
                    n: int = n,
                ) -> tuple[bool, int, float, float]:
                    t = items[k].pair.target
                    o = self.runner.run(t.prompt, t.seed, n, t.attributes, plan=plan, donor=donors[k])
                    return o.correct["all"], o.steps_computed, o.tokens_fraction, o.block_fraction

                k1f, k2f, alphas, thresholds = cfg.grid(n)
                grid = cal.candidates(n, k1f, k2f, alphas, thresholds)
                with self.progress.phase(f"calibration N={n} {spec.name}: candidates", len(grid)) as tick:
                    chosen, trials = cal.sweep(
                        n, grid, baseline, evaluate, cfg.tolerance, on_trial=lambda _t: tick()
                    )
                del donors
                base_acc = sum(baseline) / len(baseline)
                measured: dict[str, float] = {
                    "steps": float(n),
                    "pairs": float(len(items)),
                    "no_reuse_all_correct": round(base_acc, 4),
                    "similarity_min": round(min(i.similarity for i in items), 4),
                    "candidates_tried": float(len(trials)),
                }
                for cls, count in Counter(i.pair.pair_class for i in items).items():
                    measured[f"pairs_{cls}"] = float(count)
                win = next((tr for tr in trials if tr.passed and tr.candidate == chosen), None)
                if win is not None:
                    measured.update(
                        {
                            "reuse_all_correct": round((win.evaluated - win.wrong) / win.evaluated, 4),
                            "delta_all_correct": round(
                                (win.evaluated - win.wrong) / win.evaluated - base_acc, 4
                            ),
                            "steps_computed_mean": round(win.steps_computed_mean, 3),
                            "tokens_computed_fraction_mean": round(win.tokens_fraction_mean, 4),
                        }
                    )
                rows.append(cal.table_row(spec, n, chosen, measured))
                regime_report["rows"].append(
                    {
                        "name": spec.name,
                        "pairs": len(items),
                        "no_reuse_all_correct": round(base_acc, 4),
                        "chosen": win.as_dict(n) if win is not None else None,
                        "trials": [tr.as_dict(n) for tr in trials],
                    }
                )
            regimes.append((name, n, rows))
            report["regimes"].append(regime_report)
        note = (
            "Measured by `chorus bench quality --calibrate` on the toy model "
            f"(weights {self.cfg.weights.get('weights_id', '?')[:12]}, guidance {cfg.guidance:g}, judged on "
            f"{'+'.join(cfg.judge)}): per regime, each row is the most reuse whose all-attribute accuracy on the calibration pairs the row admits stays within "
            f"{cfg.tolerance * 100:g} point(s) of no reuse on the same targets and seeds (k1 = k2 = 0: nothing "
            f"passed). Rows are drawn from the measured pair classes; '{cal.BLOCKER}' never reuses (changes below the "
            "measured similarities, or 3 content words, were not measured); each reusing row admits only "
            f"similarities above every unmeasured change (3-4 attributes, or 2-4 reworded; {cfg.negative_prompts} "
            f"captions) that would reach it, and rows left with under {cfg.min_row_pairs} measured pairs are "
            f"dropped{' (here: ' + ', '.join(dropped) + ')' if dropped else ''}. See workers/bench/calibrate.py."
        )
        table = cal.build_table(regimes, cfg.command, note, ignorable)
        return table, report

    # ------------------------------------------------------------------------------------------------------
    def bench(self, planner: Planner, ignorable: Sequence[str]) -> dict[str, Any]:
        cfg = self.cfg
        targets = eval_targets(cfg.prompts, cfg.seeds)
        infos = pair_facts(make_pairs(targets, cfg.classes), ignorable)
        want = set(cfg.rows)
        sheet_targets = {t.index for t in targets[: cfg.sheet_prompts]} if "sheet" in want else set()
        frames: dict[tuple[int, int, str], tuple[np.ndarray, Outcome, str]] = {}
        rows: list[dict[str, Any]] = []
        sheets: list[dict[str, Any]] = []
        summary: dict[str, Any] = {}
        for n in cfg.steps:
            base_row = Row(f"no-reuse@{n}", "no-reuse", n, description="every step in full, no donor")
            with self.progress.phase(f"N={n}: no reuse", len(targets)) as tick:
                for t in targets:
                    keep = t.index in sheet_targets
                    o = self.runner.run(t.prompt, t.seed, n, t.attributes, keep_frames=keep)
                    if keep and o.frames is not None:
                        frames[(n, t.index, "no-reuse")] = (o.frames, o, "no reuse")
                    base_row.add(o)
                    tick()
            base_all = {t.index: o.correct["all"] for t, o in zip(targets, base_row.outcomes, strict=True)}
            base_by_index = dict(zip([t.index for t in targets], base_row.outcomes, strict=True))
            rows.append(base_row.summary())

            cache_alone: dict[int, Outcome] = {}
            if "cachedit" in want or "chorus-cachedit" in want:
                for w, settings in enumerate(cfg.cachedit):
                    if w > 0 and "cachedit" not in want:
                        break
                    engine = self.cached_engine(n, w)
                    row = Row(
                        f"cachedit-r{settings.residual_diff_threshold:g}@{n}",
                        "cachedit",
                        n,
                        description="cache-dit DBCache alone",
                        extra={"cachedit_settings": settings.describe(n)},
                    )
                    with self.progress.phase(
                        f"N={n}: cache-dit r={settings.residual_diff_threshold:g}", len(targets)
                    ) as tick:
                        for t in targets:
                            keep = w == 0 and t.index in sheet_targets
                            o = self.runner.run(
                                t.prompt, t.seed, n, t.attributes, cached=engine, keep_frames=keep
                            )
                            if keep and o.frames is not None:
                                frames[(n, t.index, "cachedit")] = (
                                    o.frames,
                                    o,
                                    f"cache-dit r={settings.residual_diff_threshold:g}",
                                )
                            if w == 0:
                                cache_alone[t.index] = o
                            row.add(o)
                            tick()
                    if "cachedit" in want:
                        rows.append(row.summary([base_all[t.index] for t in targets]))

            pooled = Row(
                f"chorus@{n}", "chorus", n, "all", "planner defaults over every pair class (reuse-heavy set)"
            )
            pooled_base: list[bool] = []
            probe = ReusePlan(
                stage1_steps=math.floor(PROBE_K1 * n),
                stage2_steps=math.floor(PROBE_K2 * n),
                stage3_steps=n - math.floor(PROBE_K1 * n) - math.floor(PROBE_K2 * n),
            )
            for cls in cfg.classes:
                group = [i for i in infos if i.pair.pair_class == cls]
                chorus = Row(
                    f"chorus/{cls}@{n}", "chorus", n, cls, "planner's plan from the calibration table"
                )
                alpha1 = Row(
                    f"chorus-alpha1/{cls}@{n}",
                    "chorus-alpha1",
                    n,
                    cls,
                    "planner's plan with alpha=1 (TGAA off), where it has alpha>1 and a Stage 2",
                )
                probes = {
                    a: Row(
                        f"probe-alpha{a:g}/{cls}@{n}",
                        "probe",
                        n,
                        cls,
                        f"fixed plan {plan_label(probe.model_copy(update={'alpha': a}))}",
                        extra={"plan": plan_dict(probe.model_copy(update={"alpha": a}))},
                    )
                    for a in cfg.ablation_alphas
                }
                combined = Row(
                    f"chorus+cachedit/{cls}@{n}",
                    "chorus+cachedit",
                    n,
                    cls,
                    "planner's plan, cache-dit on the computed passes",
                )
                plans: Counter[str] = Counter()
                alpha1_base: list[bool] = []
                run_probe = "tgaa" in want and cls != "same-prompt" and probe.reuses
                with self.progress.phase(f"N={n}: {cls}", len(group)) as tick:
                    for info in group:
                        t = info.pair.target
                        keep = t.index in sheet_targets and cls == SHEET_CLASSES[t.index % len(SHEET_CLASSES)]
                        choice = planner.plan(
                            info.similarity, token_diff(info.pair.donor_prompt, t.prompt), n
                        )
                        plan = choice.plan
                        plans[plan_label(plan)] += 1
                        needs_donor = plan.reuses or run_probe
                        donor: Trajectory | None = None
                        if needs_donor and ({"chorus", "tgaa", "chorus-cachedit"} & want):
                            d_out, donor = self.donor(info.pair, n, keep_frames=keep)
                            if keep and d_out.frames is not None:
                                frames[(n, t.index, "donor")] = (d_out.frames, d_out, f"donor ({cls})")
                        if "chorus" in want:
                            if plan.reuses:
                                o = self.runner.run(
                                    t.prompt,
                                    t.seed,
                                    n,
                                    t.attributes,
                                    plan=plan,
                                    donor=donor,
                                    keep_frames=keep,
                                )
                            else:
                                o = _copy_outcome(base_by_index[t.index])
                                if keep and (n, t.index, "no-reuse") in frames:
                                    o.frames = frames[(n, t.index, "no-reuse")][0]
                            if keep and o.frames is not None:
                                frames[(n, t.index, "chorus")] = (o.frames, o, f"Chorus {plan_label(plan)}")
                            chorus.add(o)
                            pooled.add(copy.copy(o))
                            pooled_base.append(base_all[t.index])
                        if "tgaa" in want and plan.reuses and plan.stage2_steps > 0 and plan.alpha > 1.0:
                            off = plan.model_copy(update={"alpha": 1.0})
                            alpha1.add(
                                self.runner.run(t.prompt, t.seed, n, t.attributes, plan=off, donor=donor)
                            )
                            alpha1_base.append(base_all[t.index])
                        if run_probe:
                            for a, prow in probes.items():
                                p = probe.model_copy(update={"alpha": a})
                                keep_p = keep and a == max(cfg.ablation_alphas)
                                o = self.runner.run(
                                    t.prompt, t.seed, n, t.attributes, plan=p, donor=donor, keep_frames=keep_p
                                )
                                if keep_p and o.frames is not None:
                                    frames[(n, t.index, "probe")] = (o.frames, o, f"probe {plan_label(p)}")
                                prow.add(o)
                        if "chorus-cachedit" in want:
                            if plan.reuses:
                                o = self.runner.run(
                                    t.prompt,
                                    t.seed,
                                    n,
                                    t.attributes,
                                    plan=plan,
                                    donor=donor,
                                    cached=self.cached_engine(n),
                                    keep_frames=keep,
                                )
                            else:
                                o = _copy_outcome(cache_alone[t.index])
                                if keep and (n, t.index, "cachedit") in frames:
                                    o.frames = frames[(n, t.index, "cachedit")][0]
                            if keep and o.frames is not None:
                                frames[(n, t.index, "chorus+cachedit")] = (
                                    o.frames,
                                    o,
                                    f"Chorus {plan_label(plan)} + cache-dit",
                                )
                            combined.add(o)
                        del donor
                        tick()
                cls_base = [base_all[i.pair.target.index] for i in group]
                extra = {"plans": dict(plans.most_common())}
                if "chorus" in want:
                    chorus.extra = extra
                    rows.append(chorus.summary(cls_base))
                if alpha1.outcomes:
                    alpha1.extra = {"n_plans_with_tgaa": len(alpha1.outcomes)}
                    rows.append(alpha1.summary(alpha1_base))
                if run_probe:
                    rows.extend(r.summary(cls_base) for r in probes.values())
                if "chorus-cachedit" in want:
                    combined.extra = {"cachedit_settings": cfg.cachedit[0].describe(n), **extra}
                    rows.append(combined.summary(cls_base))
            if pooled.outcomes:
                pooled_summary = pooled.summary(pooled_base)
                rows.append(pooled_summary)
                summary[str(n)] = pooled_summary
            if sheet_targets:
                path = cfg.out_dir / f"contact_{n}steps.png"
                size = self._sheet(n, targets, sheet_targets, frames, infos, path)
                if size is not None:
                    sheets.append({"steps": n, "path": str(path), "size": list(size)})
                frames = {k: v for k, v in frames.items() if k[0] != n}
        return {
            "pair_classes": class_report(infos, planner, cfg.steps),
            "rows": rows,
            "contact_sheets": sheets,
        }

    def _sheet(
        self,
        n: int,
        targets: Sequence[Target],
        chosen: set[int],
        frames: dict[tuple[int, int, str], tuple[np.ndarray, Outcome, str]],
        infos: Sequence[PairInfo],
        path: Path,
    ) -> tuple[int, int] | None:
        groups = []
        for t in targets:
            if t.index not in chosen:
                continue
            cls = SHEET_CLASSES[t.index % len(SHEET_CLASSES)]
            info = next(
                (i for i in infos if i.pair.target.index == t.index and i.pair.pair_class == cls), None
            )
            rows = []
            for kind in ("donor", "no-reuse", "chorus", "probe", "cachedit", "chorus+cachedit"):
                entry = frames.get((n, t.index, kind))
                if entry is None:
                    continue
                fr, o, label = entry
                wrong = [k for k, ok in o.correct.items() if k != "all" and not ok]
                if kind == "donor":
                    detail = "read: " + " ".join(o.read.values())
                    ok: bool | None = None
                else:
                    detail = ("all correct" if o.correct["all"] else "wrong: " + ", ".join(wrong)) + (
                        f" | compute {o.block_fraction:.2f}"
                    )
                    ok = o.correct["all"]
                rows.append(SheetRow(label, fr, detail, ok))
            if not rows:
                continue
            subtitle = ""
            if info is not None:
                subtitle = f"donor ({cls}, sim {info.similarity:.2f}): {info.pair.donor_prompt}"
            groups.append(SheetGroup(f"[{n} steps, seed {t.seed}] {t.prompt}", subtitle, rows))
        if not groups:
            return None
        return write_sheet(groups, path)


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
            assert out_path is not None
            table, cal_report = suite.calibrate(ignorable)
            write_calibration(table, out_path)
            cal_report["written_to"] = str(out_path)
            report["calibration"] = cal_report
            table_path = out_path
            table = load_calibration(out_path)
            progress.log(f"calibration table written to {out_path}")
        report["calibration_table"] = {
            "path": str(table_path) if table_path else "packaged chorus_sched/calibration.json",
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
