"""The benchmark rows of one step count N (``Suite.bench``), one method per row kind.

``StepCountBench`` runs N's rows in the order that ``workers.bench.suite`` describes: ``no_reuse`` (always: it is
every other row's baseline), ``cachedit``, then per pair class each target once, its donor generated once and
shared by the ``chorus``, ``tgaa`` (``alpha1`` and ``probes``) and ``chorus_cachedit`` rows; then the pooled
``chorus`` row and the contact ``sheet``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from chorus_sched.embedding import word_diff
from chorus_sched.planner import Planner
from producer.contract import ReusePlan
from workers.bench.contact import SheetGroup, SheetRow, write_sheet
from workers.bench.pair_facts import PairFacts
from workers.bench.pairs import Target
from workers.bench.runner import Outcome, Row, plan_dict, plan_label
from workers.engine.trajectory import Trajectory

if TYPE_CHECKING:
    from workers.bench.suite import Suite

SHEET_CLASSES: tuple[str, ...] = ("one-attribute", "two-attributes", "paraphrase", "same-prompt")
PROBE_K1, PROBE_K2 = 0.25, 0.5

# (N, target index, row kind) -> (frames, outcome, label), for the contact sheet
Frames = dict[tuple[int, int, str], tuple[np.ndarray, Outcome, str]]


SERVED = "served (another seed's video)"


def _copy_outcome(o: Outcome) -> Outcome:
    c = copy.copy(o)
    c.reused = False
    return c


def _served(donor: Outcome) -> Outcome:
    """What the scheduler answers a same-prompt request of another seed: the donor's clip, nothing computed."""
    return dataclasses.replace(
        donor,
        steps_computed=0,
        tokens_fraction=0.0,
        block_fraction=0.0,
        reused=True,
        fallback=None,
        seconds=0.0,
        stage2_fractions=(),
        verification=None,
        cache=None,
        trajectory=None,
    )


@dataclass
class ClassRows:
    """The rows of one pair class at one step count, filled target by target."""

    chorus: Row
    alpha1: Row
    probes: dict[float, Row]
    combined: Row
    plans: Counter[str] = field(default_factory=Counter)
    alpha1_base: list[bool] = field(default_factory=list)


class StepCountBench:
    """Every row of one step count N; ``run`` returns their summaries in report order."""

    def __init__(
        self,
        suite: Suite,
        n: int,
        targets: Sequence[Target],
        infos: Sequence[PairFacts],
        planner: Planner,
        sheet_targets: set[int],
        negatives: Sequence[PairFacts] = (),
    ) -> None:
        self.suite = suite
        self.negative_pairs = negatives
        self.cfg = suite.cfg
        self.n = n
        self.targets = targets
        self.infos = infos
        self.planner = planner
        self.sheet_targets = sheet_targets
        self.want = set(self.cfg.rows)
        self.frames: Frames = {}
        self.rows: list[dict[str, Any]] = []
        self.base_all: dict[int, bool] = {}  # target index -> all correct without reuse
        self.base_by_index: dict[int, Outcome] = {}
        self.cache_alone: dict[int, Outcome] = {}  # target index -> outcome under the first cache-dit setting
        self.pooled = Row(
            f"chorus@{n}", "chorus", n, "all", "planner defaults over every pair class (reuse-heavy set)"
        )
        self.pooled_base: list[bool] = []
        self.probe = ReusePlan(
            stage1_steps=math.floor(PROBE_K1 * n),
            stage2_steps=math.floor(PROBE_K2 * n),
            stage3_steps=n - math.floor(PROBE_K1 * n) - math.floor(PROBE_K2 * n),
        )

    def run(self) -> list[dict[str, Any]]:
        self.no_reuse()
        if "cachedit" in self.want or "chorus-cachedit" in self.want:
            self.cachedit()
        for cls in self.cfg.classes:
            self.pair_class(cls)
        if self.pooled.outcomes:
            self.rows.append(self.pooled.summary(self.pooled_base))
        if self.negative_pairs and "chorus" in self.want:
            self.negatives()
        return self.rows

    # --- negatives: changes no row was measured on, generated wherever the planner would reuse --------------
    def negatives(self) -> None:
        """The planner's plan on each negative pair it would reuse for (each with its donor and its own no-reuse
        clip): what the model's donor check turned away and what it let through. A kept donor that got an
        attribute wrong which no reuse got right is *harmed*."""
        n = self.n
        planned = [
            (info, choice.plan)
            for info in self.negative_pairs
            for choice in [
                self.planner.plan(
                    info.similarity, word_diff(info.pair.donor_prompt, info.pair.target.prompt), n
                )
            ]
            if choice.plan.reuses
        ]
        row = Row(
            f"chorus/negatives@{n}",
            "chorus",
            n,
            "negatives",
            "planner's plan on the negative pairs it would reuse for (3-4 attributes, or 2-4 in other words)",
        )
        base: list[bool] = []
        harmed: Counter[str] = Counter()
        alone_by_target: dict[int, Outcome] = {}  # each target has a negative of every class: run it once
        with self.suite.progress.phase(f"N={n}: negatives the planner reuses for", len(planned)) as tick:
            for info, plan in planned:
                t = info.pair.target
                if t.index not in alone_by_target:
                    alone_by_target[t.index] = self.suite.runner.run(t.prompt, t.seed, n, t.attributes)
                alone = alone_by_target[t.index]
                donor = self.suite.donor(info.pair, n)[1]
                o = self.suite.runner.run(t.prompt, t.seed, n, t.attributes, plan=plan, donor=donor)
                o.changed = info.pair.changed
                if o.reused and any(alone.correct[a] and not o.correct[a] for a in self.suite.runner.judge):
                    harmed[info.pair.pair_class] += 1
                row.add(o)
                base.append(alone.correct["all"])
                tick()
        row.extra = {
            "negative_pairs": len(self.negative_pairs),
            "planned_reuse": len(planned),
            "planned_by_class": dict(Counter(i.pair.pair_class for i, _ in planned)),
            "kept_donor": sum(1 for o in row.outcomes if o.reused),
            "harmed": sum(harmed.values()),
            "harmed_by_class": dict(harmed),
        }
        self.rows.append(row.summary(base))

    # --- no-reuse and cache-dit alone: every target --------------------------------------------------------
    def no_reuse(self) -> None:
        n, targets = self.n, self.targets
        base_row = Row(f"no-reuse@{n}", "no-reuse", n, description="every step in full, no donor")
        with self.suite.progress.phase(f"N={n}: no reuse", len(targets)) as tick:
            for t in targets:
                keep = t.index in self.sheet_targets
                o = self.suite.runner.run(t.prompt, t.seed, n, t.attributes, keep_frames=keep)
                if keep and o.frames is not None:
                    self.frames[(n, t.index, "no-reuse")] = (o.frames, o, "no reuse")
                base_row.add(o)
                tick()
        self.base_all = {t.index: o.correct["all"] for t, o in zip(targets, base_row.outcomes, strict=True)}
        self.base_by_index = dict(zip([t.index for t in targets], base_row.outcomes, strict=True))
        self.rows.append(base_row.summary())

    def cachedit(self) -> None:
        """One row per cache-dit setting; only the first when just ``chorus-cachedit`` needs its outcomes."""
        for w in range(len(self.cfg.cachedit)):
            if w > 0 and "cachedit" not in self.want:
                break
            self.cachedit_setting(w)

    def cachedit_setting(self, w: int) -> None:
        n, targets, settings = self.n, self.targets, self.cfg.cachedit[w]
        engine = self.suite.cached_engine(n, w)
        row = Row(
            f"cachedit-r{settings.residual_diff_threshold:g}@{n}",
            "cachedit",
            n,
            description="cache-dit DBCache alone",
            extra={"cachedit_settings": settings.describe(n)},
        )
        with self.suite.progress.phase(
            f"N={n}: cache-dit r={settings.residual_diff_threshold:g}", len(targets)
        ) as tick:
            for t in targets:
                keep = w == 0 and t.index in self.sheet_targets
                o = self.suite.runner.run(t.prompt, t.seed, n, t.attributes, cached=engine, keep_frames=keep)
                if keep and o.frames is not None:
                    self.frames[(n, t.index, "cachedit")] = (
                        o.frames,
                        o,
                        f"cache-dit r={settings.residual_diff_threshold:g}",
                    )
                if w == 0:
                    self.cache_alone[t.index] = o
                row.add(o)
                tick()
        if "cachedit" in self.want:
            self.rows.append(row.summary([self.base_all[t.index] for t in targets]))

    # --- per pair class: each target with its donor ---------------------------------------------------------
    def pair_class(self, cls: str) -> None:
        group = [i for i in self.infos if i.pair.pair_class == cls]
        rows = self.class_rows(cls)
        run_probe = "tgaa" in self.want and cls != "same-prompt" and self.probe.reuses
        with self.suite.progress.phase(f"N={self.n}: {cls}", len(group)) as tick:
            for info in group:
                self.pair(info, cls, rows, run_probe)
                tick()
        cls_base = [self.base_all[i.pair.target.index] for i in group]
        extra = {"plans": dict(rows.plans.most_common())}
        if "chorus" in self.want:
            rows.chorus.extra = extra
            self.rows.append(rows.chorus.summary(cls_base))
        if rows.alpha1.outcomes:
            rows.alpha1.extra = {"n_plans_with_tgaa": len(rows.alpha1.outcomes)}
            self.rows.append(rows.alpha1.summary(rows.alpha1_base))
        if run_probe:
            self.rows.extend(r.summary(cls_base) for r in rows.probes.values())
        if "chorus-cachedit" in self.want:
            rows.combined.extra = {"cachedit_settings": self.cfg.cachedit[0].describe(self.n), **extra}
            self.rows.append(rows.combined.summary(cls_base))

    def class_rows(self, cls: str) -> ClassRows:
        n, probe = self.n, self.probe
        return ClassRows(
            chorus=Row(f"chorus/{cls}@{n}", "chorus", n, cls, "planner's plan from the calibration table"),
            alpha1=Row(
                f"chorus-alpha1/{cls}@{n}",
                "chorus-alpha1",
                n,
                cls,
                "planner's plan with alpha=1 (TGAA off), where it has alpha>1 and a Stage 2",
            ),
            probes={
                a: Row(
                    f"probe-alpha{a:g}/{cls}@{n}",
                    "probe",
                    n,
                    cls,
                    f"fixed plan {plan_label(probe.model_copy(update={'alpha': a}))}",
                    extra={"plan": plan_dict(probe.model_copy(update={"alpha": a}))},
                )
                for a in self.cfg.ablation_alphas
            },
            combined=Row(
                f"chorus+cachedit/{cls}@{n}",
                "chorus+cachedit",
                n,
                cls,
                "planner's plan, cache-dit on the computed passes",
            ),
        )

    def pair(self, info: PairFacts, cls: str, rows: ClassRows, run_probe: bool) -> None:
        """One target of the class: its donor (once), then each wanted row's request."""
        n, t = self.n, info.pair.target
        keep = t.index in self.sheet_targets and cls == SHEET_CLASSES[t.index % len(SHEET_CLASSES)]
        choice = self.planner.plan(info.similarity, word_diff(info.pair.donor_prompt, t.prompt), n)
        plan = choice.plan
        # The very same prompt and settings with another seed: the scheduler serves the donor's video whole
        # (chorus_sched.exact; what a Stage-1 plan from it would compute, bit for bit), unless the request keeps
        # its seed, which the benchmark's do not.
        served = info.pair.donor_prompt == t.prompt
        rows.plans[SERVED if served else plan_label(plan)] += 1
        needs_donor = served or plan.reuses or run_probe
        donor: Trajectory | None = None
        d_out: Outcome | None = None
        if needs_donor and ({"chorus", "tgaa", "chorus-cachedit"} & self.want):
            d_out, donor = self.suite.donor(info.pair, n, keep_frames=keep)
            if keep and d_out.frames is not None:
                self.frames[(n, t.index, "donor")] = (d_out.frames, d_out, f"donor ({cls})")
        clip = _served(d_out) if served and d_out is not None else None
        if "chorus" in self.want:
            self.chorus(t, plan, donor, keep, rows.chorus, served=clip)
            rows.chorus.outcomes[-1].changed = info.pair.changed
        if "tgaa" in self.want and plan.reuses and plan.stage2_steps > 0 and plan.alpha > 1.0:
            self.alpha1(t, plan, donor, rows)
        if run_probe:
            self.probes(t, donor, keep, rows.probes)
        if "chorus-cachedit" in self.want:
            if clip is not None:  # served whole: no cache-dit run either
                rows.combined.add(copy.copy(clip))
            else:
                self.chorus_cachedit(t, plan, donor, keep, rows.combined)

    def chorus(
        self,
        t: Target,
        plan: ReusePlan,
        donor: Trajectory | None,
        keep: bool,
        row: Row,
        served: Outcome | None = None,
    ) -> None:
        """The planner's plan; a plan without reuse is the no-reuse outcome (everything is seeded); a request
        served another seed's video of its prompt is that clip (``served``: computed nothing)."""
        n = self.n
        label = f"Chorus {plan_label(plan)}"
        if served is not None:
            o = copy.copy(served)
            label = f"Chorus: {SERVED}"
        elif plan.reuses:
            o = self.suite.runner.run(
                t.prompt, t.seed, n, t.attributes, plan=plan, donor=donor, keep_frames=keep
            )
        else:
            o = _copy_outcome(self.base_by_index[t.index])
            if keep and (n, t.index, "no-reuse") in self.frames:
                o.frames = self.frames[(n, t.index, "no-reuse")][0]
        if keep and o.frames is not None:
            self.frames[(n, t.index, "chorus")] = (o.frames, o, label)
        row.add(o)
        self.pooled.add(copy.copy(o))
        self.pooled_base.append(self.base_all[t.index])

    def alpha1(self, t: Target, plan: ReusePlan, donor: Trajectory | None, rows: ClassRows) -> None:
        """The planner's plan with TGAA off."""
        off = plan.model_copy(update={"alpha": 1.0})
        rows.alpha1.add(self.suite.runner.run(t.prompt, t.seed, self.n, t.attributes, plan=off, donor=donor))
        rows.alpha1_base.append(self.base_all[t.index])

    def probes(self, t: Target, donor: Trajectory | None, keep: bool, probes: dict[float, Row]) -> None:
        """The fixed probe plan at each ablation α."""
        n = self.n
        for a, prow in probes.items():
            p = self.probe.model_copy(update={"alpha": a})
            keep_p = keep and a == max(self.cfg.ablation_alphas)
            o = self.suite.runner.run(
                t.prompt, t.seed, n, t.attributes, plan=p, donor=donor, keep_frames=keep_p
            )
            if keep_p and o.frames is not None:
                self.frames[(n, t.index, "probe")] = (o.frames, o, f"probe {plan_label(p)}")
            prow.add(o)

    def chorus_cachedit(
        self, t: Target, plan: ReusePlan, donor: Trajectory | None, keep: bool, row: Row
    ) -> None:
        """The planner's plan under cache-dit; without reuse it is the cache-dit-alone outcome."""
        n = self.n
        if plan.reuses:
            o = self.suite.runner.run(
                t.prompt,
                t.seed,
                n,
                t.attributes,
                plan=plan,
                donor=donor,
                cached=self.suite.cached_engine(n),
                keep_frames=keep,
            )
        else:
            o = _copy_outcome(self.cache_alone[t.index])
            if keep and (n, t.index, "cachedit") in self.frames:
                o.frames = self.frames[(n, t.index, "cachedit")][0]
        if keep and o.frames is not None:
            self.frames[(n, t.index, "chorus+cachedit")] = (
                o.frames,
                o,
                f"Chorus {plan_label(plan)} + cache-dit",
            )
        row.add(o)

    # --- contact sheet ----------------------------------------------------------------------------------------
    def sheet(self) -> dict[str, Any] | None:
        """Write N's contact sheet (the kept frames of the sheet targets); its report entry, or None if empty."""
        path = self.cfg.out_dir / f"contact_{self.n}steps.png"
        groups = [g for t in self.targets if t.index in self.sheet_targets for g in self.sheet_group(t)]
        if not groups:
            return None
        size = write_sheet(groups, path)
        return {"steps": self.n, "path": str(path), "size": list(size)}

    def sheet_group(self, t: Target) -> list[SheetGroup]:
        """The target's group of the sheet ([] when nothing of it was kept)."""
        n = self.n
        cls = SHEET_CLASSES[t.index % len(SHEET_CLASSES)]
        info = next(
            (i for i in self.infos if i.pair.target.index == t.index and i.pair.pair_class == cls), None
        )
        rows = []
        for kind in ("donor", "no-reuse", "chorus", "probe", "cachedit", "chorus+cachedit"):
            entry = self.frames.get((n, t.index, kind))
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
            return []
        subtitle = ""
        if info is not None:
            subtitle = f"donor ({cls}, sim {info.similarity:.2f}): {info.pair.donor_prompt}"
        return [SheetGroup(f"[{n} steps, seed {t.seed}] {t.prompt}", subtitle, rows)]
