"""The scheduler service: the ``Scheduler`` assembled from its parts, wired to real services, run on Kafka.

The scheduler turns requests into work orders and results into donors, and keeps the donor cache in budget. Each
concern is its own module, the way an engine is split from its I/O:

- ``chorus_sched.intake``: requests in, decisions, work orders out (``Intake``); invalid or failing messages
  go to ``chorus_sched.dead_letters``;
- ``chorus_sched.feedback``: results in, donor index updated, hits counted (``Feedback``);
- ``chorus_sched.maintenance``: the cache policy (``chorus_sched.cache``) applied, evict orders sent
  (``CacheMaintenance``);
- ``chorus_sched.loop``: the Kafka consumer loop, one thread per topic (``ConsumerLoop``);
- ``chorus_sched.batch``: what they share (the message read, a batch's outcome, the stats).

Here: ``Scheduler`` gives the parts their injected ports and one ``SchedulerStats``; ``build_scheduler`` wires it
to the services the settings name; ``run`` consumes the requests and results topics (each by its own thread and
consumer group) until stopped, running cache maintenance every ``evict_interval_s`` after a results poll.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

from chorus_sched.batch import BatchOutcome, Message, Publisher, SchedulerStats
from chorus_sched.dead_letters import DeadLetters
from chorus_sched.dispatch import Dispatcher
from chorus_sched.embedding import Embedder
from chorus_sched.exact import ExactHits
from chorus_sched.feedback import Feedback
from chorus_sched.grouping import Decision
from chorus_sched.index import DonorIndex
from chorus_sched.intake import Intake
from chorus_sched.ledger import Ledger
from chorus_sched.loop import ConsumerLoop
from chorus_sched.maintenance import CacheMaintenance
from chorus_sched.planner import Planner
from chorus_sched.resend import Resends
from chorus_sched.reuse_gate import GateConfig, VerifiedReuseGate
from chorus_sched.settings import SchedulerSettings
from chorus_sched.watchdog import OrderWatchdog
from producer import bus
from producer.contract import GenerationRequest

log = logging.getLogger(__name__)


class Scheduler:
    """The scheduling core, independent of how messages arrive (``run`` below feeds it from Kafka).

    It composes ``Intake``, ``Feedback`` and ``CacheMaintenance`` over the same ports (every dependency is an
    argument) and counts into one ``stats``.
    """

    def __init__(
        self,
        settings: SchedulerSettings,
        *,
        embedder: Embedder,
        index: DonorIndex,
        ledger: Ledger,
        dispatcher: Dispatcher,
        publish: Publisher,
        planner: Planner,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.embedder = embedder
        self.index = index
        self.ledger = ledger
        self.dispatcher = dispatcher
        self.publish = publish
        # Verified rows apply only while their donor checks pay (chorus_sched.reuse_gate), learned from results.
        self.gate = (
            VerifiedReuseGate(
                GateConfig(
                    explore_every_s=settings.verified_gate_explore_s,
                    explore_max_s=max(settings.verified_gate_explore_s, settings.verified_gate_explore_max_s),
                    pending_ttl_s=settings.verified_gate_pending_ttl_s,
                )
            )
            if settings.verified_gate
            else None
        )
        # An embedder off the calibration's numbers by up to its tolerance (MiniLM in bfloat16) widens the rows.
        planner = planner.widened(embedder.similarity_tolerance)
        self.planner = planner.gated(self.gate) if self.gate is not None else planner
        self.clock = clock
        self.instance = settings.resolved_instance_id
        self.stats = SchedulerStats()
        self.cache = CacheMaintenance(
            settings, index=index, ledger=ledger, dispatcher=dispatcher, stats=self.stats, clock=clock
        )
        self.resends = Resends(settings, ledger=ledger, publish=publish)
        self.exact = ExactHits(
            settings,
            ledger=ledger,
            publish=publish,
            send_order=dispatcher.generate,
            resends=self.resends,
            clock=clock,
        )
        self.intake = Intake(
            settings,
            embedder=embedder,
            index=index,
            ledger=ledger,
            dispatcher=dispatcher,
            planner=self.planner,
            dead_letters=DeadLetters(settings, ledger=ledger, publish=publish, stats=self.stats),
            exact=self.exact,
            resends=self.resends,
            stats=self.stats,
            clock=clock,
        )
        self.feedback = Feedback(
            embedder=embedder,
            index=index,
            ledger=ledger,
            evict=self.cache.evict,
            discard=self.cache.discard,
            exact=self.exact,
            resends=self.resends,
            stats=self.stats,
            gate=self.gate,
            regime_of=lambda n: planner.table.regime_for(n).name,
            clock=clock,
        )
        self.watchdog = OrderWatchdog(
            settings, ledger=ledger, dispatcher=dispatcher, publish=publish, clock=clock
        )
        if planner.table.embedder != embedder.name:
            log.warning(
                "the calibration table was made for another embedder: its similarity thresholds may not fit",
                extra={"table_embedder": planner.table.embedder, "embedder": embedder.name},
            )

    def handle_requests(self, messages: Sequence[Message]) -> BatchOutcome:
        """Schedule a poll of the requests topic (``Intake.handle_requests``)."""
        return self.intake.handle_requests(messages)

    def decide(self, request: GenerationRequest, vector: list[float] | None) -> Decision:
        """Choose (donor, role, plan) for one request (``Intake.decide``)."""
        return self.intake.decide(request, vector)

    def handle_results(self, messages: Sequence[Message]) -> BatchOutcome:
        """Take in a poll of the results topic (``Feedback.handle_results``)."""
        return self.feedback.handle_results(messages)

    def maintain(self) -> list[str]:
        """Apply the cache policy (``CacheMaintenance.maintain``); returns the request ids evicted now. Then
        check the orders in flight (``check_orders``)."""
        evicted = self.cache.maintain()
        self.check_orders()
        return evicted

    def check_orders(self) -> None:
        """Send again the orders whose workers vanished, reject those no worker serves (``OrderWatchdog``)."""
        try:
            self.watchdog.check()
        except Exception as exc:  # the next check tries again
            log.warning("order watchdog failed; will retry", extra={"error": repr(exc)})


class ServiceUnreachable(ConnectionError):
    """A backing service the scheduler needs at start cannot be used; the message says which, where, and why."""

    def __init__(self, what: str, where: str, variables: str, cause: BaseException) -> None:
        reason = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        super().__init__(f"cannot reach {what} at {where} ({variables}): {reason[:300]}")


def build_scheduler(
    settings: SchedulerSettings,
    *,
    embedder: Embedder | None = None,
    dispatcher: Dispatcher | None = None,
    publish: Publisher | None = None,
) -> tuple[Scheduler, Callable[[], None]]:
    """A scheduler wired to the services ``settings`` names, and a function that closes them."""
    from chorus_sched.embedding import make_embedder
    from chorus_sched.ledger_stores import open_ledger
    from chorus_sched.planner import load_calibration

    planner = Planner(load_calibration(settings.calibration_path))
    embedder = embedder or make_embedder(
        settings.embedder, threads=settings.embed_threads, precision=settings.embed_precision
    )
    dim = len(embedder.embed(["warm-up"])[0])  # load the model now, not on the first request
    where = settings.qdrant_url or settings.resolved_qdrant_path
    try:
        index = DonorIndex.connect(
            url=settings.qdrant_url,
            path=settings.resolved_qdrant_path,
            api_key=settings.qdrant_api_key,
            collection=settings.qdrant_collection,
            dim=dim,
            lock_wait_s=settings.index_lock_wait_s,
            keep_open_s=settings.index_keep_open_s,
        )
    except Exception as exc:
        raise ServiceUnreachable(
            "the donor index", where, "CHORUS_QDRANT_URL / CHORUS_QDRANT_PATH", exc
        ) from exc
    ledger = open_ledger(
        settings.redis_url,
        state_dir=settings.state_dir,
        prefix=settings.ledger_prefix,
        ttl_s=settings.ledger_ttl_s,
    )
    try:
        ledger.state("chorus-startup-probe")  # Redis connects lazily: find out now, not on the first request
    except Exception as exc:
        index.close()
        raise ServiceUnreachable(
            "the ledger", settings.redis_url or "SQLite", "CHORUS_REDIS_URL", exc
        ) from exc
    dispatcher = dispatcher or Dispatcher.for_broker(settings.broker_url, state_dir=settings.state_dir)
    producer = None
    if publish is None:
        producer = bus.make_producer(settings)

        def publish(topic: str, key: str, value: bytes) -> None:
            assert producer is not None
            bus.publish(producer, topic, key, value)

    scheduler = Scheduler(
        settings,
        embedder=embedder,
        index=index,
        ledger=ledger,
        dispatcher=dispatcher,
        publish=publish,
        planner=planner,
    )

    def close() -> None:
        for step in (
            (lambda: producer.close(timeout=10)) if producer is not None else None,
            index.close,
            ledger.close,
            dispatcher.close,
        ):
            if step is None:
                continue
            try:
                step()
            except Exception as exc:
                log.warning("error while closing", extra={"error": repr(exc)})

    return scheduler, close


def run(
    settings: SchedulerSettings,
    stop: threading.Event,
    *,
    scheduler: Scheduler | None = None,
    on_ready: Callable[[], None] | None = None,
) -> SchedulerStats:
    """Consume requests and results until ``stop`` is set; commits only what is handled. Returns the stats.

    Raises ``RuntimeError`` if a consumer loop failed (after stopping the other one).
    """
    close: Callable[[], None] = lambda: None  # noqa: E731
    if scheduler is None:
        scheduler, close = build_scheduler(settings)
    instance = scheduler.instance
    next_maintenance = next_check = time.monotonic()

    def maintain() -> None:
        # Two cadences: the cache policy every evict_interval_s, the order watchdog every watchdog_interval_s
        # (an order no worker serves is answered within seconds, not at the next eviction).
        nonlocal next_maintenance, next_check
        now = time.monotonic()
        if now >= next_maintenance:
            try:
                scheduler.cache.maintain()
            except Exception as exc:
                log.warning("cache maintenance failed; will retry", extra={"error": repr(exc)})
            next_maintenance = time.monotonic() + settings.evict_interval_s
        if now >= next_check:
            scheduler.check_orders()
            next_check = time.monotonic() + settings.watchdog_interval_s

    loops = [
        ConsumerLoop(
            settings,
            name="requests",
            topic=settings.kafka_requests_topic,
            group_id=settings.kafka_group_id,
            client_id=instance,
            handle=scheduler.handle_requests,
            stop=stop,
        ),
        ConsumerLoop(
            settings,
            name="results",
            topic=settings.kafka_results_topic,
            group_id=settings.kafka_results_group_id,
            client_id=f"{instance}-results",
            handle=scheduler.handle_results,
            stop=stop,
            after_poll=maintain,
        ),
    ]
    log.info(
        "scheduler started",
        extra={
            "instance": instance,
            "requests_topic": settings.kafka_requests_topic,
            "results_topic": settings.kafka_results_topic,
            "group": settings.kafka_group_id,
            "embedder": scheduler.embedder.name,
            "calibration_provisional": scheduler.planner.table.provisional,
            "index": settings.qdrant_url or str(scheduler.index.path),
            "broker": scheduler.dispatcher.broker_url,
            "ledger": type(scheduler.ledger).__name__,
        },
    )
    try:
        for loop in loops:
            loop.thread.start()
        if on_ready is not None:
            on_ready()
        stop.wait()
    finally:
        stop.set()
        for loop in loops:
            loop.thread.join()
        log.info("scheduler stopped", extra={"instance": instance, "stats": asdict(scheduler.stats)})
        close()
    failed = [loop for loop in loops if loop.error is not None]
    if failed:
        raise RuntimeError(f"the {failed[0].name} loop failed: {failed[0].error!r}") from failed[0].error
    return scheduler.stats
