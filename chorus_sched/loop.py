"""The Kafka consumer loop: one consumer per topic, polled in its own thread, its batches handed to a handler.

``ConsumerLoop`` polls, hands each non-empty batch to its handler (``Intake.handle_requests`` or
``Feedback.handle_results``), commits the offsets the handler reports as handled and seeks back to the first one
it left for a retry, then backs off (doubling, up to ``retry_backoff_max_s``) while anything is being retried. A
consumer whose polls keep failing is closed and replaced by a fresh group member. ``chorus_sched.service.run``
starts the loops and stops them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kafka import ConsumerRebalanceListener
from kafka.structs import TopicPartition

from chorus_sched.batch import BatchOutcome, Message
from chorus_sched.metrics import METRICS
from chorus_sched.settings import SchedulerSettings
from producer import bus
from producer.readiness import ReadinessEvent

log = logging.getLogger(__name__)


def _records(batches: dict[Any, list[Any]]) -> list[Any]:
    return [r for records in batches.values() for r in records]


# Consecutive failed polls after which a consumer loop leaves the group and joins again as a new member.
REJOIN_AFTER_POLL_FAILURES = 5


class _Listener(ConsumerRebalanceListener):
    def __init__(self, topic: str, client_id: str) -> None:
        self.topic = topic
        self.client_id = client_id

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        log.info(
            "partitions revoked",
            extra={"topic": self.topic, "partitions": sorted(tp.partition for tp in revoked)},
        )

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        log.info(
            ReadinessEvent.PARTITIONS_ASSIGNED,
            extra={
                "topic": self.topic,
                "client": self.client_id,
                "partitions": sorted(tp.partition for tp in assigned),
            },
        )


class ConsumerLoop:
    """One consumer polled continuously in its own thread, its batches handed to the scheduler.

    Each consumer gets its own thread: kafka-python's group membership (joins, rebalances) only progresses while
    its consumer is polled, and two consumers polled in turn by one thread were seen to never finish joining.
    """

    def __init__(
        self,
        settings: SchedulerSettings,
        *,
        name: str,
        topic: str,
        group_id: str,
        client_id: str,
        handle: Callable[[Sequence[Message]], BatchOutcome],
        stop: threading.Event,
        after_poll: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.name = name
        self.topic = topic
        self.group_id = group_id
        self.client_id = client_id
        self.handle = handle
        self.stop = stop
        self.after_poll = after_poll
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name=f"chorus-{name}", daemon=True)

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            log.critical(
                "consumer loop failed; stopping the scheduler", exc_info=exc, extra={"loop": self.name}
            )
            self.error = exc
            self.stop.set()

    def _open_consumer(self) -> Any:
        settings = self.settings
        consumer = bus.make_consumer(
            settings,
            [],
            group_id=self.group_id,
            client_id=self.client_id,
            max_poll_records=settings.poll_max_records,
            metadata_max_age_ms=settings.kafka_metadata_max_age_ms,
            session_timeout_ms=settings.kafka_session_timeout_ms,
            heartbeat_interval_ms=max(100, settings.kafka_session_timeout_ms // 3),
            max_poll_interval_ms=settings.kafka_max_poll_interval_ms,
        )
        consumer.subscribe([self.topic], listener=_Listener(self.topic, self.client_id))
        return consumer

    def _close_consumer(self, consumer: Any) -> None:
        try:
            consumer.close(autocommit=False)
        except Exception as exc:
            log.warning("error while closing a consumer", extra={"topic": self.topic, "error": repr(exc)})

    def _run(self) -> None:
        from kafka.errors import CommitFailedError, KafkaError

        topic, settings = self.topic, self.settings
        consumer = self._open_consumer()
        lag_probe = METRICS.lag_probe(self.name)
        backoff = 0.0
        failures = 0
        try:
            while not self.stop.is_set():
                retry = False
                try:
                    batch = _records(
                        consumer.poll(
                            timeout_ms=settings.poll_timeout_ms, max_records=settings.poll_max_records
                        )
                    )
                    failures = 0
                except KafkaError as exc:
                    failures += 1
                    log.warning(
                        "poll failed", extra={"topic": topic, "error": repr(exc), "in_a_row": failures}
                    )
                    batch, retry = [], True
                    if failures >= REJOIN_AFTER_POLL_FAILURES:
                        # A member whose group state went wrong (e.g. a SyncGroup the coordinator no longer
                        # expects) can keep failing the same way; a fresh member rejoins and forces a
                        # rebalance. Nothing uncommitted is lost: the next owner reads it again.
                        log.warning(
                            "consumer rebuilt after repeated poll failures",
                            extra={"topic": topic, "failures": failures},
                        )
                        self._close_consumer(consumer)
                        consumer = self._open_consumer()
                        failures = 0
                if batch:
                    outcome = self.handle(batch)
                    try:
                        bus.commit_offsets(consumer, outcome.commit)
                    except (CommitFailedError, KafkaError) as exc:
                        # The partitions moved to another instance, which reads these messages again; the
                        # ledger makes that harmless.
                        log.warning("offset commit failed", extra={"topic": topic, "error": repr(exc)})
                    for tp, offset in outcome.retry.items():
                        consumer.seek(tp, offset)
                    retry = retry or bool(outcome.retry)
                lag_probe(consumer)
                if self.after_poll is not None:
                    self.after_poll()
                if retry:
                    backoff = min(max(0.2, backoff * 2), settings.retry_backoff_max_s)
                    self.stop.wait(backoff)
                else:
                    backoff = 0.0
        finally:
            self._close_consumer(consumer)
