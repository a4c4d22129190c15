"""The donor cache policy: which donor entries to evict, as a pure function of the entries and the clock.

In the spirit of NIRVANA's LCBFU, a donor is worth the steps it has saved (its ``steps_saved`` already sums
over its hits, i.e. steps per hit × hits) per byte it occupies, aged: the value halves every ``half_life_s``
the donor goes unused. A new donor is credited ``new_entry_credit × N`` steps so it is not evicted before it
had a chance to be hit. Evictions, in order:

1. a running leader whose result never came (older than ``leader_stale_s``): its worker is gone;
2. a finished donor unused for longer than ``ttl_s``;
3. while the finished donors together exceed ``budget_bytes``: the lowest value first (ties: least recently
   used, then request id, so the choice is deterministic).

Evicting means removing the Qdrant point and sending an ``EvictOrder`` (``chorus_sched.maintenance``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from chorus_sched.index import DonorEntry

EvictReason = Literal["stale-leader", "ttl", "budget"]


@dataclass(frozen=True)
class CachePolicy:
    budget_bytes: int
    ttl_s: float
    half_life_s: float
    new_entry_credit: float = 0.25
    leader_stale_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.budget_bytes < 0 or self.ttl_s <= 0 or self.half_life_s <= 0 or self.leader_stale_s <= 0:
            raise ValueError("budget must be ≥ 0 and ttl, half-life and leader staleness > 0")
        if not 0 <= self.new_entry_credit <= 1:
            raise ValueError("new_entry_credit must be within [0, 1]")


@dataclass(frozen=True)
class Eviction:
    request_id: str
    reason: EvictReason
    bytes: int
    score: float | None = None


def last_used(entry: DonorEntry) -> float:
    return max(entry.created_at, entry.last_hit_at or 0.0)


def value(entry: DonorEntry, now: float, policy: CachePolicy) -> float:
    """Steps saved (plus the new-entry credit) per byte, halved per half-life of idleness."""
    benefit = entry.steps_saved + policy.new_entry_credit * entry.num_steps
    idle = max(0.0, now - last_used(entry))
    return benefit / max(entry.bytes, 1) * 0.5 ** (idle / policy.half_life_s)


def plan_evictions(entries: Iterable[DonorEntry], now: float, policy: CachePolicy) -> list[Eviction]:
    out: list[Eviction] = []
    live: list[DonorEntry] = []
    for entry in entries:
        if not entry.ready:
            if now - entry.created_at > policy.leader_stale_s:
                out.append(Eviction(entry.request_id, "stale-leader", entry.bytes))
            continue
        if now - last_used(entry) > policy.ttl_s:
            out.append(Eviction(entry.request_id, "ttl", entry.bytes))
            continue
        live.append(entry)
    total = sum(e.bytes for e in live)
    if total <= policy.budget_bytes:
        return out
    ranked = sorted(live, key=lambda e: (value(e, now, policy), last_used(e), e.request_id))
    for entry in ranked:
        if total <= policy.budget_bytes:
            break
        if entry.bytes == 0:
            continue
        out.append(Eviction(entry.request_id, "budget", entry.bytes, value(entry, now, policy)))
        total -= entry.bytes
    return out
