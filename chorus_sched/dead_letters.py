"""Dead-lettering: a message the scheduler will not schedule goes to the dead-letter topic, once.

A dead letter keeps the raw bytes (base64, at most ``DEAD_LETTER_RAW_BYTES`` of them, with the size and sha256), the key, the reason and where the message was read
(topic/partition/offset). When the message still names a request id, a ``rejected`` result tells the producer
waiting for it why no video will come — unless that id belongs to a request accepted before (a broken duplicate
must not contradict the real one). A ledger mark per topic/partition/offset keeps a redelivered message from being
dead-lettered twice. Used by ``chorus_sched.intake`` for invalid messages and for requests that kept failing.
"""

from __future__ import annotations

import logging

from chorus_sched.batch import Message, Publisher, SchedulerStats
from chorus_sched.ledger import Ledger
from chorus_sched.metrics import METRICS
from chorus_sched.settings import SchedulerSettings
from producer.contract import (
    DeadLetter,
    ErrorInfo,
    FieldIssue,
    GenerationRequest,
    GenerationResult,
    ResultStatus,
    job_id,
)
from producer.parsing import salvage_identity, salvage_json

log = logging.getLogger(__name__)


def _named(value: bytes | None, key: bytes | None) -> object:
    """What names the message's request: its JSON, with the key standing in for a missing request id (as the
    contract reads it), or the key alone when the JSON cannot be read at all. A tombstone names nothing."""
    if value is None:
        return None
    data = salvage_json(value)
    if key is None:
        return data
    if data is None:
        return {"request_id": key.decode("utf-8", "replace")}
    if isinstance(data, dict) and "request_id" not in data:
        return {**data, "request_id": key.decode("utf-8", "replace")}
    return data


class DeadLetters:
    """Sends dead letters (and ``rejected`` results) through ``publish``; marks each message sent in the ledger."""

    def __init__(
        self, settings: SchedulerSettings, *, ledger: Ledger, publish: Publisher, stats: SchedulerStats
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.publish = publish
        self.stats = stats

    def send(
        self,
        m: Message,
        code: str,
        message: str,
        issues: list[FieldIssue],
        *,
        request: GenerationRequest | None = None,
        claimed: bool = True,
    ) -> GenerationResult | None:
        """Dead-letter ``m``; returns the ``rejected`` result sent to its producer, if one was. ``request``: the
        request it carries, when it parsed (the rejection names its ``answer_key``). ``claimed=False``: the request's
        claim is not this message's (it sent again the id of a request taken before, or its claim could not be
        made): its rejection answers this message alone (``answers_resend``), never the request taken before."""
        mark = f"dlq:{m.topic}:{m.partition}:{m.offset}"
        if self.ledger.is_marked(mark):
            return None
        # Bounded: a 1 MB message must still fit in a dead letter the producer accepts.
        letter = DeadLetter.of_message(
            m.value,
            m.key,
            ErrorInfo(code=code, message=message[:4000]),
            issues[:50],
            topic=m.topic,
            partition=m.partition,
            offset=m.offset,
        )
        rid, tenant = salvage_identity(_named(m.value, m.key))
        self.publish(
            self.settings.kafka_dead_letter_topic,
            rid or f"{m.topic}/{m.partition}/{m.offset}",
            letter.to_bytes(),
        )
        # A producer waiting for this request id learns why it will get no video — unless the id belongs
        # to a request that was accepted before (a broken duplicate must not contradict the real one).
        rejected: GenerationResult | None = None
        if request is not None:
            rid, tenant = request.request_id, request.tenant
        if rid is not None and (
            not claimed or code == "scheduling_failed" or self.ledger.state(job_id(tenant, rid)) is None
        ):
            rejected = GenerationResult(
                request_id=rid,
                tenant=tenant,
                status=ResultStatus.REJECTED,
                error=ErrorInfo(code=code, message=message[:2000]),
                request_key=request.answer_key if request is not None else None,
                answers_resend=not claimed,
            )
            self.publish(self.settings.kafka_results_topic, rid, rejected.to_bytes())
        self.ledger.mark_once(mark)
        self.stats.dead_lettered += 1
        METRICS.count_dead_letter(code, rejected=rejected is not None)
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
        return rejected
