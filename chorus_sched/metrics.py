"""The scheduler's Prometheus metrics, and the ``/metrics`` endpoint that serves them.

Every metric is defined here and incremented at one place in the scheduler's modules (``chorus_sched.intake``,
``dead_letters``, ``feedback``, ``resend``, ``maintenance``, ``loop``; the catalogue below names it). Labels take values from
small fixed sets only (roles, outcomes, reasons, catalog models, queue names); each labelled series is created at
zero when the module loads, so ``rate``/``increase`` see the first event too.

==========================================================  =========  ==========================================
metric                                                      type       where
==========================================================  =========  ==========================================
``chorus_requests_received_total``                          counter    each message read from the requests topic
``chorus_requests_accepted_total{role}``                    counter    each work order on the broker
``chorus_requests_rejected_total{reason}``                  counter    each ``rejected`` result published
``chorus_requests_dead_lettered_total{reason}``             counter    each message sent to the dead-letter topic
``chorus_requests_duplicate_total``                         counter    each claimed message read again (skipped)
``chorus_requests_resent_total{outcome}``                   counter    each new message with a taken id, answered
``chorus_scheduler_retries_total{cause}``                   counter    each message left for a later poll
``chorus_donor_lookups_total{outcome}``                     counter    each index search for a request
``chorus_donor_similarity{role}``                           histogram  similarity of each chosen donor
``chorus_scheduler_phase_duration_seconds{phase}``          histogram  embed (per poll), search, dispatch
``chorus_scheduler_results_total{status}``                  counter    each result of a request it dispatched
``chorus_donor_hits_total``                                 counter    each result that used its donor
``chorus_donor_steps_saved_total``                          counter    token-steps those results did not compute
``chorus_donors_indexed_total``                             counter    each finished request indexed as a donor
``chorus_cache_size_bytes`` / ``chorus_cache_budget_bytes`` gauge      after each cache maintenance
``chorus_cache_entries{status}``                            gauge      after each cache maintenance
``chorus_cache_evictions_total{reason}``                    counter    each donor removed from the index
``chorus_cache_evict_orders_total``                         counter    each eviction order sent to the workers
``chorus_consumer_lag_messages{consumer}``                  gauge      this instance's partitions, every few s
``chorus_celery_queue_length{queue}``                       gauge      a sampler thread, every few seconds
==========================================================  =========  ==========================================

Derived in PromQL (see ``infra/prometheus/rules``): the donor hit ratio is
``sum(rate(chorus_donor_lookups_total{outcome="hit"}[5m])) / sum(rate(chorus_donor_lookups_total[5m]))``.
Several scheduler instances each export their own counters (sum them); the cache and queue gauges describe
shared state, so every instance reports the same value (take ``max``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from chorus_sched.index import DonorStatus
from producer.metrics_server import Exposition, listen, zero_series
from producer.orders import Role, all_queues

if TYPE_CHECKING:
    from kafka import KafkaConsumer

    from chorus_sched.grouping import Decision
    from chorus_sched.index import DonorEntry
    from chorus_sched.settings import SchedulerSettings

log = logging.getLogger(__name__)

ROLES: Final = (Role.LEADER, Role.FOLLOWER, Role.SOLO)
REJECT_REASONS: Final = ("invalid_request", "unreadable", "no_worker", "scheduling_failed")
RETRY_CAUSES: Final = ("backing_service", "error", "busy")
LOOKUP_OUTCOMES: Final = ("hit", "miss", "incompatible", "cross_tenant_blocked")
SCHEDULER_PHASES: Final = ("embed", "search", "dispatch")
RESULT_STATUSES: Final = ("done", "failed", "rejected")
EVICTION_REASONS: Final = (
    "stale_leader",
    "ttl",
    "budget",
    "leader_failed",
    "leader_no_trajectory",
    "donor_gone",
    "other",
)
CONSUMERS: Final = ("requests", "results")
ENTRY_STATUSES: Final = (DonorStatus.READY, DonorStatus.RUNNING)

# Seconds: milliseconds (an embedding, a search) up to minutes (a slow broker).
PHASE_BUCKETS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Cosine similarity of a chosen donor; the planner accepts donors from about 0.6 up.
SIMILARITY_BUCKETS: Final = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 0.99, 1.0)

LAG_INTERVAL_S: Final = 2.0
QUEUE_SAMPLE_INTERVAL_S: Final = 5.0


class ResendOutcome(StrEnum):
    """What ``chorus_sched.resend`` did with a new message carrying a taken request id (a metric label)."""

    REPLAYED = (
        "replayed"  # answered with a copy of its request's answer (at once, or when the request finished)
    )
    REJECTED = "rejected"  # the answer does not fit what it asks (request_id_reused), or is no longer kept


class SchedulerMetrics:
    """The scheduler's metrics, registered on ``registry`` (the process-wide default for the service)."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self._intake(registry)
        self._reuse(registry)
        self._cache_and_queues(registry)
        self._initialise_labels()

    def _intake(self, registry: CollectorRegistry | None) -> None:
        """Requests in: received, accepted, rejected, dead-lettered, duplicates, retries, lost orders."""
        self.requests_received = Counter(
            "chorus_requests_received",
            "Messages read from the requests topic (a message read again after a retry counts again).",
            registry=registry,
        )
        self.requests_accepted = Counter(
            "chorus_requests_accepted",
            "Requests whose work order is on the broker, by group role.",
            ["role"],
            registry=registry,
        )
        self.requests_rejected = Counter(
            "chorus_requests_rejected",
            "Requests answered with a `rejected` result, by reason (the dead letter's error code).",
            ["reason"],
            registry=registry,
        )
        self.dead_lettered = Counter(
            "chorus_requests_dead_lettered",
            "Messages sent to the dead-letter topic, by reason (the dead letter's error code).",
            ["reason"],
            registry=registry,
        )
        self.duplicates = Counter(
            "chorus_requests_duplicate",
            "The message a request was claimed from, read again (a redelivery: skipped).",
            registry=registry,
        )
        self.resent = Counter(
            "chorus_requests_resent",
            "New messages with the id of a request taken before, counted once answered, by outcome: replayed (a "
            "copy of the request's answer, at once or when it finished) or rejected (request_id_reused: another "
            "request under the id; result_not_kept).",
            ["outcome"],
            registry=registry,
        )
        self.exact_hits = Counter(
            "chorus_exact_hits",
            "Requests answered from an identical request's result with no worker compute, by kind: stored "
            "(answered at once) or coalesced (waited for an identical request in flight); *_other_seed: the "
            "same prompt and settings with another seed (the video a same-prompt donor would give exactly).",
            ["kind"],
            registry=registry,
        )
        zero_series(
            self.exact_hits, kind=("stored", "coalesced", "stored_other_seed", "coalesced_other_seed")
        )
        self.redispatched = Counter(
            "chorus_orders_lost",
            "Orders no result came for, by what the watchdog did: sent again or answered failed (their worker "
            "vanished), or worker_failed (their task failed in the worker without an answer: answered failed).",
            ["outcome"],
            registry=registry,
        )
        zero_series(self.redispatched, outcome=("sent_again", "failed", "worker_failed"))
        self.retries = Counter(
            "chorus_scheduler_retries",
            "Messages left to be handled again on a later poll, by cause.",
            ["cause"],
            registry=registry,
        )
        self.phase_seconds = Histogram(
            "chorus_scheduler_phase_duration_seconds",
            "Scheduler latency per phase: embed (one poll's prompts), search (index search and planning for "
            "one request), dispatch (sending one work order to the broker).",
            ["phase"],
            buckets=PHASE_BUCKETS_S,
            registry=registry,
        )

    def _reuse(self, registry: CollectorRegistry | None) -> None:
        """Reuse: exact hits, index outages, donor lookups and similarity, hits and steps saved, results."""
        self.index_unavailable = Counter(
            "chorus_index_unavailable",
            "Requests scheduled without reuse (full compute) because the donor index could not be used.",
            registry=registry,
        )
        self.donor_lookups = Counter(
            "chorus_donor_lookups",
            "Donor index searches for a request, by outcome: hit (a donor or running leader was chosen), miss "
            "(no candidate), incompatible (candidates, all refused by the planner), cross_tenant_blocked (no "
            "donor of its own tenant, but another tenant's would have served).",
            ["outcome"],
            registry=registry,
        )
        self.donor_similarity = Histogram(
            "chorus_donor_similarity",
            "Prompt-embedding cosine similarity of each chosen donor, by role (solo: finished donor, follower: "
            "running leader).",
            ["role"],
            buckets=SIMILARITY_BUCKETS,
            registry=registry,
        )
        self.results = Counter(
            "chorus_scheduler_results",
            "Results read for requests this deployment dispatched, by status.",
            ["status"],
            registry=registry,
        )
        self.donor_hits = Counter(
            "chorus_donor_hits",
            "Results that saved compute with their donor (fewer token-steps than in full), once per request.",
            registry=registry,
        )
        self.steps_saved = Counter(
            "chorus_donor_steps_saved",
            "Token-steps not computed thanks to donors: steps_requested × (1 − tokens_computed_fraction) of "
            "each result that reused its donor.",
            registry=registry,
        )
        self.donors_indexed = Counter(
            "chorus_donors_indexed",
            "Finished requests indexed as donors.",
            registry=registry,
        )

    def _cache_and_queues(self, registry: CollectorRegistry | None) -> None:
        """The donor cache, evictions, consumer lag and Celery queue lengths."""
        self.cache_bytes = Gauge(
            "chorus_cache_size_bytes",
            "Bytes of all finished donor trajectories in the index.",
            registry=registry,
        )
        self.cache_budget = Gauge(
            "chorus_cache_budget_bytes",
            "The donor cache's byte budget.",
            registry=registry,
        )
        self.cache_entries = Gauge(
            "chorus_cache_entries",
            "Donor index entries, by status (ready: finished donor, running: group leader).",
            ["status"],
            registry=registry,
        )
        self.evictions = Counter(
            "chorus_cache_evictions",
            "Donors removed from the index, by reason.",
            ["reason"],
            registry=registry,
        )
        self.evict_orders = Counter(
            "chorus_cache_evict_orders",
            "Eviction orders sent to the workers.",
            registry=registry,
        )
        self.consumer_lag = Gauge(
            "chorus_consumer_lag_messages",
            "Messages not yet read on the partitions this instance consumes, per consumer (topic role).",
            ["consumer"],
            registry=registry,
        )
        self.queue_length = Gauge(
            "chorus_celery_queue_length",
            "Work orders waiting on each Celery queue (sampled from the broker).",
            ["queue"],
            registry=registry,
        )

    def _initialise_labels(self) -> None:
        zero_series(self.requests_accepted, role=ROLES)
        zero_series(self.requests_rejected, reason=REJECT_REASONS)
        zero_series(self.dead_lettered, reason=REJECT_REASONS)
        zero_series(self.retries, cause=RETRY_CAUSES)
        zero_series(self.donor_lookups, outcome=LOOKUP_OUTCOMES)
        zero_series(self.resent, outcome=tuple(ResendOutcome))
        zero_series(self.donor_similarity, role=(Role.SOLO, Role.FOLLOWER))
        zero_series(self.phase_seconds, phase=SCHEDULER_PHASES)
        zero_series(self.results, status=RESULT_STATUSES)
        zero_series(self.cache_entries, status=ENTRY_STATUSES)
        zero_series(self.evictions, reason=EVICTION_REASONS)
        zero_series(self.consumer_lag, consumer=CONSUMERS)
        zero_series(self.queue_length, queue=all_queues())

    # ------------------------------------------------------------------------------------------ call sites
    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Observe the duration of the block (also when it raises) as phase ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds.labels(phase=name).observe(time.perf_counter() - start)

    def count_lookup(self, decision: Decision, *, cross_tenant_blocked: bool) -> None:
        self.donor_lookups.labels(outcome=lookup_outcome(decision, cross_tenant_blocked)).inc()

    def count_dispatch(self, decision: Decision) -> None:
        role = str(decision.role)
        self.requests_accepted.labels(role=role).inc()
        donor = decision.donor
        if donor is not None:
            self.donor_similarity.labels(role=role).observe(donor.similarity)

    def count_dead_letter(self, code: str, *, rejected: bool) -> None:
        reason = code if code in REJECT_REASONS else "scheduling_failed"
        self.dead_lettered.labels(reason=reason).inc()
        if rejected:
            self.requests_rejected.labels(reason=reason).inc()

    def count_hit(self, steps_saved: float) -> None:
        self.donor_hits.inc()
        self.steps_saved.inc(max(0.0, steps_saved))

    def count_evictions(self, reason: str, count: int) -> None:
        self.evictions.labels(reason=eviction_reason(reason)).inc(count)

    def observe_cache(self, entries: Iterable[DonorEntry], *, evicted: Iterable[str] = ()) -> None:
        """Set the cache gauges from the index entries (leaving out those just evicted)."""
        gone = set(evicted)
        ready = running = size = 0
        for entry in entries:
            if entry.request_id in gone:
                continue
            if entry.ready:
                ready += 1
                size += entry.bytes
            else:
                running += 1
        self.cache_entries.labels(status=DonorStatus.READY).set(ready)
        self.cache_entries.labels(status=DonorStatus.RUNNING).set(running)
        self.cache_bytes.set(size)

    def lag_probe(self, consumer_name: str, interval_s: float = LAG_INTERVAL_S) -> LagProbe:
        return LagProbe(self.consumer_lag.labels(consumer=consumer_name), interval_s)


def lookup_outcome(decision: Decision, cross_tenant_blocked: bool) -> str:
    if decision.donor is not None:
        return "hit"
    if cross_tenant_blocked:
        return "cross_tenant_blocked"
    return "incompatible" if decision.considered else "miss"


def eviction_reason(reason: str) -> str:
    """A bounded label for an eviction reason (the cache policy's, or the free text of a failed leader)."""
    label = reason.replace("-", "_")
    if label in EVICTION_REASONS:
        return label
    if reason.startswith("leader finished without"):
        return "leader_no_trajectory"
    if reason.startswith("leader "):
        return "leader_failed"
    return "other"


class LagProbe:
    """Measures a consumer's lag from the thread that polls it (kafka-python consumers are not thread-safe),
    at most once per ``interval_s``; a failed measurement keeps the last value."""

    def __init__(self, gauge: Any, interval_s: float) -> None:
        self.gauge = gauge
        self.interval_s = interval_s
        self._next = 0.0

    def __call__(self, consumer: KafkaConsumer) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        from producer import bus

        try:
            lag = bus.consumer_lag(consumer)
        except Exception as exc:  # never let a measurement disturb consumption
            log.debug("consumer lag not measured", extra={"error": repr(exc)})
            return
        self.gauge.set(sum(lag.values()))


METRICS = SchedulerMetrics()


# ------------------------------------------------------------------------------------------ queue sampler


def queue_lengths(app: Any, queues: Iterable[str]) -> dict[str, int]:
    """Messages waiting on each queue of ``app``'s broker (0 for a queue the broker does not hold yet)."""
    from kombu.exceptions import ChannelError

    out: dict[str, int] = {}
    with app.connection_for_read() as conn:
        for queue in queues:
            channel = conn.channel()
            try:
                out[queue] = int(channel.queue_declare(queue=queue, passive=True).message_count)
            except ChannelError:
                out[queue] = 0  # Redis: an empty queue has no key; AMQP: not declared yet
            finally:
                try:
                    channel.close()
                except Exception as exc:
                    log.debug("channel not closed", extra={"error": repr(exc)})
    return out


class QueueSampler:
    """A daemon thread that sets ``chorus_celery_queue_length`` every ``interval_s`` seconds."""

    def __init__(
        self,
        sample: Callable[[], dict[str, int]],
        *,
        metrics: SchedulerMetrics = METRICS,
        interval_s: float = QUEUE_SAMPLE_INTERVAL_S,
    ) -> None:
        self.sample = sample
        self.metrics = metrics
        self.interval_s = interval_s
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._main, name="chorus-queue-sampler", daemon=True)

    def start(self) -> QueueSampler:
        self.thread.start()
        return self

    def sample_once(self) -> None:
        for queue, length in self.sample().items():
            self.metrics.queue_length.labels(queue=queue).set(length)

    def _main(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.sample_once()
            except Exception as exc:
                log.warning("Celery queue lengths not sampled", extra={"error": repr(exc)})
            self.stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=10)


# ------------------------------------------------------------------------------------------- exposition


def serve(settings: SchedulerSettings, *, addr: str | None = None) -> Exposition | None:
    """Serve ``/metrics`` on ``settings.metrics_port`` (0: not at all) at ``addr`` (default
    ``settings.metrics_bind_address``) and start the queue sampler."""
    if settings.metrics_port == 0:
        log.info("metrics not exposed (metrics_port is 0)")
        return None
    addr = addr or settings.metrics_bind_address
    from producer.broker import app_for_broker

    endpoint = listen(settings.metrics_port, addr=addr)
    if endpoint is None:
        return None
    METRICS.cache_budget.set(settings.cache_budget_bytes)
    queues = all_queues()
    app = app_for_broker(settings.broker_url, state_dir=settings.state_dir)
    sampler = QueueSampler(lambda: queue_lengths(app, queues)).start()
    log.info("metrics exposed", extra={"port": endpoint.port, "addr": addr})

    def close() -> None:
        sampler.stop()
        endpoint.close()
        app.close()

    return Exposition(port=endpoint.port, close=close)
