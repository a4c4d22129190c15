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

from chorus_sched.planner import CalibrationRow, CalibrationTable, VerificationThresholds
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
    # verified row name -> the negatives it admits that are generated and measured with it (a sample)
    measured_negatives: dict[str, list[PairFacts]]


def sample_by_class(pairs: Sequence[PairFacts], limit: int) -> list[PairFacts]:
    """At most ``limit`` of ``pairs``, taken in turn from each class (first come first), so that every class
    reaching a row is measured."""
    queues: dict[str, list[PairFacts]] = {}
    for f in pairs:
        queues.setdefault(f.pair.pair_class, []).append(f)
    out: list[PairFacts] = []
    while len(out) < limit and any(queues.values()):
        for queue in queues.values():
            if queue and len(out) < limit:
                out.append(queue.pop(0))
    return out


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
    measured = {
        s.name: sample_by_class(
            [f for f in negatives if cal.route(specs, f.similarity, f.content_changes) == s],
            cfg.verified_negatives,
        )
        for s in specs
        if s.verified
    }
    return CalibrationSet(targets, infos, negatives, specs, dropped, routed, negatives_at, measured)


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
                "verified": s.verified,
                "measured_negatives": dict(
                    Counter(f.pair.pair_class for f in cs.measured_negatives.get(s.name, []))
                ),
            }
            for s in cs.specs
        ],
        "min_row_pairs": cfg.min_row_pairs,
        "verified_negatives": cfg.verified_negatives,
        "verification": VerificationThresholds().model_dump(),
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


def target_key(t: Target) -> tuple[str, int]:
    """A target across sets (the calibration and negative sets number their targets from 0 each)."""
    return (t.prompt, t.seed)


@dataclass(frozen=True)
class Checked:
    """One pair under one candidate plan: the donor check's decision (None: nothing checked), whether the donor
    was used, and whether the clip was all correct."""

    decision: str | None
    reused: bool
    correct: bool


def verification_counts(items: Sequence[PairFacts], checked: dict[int, Checked]) -> dict[str, dict[str, int]]:
    """Per pair class, how many pairs each decision of the donor check got (pairs not evaluated left out)."""
    out: dict[str, Counter[str]] = {}
    for k, c in checked.items():
        out.setdefault(items[k].pair.pair_class, Counter())[c.decision or "none"] += 1
    return {cls: dict(sorted(counts.items())) for cls, counts in sorted(out.items())}


def negative_harm(
    items: Sequence[PairFacts], baseline: Sequence[bool], checked: dict[int, Checked], first_negative: int
) -> dict[str, int]:
    """Of the negatives (items from ``first_negative`` on): how many were measured, how many kept their donor
    after the check, and how many of those came out wrong where no reuse was right (an attribute the target
    asked for lost to the donor)."""
    negatives = [k for k in checked if k >= first_negative]
    reused = [k for k in negatives if checked[k].reused]
    harmed = [k for k in reused if baseline[k] and not checked[k].correct]
    return {
        "negatives_measured": len(negatives),
        "negatives_reused": len(reused),
        "negatives_harmed": len(harmed),
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
        negative_targets = list(
            {
                target_key(f.pair.target): f.pair.target for fs in cs.measured_negatives.values() for f in fs
            }.values()
        )
        for name, n, _ in cal.regime_bounds(self.cfg.steps):
            base = self.no_reuse([*cs.targets, *negative_targets], n)
            rows = []
            regime_report: dict[str, Any] = {"name": name, "steps": n, "rows": []}
            for spec in cs.specs:
                negatives = cs.measured_negatives.get(spec.name, [])
                row, entry = self.row(spec, cs.routed[spec.name], negatives, base, n)
                rows.append(row)
                regime_report["rows"].append(entry)
            regimes.append((name, n, rows))
            report["regimes"].append(regime_report)
        table = cal.build_table(regimes, self.cfg.command, self.note(cs.dropped), self.ignorable)
        return table, report

    def no_reuse(self, targets: Sequence[Target], n: int) -> dict[tuple[str, int], bool]:
        """All-correct flag of every target at N steps without reuse, by ``target_key``."""
        base: dict[tuple[str, int], bool] = {}
        with self.suite.progress.phase(f"calibration N={n}: no reuse", len(targets)) as tick:
            for t in targets:
                base[target_key(t)] = self.suite.runner.run(t.prompt, t.seed, n, t.attributes).correct["all"]
                tick()
        return base

    def row(
        self,
        spec: cal.RowSpec,
        items: list[PairFacts],
        negatives: list[PairFacts],
        base: dict[tuple[str, int], bool],
        n: int,
    ) -> tuple[CalibrationRow, dict[str, Any]]:
        """The table row ``spec`` at N steps and its report entry: the sweep's choice over the row's pairs (and,
        for a verified row, the negatives it admits: what the model's check must turn away)."""
        if not spec.calibrated or not items:
            return cal.table_row(spec, n, None, None), {
                "name": spec.name,
                "chosen": None,
                "pairs": len(items),
            }
        items = sorted(items, key=lambda i: (i.pair.target.index, PAIR_CLASSES.index(i.pair.pair_class)))
        items = [*items, *negatives]
        baseline = [base[target_key(i.pair.target)] for i in items]
        chosen, trials, checks = self.sweep(spec, items, baseline, n)
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
        entry: dict[str, Any] = {
            "name": spec.name,
            "pairs": len(items),
            "negatives": len(negatives),
            "no_reuse_all_correct": round(base_acc, 4),
            "chosen": win.as_dict(n) if win is not None else None,
            "trials": [tr.as_dict(n) for tr in trials],
        }
        decided = checks.get(chosen) if chosen is not None else None
        if decided:
            entry["chosen_verification"] = verification_counts(items, decided)
            if negatives:
                harm = negative_harm(items, baseline, decided, first_negative=len(items) - len(negatives))
                measured.update({k: float(v) for k, v in harm.items()})
                entry["negatives_outcome"] = harm
        return cal.table_row(spec, n, chosen, measured), entry

    def sweep(
        self,
        spec: cal.RowSpec,
        items: list[PairFacts],
        baseline: list[bool],
        n: int,
    ) -> tuple[cal.CandidatePlan | None, list[cal.Trial], dict[cal.CandidatePlan, dict[int, Checked]]]:
        """Generate the row's donors and each item's target prompt without reuse from its donor's noise seed
        (what an output that kept a Stage-1 donor is paired with, ``calibrate.sweep``), then try the candidate
        plans on its pairs (the donors are dropped on return, before the next row generates its own). Also
        returns, per candidate and pair, what the model's donor check decided and whether the clip came out
        right."""
        progress, runner = self.suite.progress, self.suite.runner
        donors: list[Trajectory] = []
        donor_baseline: list[bool] = []
        with progress.phase(f"calibration N={n} {spec.name}: donors", len(items)) as tick:
            for info in items:
                d_out, trajectory = self.suite.donor(info.pair, n)
                donors.append(trajectory)
                t = info.pair.target
                if info.pair.donor_prompt == t.prompt:  # the donor itself is that clip (same request)
                    donor_baseline.append(d_out.correct["all"])
                else:
                    donor_baseline.append(
                        runner.run(t.prompt, info.pair.donor_seed, n, t.attributes).correct["all"]
                    )
                tick()

        checks: dict[str, dict[int, Checked]] = {}  # by the plan as run (JSON)

        def evaluate(k: int, plan: ReusePlan) -> cal.Evaluated:
            t = items[k].pair.target
            o = runner.run(t.prompt, t.seed, n, t.attributes, plan=plan, donor=donors[k])
            checks.setdefault(plan.model_dump_json(), {})[k] = Checked(
                o.verification, o.reused, o.correct["all"]
            )
            kept = o.reused and plan.stage1_steps > 0  # started from the donor's latent
            return cal.Evaluated(
                o.correct["all"], o.steps_computed, o.tokens_fraction, o.block_fraction, kept
            )

        k1f, k2f, alphas, thresholds = self.cfg.grid(n)
        grid = cal.candidates(n, k1f, k2f, alphas, thresholds)
        if spec.verified:  # only Stage-1 plans (the planner never applies it otherwise), at each threshold
            grid = cal.verified_candidates(grid)
        policy = VerificationThresholds().for_plan()  # the thresholds ``build_table`` writes
        with progress.phase(f"calibration N={n} {spec.name}: candidates", len(grid)) as tick:
            chosen, trials = cal.sweep(
                n,
                grid,
                baseline,
                evaluate,
                self.cfg.tolerance,
                on_trial=lambda _t: tick(),
                verification=policy,
                similarities=[i.similarity for i in items],
                donor_baseline=donor_baseline,
            )
        # candidates that differ only in their similarity floor run the same plan: each keeps the items it ran
        by_candidate = {
            c: {
                k: v
                for k, v in checks.get(c.plan(n, policy).model_dump_json(), {}).items()
                if c.min_similarity is None or items[k].similarity >= c.min_similarity
            }
            for c in grid
        }
        return chosen, trials, by_candidate

    def note(self, dropped: list[str]) -> str:
        cfg = self.cfg
        return (
            "Measured by `chorus bench quality --calibrate` on the toy model "
            f"(weights {cfg.weights.get('weights_id', '?')[:12]}, guidance {cfg.guidance:g}, judged on "
            f"{'+'.join(cfg.judge)}): per regime, each row is the most reuse whose all-attribute accuracy on the calibration pairs the row admits passes the "
            f"paired test: the one-sided 95% bound of the loss against no reuse from the same noise (the donor's "
            f"seed where a Stage-1 donor was kept) within {cfg.tolerance * 100:g} point(s) (k1 = k2 = 0: nothing "
            f"passed). Rows are drawn from the measured pair classes; '{cal.BLOCKER}' never reuses (changes below the "
            "measured similarities, or 3 content words, were not measured); each reusing row admits only "
            f"similarities above every unmeasured change (3-4 attributes, or 2-4 reworded; {cfg.negative_prompts} "
            f"captions) that would reach it, and rows left with under {cfg.min_row_pairs} measured pairs are "
            f"dropped{' (here: ' + ', '.join(dropped) + ')' if dropped else ''}. A verified row (paraphrase: other "
            "words, changes > 3) is not bounded by the negatives: it applies only while the worker checks each donor "
            "with the model, and up to "
            f"{cfg.verified_negatives} negatives it admits are generated and counted in its paired test. Plans with "
            "a Stage 1 were measured with the table's verification thresholds. See workers/bench/calibrate.py."
        )
