"""Request ids sent again: a *new* message with the id of a request the scheduler has already taken.

One request, one result — and a sender who asks again is answered, never left waiting. The ledger tells the two
kinds of duplicate apart by where the request was claimed from (``Claim.resent_by``):

- the claimed message read again (a redelivery after a crash or a rebalance): skipped, as before; its request's
  one result answers whoever sent it;
- a new message with the id (a client that timed out and resends, a batch sent twice, a producer retry): answered
  here. The request finished with a video: its kept result is published again, ``replayed``, nothing computed. It is
  still in flight: the message waits under the job id, and the request's result answers it when it comes (a
  client follows the results topic from before it sends, but the first answer may have gone out just before). A
  request that ended without a video is not a resend: the ledger claims it afresh (``Claim`` outcome ``retry``).

A new message that asks for something else under the id (another prompt, seed, shape…: another
``GenerationRequest.fingerprint``, or ``keep_seed`` where the kept video is a donor's sample) is ``rejected`` with
``request_id_reused``; the first request and its result are untouched. Results name the fingerprint they answer
(``request_fingerprint``), so a client waiting on its request (``ResultWatcher.wait``) takes its own answer and
not the other's. Results are kept for the ledger's TTL, as long as the claim that recognises the id.
"""

from __future__ import annotations

import logging

from chorus_sched.batch import Publisher
from chorus_sched.ledger import Ledger, RequestState
from chorus_sched.metrics import METRICS, ResendOutcome
from chorus_sched.settings import SchedulerSettings
from producer.contract import ErrorInfo, GenerationRequest, GenerationResult, ResultStatus
from producer.orders import WorkOrder

log = logging.getLogger(__name__)

REQUEST_ID_REUSED = "request_id_reused"
RESULT_NOT_KEPT = "result_not_kept"


def _kept_key(job: str) -> str:
    return f"result:{job}"


def _waiting_key(job: str) -> str:
    return f"resent:{job}"


class Resends:
    """Answers request ids sent again; keeps finished results for it (``settled``, called for every result)."""

    def __init__(self, settings: SchedulerSettings, *, ledger: Ledger, publish: Publisher) -> None:
        self.settings = settings
        self.ledger = ledger
        self.publish = publish

    # --- intake ----------------------------------------------------------------------------------------------
    def answer(self, request: GenerationRequest, state: RequestState | None) -> ResendOutcome:
        """Answer a new message carrying the id of a request taken before (``state``: that request's)."""
        job = request.job_id
        kept = self._kept(job)
        if kept is not None:
            return self._respond(request, kept)
        first = self._dispatched(job)
        if first is not None and first.fingerprint != request.fingerprint:
            return self._reject(request, REQUEST_ID_REUSED, _reused_message(request))
        if state is RequestState.DONE:
            # Answered before this module kept results, or its result outlived by the claim: say so, never hang.
            return self._reject(
                request,
                RESULT_NOT_KEPT,
                f"request id {request.request_id!r} was answered earlier and its result is no longer kept; "
                "send it with a new request id",
            )
        self.ledger.add_waiter(_waiting_key(job), request.model_dump_json())
        # The result may have been kept between the look and the push, its waiting list taken empty: look again
        # (taking the list is atomic, so nothing is answered twice).
        kept = self._kept(job)
        if kept is not None:
            self._answer_waiting(kept)
        METRICS.resent.labels(outcome=ResendOutcome.WAITING).inc()
        log.info(
            "request id sent again while its request runs; its result will answer this message too",
            extra={"request_id": request.request_id, "tenant": request.tenant, "state": state},
        )
        return ResendOutcome.WAITING

    # --- results ---------------------------------------------------------------------------------------------
    def settled(self, result: GenerationResult) -> None:
        """A request this deployment took has its result: keep it if it has a video, answer messages waiting."""
        if result.replayed:
            return
        if result.status is ResultStatus.DONE:
            self.ledger.put_value(_kept_key(result.job_id), result.model_dump_json())
        self._answer_waiting(result)

    def _answer_waiting(self, result: GenerationResult) -> None:
        waiting = self.ledger.take_waiters(_waiting_key(result.job_id))
        for i, raw in enumerate(waiting):
            try:
                self._respond(GenerationRequest.model_validate_json(raw), result)
            except Exception:
                for left in waiting[i:]:  # answered on the result's retry
                    self.ledger.add_waiter(_waiting_key(result.job_id), left)
                raise

    # --- helpers ---------------------------------------------------------------------------------------------
    def _kept(self, job: str) -> GenerationResult | None:
        raw = self.ledger.get_value(_kept_key(job))
        return None if raw is None else GenerationResult.model_validate_json(raw)

    def _dispatched(self, job: str) -> GenerationRequest | None:
        record = self.ledger.record(job)
        if record is None or record.order is None:
            return None
        return WorkOrder.model_validate_json(record.order).request

    def _respond(self, request: GenerationRequest, result: GenerationResult) -> ResendOutcome:
        if result.request_fingerprint is not None and result.request_fingerprint != request.fingerprint:
            return self._reject(request, REQUEST_ID_REUSED, _reused_message(request))
        if request.keep_seed and not result.seed_honoured:
            return self._reject(
                request,
                REQUEST_ID_REUSED,
                f"request id {request.request_id!r} was answered with a video started from a donor of another "
                "seed; to get this seed's own sample (keep_seed), send it with a new request id",
            )
        replay = result.model_copy(update={"replayed": True})
        self.publish(self.settings.kafka_results_topic, request.request_id, replay.to_bytes())
        METRICS.resent.labels(outcome=ResendOutcome.REPLAYED).inc()
        log.info(
            "request id sent again; answered with its earlier result",
            extra={"request_id": request.request_id, "tenant": request.tenant, "status": str(result.status)},
        )
        return ResendOutcome.REPLAYED

    def _reject(self, request: GenerationRequest, code: str, message: str) -> ResendOutcome:
        rejected = GenerationResult(
            request_id=request.request_id,
            tenant=request.tenant,
            status=ResultStatus.REJECTED,
            error=ErrorInfo(code=code, message=message),
            request_fingerprint=request.fingerprint,
        )
        self.publish(self.settings.kafka_results_topic, request.request_id, rejected.to_bytes())
        METRICS.resent.labels(outcome=ResendOutcome.REJECTED).inc()
        log.warning(
            "request id sent again; rejected",
            extra={
                "request_id": request.request_id,
                "tenant": request.tenant,
                "code": code,
                "reason": message,
            },
        )
        return ResendOutcome.REJECTED


def _reused_message(request: GenerationRequest) -> str:
    return (
        f"request id {request.request_id!r} was already used for another request (its prompt, seed, shape or "
        "settings differ); the first keeps its result: send this one with a new request id"
    )
