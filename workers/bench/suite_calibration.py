"""``chorus bench quality --calibrate``: measure the calibration table (``Suite.calibrate``).

The calibration pairs and the negatives (changes no row may admit) give the table's rows and route each pair to
at most one row (``calibration_set``); then per regime (one calibrated step count): the calibration targets without
reuse, and per row its pairs' donors and the plan sweep of ``workers.bench.calibrate`` against those no-reuse
outcomes. Kept apart from the benchmark rows (``workers.bench.suite_rows``): the two share only the suite's runner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chorus_sched.planner import CalibrationRow, CalibrationTable
from producer.contract import ReusePlan
from workers.bench import calibrate as cal
from workers.bench.pair_facts import PairFacts, class_report, pair_facts
from workers.bench.pairs import (
    CALIBRATION_SEED_BASE,
    CALIBRATION_SET_SEED,
    NEGATIVE_CLASSES,
    NEGATIVE_SEED_BASE,
    NEGATIVE_SET_SEED,
    PAIR_CLASSES,
    Target,
    eval_targets,
    make_negative_pairs,
    make_pairs,
)
from workers.engine.trajectory import Trajectory

if TYPE_CHECKING:
    from workers.bench.suite import BenchConfig, Suite


@dataclass
class CalibrationSet:
    """The calibration pairs and negatives, the table rows derived from them, and what each row admits."""

    targets: list[Target]
    infos: list[PairFacts]
    negatives: list[PairFacts]
    specs: list[cal.RowSpec]
    dropped: list[str]  # rows left with too few measured pairs
    routed: dict[str, list[PairFacts]]  # row name -> the calibration pairs it admits
    negatives_at: dict[str, Counter[str]]  # row name -> negatives it admits, per negative class


def calibration_set(cfg: BenchConfig, ignorable: Sequence[str]) -> CalibrationSet:
    """Build the pair facts once and route each pair (and each negative) once."""
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
    specs = cal.derive_rows(infos, negatives, cfg.min_row_pairs)
    kept = {s.name for s in specs}
    dropped = [s.name for s in cal.class_rows(infos) if s.name not in kept]
    negatives_at: dict[str, Counter[str]] = {s.name: Counter() for s in specs}
    for info in negatives:
        spec = cal.route(specs, info.similarity, info.content_changes)
        if spec is not None:
            negatives_at[spec.name][info.pair.pair_class] += 1
    routed: dict[str, list[PairFacts]] = {s.name: [] for s in specs}
    for info in infos:
        spec = cal.route(specs, info.similarity, info.content_changes)
        if spec is not None:
            routed[spec.name].append(info)
    return CalibrationSet(targets, infos, negatives, specs, dropped, routed, negatives_at)


def set_report(cfg: BenchConfig, cs: CalibrationSet) -> dict[str, Any]:
    """The report's ``calibration`` section before any regime was measured."""
    return {
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
                "routed_pairs": dict(Counter(i.pair.pair_class for i in cs.routed[s.name])),
                "routed_negatives": dict(cs.negatives_at[s.name]),
            }
            for s in cs.specs
        ],
        "min_row_pairs": cfg.min_row_pairs,
        "dropped_rows": cs.dropped,
        "negative_set": {
            "prompts": cfg.negative_prompts,
            "set_seed": NEGATIVE_SET_SEED,
            "classes": list(NEGATIVE_CLASSES),
        },
        "pair_classes": class_report(cs.infos, None, []),
        "negative_classes": class_report(cs.negatives, None, []) if cs.negatives else {},
        "regimes": [],
    }


class Calibration:
    """One ``Suite.calibrate`` call: every regime, every row, on the suite's runner."""

    def __init__(self, suite: Suite, ignorable: Sequence[str]) -> None:
        self.suite = suite
        self.cfg = suite.cfg
        self.ignorable = ignorable

    def run(self) -> tuple[CalibrationTable, dict[str, Any]]:
        cs = calibration_set(self.cfg, self.ignorable)
        report = set_report(self.cfg, cs)
        regimes: list[tuple[str, int, list[Any]]] = []
        for name, n, _ in cal.regime_bounds(self.cfg.steps):
            base = self.no_reuse(cs.targets, n)
            rows = []
            regime_report: dict[str, Any] = {"name": name, "steps": n, "rows": []}
            for spec in cs.specs:
                row, entry = self.row(spec, cs.routed[spec.name], base, n)
                rows.append(row)
                regime_report["rows"].append(entry)
            regimes.append((name, n, rows))
            report["regimes"].append(regime_report)
        table = cal.build_table(regimes, self.cfg.command, self.note(cs.dropped), self.ignorable)
        return table, report

    def no_reuse(self, targets: Sequence[Target], n: int) -> dict[int, bool]:
        """All-correct flag of every calibration target at N steps without reuse, by target index."""
        base: dict[int, bool] = {}
        with self.suite.progress.phase(f"calibration N={n}: no reuse", len(targets)) as tick:
            for t in targets:
                base[t.index] = self.suite.runner.run(t.prompt, t.seed, n, t.attributes).correct["all"]
                tick()
        return base

    def row(
        self, spec: cal.RowSpec, items: list[PairFacts], base: dict[int, bool], n: int
    ) -> tuple[CalibrationRow, dict[str, Any]]:
        """The table row ``spec`` at N steps and its report entry: the sweep's choice over the row's pairs."""
        if not spec.calibrated or not items:
            return cal.table_row(spec, n, None, None), {
                "name": spec.name,
                "chosen": None,
                "pairs": len(items),
            }
        items = sorted(items, key=lambda i: (i.pair.target.index, PAIR_CLASSES.index(i.pair.pair_class)))
        baseline = [base[i.pair.target.index] for i in items]
        chosen, trials = self.sweep(spec, items, baseline, n)
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
                    "delta_all_correct": round((win.evaluated - win.wrong) / win.evaluated - base_acc, 4),
                    "steps_computed_mean": round(win.steps_computed_mean, 3),
                    "tokens_computed_fraction_mean": round(win.tokens_fraction_mean, 4),
                    "lost": float(win.lost),
                    "gained": float(win.gained),
                    "loss_bound": round(win.loss_bound, 4),
                }
            )
        entry = {
            "name": spec.name,
            "pairs": len(items),
            "no_reuse_all_correct": round(base_acc, 4),
            "chosen": win.as_dict(n) if win is not None else None,
            "trials": [tr.as_dict(n) for tr in trials],
        }
        return cal.table_row(spec, n, chosen, measured), entry

    def sweep(
        self, spec: cal.RowSpec, items: list[PairFacts], baseline: list[bool], n: int
    ) -> tuple[cal.CandidatePlan | None, list[cal.Trial]]:
        """Generate the row's donors, then try the candidate plans on its pairs (the donors are dropped on
        return, before the next row generates its own)."""
        progress, runner = self.suite.progress, self.suite.runner
        donors: list[Trajectory] = []
        with progress.phase(f"calibration N={n} {spec.name}: donors", len(items)) as tick:
            for info in items:
                donors.append(self.suite.donor(info.pair, n)[1])
                tick()

        def evaluate(k: int, plan: ReusePlan) -> tuple[bool, int, float, float]:
            t = items[k].pair.target
            o = runner.run(t.prompt, t.seed, n, t.attributes, plan=plan, donor=donors[k])
            return o.correct["all"], o.steps_computed, o.tokens_fraction, o.block_fraction

        k1f, k2f, alphas, thresholds = self.cfg.grid(n)
        grid = cal.candidates(n, k1f, k2f, alphas, thresholds)
        with progress.phase(f"calibration N={n} {spec.name}: candidates", len(grid)) as tick:
            return cal.sweep(n, grid, baseline, evaluate, self.cfg.tolerance, on_trial=lambda _t: tick())

    def note(self, dropped: list[str]) -> str:
        cfg = self.cfg
        return (
            "Measured by `chorus bench quality --calibrate` on the toy model "
            f"(weights {cfg.weights.get('weights_id', '?')[:12]}, guidance {cfg.guidance:g}, judged on "
            f"{'+'.join(cfg.judge)}): per regime, each row is the most reuse whose all-attribute accuracy on the calibration pairs the row admits stays within "
            f"{cfg.tolerance * 100:g} point(s) of no reuse on the same targets and seeds (k1 = k2 = 0: nothing "
            f"passed). Rows are drawn from the measured pair classes; '{cal.BLOCKER}' never reuses (changes below the "
            "measured similarities, or 3 content words, were not measured); each reusing row admits only "
            f"similarities above every unmeasured change (3-4 attributes, or 2-4 reworded; {cfg.negative_prompts} "
            f"captions) that would reach it, and rows left with under {cfg.min_row_pairs} measured pairs are "
            f"dropped{' (here: ' + ', '.join(dropped) + ')' if dropped else ''}. See workers/bench/calibrate.py."
        )
