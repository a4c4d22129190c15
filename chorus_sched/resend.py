"""Request ids sent again: a *new* message with the id of a request the scheduler has already taken.

A request runs once per id, and a sender who asks again is answered, not left waiting. The ledger tells the two
kinds of duplicate apart by where the request was claimed from (``Claim.resent_by``):

- the claimed message read again (a redelivery after a crash or a rebalance): skipped; the request's one result
  answers whoever sent it;
- a new message with the id (a client that timed out and resends, a batch sent twice, a producer retry): answered
  here, with ``answers_resend`` set (the scheduler's feedback takes such results for nothing new). The request has
  its answer: a copy of it goes out, nothing computed. It is in flight: the message waits under the job id, and
  the request's answer — its result, or its dead letter's rejection — answers it when it comes (the first answer
  may have gone out just before the sender started to follow the topic). A request that ended without a video is
  not a resend: the ledger claims it afresh (``Claim`` outcome ``retry``), and the answer kept for it is forgotten.

A new message that asks for another answer under the id — another prompt, seed, shape…, or other terms
(``reuse``, ``keep_seed``): another ``GenerationRequest.answer_key`` — is ``rejected`` with ``request_id_reused``,
and the first request and its result are untouched. Results name the key they answer (``request_key``), so a
client waiting on its request (``ResultWatcher.wait``) takes its own answer and not the other's. Each message is
answered once (a ledger mark per message, set after its answer is sent: a resend read again is not answered
again; two instances racing on one waiting message may both answer it). Answers are kept for the ledger's TTL, as
long as the claim that recognises the id.
"""

from __future__ import annotations

import json
import logging

from pydantic import ValidationError

from chorus_sched.batch import Publisher
from chorus_sched.ledger import Ledger, RequestState
from chorus_sched.metrics import METRICS, ResendOutcome
from chorus_sched.settings import SchedulerSettings
from producer.contract import REQUEST_ID_REUSED, ErrorInfo, GenerationRequest, GenerationResult, ResultStatus
from producer.orders import WorkOrder

log = logging.getLogger(__name__)

RESULT_NOT_KEPT = "result_not_kept"


def _kept_key(job: str) -> str:
    return f"result:{job}"


def _waiting_key(job: str) -> str:
    return f"resent:{job}"


def _answered_mark(origin: str) -> str:
    return f"resent-answered:{origin}"


class Resends:
    """Answers request ids sent again, from the answer kept for each request (``keep``, by the feedback)."""

    def __init__(self, settings: SchedulerSettings, *, ledger: Ledger, publish: Publisher) -> None:
        self.settings = settings
        self.ledger = ledger
        self.publish = publish

    # --- intake ----------------------------------------------------------------------------------------------
    def answer(self, request: GenerationRequest, state: RequestState | None, *, origin: str) -> None:
        """Answer the message at ``origin`` that sent again the id of a request taken before (in ``state``)."""
        job = request.job_id
        if self.ledger.is_marked(_answered_mark(origin)):
            log.info("resent message read again; answered before", extra={"request_id": request.request_id})
            return
        kept = self._kept(job)
        if kept is not None:
            self._respond(request, kept, origin)
            self.answer_waiting(kept)  # and any copy left waiting by an earlier failure to tell it
            return
        if state in (RequestState.DONE, RequestState.EVICTED):
            # Answered before answers were kept, or its answer expired before its claim (an eviction renews the
            # claim): say so, never hang. (A running leader evicted before it finished is told so too.)
            message = (
                f"request id {request.request_id!r} was taken earlier and no answer is kept for it; "
                "send it with a new request id"
            )
            self._reject(request, RESULT_NOT_KEPT, message, origin)
            return
        first = self._dispatched(job)
        if first is not None and first.answer_key != request.answer_key:
            self._reject(
                request, REQUEST_ID_REUSED, _reused_message(request), origin
            )  # now, not after its run
            return
        waiting = json.dumps({"origin": origin, "request": request.model_dump(mode="json")})
        self.ledger.add_waiter(_waiting_key(job), waiting)
        log.info(
            "request id sent again while its request runs; its answer will answer this message too",
            extra={"request_id": request.request_id, "tenant": request.tenant, "state": state},
        )
        # The answer may have been kept between the look and the push, its waiting list taken empty: look again
        # (taking the list is atomic, so nothing is answered twice).
        kept = self._kept(job)
        if kept is not None:
            self.answer_waiting(kept)

    def forget(self, job: str) -> None:
        """The request is claimed afresh (it ended without a video and was sent again): its old answer is void."""
        self.ledger.delete_value(_kept_key(job))

    # --- answers ---------------------------------------------------------------------------------------------
    def keep(self, result: GenerationResult) -> None:
        """Keep the answer of a request this deployment took, before its state says it ended."""
        if not result.answers_resend:
            self.ledger.put_value(_kept_key(result.job_id), result.model_dump_json())

    def answer_waiting(self, result: GenerationResult) -> None:
        """Answer the messages that sent the request's id again while it ran (each message once)."""
        waiting = self.ledger.take_waiters(_waiting_key(result.job_id))
        for i, raw in enumerate(waiting):
            try:
                entry = json.loads(raw)
                origin, request = str(entry["origin"]), GenerationRequest.model_validate(entry["request"])
            except (ValueError, KeyError, TypeError, ValidationError) as exc:
                log.error("unreadable resend entry dropped", extra={"job": result.job_id, "error": repr(exc)})
                continue
            if self.ledger.is_marked(_answered_mark(origin)):
                continue  # a poll read again after a failure pushed its copies again
            try:
                self._respond(request, result, origin)
            except Exception:
                for left in waiting[i:]:  # answered when the result is handled again
                    self.ledger.add_waiter(_waiting_key(result.job_id), left)
                raise

    def try_answer_waiting(self, result: GenerationResult) -> None:
        """``answer_waiting`` where the request is answered already and must not be handled again for them: a
        failure is logged, and the copies left waiting are told when the id comes again (``answer``)."""
        try:
            self.answer_waiting(result)
        except Exception as exc:
            log.error(
                "copies waiting on a request could not be told yet; they are when its id comes again",
                extra={"request_id": result.request_id, "tenant": result.tenant, "error": repr(exc)},
            )

    # --- helpers ---------------------------------------------------------------------------------------------
    def _kept(self, job: str) -> GenerationResult | None:
        raw = self.ledger.get_value(_kept_key(job))
        return None if raw is None else GenerationResult.model_validate_json(raw)

    def _dispatched(self, job: str) -> GenerationRequest | None:
        record = self.ledger.record(job)
        if record is None or record.order is None:
            return None
        return WorkOrder.model_validate_json(record.order).request

    def _respond(self, request: GenerationRequest, result: GenerationResult, origin: str) -> None:
        """Send the message at ``origin`` a copy of ``result``, or why it does not answer its request."""
        first = result.request_key
        if first is None and (dispatched := self._dispatched(request.job_id)) is not None:
            first = dispatched.answer_key  # a worker too old to name it
        if first is not None and first != request.answer_key:
            self._reject(request, REQUEST_ID_REUSED, _reused_message(request), origin)
            return
        copy = result.model_copy(update={"answers_resend": True})
        self.publish(self.settings.kafka_results_topic, request.request_id, copy.to_bytes())
        self.ledger.mark_once(_answered_mark(origin))
        METRICS.resent.labels(outcome=ResendOutcome.REPLAYED).inc()
        log.info(
            "request id sent again; answered with its earlier result",
            extra={"request_id": request.request_id, "tenant": request.tenant, "status": str(result.status)},
        )

    def _reject(self, request: GenerationRequest, code: str, message: str, origin: str) -> None:
        rejected = GenerationResult(
            request_id=request.request_id,
            tenant=request.tenant,
            status=ResultStatus.REJECTED,
            error=ErrorInfo(code=code, message=message),
            request_key=request.answer_key,
            answers_resend=True,
        )
        self.publish(self.settings.kafka_results_topic, request.request_id, rejected.to_bytes())
        self.ledger.mark_once(_answered_mark(origin))
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


def _reused_message(request: GenerationRequest) -> str:
    return (
        f"request id {request.request_id!r} was used before for another request (other prompt, seed, shape, "
        "settings, reuse or keep_seed): send this one with a new request id"
    )
