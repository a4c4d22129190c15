"""The order watchdog: an order whose worker vanished is sent again, a bounded number of times.

A Celery worker killed as a whole (its process group, its machine) takes its in-flight order with it: with
kombu's filesystem transport the message was deleted when read, and nothing else ever reports. The scheduler
keeps the order it sent in the ledger (``RequestRecord.order``) and, during maintenance, checks every request
still ``dispatched`` for longer than ``order_check_after_s``:

- started (STARTED/PROGRESS) and its heartbeat (``producer.orders.HEARTBEAT_FIELD``, written every
  ``worker_heartbeat_s`` by the running task) older than ``worker_lost_after_s``: the worker is gone;
- never started (PENDING) for longer than ``order_pending_lost_after_s``: the message was lost (a live queue
  that is merely long keeps the order PENDING too, so this bound is generous);
- succeeded in Celery (SUCCESS) yet no result reached us: left alone (the task returns only after its result
  was published; re-running would duplicate);
- failed in Celery (FAILURE: its result could not be published after the task's own retries, the hard time
  limit killed it, an exception escaped the task) and no result reached us: nothing will ever answer it, so it is
  answered ``failed`` (``worker_failed``, with Celery's reason) — not sent again, as what failed it would most
  likely fail it again, and its sender may send it again.

A lost order is sent again with the same task id, up to ``max_redispatches`` times; after that the request is
answered ``failed`` (``worker_lost``) so its sender is never left waiting.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Protocol

from chorus_sched.batch import Publisher
from chorus_sched.ledger import Ledger, RequestRecord, RequestState
from chorus_sched.metrics import METRICS
from chorus_sched.settings import SchedulerSettings
from producer.broker import ANY_MODEL
from producer.contract import DeadLetter, ErrorInfo, FieldIssue, GenerationResult, ResultStatus
from producer.orders import WorkOrder

log = logging.getLogger(__name__)

STARTED_STATES = ("STARTED", "PROGRESS")
NO_WORKER = "no_worker"
WORKER_FAILED = "worker_failed"
WORKER_LOST = "worker_lost"


def _origin(origin: str, default_topic: str) -> tuple[str, int, int]:
    """(topic, partition, offset) of a request's message, as recorded at intake ("" for an older record)."""
    topic, _, rest = origin.rpartition(":")
    head, _, partition = topic.rpartition(":")
    try:
        return head, int(partition), int(rest)
    except ValueError:
        return default_topic, 0, 0


class OrderPort(Protocol):
    def generate(self, order: WorkOrder) -> None: ...

    def task_state(self, task_id: str) -> tuple[str, float | None]: ...

    def failure_of(self, task_id: str) -> str: ...

    def model_last_seen(self, model: str) -> float | None: ...

    def mark_answered(self, task_id: str) -> None: ...


class OrderWatchdog:
    def __init__(
        self,
        settings: SchedulerSettings,
        *,
        ledger: Ledger,
        dispatcher: OrderPort,
        publish: Publisher,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.dispatcher = dispatcher
        self.publish = publish
        self.clock = clock

    def check(self) -> list[str]:
        """Send again (or fail) every lost order; returns the job ids acted on. One instance at a time: with
        several schedulers, the others skip the round rather than act on the same orders twice."""
        token = f"{self.settings.resolved_instance_id}:{uuid.uuid4().hex}"
        if not self.ledger.try_lock(
            "watchdog", token, ttl_s=max(30.0, 4 * self.settings.watchdog_interval_s)
        ):
            return []
        try:
            return self._check_all()
        finally:
            self.ledger.unlock("watchdog", token)

    def _check_all(self) -> list[str]:
        now = self.clock()
        acted = []
        for record in self.ledger.dispatched_records():
            sent_at = record.dispatched_at or record.accepted_at
            # The snapshot may be stale: a result read since must not be overwritten by a re-send or a failure.
            if record.order is None or self.ledger.state(record.request_id) != RequestState.DISPATCHED:
                continue
            if now - sent_at >= self.settings.no_worker_after_s and self._nobody_serves(record, now):
                acted.append(record.request_id)
                continue
            if now - sent_at < self.settings.order_check_after_s:
                continue
            state, heartbeat = self.dispatcher.task_state(record.request_id)
            if state == "FAILURE":
                acted.append(record.request_id)
                self._failed_in_worker(record)
                continue
            why = self._lost(state, heartbeat, sent_at, now)
            if why is None:
                continue
            acted.append(record.request_id)
            if record.redispatches >= self.settings.max_redispatches:
                message = f"order lost {record.redispatches + 1} times ({why}); not sent again"
                self._answer_failed(record, WORKER_LOST, message)
                METRICS.redispatched.labels(outcome="failed").inc()
                log.error("order lost; answered failed", extra={"job": record.request_id, "why": why})
            else:
                self._redispatch(record, why, now)
        return acted

    def _nobody_serves(self, record: RequestRecord, now: float) -> bool:
        """An order no worker will take — workers are running, but none announced its model lately — is answered
        rejected, with a dead letter, instead of waiting in its queue forever; a worker that comes later skips it.
        With no live worker at all the order waits (workers may be starting or scaled to zero)."""
        ttl = self.settings.worker_presence_ttl_s
        anyone = self.dispatcher.model_last_seen(ANY_MODEL)
        if anyone is None or now - anyone > ttl:
            return False  # no worker at all yet (starting up, or scaled to zero): the order waits for one
        seen = self.dispatcher.model_last_seen(record.model)
        if seen is not None and now - seen <= ttl:
            return False
        state, _ = self.dispatcher.task_state(record.request_id)
        if state != "PENDING":
            return False
        order = WorkOrder.model_validate_json(record.order or "")
        when = "ever" if seen is None else f"in the last {ttl:g} s"
        message = (
            f"no worker serves model {record.model!r} (none announced it {when}); start one with "
            f"`chorus worker --model {record.model}` and send the request again"
        )
        self.dispatcher.mark_answered(record.request_id)
        topic, partition, offset = _origin(record.origin, self.settings.kafka_requests_topic)
        letter = DeadLetter.of_message(
            order.request.to_bytes(),
            order.request.request_id.encode(),
            ErrorInfo(code=NO_WORKER, message=message),
            [FieldIssue(field="model", rule=NO_WORKER, message=message)],
            topic=topic,
            partition=partition,
            offset=offset,
        )
        self.publish(self.settings.kafka_dead_letter_topic, order.request.request_id, letter.to_bytes())
        rejected = GenerationResult(
            request_id=order.request.request_id,
            tenant=order.request.tenant,
            status=ResultStatus.REJECTED,
            error=ErrorInfo(code=NO_WORKER, message=message),
            request_key=order.request.answer_key,
        )
        self.publish(self.settings.kafka_results_topic, order.request.request_id, rejected.to_bytes())
        self.ledger.set_state(record.request_id, RequestState.FAILED)
        METRICS.count_dead_letter(NO_WORKER, rejected=True)
        log.error(
            "order rejected: no worker serves its model",
            extra={"job": record.request_id, "model": record.model},
        )
        return True

    def _lost(self, state: str, heartbeat: float | None, sent_at: float, now: float) -> str | None:
        if state in STARTED_STATES:
            # A re-sent order shows the dead worker's last beat until a copy starts: count from the re-send.
            last = max(heartbeat or 0.0, sent_at)
            if now - last > self.settings.worker_lost_after_s:
                return f"its worker stopped beating {now - last:.0f} s ago"
        elif state == "PENDING" and now - sent_at > self.settings.order_pending_lost_after_s:
            return f"not started {now - sent_at:.0f} s after it was sent"
        return None

    def _redispatch(self, record: RequestRecord, why: str, now: float) -> None:
        assert record.order is not None
        self.dispatcher.generate(WorkOrder.model_validate_json(record.order))
        again = record.model_copy(update={"dispatched_at": now, "redispatches": record.redispatches + 1})
        self.ledger.record_dispatch(again)
        METRICS.redispatched.labels(outcome="sent_again").inc()
        log.warning(
            "order lost; sent again",
            extra={"job": record.request_id, "why": why, "redispatches": again.redispatches},
        )

    def _failed_in_worker(self, record: RequestRecord) -> None:
        reason = self.dispatcher.failure_of(record.request_id)
        message = f"the worker's task failed without an answer ({reason}); send the request again to retry it"
        self._answer_failed(record, WORKER_FAILED, message)
        METRICS.redispatched.labels(outcome=WORKER_FAILED).inc()
        log.error(
            "order failed in its worker without an answer; answered failed",
            extra={"job": record.request_id, "reason": reason},
        )

    def _answer_failed(self, record: RequestRecord, code: str, message: str) -> None:
        order = WorkOrder.model_validate_json(record.order or "")
        failed = GenerationResult(
            request_id=order.request.request_id,
            tenant=order.request.tenant,
            status=ResultStatus.FAILED,
            error=ErrorInfo(code=code, message=message[:2000]),
            steps_requested=order.request.num_steps,
            request_key=order.request.answer_key,
        )
        self.dispatcher.mark_answered(record.request_id)  # copies still queued must not answer it again
        self.publish(self.settings.kafka_results_topic, order.request.request_id, failed.to_bytes())
        self.ledger.set_state(record.request_id, RequestState.FAILED)
