"""The reuse planner: (similarity, word difference, N) → ``ReusePlan``, by a calibration table stored as data.

The table (``chorus_sched/calibration.json``, or ``CHORUS_CALIBRATION_PATH``) has one *regime* per range of
step counts (few-step and many-step requests behave differently) and, in each, rows tried in order; the first
row that admits the donor decides the plan. A row admits a donor when the prompts' embedding similarity is at
least ``min_similarity`` and at most ``max_content_changes`` word slots differ once ignorable (function) words
are left out. Stage lengths are fractions of N: ``k1`` (Stage 1, reuse the donor's latent) and ``k2`` (Stage
2, recompute only divergent tokens), rounded down; Stage 3 gets the rest, always at least one step.

A ``verification`` section (per table, per regime, or per row) holds the thresholds by which the worker checks a Stage-1
donor with the model before trusting it (``VerificationThresholds``; defaults apply when a table has none). A
``verified`` row admits on a looser rule than similarity alone could justify and applies only while verification
is on: the model's check, not the embedder, keeps its wrong donors out.

The shipped table is measured: ``chorus bench quality --calibrate`` on the trained toy model wrote it with
``write_calibration`` (its ``source`` is the command, each row's ``measured`` what it was accepted on). A table
marked ``provisional`` (hand-written, not measured) still loads, with a warning.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal, Protocol, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from chorus_sched.embedding import WordDiff
from producer.contract import DonorVerification, ReusePlan

log = logging.getLogger(__name__)

FORMAT = "chorus-calibration/1"
MAX_STEPS = 1000  # the contract's largest num_steps: the last regime must reach it


class CalibrationError(ValueError):
    """A calibration table could not be read or is not valid; the message names the file and the problems."""


class AdmissionRule(Protocol):
    """What decides whether a row admits a donor (a table's ``CalibrationRow``, the benchmark's candidate rows)."""

    @property
    def min_similarity(self) -> float: ...

    @property
    def max_content_changes(self) -> int: ...


def admits(rule: AdmissionRule, similarity: float, content_changes: int) -> bool:
    """The planner's admission rule: the prompts' similarity is at least the row's ``min_similarity`` and at most
    ``max_content_changes`` content words differ."""
    return similarity >= rule.min_similarity and content_changes <= rule.max_content_changes


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VerificationThresholds(_Strict):
    """When a plan reuses Stage 1, the worker checks the donor with the model (``producer.contract.DonorVerification``
    says how). The defaults are provisional, from a prototype on the first toy model at 4 steps (the signal's
    median was 0.006 for paraphrases, 0.024 for shape changes, 0.08–0.37 for colour, direction and background
    changes), until a calibration measures them."""

    enabled: bool = True
    accept_max: float = Field(default=0.01, ge=0.0, allow_inf_nan=False)
    # no shorten band: shorten_max = accept_max (a number, since a written table leaves None fields out)
    shorten_max: float = Field(default=0.03, ge=0.0, allow_inf_nan=False)
    shorten_fraction: float = Field(default=0.5, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.shorten_max < self.accept_max:
            raise ValueError("verification: shorten_max must not be below accept_max")
        return self

    def for_plan(self) -> DonorVerification | None:
        if not self.enabled:
            return None
        return DonorVerification(
            accept_max=self.accept_max, shorten_max=self.shorten_max, shorten_fraction=self.shorten_fraction
        )


class CalibrationRow(_Strict):
    name: str = Field(min_length=1)
    min_similarity: float = Field(ge=-1.0, le=1.0, allow_inf_nan=False)
    max_content_changes: int = Field(ge=0)
    k1: float = Field(ge=0.0, le=1.0, allow_inf_nan=False, description="Stage 1 steps as a fraction of N")
    k2: float = Field(ge=0.0, le=1.0, allow_inf_nan=False, description="Stage 2 steps as a fraction of N")
    alpha: float = Field(default=1.0, ge=1.0, le=20.0, allow_inf_nan=False)
    mask_threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    min_active_fraction: float = Field(default=0.05, ge=0.0, le=1.0)
    max_active_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    tgaa_in_stage3: bool = False
    # A verified row admits on a loose similarity rule (paraphrases and other changes in other words look alike to
    # the embedder) and trusts the worker's model check to tell them apart: it applies only while verification is
    # enabled, and only with a Stage 1 to verify.
    verified: bool = False
    verification: VerificationThresholds | None = None  # None: the regime's (or the table's)
    mask_dilation: int | None = Field(default=None, ge=0, le=16)
    mask_levels: int | None = Field(default=None, ge=1, le=6)
    # What the benchmark observed for this row (e.g. attribute accuracy with and without reuse); informative.
    measured: dict[str, float] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.k1 + self.k2 >= 1.0:
            raise ValueError(f"row {self.name!r}: k1 + k2 must be below 1 so Stage 3 keeps at least one step")
        if self.min_active_fraction > self.max_active_fraction:
            raise ValueError(f"row {self.name!r}: min_active_fraction exceeds max_active_fraction")
        if self.verified and self.k2 > 0 and self.k1 == 0:
            raise ValueError(
                f"row {self.name!r}: a verified row needs a Stage 1 (k1 > 0) for the model to check"
            )
        return self

    def admits(self, similarity: float, content_changes: int) -> bool:
        return admits(self, similarity, content_changes)


class Regime(_Strict):
    name: str = Field(min_length=1)
    max_steps: int = Field(ge=1, description="applies to N up to this (and above the previous regime's)")
    rows: list[CalibrationRow]
    verification: VerificationThresholds | None = None  # None: the table's

    @model_validator(mode="after")
    def _rows_reachable(self) -> Self:
        names = [r.name for r in self.rows]
        if len(set(names)) != len(names):
            raise ValueError(f"regime {self.name!r}: row names must be unique")
        for i, row in enumerate(self.rows):
            for earlier in self.rows[:i]:
                if (
                    earlier.min_similarity <= row.min_similarity
                    and earlier.max_content_changes >= row.max_content_changes
                ):
                    raise ValueError(
                        f"regime {self.name!r}: row {row.name!r} can never apply, "
                        f"row {earlier.name!r} before it admits everything it does"
                    )
        return self


class CalibrationTable(_Strict):
    format: Literal["chorus-calibration/1"]
    provisional: bool
    note: str = ""
    source: str = Field(min_length=1, description="the command (or hand) that produced the table")
    embedder: str = Field(min_length=1, description="similarities are on this embedder's scale")
    ignorable_words: list[str] = Field(default_factory=list)
    regimes: list[Regime] = Field(min_length=1)
    verification: VerificationThresholds = Field(default_factory=VerificationThresholds)

    @model_validator(mode="after")
    def _regimes_cover_all_steps(self) -> Self:
        bounds = [r.max_steps for r in self.regimes]
        if any(b <= a for a, b in itertools.pairwise(bounds)):
            raise ValueError("regimes must be ordered by strictly increasing max_steps")
        if bounds[-1] < MAX_STEPS:
            raise ValueError(f"the last regime must reach max_steps {MAX_STEPS} (it stops at {bounds[-1]})")
        names = [r.name for r in self.regimes]
        if len(set(names)) != len(names):
            raise ValueError("regime names must be unique")
        return self

    def regime_for(self, num_steps: int) -> Regime:
        for regime in self.regimes:
            if num_steps <= regime.max_steps:
                return regime
        raise ValueError(f"no regime covers {num_steps} steps")


def parse_calibration(text: str, *, source: str = "<calibration>") -> CalibrationTable:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CalibrationError(
            f"{source}: not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    try:
        return CalibrationTable.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors(include_url=False)
        )
        raise CalibrationError(f"{source}: not a valid calibration table: {problems}") from None


def default_calibration_path() -> Path:
    return Path(str(resources.files("chorus_sched").joinpath("calibration.json")))


def load_calibration(path: Path | str | None = None) -> CalibrationTable:
    """The table at ``path`` (default: the packaged one). Raises CalibrationError with a clear reason."""
    where = Path(path) if path else default_calibration_path()
    try:
        text = where.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{where}: cannot read the calibration table: {exc}") from None
    table = parse_calibration(text, source=str(where))
    if table.provisional:
        log.warning("calibration table is provisional (not measured yet)", extra={"path": str(where)})
    return table


def write_calibration(table: CalibrationTable, path: Path | str) -> None:
    """Validate and write ``table`` atomically (a reader never sees half a file). For the quality benchmark."""
    table = CalibrationTable.model_validate(table.model_dump())
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".calibration-", suffix=".json", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(table.model_dump_json(indent=2, exclude_none=True) + "\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def estimated_steps_saved(plan: ReusePlan) -> float:
    """Steps of transformer compute a plan saves, roughly: all of Stage 1, about half of Stage 2.

    Only used to rank candidate donors against each other, never reported as a measurement.
    """
    return plan.stage1_steps + 0.5 * plan.stage2_steps


@dataclass(frozen=True)
class PlanChoice:
    plan: ReusePlan
    regime: str
    row: str | None  # the row that decided; None when the plan is a full run
    content_changes: int
    reason: str
    verified: bool = False  # a verified row made it: its donor check's outcome teaches the gate

    @property
    def reuses(self) -> bool:
        return self.plan.reuses


class ReuseGate(Protocol):
    """What decides whether a verified row may apply now (``chorus_sched.reuse_gate``)."""

    def allows(self, model: str, regime: str, similarity: float, stage1_steps: int) -> bool: ...

    def chosen(self, model: str, regime: str, similarity: float, stage1_steps: int) -> None: ...


class Planner:
    def __init__(
        self, table: CalibrationTable, gate: ReuseGate | None = None, *, similarity_margin: float = 0.0
    ) -> None:
        if similarity_margin < 0:
            raise ValueError("similarity_margin must be ≥ 0")
        self.table = table
        self.gate = gate  # None: verified rows apply whenever the table says (the benchmarks)
        self.ignorable = frozenset(w.casefold() for w in table.ignorable_words)
        # An embedder whose similarities may be off the calibration's by up to this much (``Embedder.
        # similarity_tolerance``) has every unverified row's similarity threshold raised by it: such a row never
        # admits where the calibration's numbers would refuse (a verified row's floor is left to the model check).
        self.similarity_margin = similarity_margin

    def widened(self, margin: float) -> Planner:
        """The same table and gate, its similarity thresholds raised by at least ``margin``."""
        if margin <= self.similarity_margin:
            return self
        return Planner(self.table, self.gate, similarity_margin=margin)

    def gated(self, gate: ReuseGate) -> Planner:
        """The same table and margin, its verified rows applied only while ``gate`` allows."""
        return Planner(self.table, gate, similarity_margin=self.similarity_margin)

    def chosen(self, choice: PlanChoice, model: str, similarity: float) -> None:
        """``choice`` was dispatched: a verified plan's check is now in flight in its band, and one made while the
        band was closed spends the exploration."""
        if choice.verified and self.gate is not None:
            self.gate.chosen(model, choice.regime, similarity, choice.plan.stage1_steps)

    def plan(self, similarity: float, diff: WordDiff, num_steps: int, model: str = "") -> PlanChoice:
        """The first row of ``num_steps``' regime that admits the pair decides; ``model`` scopes the gate."""
        regime = self.table.regime_for(num_steps)
        changes = diff.content_changes(self.ignorable)
        margin = f" less the embedder's margin {self.similarity_margin:g}" if self.similarity_margin else ""
        for row in regime.rows:
            # The margin guards the rows that nothing checks after the planner; a verified row's loose floor is
            # not its safety (the worker's model check is, and its calibration counted what it admits).
            if not row.admits(similarity - (0.0 if row.verified else self.similarity_margin), changes):
                continue
            policy = (row.verification or regime.verification or self.table.verification).for_plan()
            k1 = math.floor(row.k1 * num_steps)
            k2 = math.floor(row.k2 * num_steps)
            if row.verified and (policy is None or k1 == 0):
                continue  # nothing would check the donor: the row's loose rule does not apply
            gate = self.gate
            if row.verified and gate is not None and not gate.allows(model, regime.name, similarity, k1):
                continue  # its checks have been rejecting donors like this one: it costs more than it saves
            k3 = num_steps - k1 - k2  # ≥ 1 because k1 + k2 < 1
            plan = ReusePlan(
                stage1_steps=k1,
                stage2_steps=k2,
                stage3_steps=k3,
                alpha=row.alpha,
                mask_threshold=row.mask_threshold,
                min_active_fraction=row.min_active_fraction,
                max_active_fraction=row.max_active_fraction,
                tgaa_in_stage3=row.tgaa_in_stage3,
                verification=policy if k1 > 0 else None,
                **{
                    k: v
                    for k, v in (("mask_dilation", row.mask_dilation), ("mask_levels", row.mask_levels))
                    if v is not None
                },
            )
            if not plan.reuses:
                reason = (
                    f"row {row.name!r} admits similarity {similarity:.3f} with {changes} content change(s), "
                    f"but its fractions round to no reused step at N={num_steps}"
                )
                return PlanChoice(ReusePlan.full(num_steps), regime.name, None, changes, reason)
            reason = (
                f"row {row.name!r}: similarity {similarity:.3f}{'' if row.verified else margin} "
                f"≥ {row.min_similarity}, "
                f"{changes} content change(s) ≤ {row.max_content_changes} ({diff.describe()})"
                + ("; the worker verifies the donor with the model" if row.verified else "")
            )
            return PlanChoice(plan, regime.name, row.name, changes, reason, verified=row.verified)
        reason = (
            f"no {regime.name} row admits similarity {similarity:.3f} with {changes} content change(s) "
            f"({diff.describe()})" + (f"; unverified rows take it{margin}" if margin else "")
        )
        return PlanChoice(ReusePlan.full(num_steps), regime.name, None, changes, reason)
