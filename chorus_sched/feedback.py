"""Feedback: results in, donor index updated — what the workers report back makes the next requests cheaper.

Per poll of the results topic (its own consumer group; ``Feedback.handle_results``), for each result of a request
this deployment dispatched: a ``done`` result with a trajectory becomes (or finalizes) a ``ready`` donor entry; a
failed leader's ``running`` entry is evicted; a donor that was used gets its hit and token-steps saved counted
once (a ledger mark per result); a donor a worker found unusable is evicted. Evictions go through
``CacheMaintenance.evict`` (``chorus_sched.maintenance``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from pydantic import ValidationError

from chorus_sched.batch import BatchOutcome, Message, Progress, SchedulerStats, finish, transient
from chorus_sched.embedding import Embedder
from chorus_sched.exact import ExactHits
from chorus_sched.index import DonorEntry, DonorIndex, DonorStatus
from chorus_sched.ledger import Ledger, RequestRecord, RequestState
from chorus_sched.metrics import METRICS
from chorus_sched.resend import Resends
from chorus_sched.reuse_gate import VerifiedReuseGate
from producer.contract import GenerationResult, ResultStatus, ReusePolicy
from producer.orders import Role, WorkOrder, trajectory_prefix

log = logging.getLogger(__name__)


class Feedback:
    """Turns results into donor entries and hit counts; evicts through ``evict`` and deletes the objects of
    entries already gone through ``discard`` (request id -> reason)."""

    def __init__(
        self,
        *,
        embedder: Embedder,
        index: DonorIndex,
        ledger: Ledger,
        evict: Callable[[dict[str, str]], None],
        discard: Callable[[dict[str, str]], None],
        exact: ExactHits,
        resends: Resends,
        stats: SchedulerStats,
        gate: VerifiedReuseGate | None = None,
        regime_of: Callable[[int], str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.embedder = embedder
        self.index = index
        self.ledger = ledger
        self.evict = evict
        self.discard = discard
        self.exact = exact
        self.resends = resends
        self.stats = stats
        if gate is not None and regime_of is None:
            raise ValueError("a reuse gate needs regime_of: its bands are per regime")
        self.gate = gate
        self.regime_of = regime_of
        self.clock = clock

    def handle_results(self, messages: Sequence[Message]) -> BatchOutcome:
        progress = Progress()
        results: list[tuple[Message, GenerationResult]] = []
        for m in messages:
            progress.seen(m)
            try:
                results.append((m, GenerationResult.model_validate_json(m.value)))
            except ValidationError as exc:
                log.warning(
                    "unreadable result skipped",
                    extra={"partition": m.partition, "offset": m.offset, "error": str(exc).splitlines()[0]},
                )
        if results:
            try:
                with self.index.hold():
                    for m, result in results:
                        try:
                            self._on_result(result)
                        except Exception as exc:
                            log.warning(
                                "result not processed; will retry",
                                exc_info=not transient(exc),
                                extra={"request_id": result.request_id, "error": repr(exc)},
                            )
                            progress.failed(m)
            except Exception as exc:  # the index could not be opened
                log.warning("donor index unavailable; results will be retried", extra={"error": repr(exc)})
                for m, _ in results:
                    progress.failed(m)
        return finish(progress, self.stats)

    def _on_result(self, result: GenerationResult) -> None:
        if result.answers_resend:
            return  # an answer to a message that sent the id again: nothing new (chorus_sched.resend)
        rid = result.job_id  # the ledger and the index know a request by its job id (ids are per tenant)
        record = self.ledger.record(rid)
        if record is None:
            log.debug(
                "result of a request this deployment did not dispatch (or has forgotten)",
                extra={"request_id": result.request_id, "job": rid},
            )
            return
        self.stats.results += 1
        METRICS.results.labels(status=str(result.status)).inc()
        state = self.ledger.state(rid)
        self.exact.on_result(record, result)
        # The request's answer, kept before the state says it ended (a resend that sees the state finds it); a
        # stray failure after a video does not replace the video.
        answer = result.status is ResultStatus.DONE or state != RequestState.DONE
        if answer:
            self.resends.keep(result)
        self._take_in(record, result, state)
        if answer:
            self.resends.answer_waiting(result)

    def _take_in(self, record: RequestRecord, result: GenerationResult, state: RequestState | None) -> None:
        """Index a video's trajectory, count hits and checks, evict what a failure leaves behind."""
        rid, leader = record.request_id, record.role is Role.LEADER
        if result.status is ResultStatus.DONE:
            if state != RequestState.EVICTED:
                self.ledger.set_state(rid, RequestState.DONE)
            if record.reuse is ReusePolicy.OFF:
                log.info(
                    "result not indexed: the request opted out of reuse",
                    extra={"request_id": result.request_id, "job": rid},
                )
            elif state == RequestState.EVICTED:
                log.info(
                    "result not indexed: the entry was evicted before it finished; its trajectory is deleted",
                    extra={"request_id": result.request_id, "job": rid},
                )
                if result.trajectory_uri:  # stored after the eviction's order ran, or missed by it
                    self.discard({rid: "finished after its entry was evicted"})
            elif result.trajectory_uri:
                self._index_donor(record, result)
            elif leader and (entry := self.index.get(rid)) is not None and not entry.ready:
                self.evict({rid: "leader finished without a stored trajectory"})
            self._count_hit(result)
            self._count_check(record, result)
            self._drop_gone_donor(result)
        else:
            self._count_check(record, result)
            if state != RequestState.DONE:
                self.ledger.set_state(rid, RequestState.FAILED)
            entry = self.index.get(rid)
            if entry is not None and not entry.ready:
                self.evict({rid: f"leader {result.status}"})
            log.info(
                "request did not finish",
                extra={
                    "request_id": result.request_id,
                    "job": rid,
                    "status": str(result.status),
                    "error": result.error.code if result.error else None,
                },
            )

    def _index_donor(self, record: RequestRecord, result: GenerationResult) -> None:
        rid = record.request_id
        assert result.trajectory_uri is not None
        key = (
            result.trajectory_uri.split("/", 3)[-1]
            if "://" in result.trajectory_uri
            else result.trajectory_uri
        )
        if not (key.rstrip("/") + "/").startswith(trajectory_prefix(rid)):
            log.warning(
                "trajectory is outside the agreed layout; eviction by prefix would miss it",
                extra={"request_id": result.request_id, "job": rid, "trajectory_uri": result.trajectory_uri},
            )
        # What keep_seed requests match on: the seed of the noise the trajectory starts from, known only when it is
        # the request's own. One that started from a donor's (Stage 1 or Stage 2 alike) is None even when that
        # donor's seed was the same: its record names its request's seed only, so a worker reading it later
        # cannot vouch for the noise (``workers.engine.request_run.noise_seed``), and keep_seed would not hold.
        request = WorkOrder.model_validate_json(record.order).request if record.order else None
        own_noise = result.seed_honoured and result.donor is None
        noise_seed = request.seed if request is not None and own_noise else None
        fields = {
            "status": DonorStatus.READY,
            "seed": noise_seed,
            "trajectory_uri": result.trajectory_uri,
            "video_uri": result.video_uri,
            "bytes": result.trajectory_bytes,
            "created_at": self.clock(),
        }
        updated = self.index.set_fields(rid, fields)
        if updated is None:
            vector = self.embedder.embed([record.prompt])[0]
            self.index.upsert(
                DonorEntry(
                    request_id=rid,
                    tenant=record.tenant,
                    compat_key=record.compat_key,
                    prompt=record.prompt,
                    trajectory_prefix=trajectory_prefix(rid),
                    model=record.model,
                    num_steps=record.num_steps,
                    seed=noise_seed,
                    trajectory_uri=result.trajectory_uri,
                    video_uri=result.video_uri,
                    bytes=result.trajectory_bytes,
                    created_at=self.clock(),
                ),
                vector,
            )
        self.stats.donors_indexed += 1
        METRICS.donors_indexed.inc()
        log.info(
            "donor indexed",
            extra={
                "request_id": result.request_id,
                "job": rid,
                "bytes": result.trajectory_bytes,
                "was_leader": updated is not None,
                "compat_key": record.compat_key,
                "tenant": record.tenant,
            },
        )

    def _count_check(self, record: RequestRecord, result: GenerationResult) -> None:
        """Tell the gate how the worker's check of a verified row's donor went (it pauses verified reuse that does
        not pay), or, for a result without one (failed, or fallen back before checking), that the check is no
        longer in flight. Once per request: a redelivered result is not counted again. A failure here is logged,
        never retried: the gate is advice, and a retry would re-run the result's other effects."""
        if self.gate is None or self.regime_of is None or not record.verified_plan:
            return
        # The gate's band: the similarity the plan was made at (the result echoes the order's donor).
        similarity = result.donor.similarity if result.donor is not None else record.similarity
        if similarity is None:
            return
        check, plan = result.verification, result.plan
        try:
            if not self.ledger.mark_once(f"check:{result.job_id}"):
                return
            regime = self.regime_of(record.num_steps)
            done = result.status is ResultStatus.DONE
            if done and check is not None and plan is not None and plan.stage1_steps > 0:
                self.gate.record(record.model, regime, similarity, check.decision, plan.stage1_steps)
            else:
                self.gate.release(record.model, regime, similarity)
        except Exception as exc:
            log.warning(
                "donor check not counted by the reuse gate",
                extra={"request_id": result.request_id, "job": result.job_id, "error": repr(exc)},
            )

    def _drop_gone_donor(self, result: GenerationResult) -> None:
        """A worker found the planned donor's objects missing, corrupt or incompatible: stop offering it, and let
        the eviction order delete whatever of it is left in the store."""
        if not result.donor_gone or result.donor is None:
            return
        donor_id = result.donor.job_id
        entry = self.index.get(donor_id)
        if entry is None or not entry.ready:
            return
        log.warning(
            "donor unusable at fetch; evicting it",
            extra={"request_id": result.request_id, "donor": donor_id, "fallback": result.fallback},
        )
        self.evict({donor_id: "donor-gone"})

    def _count_hit(self, result: GenerationResult) -> None:
        if result.donor is None:
            return
        donor_id = result.donor.job_id
        if not result.saved_compute:  # the one definition of a hit: fewer token-steps than in full
            log.info(
                "planned donor saved nothing",
                extra={"request_id": result.request_id, "donor": donor_id, "fallback": result.fallback},
            )
            return
        if not self.ledger.mark_once(f"hit:{result.job_id}"):
            return
        # Token-steps saved: the engine reports the mean fraction of tokens it computed per requested step, so
        # Stage 1 counts in full and Stage 2 by the share of tokens it skipped. A result computing no step at
        # all reports nothing usable and counts no saving.
        saved = (
            result.steps_requested * (1.0 - result.tokens_computed_fraction)
            if result.steps_computed > 0
            else 0.0
        )
        hits, total = self.ledger.add_hit(donor_id, saved)
        entry = self.index.set_fields(
            donor_id, {"hits": hits, "steps_saved": total, "last_hit_at": self.clock()}
        )
        self.stats.hits += 1
        METRICS.count_hit(saved)
        log.info(
            "donor hit recorded",
            extra={
                "request_id": result.request_id,
                "donor": donor_id,
                "steps_saved": saved,
                "donor_hits": hits,
                "donor_steps_saved": total,
                "donor_still_indexed": entry is not None,
            },
        )
