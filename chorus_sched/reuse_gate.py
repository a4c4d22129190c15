"""Verified reuse that stops paying is stopped: the planner's verified rows, gated by the donor checks' outcomes.

A verified row (``chorus_sched.planner``) admits donors on a loose similarity rule and lets the worker's model
check decide (``workers.engine.verify``). An accepted check costs nothing (its pass is the first computed step); a
rejected one throws its pass away, so the request computes one step more than in full. Whether the row pays
therefore depends on the traffic. The calibration measured it on its own mix, one pair at a time, but a stream
searches each request's nearest neighbours among everything indexed: on traffic of new prompts, the nearest
neighbour of a new prompt is often a different prompt in similar words (``chorus bench serve --trace fresh``
before this gate: 25 of 47 requests planned a verified donor and 23 of those checks rejected it).

So the scheduler counts the checks' outcomes per (model, regime, similarity band) and applies a verified row only while
its expected saving is positive: with ``p`` the band's acceptance rate, an accepted check saves ``k1`` steps and a
rejected one costs one, so the row applies while ``p * k1 >= (1 - p)`` (at 4 steps, k1 = 2: p >= 1/3; at 50 steps,
k1 = 25: p >= 1/26). Recent outcomes weigh more (each new outcome in a band decays the band's earlier counts),
from a prior of one accept and one reject. A closed band still lets one plan through every ``explore_every_s``,
so that a change of traffic can reopen it (time, not a count: the planner asks once per candidate donor); each
exploration spent doubles the wait before the next, up to ``explore_max_s``, and a reopened band starts again
from ``explore_every_s``, so a band that keeps rejecting costs a check every few minutes, not every few seconds.

Checks still in flight count as rejected until they answer. A band with no history would otherwise admit every
plan of a burst before the first check came back (``--trace fresh`` in a closed loop: 17 of 48 requests threw a
check away before the gate heard of any); counted this way, a new band lets two plans through at k1 = 2 of 4 and
waits for their outcomes, while a band whose checks have been accepting keeps going. Every result of a verified
plan takes one check of its band out of flight (``record`` with its outcome, ``release`` for a result without
one: failed, or fallen back before checking); a check whose result never arrives stops counting after
``pending_ttl_s``. The count is per scheduler instance, and instances share the results topic's consumer group,
so with several instances a result may release a check another instance dispatched: each instance's count is
then approximate, corrected by the results it does read and by the TTL.

Only the checks of plans a verified row made teach the gate (the feedback knows them from the request's record):
a same-prompt row's donor is checked too, and its accepts would open a band for the loose row it never tried.
``allows`` has no side effect on a band's outcomes (it only drops expired checks) — the planner asks for every candidate, including ones that lose the ranking and
the search across tenants — and an exploration is spent (``chosen``) only when such a plan is dispatched.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateConfig:
    band_width: float = 0.05  # similarity bands: [0.70, 0.75), [0.75, 0.80), …
    decay: float = 0.97  # per new outcome in the band: about the last 30 outcomes count
    prior_accepted: float = 1.0
    prior_rejected: float = 1.0
    explore_every_s: float = 5.0  # a closed band still lets one plan through this often …
    explore_max_s: float = 160.0  # … doubling after each exploration that left it closed, up to this
    pending_ttl_s: float = 120.0  # a dispatched check not heard of in this long no longer counts as in flight


@dataclass
class _Band:
    accepted: float
    rejected: float
    explored_at: float = -math.inf
    explorations: int = 0  # spent since the band last reopened
    open: bool = True
    pending: list[float] = field(default_factory=list)  # when each check still in flight was dispatched


class VerifiedReuseGate:
    """Outcomes in (``record``), decisions out (``allows``); shared by the intake and feedback threads."""

    def __init__(self, config: GateConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or GateConfig()
        self.clock = clock
        self._bands: dict[tuple[str, str, int], _Band] = {}
        self._lock = threading.Lock()
        self.refusals = 0  # verified plans turned down (per candidate donor), over the gate's life

    def _band(self, model: str, regime: str, similarity: float) -> tuple[tuple[str, str, int], _Band]:
        # round first: 0.70 / 0.05 is 13.999999999999998 in binary, and 0.70 belongs to the band that starts there
        key = (model, regime, math.floor(round(similarity / self.config.band_width, 9)))
        band = self._bands.get(key)
        if band is None:
            band = self._bands[key] = _Band(self.config.prior_accepted, self.config.prior_rejected)
        return key, band

    def _explore_wait(self, band: _Band) -> float:
        """Seconds between explorations of a closed band: the base interval, doubled per exploration after the
        first since it last reopened, up to the cap."""
        doublings = min(max(0, band.explorations - 1), 32)
        return min(self.config.explore_every_s * 2.0**doublings, self.config.explore_max_s)

    def acceptance(self, model: str, regime: str, similarity: float) -> float:
        with self._lock:
            _, band = self._band(model, regime, similarity)
            return band.accepted / (band.accepted + band.rejected)

    def _in_flight(self, band: _Band) -> int:
        horizon = self.clock() - self.config.pending_ttl_s
        while band.pending and band.pending[0] < horizon:
            band.pending.pop(0)
        return len(band.pending)

    def _take_one(self, band: _Band) -> None:
        """A result answered: one check of the band is no longer in flight (checks are counted, not told apart)."""
        if self._in_flight(band):
            band.pending.pop(0)

    def release(self, model: str, regime: str, similarity: float) -> None:
        """A verified plan's result came back without a check outcome (failed, or fell back before checking)."""
        with self._lock:
            _, band = self._band(model, regime, similarity)
            self._take_one(band)

    def allows(self, model: str, regime: str, similarity: float, stage1_steps: int) -> bool:
        """Whether a verified plan reusing ``stage1_steps`` steps may be made in this band now: while its checks
        pay, counting those in flight as rejected, or when a closed band is due an exploration (spent by
        ``chosen``). No side effect on the band's outcomes."""
        with self._lock:
            _, band = self._band(model, regime, similarity)
            if _pays(band.accepted, band.rejected + self._in_flight(band), stage1_steps):
                return True
            # Explorations are for a band its outcomes closed, not one waiting for the checks in flight.
            closed = not _pays(band.accepted, band.rejected, stage1_steps)
            if closed and self.clock() - band.explored_at >= self._explore_wait(band):
                return True  # explore: the only way a closed band learns that traffic changed
            self.refusals += 1  # a statistic only: per candidate donor, across every search that asked
            return False

    def chosen(self, model: str, regime: str, similarity: float, stage1_steps: int) -> None:
        """A verified plan in this band was dispatched: its check is in flight, and if the band is closed by its
        outcomes, that was its exploration."""
        with self._lock:
            _, band = self._band(model, regime, similarity)
            band.pending.append(self.clock())
            if not _pays(band.accepted, band.rejected, stage1_steps):
                band.explored_at = self.clock()
                band.explorations += 1

    def record(self, model: str, regime: str, similarity: float, decision: str, stage1_steps: int) -> None:
        """A check's outcome (``VerificationReport.decision``); a shortened donor counts half accepted."""
        weight = {"accepted": 1.0, "shortened": 0.5, "rejected": 0.0}.get(decision)
        with self._lock:
            key, band = self._band(model, regime, similarity)
            self._take_one(band)
            if weight is None:
                return  # unverified: the check could not measure, it says nothing about the band
            band.accepted = band.accepted * self.config.decay + weight
            band.rejected = band.rejected * self.config.decay + (1.0 - weight)
            p = band.accepted / (band.accepted + band.rejected)
            now_open = _pays(band.accepted, band.rejected, stage1_steps)
            if now_open:
                band.explorations = 0
            if now_open != band.open:
                band.open = now_open
                width = self.config.band_width
                log.info(
                    "verified reuse reopened for a similarity band"
                    if now_open
                    else "verified reuse paused for a similarity band: its donor checks reject too often",
                    extra={
                        "model": model,
                        "regime": regime,
                        "band": [round(key[2] * width, 3), round((key[2] + 1) * width, 3)],
                        "acceptance": round(p, 3),
                        "stage1_steps": stage1_steps,
                        "break_even": round(1.0 / (stage1_steps + 1), 3),
                        "explore_every_s": self._explore_wait(band),
                    },
                )


def _pays(accepted: float, rejected: float, stage1_steps: int) -> bool:
    """An accepted check saves ``stage1_steps`` steps, a rejected one costs one: ``p * k1 >= 1 - p``, written
    without the division (1/3 * 2 < 1 - 1/3 in floating point, which made the break-even band refuse)."""
    return accepted * stage1_steps >= rejected - 1e-9
