"""Cache maintenance: applies the donor cache policy (``chorus_sched.cache``) to the index and the workers' store.

Every ``evict_interval_s`` (the consumer loop of the results topic calls ``maintain`` after its polls) evictions
left pending are sent, then the policy runs under a ledger mutex: the chosen entries are removed from the index,
then an ``EvictOrder`` per reason is sent for the workers to delete their objects. An eviction is recorded as
pending in the ledger first, so an order that cannot be sent now is sent by a later maintenance. ``Feedback``
evicts through here too (a failed leader, a donor found unusable).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict

from chorus_sched.batch import SchedulerStats
from chorus_sched.cache import CachePolicy, plan_evictions
from chorus_sched.dispatch import Dispatcher
from chorus_sched.index import DonorIndex
from chorus_sched.ledger import RETRYABLE_STATES, Ledger, RequestState
from chorus_sched.metrics import METRICS
from chorus_sched.settings import SchedulerSettings
from producer.orders import EvictOrder

log = logging.getLogger(__name__)


class CacheMaintenance:
    """Keeps the donor cache within the policy; evicts entries from the index and orders their objects deleted."""

    def __init__(
        self,
        settings: SchedulerSettings,
        *,
        index: DonorIndex,
        ledger: Ledger,
        dispatcher: Dispatcher,
        stats: SchedulerStats,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.index = index
        self.ledger = ledger
        self.dispatcher = dispatcher
        self.stats = stats
        self.clock = clock
        self.policy = CachePolicy(
            budget_bytes=settings.cache_budget_bytes,
            ttl_s=settings.donor_ttl_s,
            half_life_s=settings.cache_half_life_s,
            new_entry_credit=settings.cache_new_entry_credit,
            leader_stale_s=settings.leader_stale_s,
        )

    def maintain(self) -> list[str]:
        """Send evictions left pending, then apply the cache policy; returns the request ids evicted now."""
        self._flush_evictions()
        with self.ledger.mutex(
            "evict", ttl_s=self.settings.group_lock_lease_s, owner=self.settings.resolved_instance_id
        ):
            entries = self.index.entries()
            evictions = plan_evictions(entries, self.clock(), self.policy)
            if evictions:
                total = sum(e.bytes for e in entries if e.ready)
                log.info(
                    "cache policy evicts donors",
                    extra={
                        "evictions": [asdict(e) for e in evictions],
                        "bytes_before": total,
                        "budget_bytes": self.policy.budget_bytes,
                    },
                )
                self.evict({e.request_id: e.reason for e in evictions})
            METRICS.observe_cache(entries, evicted=[e.request_id for e in evictions])
        self.ledger.purge_expired()
        return [e.request_id for e in evictions]

    def evict(self, reasons: dict[str, str]) -> None:
        """Remove the index entries, then order the workers to delete the objects (pending until sent)."""
        for reason, ids in _by_reason(reasons).items():
            self.ledger.add_pending_evictions(ids, reason)
            for rid in ids:
                # A request that ended without a video stays open to being sent again.
                if self.ledger.state(rid) not in RETRYABLE_STATES:
                    self.ledger.set_state(rid, RequestState.EVICTED)
            self.index.delete(ids)
            self.stats.evicted += len(ids)
            METRICS.count_evictions(reason, len(ids))
        self._flush_evictions()

    def discard(self, reasons: dict[str, str]) -> None:
        """Order the stored objects of requests no entry names deleted (an entry evicted while its request ran:
        what the worker stored after the eviction's order). Not an eviction: nothing is counted or unindexed."""
        for reason, ids in _by_reason(reasons).items():
            self.ledger.add_pending_evictions(ids, reason)
        self._flush_evictions()

    def _flush_evictions(self) -> None:
        for reason, ids in _by_reason(self.ledger.pending_evictions()).items():
            try:
                self.dispatcher.evict(EvictOrder(request_ids=ids, reason=reason))
            except Exception as exc:
                log.warning(
                    "evict order not sent; will retry", extra={"request_ids": ids, "error": repr(exc)}
                )
                continue
            self.ledger.remove_pending_evictions(ids)
            self.stats.evict_orders += 1
            METRICS.evict_orders.inc()
            log.info("evict order sent", extra={"request_ids": ids, "reason": reason})


def _by_reason(reasons: Mapping[str, str]) -> dict[str, list[str]]:
    """Request ids grouped by their reason (one order per reason), each group in id order."""
    groups: dict[str, list[str]] = defaultdict(list)
    for rid, reason in sorted(reasons.items()):
        groups[reason].append(rid)
    return dict(groups)
