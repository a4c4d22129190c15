"""Which donor a request takes, and its role in a group: a pure decision over the search results.

Candidates are finished donors (``ready``) and leaders still running. Each candidate is planned (similarity +
word difference → plan); refused ones are kept with the reason so the log explains the choice. Among those the
planner accepts, the one saving the most steps wins (ties: a finished donor over a running leader, then the
higher similarity). A running leader makes the request a FOLLOWER; a finished donor a SOLO run with a donor;
no acceptable candidate makes it a LEADER that later similar requests can follow (or SOLO when grouping is off).
``reuse: off`` always runs SOLO in full.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from chorus_sched.embedding import WordDiff, word_diff
from chorus_sched.planner import PlanChoice, Planner, estimated_steps_saved
from producer.contract import GenerationRequest, ReusePlan, ReusePolicy
from producer.orders import Role


@dataclass(frozen=True)
class Candidate:
    request_id: str
    prompt: str
    tenant: str
    similarity: float
    ready: bool  # False: a leader still running
    trajectory_prefix: str
    seed: int | None = None  # None: an entry indexed before seeds were recorded


@dataclass(frozen=True)
class Considered:
    candidate: Candidate
    diff: WordDiff
    choice: PlanChoice

    def summary(self) -> dict[str, object]:
        c = self.candidate
        return {
            "donor": c.request_id,
            "ready": c.ready,
            "tenant": c.tenant,
            "similarity": round(c.similarity, 4),
            "content_changes": self.choice.content_changes,
            "donor_only": list(self.diff.donor_only),
            "target_only": list(self.diff.target_only),
            "row": self.choice.row,
            "accepted": self.choice.reuses,
            "why": self.choice.reason,
        }


@dataclass(frozen=True)
class Decision:
    role: Role
    plan: ReusePlan
    chosen: Considered | None
    reason: str
    considered: list[Considered] = field(default_factory=list)

    @property
    def donor(self) -> Candidate | None:
        return self.chosen.candidate if self.chosen is not None else None

    @property
    def steps_saved_estimate(self) -> float:
        return estimated_steps_saved(self.plan)


def _rank(c: Considered) -> tuple[float, bool, float]:
    return (estimated_steps_saved(c.choice.plan), c.candidate.ready, c.candidate.similarity)


def decide(
    request: GenerationRequest,
    candidates: Sequence[Candidate],
    planner: Planner,
    *,
    grouping: bool = True,
) -> Decision:
    n = request.num_steps
    if request.reuse is ReusePolicy.OFF:
        return Decision(Role.SOLO, ReusePlan.full(n), None, "reuse is off for this request: full run")
    considered = [
        Considered(c, diff, planner.plan(c.similarity, diff, n, request.model))
        for c in candidates
        if c.request_id != request.job_id  # candidates are named by job id
        for diff in (word_diff(c.prompt, request.prompt),)
    ]
    accepted = [c for c in considered if c.choice.reuses]
    if accepted:
        best = max(accepted, key=_rank)
        cand = best.candidate
        if cand.ready:
            return Decision(
                Role.SOLO,
                best.choice.plan,
                best,
                f"donor {cand.request_id}: {best.choice.reason}",
                considered,
            )
        return Decision(
            Role.FOLLOWER,
            best.choice.plan,
            best,
            f"follows running leader {cand.request_id}: {best.choice.reason}",
            considered,
        )
    why = "no donor found" if not considered else f"{len(considered)} candidate(s) refused"
    if grouping:
        return Decision(
            Role.LEADER, ReusePlan.full(n), None, f"{why}: full run as a group leader", considered
        )
    return Decision(Role.SOLO, ReusePlan.full(n), None, f"{why}: full run", considered)


def blocked_gain(tenant: str, own: Decision, unrestricted: Decision) -> float:
    """Steps a donor of another tenant would have saved beyond the tenant's own best (0 if none was better)."""
    donor = unrestricted.donor
    if donor is None or donor.tenant == tenant:
        return 0.0
    return max(0.0, unrestricted.steps_saved_estimate - own.steps_saved_estimate)
