"""Exact hits: a request identical to one already served is answered from its stored result, with no worker.

Identical means the same ``GenerationRequest.fingerprint`` (model, shape, steps, scheduler, prompt, negative
prompt, seed, guidance) in the same scope (the tenant; every tenant when cross-tenant reuse is on). Three cases,
decided at intake before any embedding or search:

- a finished request with that fingerprint: answered at once, ``reuse: exact``, the same video, 0 steps computed;
- one still running: the new request waits for it (*coalesced*) and is answered when its result arrives; if that
  run fails, each waiting request is sent to the workers as a full order of its own;
- neither: the request runs, and is recorded as the one running for its fingerprint.

*Another seed.* A request that differs only in its seed (``any_seed_fingerprint``) and does not keep its seed is
served the same way, with ``seed_honoured: false``: by policy, the same prompt and settings sent again with a new
seed return the video already made unless the request sets ``keep_seed``. It is the video Stage-1 reuse from that
donor gives: the steps computed after the switch point repeat the donor's own computation (same latent, timestep,
prompt and guidance), so with float32 trajectories the output is the donor's video bit for bit (the toy model,
k1 = 1..3 of 4: tests/unit/workers/engine/test_same_prompt_toy.py; a float16 trajectory rounds the latent the
steps start from), and the worker's steps were cost without a new sample. The stored video outlives the donor's
trajectory (cache eviction deletes trajectories, not videos), so it is served even where Stage 1 no longer could.

Everything lives in the ledger (values and waiting lists under the fingerprint), so any scheduler instance can
answer what another started. Entries expire with the donor TTL; a video is never deleted by cache eviction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import StrEnum

from chorus_sched.batch import Publisher
from chorus_sched.ledger import Ledger, RequestRecord, RequestState
from chorus_sched.metrics import METRICS
from chorus_sched.resend import Resends
from chorus_sched.settings import SchedulerSettings
from producer.contract import (
    DonorInfo,
    GenerationRequest,
    GenerationResult,
    ResultStatus,
    ReuseKind,
    ReusePlan,
    ReusePolicy,
)
from producer.orders import Role, WorkOrder

log = logging.getLogger(__name__)


class ExactOutcome(StrEnum):
    SERVED = "served"  # answered from a stored result
    COALESCED = "coalesced"  # waits for an identical request (or one of another seed) still running
    RUN = "run"  # nothing identical: schedule it


class Match(StrEnum):
    """Which key found the result: the request's own fingerprint, or its prompt and settings with another seed."""

    SAME_SEED = "same_seed"
    OTHER_SEED = "other_seed"


class ExactHits:
    def __init__(
        self,
        settings: SchedulerSettings,
        *,
        ledger: Ledger,
        publish: Publisher,
        send_order: Callable[[WorkOrder], None],
        resends: Resends,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.publish = publish
        self.send_order = send_order
        # Keeps each answer, so the id sent again is answered from it too.
        self.resends = resends
        self.clock = clock

    def _scope(self, request: GenerationRequest) -> str:
        return f"exact:{self._tenancy(request)}:{request.fingerprint}"

    def _any_seed_scope(self, request: GenerationRequest) -> str:
        return f"exact:{self._tenancy(request)}:any-seed:{request.any_seed_fingerprint}"

    def _tenancy(self, request: GenerationRequest) -> str:
        return "*" if self.settings.cross_tenant_reuse else request.tenant

    def _keys(self, request: GenerationRequest) -> list[tuple[str, Match]]:
        """Where an answer for ``request`` may be found, best first: its own seed's, then (unless it keeps its
        seed) another seed's."""
        keys = [(self._scope(request), Match.SAME_SEED)]
        if not request.keep_seed:
            keys.append((self._any_seed_scope(request), Match.OTHER_SEED))
        return keys

    # --- intake ----------------------------------------------------------------------------------------------
    def twin_key(self, request: GenerationRequest) -> str | None:
        """What requests that may wait for one another share (the prompt and settings, any seed), for a request
        that would wait for one running (None: one that would not): the intake holds back a poll's second such
        request until the first is dispatched."""
        if request.reuse is not ReusePolicy.AUTO or not self.settings.exact_hits or request.keep_seed:
            return None
        return self._any_seed_scope(request)

    def admit(self, request: GenerationRequest) -> ExactOutcome:
        """Serve, coalesce or let run one claimed request (``reuse: off`` always runs)."""
        if request.reuse is ReusePolicy.OFF or not self.settings.exact_hits:
            return ExactOutcome.RUN
        keys = self._keys(request)
        for key, match in keys:
            stored = self._stored(key, request)
            if stored is not None:
                self._serve(request, stored, "stored", match)
                return ExactOutcome.SERVED
        if request.keep_seed:  # it does not wait for a run that might not honour its seed
            return ExactOutcome.RUN
        for key, match in keys:
            running = self.ledger.get_value(f"{key}:running")
            # Only a run still in flight is waited for: one that ended without telling us must not hold others.
            if running is not None and running != request.job_id and self._in_flight(running):
                self._wait(request, key, match, running)
                return ExactOutcome.COALESCED
        return ExactOutcome.RUN

    def _in_flight(self, job_id: str | None) -> bool:
        return job_id is not None and self.ledger.state(job_id) in (
            RequestState.ACCEPTED,
            RequestState.DISPATCHED,
        )

    def _wait(self, request: GenerationRequest, key: str, match: Match, running: str) -> None:
        self.ledger.add_waiter(key, request.model_dump_json())
        self.ledger.set_state(request.job_id, RequestState.COALESCED)
        # The run may have finished between the check and the push, its result taking an empty waiting list:
        # look again, and answer whatever waits now (taking the list is atomic, so nothing is answered twice). If
        # another run in flight took the key meanwhile (one of another seed), its result answers the list.
        now = self.ledger.get_value(f"{key}:running")
        if now != running:
            stored = self._stored(key, None)
            if stored is not None or not self._in_flight(now):
                self._answer_waiters(key, match, stored)
        # Counted as a hit when answered (``_serve``): a wait whose run fails ends in a full run of its own.
        log.info(
            "identical request running; this one waits for its result"
            if match is Match.SAME_SEED
            else "the same prompt and settings with another seed running; this one waits for its video",
            extra={"request_id": request.request_id, "tenant": request.tenant, "running": running},
        )

    def _stored(self, key: str, request: GenerationRequest | None) -> GenerationResult | None:
        raw = self.ledger.get_value(f"{key}:done")
        if raw is None:
            return None
        stored = GenerationResult.model_validate_json(raw)
        if request is not None and request.keep_seed and not stored.seed_honoured:
            return None  # its video is not this seed's own sample
        return stored

    def running(self, request: GenerationRequest) -> None:
        """Record ``request`` (dispatched now) as the one running for its fingerprint, and for its prompt and
        settings with any seed."""
        if request.reuse is ReusePolicy.AUTO and self.settings.exact_hits:
            for key in (self._scope(request), self._any_seed_scope(request)):
                self.ledger.put_value(f"{key}:running", request.job_id, ttl_s=self.settings.donor_ttl_s)

    # --- results ---------------------------------------------------------------------------------------------
    def on_result(self, record: RequestRecord, result: GenerationResult) -> None:
        """Store a finished request's result for later identical ones, and answer (or run) those waiting."""
        if record.order is None or not self.settings.exact_hits:
            return
        request = WorkOrder.model_validate_json(record.order).request
        if request.reuse is not ReusePolicy.AUTO:
            return
        served = result.status is ResultStatus.DONE and result.video_uri is not None
        for key, match in (
            (self._scope(request), Match.SAME_SEED),
            (self._any_seed_scope(request), Match.OTHER_SEED),
        ):
            # The result first, then the end of the run: a request starting to wait in between finds one of them.
            if served:
                self.ledger.put_value(
                    f"{key}:done", result.model_dump_json(), ttl_s=self.settings.donor_ttl_s
                )
            if self.ledger.get_value(f"{key}:running") == request.job_id:
                self.ledger.delete_value(f"{key}:running")
            self._answer_waiters(key, match, result if served else None, failed=None if served else result)

    def _answer_waiters(
        self,
        key: str,
        match: Match,
        result: GenerationResult | None,
        *,
        failed: GenerationResult | None = None,
    ) -> None:
        """Answer every request waiting under ``key`` from ``result``, or run each in full. If answering one
        fails (Kafka, the broker), the ones not yet answered are put back to wait for the retry."""
        waiting = [GenerationRequest.model_validate_json(raw) for raw in self.ledger.take_waiters(key)]
        for i, request in enumerate(waiting):
            try:
                if result is not None:
                    self._serve(request, result, "coalesced", match)
                else:
                    self._run_in_full(request, failed)
            except Exception:
                for left in waiting[i:]:
                    self.ledger.add_waiter(key, left.model_dump_json())
                raise

    def _serve(self, request: GenerationRequest, source: GenerationResult, how: str, match: Match) -> None:
        answer = GenerationResult(
            request_id=request.request_id,
            tenant=request.tenant,
            status=ResultStatus.DONE,
            video_uri=source.video_uri,
            donor=DonorInfo(request_id=source.request_id, tenant=source.tenant, similarity=1.0),
            plan=None,  # nothing was planned or run: the video is another request's (served_from)
            steps_computed=0,
            steps_requested=request.num_steps,
            tokens_computed_fraction=0.0,
            reuse=ReuseKind.EXACT,
            served_from=source.job_id,
            # The video is the source's: so is what it says of the prompt it was made from, and of the seed when
            # the seeds are the same (another seed's video is never this seed's sample).
            seed_honoured=source.seed_honoured and match is Match.SAME_SEED,
            prompt_tokens_used=source.prompt_tokens_used,
            prompt_truncated=source.prompt_truncated,
            request_key=request.answer_key,
        )
        self.publish(self.settings.kafka_results_topic, request.request_id, answer.to_bytes())
        self.resends.keep(answer)
        self.ledger.set_state(request.job_id, RequestState.DONE)
        self.resends.try_answer_waiting(answer)
        METRICS.exact_hits.labels(kind=_kind(how, match)).inc()
        log.info(
            "exact hit: answered from an identical request's result"
            if match is Match.SAME_SEED
            else "exact hit: answered with the video of the same prompt and settings from another seed",
            extra={"request_id": request.request_id, "tenant": request.tenant, "served_from": source.job_id},
        )

    def _run_in_full(self, request: GenerationRequest, failed: GenerationResult | None) -> None:
        order = WorkOrder(request=request, plan=ReusePlan.full(request.num_steps), role=Role.SOLO)
        self.send_order(order)
        self.ledger.record_dispatch(
            RequestRecord(
                request_id=request.job_id,
                tenant=request.tenant,
                prompt=request.prompt,
                model=request.model,
                compat_key=request.compatibility_key,
                num_steps=request.num_steps,
                reuse=request.reuse,
                role=Role.SOLO,
                order=order.model_dump_json(),
                dispatched_at=self.clock(),
            )
        )
        log.warning(
            "the identical request this one waited for did not finish; running it in full",
            extra={
                "request_id": request.request_id,
                "waited_for": failed.job_id if failed else None,
                "status": str(failed.status) if failed else None,
            },
        )


def _kind(how: str, match: Match) -> str:
    """The ``chorus_exact_hits`` label: stored or coalesced, with ``_other_seed`` for another seed's video."""
    return how if match is Match.SAME_SEED else f"{how}_other_seed"
