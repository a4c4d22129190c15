"""When the processes of a local stack are ready, observed in their JSON log lines (``producer.readiness``).

A scheduler is ready once its consumers were assigned partitions of the requests and results topics
(``ReadinessEvent.PARTITIONS_ASSIGNED``) and the schedulers together cover every partition. A worker is ready once
Celery logged that it is ready and, with ``preload``, each pool process logged ``ReadinessEvent.MODEL_LOADED`` for
every model it serves; ``ReadinessEvent.MODEL_NOT_PRELOADED`` fails the start with the reason.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from producer.local.config import StackError, StackOptions
from producer.local.processes import ServiceProcess
from producer.readiness import ReadinessEvent

if TYPE_CHECKING:
    from collections.abc import Callable

    from producer.settings import ProducerSettings

POLL_S = 0.2


def wait_ready(
    processes: list[ServiceProcess],
    options: StackOptions,
    settings: ProducerSettings,
    check: Callable[[], None],
) -> None:
    """Return once every process is ready; ``check`` raises if a process of the stack died meanwhile."""
    deadline = time.monotonic() + options.ready_timeout_s
    partitions = topic_partitions(settings)
    schedulers = [p for p in processes if p.role == "scheduler"]
    pending = list(processes)
    while pending:
        check()
        for p in list(pending):
            if is_ready(p, options, schedulers, partitions):
                pending.remove(p)
        if pending and time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            tail = pending[0].log_tail()
            raise StackError(
                f"not ready within {options.ready_timeout_s:.0f} s: {names}; "
                f"the end of {pending[0].log_path}:\n{tail}"
            )
        if pending:
            time.sleep(POLL_S)


def topic_partitions(settings: ProducerSettings) -> dict[str, set[int]]:
    """The partitions of the requests and results topics, which the schedulers must cover between them."""
    from kafka import KafkaConsumer

    from producer import bus

    consumer = KafkaConsumer(**bus.client_config(settings), group_id=None, enable_auto_commit=False)
    try:
        return {
            topic: set(consumer.partitions_for_topic(topic) or ())
            for topic in (settings.kafka_requests_topic, settings.kafka_results_topic)
        }
    finally:
        consumer.close(autocommit=False)


def is_ready(
    p: ServiceProcess,
    options: StackOptions,
    schedulers: list[ServiceProcess],
    partitions: dict[str, set[int]],
) -> bool:
    events = p.read_events()
    if p.role == "worker":
        for e in events:
            if e.get("event") == ReadinessEvent.MODEL_NOT_PRELOADED:
                raise StackError(
                    f"{p.name} could not load model {e.get('model')!r}: {e.get('error')} (log: {p.log_path})"
                )
        celery_ready = any(
            e.get("logger") == "celery.apps.worker" and str(e.get("event", "")).endswith(" ready.")
            for e in events
        )
        if not options.preload:
            return celery_ready
        loaded = sum(1 for e in events if e.get("event") == ReadinessEvent.MODEL_LOADED)
        return celery_ready and loaded >= options.worker_concurrency * len(options.models)
    # A scheduler: assigned its share of both topics, and together the schedulers cover every partition.
    for topic, expected in partitions.items():
        if assignment(p, topic) is None:
            return False
        covered: set[int] = set()
        for other in schedulers:
            covered |= set(assignment(other, topic) or ())
        if not expected <= covered:
            return False
    return True


def assignment(p: ServiceProcess, topic: str) -> list[int] | None:
    """The partitions of ``topic`` last assigned to the scheduler ``p`` (None: none logged yet)."""
    latest = None
    for e in p.read_events():
        if e.get("event") == ReadinessEvent.PARTITIONS_ASSIGNED and e.get("topic") == topic:
            latest = list(e.get("partitions") or [])
    return latest
