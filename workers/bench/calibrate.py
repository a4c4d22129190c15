"""Calibration of the reuse planner's table from measured attribute accuracy (``chorus bench quality --calibrate``).

1. **Rows from the pair classes.** On a calibration set (its own prompts and noise seeds, apart from the
   benchmark's), every pair class is embedded (MiniLM) and word-diffed exactly as the scheduler does. Each measured
   class becomes a planner row whose admission rule (``min_similarity`` = the lowest similarity seen in the class,
   rounded down to 0.01; ``max_content_changes`` = the most content-word changes seen) covers what was measured:
   ``same-prompt`` (0 changes), ``one-attribute`` (1), ``two-attributes`` (2), then a blocker row that never
   reuses for small changes below the measured similarities and for 3 changes (not measured), then
   ``paraphrase``. The planner takes the first row that admits a pair, so each pair is *routed* to one row by the
   very rule the planner applies, and every row is calibrated on all the pairs it admits — e.g. the paraphrase
   row also sees the ``reworded-one-attribute`` pairs it cannot tell from paraphrases.
   **Negative pairs bound the rows** (``bound_rows``): changes no class measures (three or four attributes,
   or two to four in other words; ``pairs.NEGATIVE_CLASSES``) must not be reused on a measurement of something
   else. A row that negatives would reach (those no earlier row takes) gets its ``min_similarity`` raised above
   the most similar of them. A row left with fewer than ``min_pairs`` measured pairs is dropped — too few to
   calibrate — and its pairs fall through to later rows or to no reuse. The paraphrase row is *verified*
   instead (``CalibrationRow.verified``): the embedder cannot tell paraphrases from changes in other words, the
   worker's model check can, so the row is not bounded; the negatives it admits are generated and counted in its
   paired test, and it picks its own acceptance threshold and similarity floor (``verified_candidates``).
2. **Candidates.** Per regime (a calibrated step count N), candidate plans: k1, k2 in steps; α and mask
   threshold when k2 > 0 (``default_grid``).
3. **Paired, churn-aware acceptance.** Each clip of a candidate is paired with the no-reuse clip of the same
   target and seed: *lost* (no reuse right, the candidate wrong) or *gained* (the other way round); the rest agree.
   A net count (lost − gained ≤ tolerance · n) lets a plan that re-rolls fragile clips pass: its losses are real,
   its gains are luck. So a candidate passes only when the one-sided 95% upper bound of the paired accuracy loss,
   ``paired_loss_bound`` (McNemar's statistic on the discordant pairs: (lost − gained + z·√(lost + gained −
   (lost − gained)²/n)) / n), is at most ``tolerance`` (1 point). Every discordant pair widens the bound: a plan
   with no lost clip passes; one that loses a clip needs several gains to pass; churn of three each way fails.
   Evaluation stops as soon as no outcome of the remaining clips could bring the bound back under the
   tolerance (an exact early rejection, not an estimate).
4. **Most reuse = most measured saving.** Every Stage-1 plan is measured with the donor check on, and a donor it
   turns away costs its thrown-away pass. Of the passing candidates that save anything, the row takes the one
   whose measured computed-token fraction is lowest (Stage 2 saves only what its masks leave out, which is
   measured, not assumed). Candidates are tried by decreasing upper bound of their saving (``saving_bound``) and the search
   stops when no untried candidate could beat the best passing one. If none passes, the row keeps no reuse
   (k1 = k2 = 0).
5. ``write_calibration`` writes the table (``provisional: false``, ``source`` = the command, ``measured`` per row).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from chorus_sched.planner import CalibrationRow, CalibrationTable, Regime, VerificationThresholds, admits
from producer.contract import DonorVerification, ReusePlan
from workers.bench.pair_facts import PairFacts

EMBEDDER = "all-minilm-l6-v2"
BLOCKER = "unmeasured-small-change"
MIN_ROW_PAIRS = 8
DEFAULT_IGNORABLE = (
    "a", "an", "the", "on", "in", "over", "across", "with", "and", "of", "to", "at", "its", "is", "are",
    "toward", "towards", "against", "into", "onto", "along", "through", "while", "that", "which", "there",
)  # fmt: skip


@dataclass(frozen=True)
class RowSpec:
    name: str
    min_similarity: float
    max_content_changes: int
    classes: tuple[str, ...]  # the pair classes the row was drawn from (empty for the blocker)
    negatives_max_similarity: float | None = None  # the most similar negative that reached the row, if any
    verified: bool = False  # the worker checks each donor with the model (``CalibrationRow.verified``)

    @property
    def calibrated(self) -> bool:
        return bool(self.classes)

    def admits(self, similarity: float, changes: int) -> bool:
        return admits(self, similarity, changes)


def floor2(x: float) -> float:
    return math.floor(x * 100 + 1e-9) / 100


def class_rows(facts: Sequence[PairFacts]) -> list[RowSpec]:
    """One row per measured class, admitting everything measured in it, before any bound."""
    by_class: dict[str, list[PairFacts]] = {}
    for f in facts:
        by_class.setdefault(f.pair.pair_class, []).append(f)
    rows: list[RowSpec] = []

    def add(name: str, cls: str, max_changes: int | None = None) -> None:
        group = by_class.get(cls)
        if not group:
            return
        min_sim = floor2(min(f.similarity for f in group) - 1e-6)
        most = max(f.content_changes for f in group) if max_changes is None else max_changes
        rows.append(RowSpec(name, min_sim, most, (cls,)))

    add("same-prompt", "same-prompt", 0)
    add("one-attribute", "one-attribute", 1)
    add("two-attributes", "two-attributes", 2)
    small = [r for r in rows if r.max_content_changes <= 2]
    rows.append(RowSpec(BLOCKER, -1.0, 3 if small else 0, ()))
    add("paraphrase", "paraphrase")
    # a paraphrase row no wider than the blocker would never apply
    rows = [r for r in rows if not (r.name == "paraphrase" and r.max_content_changes <= 3)]
    # Paraphrases are as similar to the embedder as changes in other words are: only the model can tell them
    # apart, so the paraphrase row is a verified one.
    return [replace(r, verified=True) if r.name == "paraphrase" else r for r in rows]


def above(x: float) -> float:
    """The smallest multiple of 0.01 strictly above ``x``."""
    return round(math.floor(x * 100 + 1e-9) / 100 + 0.01, 2)


def bound_rows(rows: Sequence[RowSpec], negatives: Sequence[PairFacts]) -> list[RowSpec]:
    """Each reusing row with its ``min_similarity`` raised above every negative pair that reaches it (admitted
    by it and by no earlier row, earlier rows already bounded). The blocker is left as it is: it never reuses.
    A verified row is not bounded: the negatives that reach it are measured with it instead (generated, checked
    by the model, and counted in its paired test)."""
    out: list[RowSpec] = []
    for row in rows:
        if row.calibrated and not row.verified:
            reaching = [
                f.similarity
                for f in negatives
                if route(out, f.similarity, f.content_changes) is None
                and row.admits(f.similarity, f.content_changes)
            ]
            if reaching:
                worst = max(reaching)
                row = replace(
                    row,
                    min_similarity=max(row.min_similarity, above(worst)),
                    negatives_max_similarity=round(worst, 4),
                )
        out.append(row)
    return out


def derive_rows(
    facts: Sequence[PairFacts], negatives: Sequence[PairFacts] = (), min_pairs: int = MIN_ROW_PAIRS
) -> list[RowSpec]:
    """Planner rows covering the measured classes, bounded by the negatives, each admitting at least
    ``min_pairs`` measured pairs (see the module docstring)."""
    kept = class_rows(facts)
    while True:
        rows = bound_rows(kept, negatives)
        counts = Counter(
            r.name for r in (route(rows, f.similarity, f.content_changes) for f in facts) if r is not None
        )
        thin = next((r for r in rows if r.calibrated and counts[r.name] < min_pairs), None)
        if thin is None:
            return rows
        # dropping one row changes what reaches the rows below it, so bound again from scratch
        kept = [r for r in kept if r.name != thin.name]


def route(rows: Sequence[RowSpec], similarity: float, changes: int) -> RowSpec | None:
    """The first row that admits the pair — the planner's rule."""
    for row in rows:
        if row.admits(similarity, changes):
            return row
    return None


@dataclass(frozen=True)
class CandidatePlan:
    """A plan the calibration tries for a row: stage lengths in steps, α and mask threshold."""

    k1: int
    k2: int
    alpha: float = 1.0
    threshold: float = 0.5
    # A verified row's own acceptance threshold of the donor check (no shorten band); None: the table's.
    accept_max: float | None = None
    # A verified row's own, higher similarity floor (the pairs below it are not reused); None: the row's.
    min_similarity: float | None = None

    @property
    def thresholds(self) -> VerificationThresholds | None:
        """The row's own donor-check thresholds (accept up to ``accept_max``, no shorten band), if it has any."""
        if self.accept_max is None:
            return None
        return VerificationThresholds(accept_max=self.accept_max, shorten_max=self.accept_max)

    def plan(self, num_steps: int, verification: DonorVerification | None = None) -> ReusePlan:
        """The plan at ``num_steps``; ``verification`` (or the candidate's own thresholds) applies where the
        planner's would (a Stage 1 to check)."""
        own = self.thresholds
        if own is not None:
            verification = own.for_plan()
        return ReusePlan(
            stage1_steps=self.k1,
            stage2_steps=self.k2,
            stage3_steps=num_steps - self.k1 - self.k2,
            alpha=self.alpha,
            mask_threshold=self.threshold,
            verification=verification if self.k1 > 0 else None,
        )


def default_grid(num_steps: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """(k1 fractions, k2 fractions, α values, mask thresholds) swept by default for ``num_steps``."""
    if num_steps <= 8:
        return [0.0, 0.25, 0.5, 0.75], [0.0, 0.25, 0.5, 0.75], [1.0, 2.0, 4.0], [0.3, 0.6]
    return [i / 10 for i in range(10)], [0.0, 0.1, 0.2, 0.4], [1.0, 4.0], [0.5]


# The donor check's acceptance thresholds a verified row tries (relative squared difference of the predictions).
VERIFY_ACCEPT_GRID: tuple[float, ...] = (0.004, 0.008, 0.012, 0.016)
# Similarity floors a verified row tries above its own: every pair it admits but turns away costs a thrown-away
# verification pass, so admitting fewer, likelier pairs can save more.
VERIFY_SIMILARITY_GRID: tuple[float, ...] = (0.6, 0.65, 0.7, 0.75, 0.8)


def verified_candidates(
    grid: Sequence[CandidatePlan],
    accepts: Sequence[float] = VERIFY_ACCEPT_GRID,
    floors: Sequence[float] = VERIFY_SIMILARITY_GRID,
) -> list[CandidatePlan]:
    """A verified row's candidates: each Stage-1-then-full plan of ``grid`` at each acceptance threshold
    (loosest first) and similarity floor (None, the row's own, first)."""
    return [
        replace(c, accept_max=a, min_similarity=f)
        for c in grid
        if c.k1 > 0 and c.k2 == 0  # a paraphrase changes no region: Stage 2 has nothing to recompute
        for a in sorted(accepts, reverse=True)
        for f in (None, *sorted(floors))
    ]


def candidates(
    num_steps: int,
    k1_fractions: Sequence[float],
    k2_fractions: Sequence[float],
    alphas: Sequence[float],
    thresholds: Sequence[float],
) -> list[CandidatePlan]:
    """Every distinct plan of the grid that reuses and leaves Stage 3 at least one step, largest possible saving
    first."""
    k1s = sorted({math.floor(f * num_steps + 1e-9) for f in k1_fractions})
    k2s = sorted({math.floor(f * num_steps + 1e-9) for f in k2_fractions})
    out: set[CandidatePlan] = set()
    for k1 in k1s:
        for k2 in k2s:
            if k1 + k2 == 0 or k1 + k2 >= num_steps:
                continue
            if k2 == 0:
                out.add(CandidatePlan(k1, 0))
            else:
                out.update(CandidatePlan(k1, k2, a, t) for a in alphas for t in thresholds)
    return sorted(out, key=lambda c: search_order(c, num_steps))


def search_order(c: CandidatePlan, num_steps: int) -> tuple[float, ...]:
    """Largest possible saving first; among equals the longer Stage 1, the higher mask threshold, the smaller α,
    the looser acceptance threshold and the lower similarity floor (each admits or keeps more)."""
    return (
        -saving_bound(c, num_steps),
        -c.k1,
        -c.threshold,
        c.alpha,
        -(c.accept_max or 0.0),
        c.min_similarity or -1.0,
    )


def fraction(k: int, num_steps: int) -> float:
    """``k / N`` rounded for the table, such that the planner's ``floor(f · N)`` gives back ``k``."""
    f = round(k / num_steps, 6)
    while math.floor(f * num_steps) < k:
        f += 1e-6
    return f


@dataclass
class Trial:
    candidate: CandidatePlan
    evaluated: int
    wrong: int
    lost: int
    gained: int
    loss_bound: float  # ``paired_loss_bound`` over the evaluated clips
    passed: bool
    stopped_early: bool
    steps_computed_mean: float
    tokens_fraction_mean: float
    block_fraction_mean: float

    def as_dict(self, num_steps: int) -> dict[str, Any]:
        c = self.candidate
        return {
            "k1": c.k1,
            "k2": c.k2,
            "k3": num_steps - c.k1 - c.k2,
            "alpha": c.alpha,
            "mask_threshold": c.threshold,
            **({"accept_max": c.accept_max} if c.accept_max is not None else {}),
            **({"min_similarity": c.min_similarity} if c.min_similarity is not None else {}),
            "evaluated": self.evaluated,
            "wrong": self.wrong,
            "lost": self.lost,
            "gained": self.gained,
            "loss_bound": round(self.loss_bound, 4),
            "passed": self.passed,
            "stopped_early": self.stopped_early,
            "steps_computed_mean": round(self.steps_computed_mean, 3),
            "tokens_computed_fraction_mean": round(self.tokens_fraction_mean, 4),
            "block_compute_fraction_mean": round(self.block_fraction_mean, 4),
        }


# (item index, plan) -> (all attributes correct, steps computed, tokens fraction, block fraction)
class Evaluated(NamedTuple):
    """One item under one plan: all correct, steps computed, token and block fractions, and whether the output
    started from the donor's latent (a Stage-1 donor kept), which decides the no-reuse clip it is paired with."""

    ok: bool
    steps: int
    tokens: float
    blocks: float
    kept_donor: bool = False


EvalFn = Callable[[int, ReusePlan], tuple[bool, int, float, float] | Evaluated]


# One-sided 95% normal quantile.
Z_ONE_SIDED_95 = 1.6449


def paired_loss_bound(lost: int, gained: int, n: int, z: float = Z_ONE_SIDED_95) -> float:
    """One-sided upper confidence bound of the accuracy a plan loses against no reuse on the same ``n`` paired
    clips: the paired difference (lost − gained) / n plus ``z`` standard errors from the discordant pairs.

    A plan that lost no clip is charged nothing: the normal approximation would turn a lone gain on a small set
    into a positive bound (one gain in 32 clips: +2 points) and reject a plan for getting something right."""
    if n <= 0:
        return math.inf
    if lost == 0:
        return -gained / n
    diff = lost - gained
    variance = max(lost + gained - diff * diff / n, 0.0)
    return (diff + z * math.sqrt(variance)) / n


def can_still_pass(lost: int, gained: int, n: int, could_gain: int, tolerance: float) -> bool:
    """Whether some outcome of the clips not yet evaluated — each either agreeing with no reuse or, for the
    ``could_gain`` ones no reuse got wrong, gained — leaves the bound within ``tolerance``."""
    return any(paired_loss_bound(lost, gained + g, n) <= tolerance + 1e-12 for g in range(could_gain + 1))


def saving_bound(candidate: CandidatePlan, num_steps: int, min_active_fraction: float = 0.05) -> float:
    """The most compute a candidate can save: all of Stage 1, and Stage 2 down to its minimum active fraction."""
    return (candidate.k1 + candidate.k2 * (1.0 - min_active_fraction)) / num_steps


def sweep(
    num_steps: int,
    grid: Sequence[CandidatePlan],
    baseline: Sequence[bool],
    evaluate: EvalFn,
    tolerance: float = 0.01,
    on_trial: Callable[[Trial], None] | None = None,
    verification: DonorVerification | None = None,
    similarities: Sequence[float] | None = None,
    donor_baseline: Sequence[bool] | None = None,
) -> tuple[CandidatePlan | None, list[Trial]]:
    """The candidate that saves the most measured compute (1 − computed-token fraction, above 0) among those whose paired
    loss bound against no reuse (``baseline[i]``: item i correct without reuse) is within ``tolerance``, or None.

    Candidates are tried by decreasing ``saving_bound``; the search stops once no remaining candidate could beat
    the best measured saving, and a candidate is rejected as soon as it can no longer pass. Each plan with a
    Stage 1 carries ``verification``, as the planner's plans do, so what is measured is what the workers run.
    A candidate with its own ``min_similarity`` (``similarities[i]``: item i's) leaves the items below it as no
    reuse: they agree with the baseline and compute every token.

    ``donor_baseline[i]``: item i's target prompt without reuse *from the donor's noise*. An output that kept a
    Stage-1 donor started from the donor's latent, so it is that noise's sample, not the target seed's: it is
    paired with this clip, and the test measures what reusing the donor's steps cost, not which seed re-rolled
    a fragile clip. Outputs from the target's own noise (Stage 2 only, donor turned away, not admitted) are
    paired with ``baseline``."""
    order = sorted(grid, key=lambda c: search_order(c, num_steps))
    trials: list[Trial] = []
    best: CandidatePlan | None = None
    # A plan must save something to be chosen: one whose donor check turns most donors away computes more than
    # no reuse (the thrown-away verification pass), and a row that saves nothing is no reuse, not a "hit".
    best_saving = 0.0
    for cand in order:
        if saving_bound(cand, num_steps) <= best_saving + 1e-12:
            break
        run = evaluate
        if cand.min_similarity is not None:
            if similarities is None:
                raise ValueError("a candidate with its own min_similarity needs the items' similarities")
            run = _above(cand.min_similarity, similarities, baseline, num_steps, evaluate)
        trial = _trial(cand, cand.plan(num_steps, verification), baseline, run, tolerance, donor_baseline)
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
        if trial.passed and 1.0 - trial.tokens_fraction_mean > best_saving + 1e-12:
            best, best_saving = cand, 1.0 - trial.tokens_fraction_mean
    return best, trials


def _above(
    floor: float, similarities: Sequence[float], baseline: Sequence[bool], num_steps: int, evaluate: EvalFn
) -> EvalFn:
    """``evaluate`` for the items at or above ``floor``; below it, no reuse (nothing run)."""

    def run(i: int, plan: ReusePlan) -> tuple[bool, int, float, float] | Evaluated:
        if similarities[i] >= floor:
            return evaluate(i, plan)
        return Evaluated(baseline[i], num_steps, 1.0, 1.0)

    return run


def _trial(
    cand: CandidatePlan,
    plan: ReusePlan,
    baseline: Sequence[bool],
    evaluate: EvalFn,
    tolerance: float,
    donor_baseline: Sequence[bool] | None = None,
) -> Trial:
    """One candidate over the paired clips, stopped once it can no longer pass."""
    n = len(baseline)
    # a clip yet to run could gain where either of its possible pairings was wrong
    open_gain = [
        not b or (donor_baseline is not None and not donor_baseline[i]) for i, b in enumerate(baseline)
    ]
    lost = gained = wrong = 0
    steps: list[int] = []
    tokens: list[float] = []
    blocks: list[float] = []
    early = False
    for i in range(n):
        result = evaluate(i, plan)
        ok, s, tf, bf, kept = result if isinstance(result, Evaluated) else Evaluated(*result)
        steps.append(s)
        tokens.append(tf)
        blocks.append(bf)
        paired = donor_baseline[i] if donor_baseline is not None and kept else baseline[i]
        wrong += not ok
        lost += paired and not ok
        gained += ok and not paired
        could_gain = sum(open_gain[i + 1 :])
        if not can_still_pass(lost, gained, n, could_gain, tolerance):
            early = i + 1 < n
            break
    evaluated = len(steps)
    # The verdict is on all n clips: a stopped candidate counts the clips it did not run as agreeing (the most
    # favourable outcome short of gains), which is still above the tolerance.
    bound = paired_loss_bound(lost, gained, n)
    return Trial(
        cand,
        evaluated,
        wrong,
        lost,
        gained,
        bound,
        not early and bound <= tolerance + 1e-12,
        early,
        sum(steps) / evaluated,
        sum(tokens) / evaluated,
        sum(blocks) / evaluated,
    )


@dataclass
class RegimeResult:
    num_steps: int
    rows: list[CalibrationRow] = field(default_factory=list)
    report: list[dict[str, Any]] = field(default_factory=list)


def regime_bounds(steps: Sequence[int]) -> list[tuple[str, int, int]]:
    """(name, calibrated N, max_steps) per regime: each covers up to twice its N, the last up to 1000."""
    ordered = sorted(set(steps))
    out: list[tuple[str, int, int]] = []
    for i, n in enumerate(ordered):
        last = i == len(ordered) - 1
        name = "few-step" if n <= 8 else "many-step"
        if any(o[0] == name for o in out):
            name = f"{name}-{n}"
        out.append((name, n, 1000 if last else max(2 * n, n + 1)))
    for (_, _, a), (_, n, _) in itertools.pairwise(out):
        if a >= n:
            raise ValueError(f"calibrated step counts {ordered} are too close for separate regimes")
    return out


def table_row(
    spec: RowSpec, num_steps: int, chosen: CandidatePlan | None, measured: dict[str, float] | None
) -> CalibrationRow:
    if chosen is None:
        return CalibrationRow(
            name=spec.name,
            min_similarity=spec.min_similarity,
            max_content_changes=spec.max_content_changes,
            k1=0.0,
            k2=0.0,
            verified=spec.verified,
            measured=measured,
        )
    return CalibrationRow(
        name=spec.name,
        min_similarity=max(spec.min_similarity, chosen.min_similarity or -1.0),
        max_content_changes=spec.max_content_changes,
        k1=fraction(chosen.k1, num_steps),
        k2=fraction(chosen.k2, num_steps),
        alpha=chosen.alpha,
        mask_threshold=chosen.threshold,
        verified=spec.verified,
        verification=chosen.thresholds,
        measured=measured,
    )


def build_table(
    regimes: Sequence[tuple[str, int, list[CalibrationRow]]],
    source: str,
    note: str,
    ignorable: Sequence[str] = DEFAULT_IGNORABLE,
) -> CalibrationTable:
    bounds = {n: m for _, n, m in regime_bounds([n for _, n, _ in regimes])}
    return CalibrationTable(
        format="chorus-calibration/1",
        provisional=False,
        note=note,
        source=source,
        embedder=EMBEDDER,
        ignorable_words=list(ignorable),
        regimes=[Regime(name=name, max_steps=bounds[n], rows=rows) for name, n, rows in regimes],
    )
