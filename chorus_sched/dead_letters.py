"""Dead-lettering: a message the scheduler will not schedule goes to the dead-letter topic, once.

A dead letter keeps the raw bytes (base64), the key, the reason and where the message was read
(topic/partition/offset). When the message still names a request id, a ``rejected`` result tells the producer
waiting for it why no video will come — unless that id belongs to a request accepted before (a broken duplicate
must not contradict the real one). A ledger mark per topic/partition/offset keeps a redelivered message from being
dead-lettered twice. Used by ``chorus_sched.intake`` for invalid messages and for requests that kept failing.
"""

from __future__ import annotations

import base64
import json
import logging

from chorus_sched.batch import Message, Publisher, SchedulerStats
from chorus_sched.ledger import Ledger
from chorus_sched.metrics import METRICS
from chorus_sched.settings import SchedulerSettings
from producer.contract import DeadLetter, ErrorInfo, FieldIssue, GenerationResult, ResultStatus

log = logging.getLogger(__name__)


def _salvage(raw: bytes) -> tuple[str | None, str]:
    """(request id, tenant) named by an invalid message, if its JSON still has them."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None, "default"
    if not isinstance(data, dict):
        return None, "default"
    rid, tenant = data.get("request_id"), data.get("tenant")
    if not (isinstance(rid, str) and 0 < len(rid) <= 128 and rid.isprintable()):
        rid = None
    if not (isinstance(tenant, str) and 0 < len(tenant) <= 128):
        tenant = "default"
    return rid, tenant


class DeadLetters:
    """Sends dead letters (and ``rejected`` results) through ``publish``; marks each message sent in the ledger."""

    def __init__(
        self, settings: SchedulerSettings, *, ledger: Ledger, publish: Publisher, stats: SchedulerStats
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.publish = publish
        self.stats = stats

    def send(self, m: Message, code: str, message: str, issues: list[FieldIssue]) -> None:
        mark = f"dlq:{m.topic}:{m.partition}:{m.offset}"
        if self.ledger.is_marked(mark):
            return
        letter = DeadLetter(
            raw_b64=base64.b64encode(m.value or b"").decode(),
            key_b64=base64.b64encode(m.key).decode() if m.key is not None else None,
            error=ErrorInfo(code=code, message=message),
            issues=issues,
            topic=m.topic,
            partition=m.partition,
            offset=m.offset,
        )
        rid, tenant = _salvage(m.value or b"")
        rejected_sent = False
        self.publish(
            self.settings.kafka_dead_letter_topic,
            rid or f"{m.topic}/{m.partition}/{m.offset}",
            letter.to_bytes(),
        )
        # A producer waiting for this request id learns why it will get no video — unless the id belongs
        # to a request that was accepted before (a broken duplicate must not contradict the real one).
        if rid is not None and (code == "scheduling_failed" or self.ledger.state(rid) is None):
            rejected = GenerationResult(
                request_id=rid,
                tenant=tenant,
                status=ResultStatus.REJECTED,
                error=ErrorInfo(code=code, message=message[:2000]),
            )
            self.publish(self.settings.kafka_results_topic, rid, rejected.to_bytes())
            rejected_sent = True
        self.ledger.mark_once(mark)
        self.stats.dead_lettered += 1
        METRICS.count_dead_letter(code, rejected=rejected_sent)
        log.warning(
            "message dead-lettered",
            extra={
                "code": code,
                "reason": message,
                "request_id": rid,
                "topic": m.topic,
                "partition": m.partition,
                "offset": m.offset,
            },
        )
