"""Intake: the scheduler's decisions — requests in, work orders out.

Per poll of the requests topic (``Intake.handle_requests``):

1. parse each message (``parse_keyed_request``: the sender must be able to find its result); an invalid one is dead-lettered (``chorus_sched.dead_letters``) —
   consumption goes on;
2. claim each request's job id (tenant + request id) in the ledger; the claimed message read again is skipped, a new
   message with the id of a request taken before is answered by ``chorus_sched.resend``, one another instance is
   scheduling right now is retried later;
3. embed the prompts of the poll as one batch;
4. per compatibility key (under a ledger mutex, with the index held): search finished donors and running
   leaders, plan each candidate (similarity + word difference), choose; a miss becomes a group leader,
   upserted into the index as ``running`` so any instance's next search finds it;
5. send the ``WorkOrder`` to the model's Celery queue, then record the dispatch in the ledger;
6. report, per partition, the offsets to commit up to the first message that could not be handled (which is
   retried; after ``max_attempts`` non-transient failures it is dead-lettered).

The intake decides and does no I/O beyond its injected ports (embedder, donor index, ledger, dispatcher, dead
letters); the choice itself is ``chorus_sched.grouping.decide`` with ``chorus_sched.planner``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

from chorus_sched.batch import BatchOutcome, Message, Progress, SchedulerStats, finish, transient
from chorus_sched.dead_letters import DeadLetters
from chorus_sched.dispatch import Dispatcher
from chorus_sched.embedding import Embedder
from chorus_sched.exact import ExactHits, ExactOutcome
from chorus_sched.grouping import Candidate, Decision, blocked_gain, decide
from chorus_sched.index import DonorEntry, DonorIndex, DonorStatus
from chorus_sched.ledger import Claim, Ledger, RequestRecord, RequestState
from chorus_sched.metrics import METRICS
from chorus_sched.planner import Planner
from chorus_sched.resend import Resends
from chorus_sched.settings import SchedulerSettings
from producer.contract import ContractError, GenerationRequest, ReusePolicy
from producer.orders import DonorRef, Role, WorkOrder, trajectory_prefix
from producer.parsing import parse_keyed_request

log = logging.getLogger(__name__)


def _clamp(similarity: float) -> float:
    return max(-1.0, min(1.0, similarity))


class Intake:
    """Schedules the requests of a poll: claims, embeds, decides, dispatches; counts into ``stats``."""

    def __init__(
        self,
        settings: SchedulerSettings,
        *,
        embedder: Embedder,
        index: DonorIndex,
        ledger: Ledger,
        dispatcher: Dispatcher,
        planner: Planner,
        dead_letters: DeadLetters,
        exact: ExactHits,
        resends: Resends,
        stats: SchedulerStats,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.embedder = embedder
        self.index = index
        self.ledger = ledger
        self.dispatcher = dispatcher
        self.planner = planner
        self.dead_letters = dead_letters
        self.exact = exact
        self.resends = resends
        self.stats = stats
        self.clock = clock
        self.instance = settings.resolved_instance_id
        self._attempts: dict[tuple[str, int, int], int] = {}

    def handle_requests(self, messages: Sequence[Message]) -> BatchOutcome:
        progress = Progress()
        accepted, twins = self._admit(messages, progress)
        self._schedule_accepted(accepted, progress)
        if twins:
            # Identical to a request accepted earlier in this poll, which is dispatched now: each waits for its
            # result (an exact hit, coalesced), or runs if it could not be dispatched.
            again = [(m, r) for m, r in twins if not self._answered_exactly(m, r, progress)]
            self._schedule_accepted(again, progress)
        return finish(progress, self.stats)

    def _schedule_accepted(
        self, accepted: list[tuple[Message, GenerationRequest]], progress: Progress
    ) -> None:
        if not accepted:
            return
        # A poll interleaves partitions arbitrarily; scheduling in submission order lets an earlier request lead
        # the later similar ones, as it would have had they arrived in separate polls (stable for equal times).
        accepted.sort(key=lambda item: item[1].submitted_at)
        try:
            with METRICS.phase("embed"):
                vectors = self._embed_requests([r for _, r in accepted])
        except Exception as exc:
            for m, request in accepted:
                self._failed(m, progress, exc, request)
            return
        self._schedule_groups(accepted, vectors, progress)

    def _admit(
        self, messages: Sequence[Message], progress: Progress
    ) -> tuple[list[tuple[Message, GenerationRequest]], list[tuple[Message, GenerationRequest]]]:
        """Parse and claim each message: the requests to schedule now (an invalid message is dead-lettered, a
        duplicate skipped, a request another instance holds left for a retry), and those identical to one of them
        (held back until it is dispatched, ``handle_requests``)."""
        accepted: list[tuple[Message, GenerationRequest]] = []
        twins: list[tuple[Message, GenerationRequest]] = []
        twin_keys: set[str] = set()
        in_batch: set[str] = set()
        for m in messages:
            progress.seen(m)
            self.stats.requests += 1
            METRICS.requests_received.inc()
            request = self._parse(m, progress)
            if request is None:
                continue
            origin = f"{m.topic}:{m.partition}:{m.offset}"
            try:
                claim = self.ledger.begin(
                    request.job_id, owner=self.instance, lease_s=self.settings.claim_lease_s, origin=origin
                )
            except Exception as exc:
                # Not ours to release: the claim may belong to an earlier message with this id (and one this call
                # did take is our own lease, resumed when the message is read again).
                self._failed(m, progress, exc, request, claimed=False)
                continue
            # A second copy within this poll finds our own fresh lease ("resumed"): it is a new message too.
            if request.job_id in in_batch or claim.resent_by(origin):
                self.stats.resent += 1
                self._answer_resend(m, request, claim.state, progress)
            elif claim.outcome == "duplicate":
                self.stats.duplicates += 1
                METRICS.duplicates.inc()
                log.info(
                    "duplicate request skipped",
                    extra={"request_id": request.request_id, "state": claim.state, "offset": m.offset},
                )
            elif claim.outcome == "busy":
                self.stats.busy += 1
                METRICS.retries.labels(cause="busy").inc()
                log.info(
                    "request is being scheduled by another instance; retrying later",
                    extra={"request_id": request.request_id, "owner": claim.owner},
                )
                progress.failed(m)
            elif self._taken(m, request, claim, progress):
                in_batch.add(request.job_id)
                twin = self.exact.twin_key(request)
                if twin is not None and twin in twin_keys:
                    twins.append((m, request))
                    continue
                if self._answered_exactly(m, request, progress):
                    continue
                if twin is not None:
                    twin_keys.add(twin)
                accepted.append((m, request))
        return accepted, twins

    def _taken(self, m: Message, request: GenerationRequest, claim: Claim, progress: Progress) -> bool:
        """Ready a request claimed now (new, resumed, or sent again after it ended without a video) to be
        scheduled; False if a backing service failed (the message is then left for a retry)."""
        if claim.outcome == "resumed":
            log.info(
                "resuming a request whose scheduling did not finish",
                extra={"request_id": request.request_id, "previous_owner": claim.owner},
            )
        elif claim.outcome == "retry":
            # Its new order reuses the task id: the ended one's marks would make a worker skip it.
            try:
                self.dispatcher.forget(request.job_id)
            except Exception as exc:
                self._failed(m, progress, exc, request)
                return False
            log.info(
                "request sent again after it ended without a video; scheduling it anew",
                extra={"request_id": request.request_id, "tenant": request.tenant, "was": claim.state},
            )
        try:
            # An answer kept for an earlier claim of the id (one that ended without a video) is void; the claim
            # may have been released since, so this is done for every claim, not only a retry's.
            self.resends.forget(request.job_id)
        except Exception as exc:
            self._failed(m, progress, exc, request)
            return False
        return True

    def _answer_resend(
        self, m: Message, request: GenerationRequest, state: RequestState | None, progress: Progress
    ) -> None:
        try:
            self.resends.answer(request, state, origin=f"{m.topic}:{m.partition}:{m.offset}")
        except Exception as exc:
            self._failed(m, progress, exc, request, claimed=False)

    def _answered_exactly(self, m: Message, request: GenerationRequest, progress: Progress) -> bool:
        """True if an identical request's result answers this one (now, or when that one finishes)."""
        try:
            outcome = self.exact.admit(request)
        except Exception as exc:
            self._failed(m, progress, exc, request)
            return True
        if outcome is ExactOutcome.RUN:
            return False
        self.stats.exact_hits += 1
        return True

    def _parse(self, m: Message, progress: Progress) -> GenerationRequest | None:
        """The message's request, or None after dead-lettering it (or leaving it for a retry if that failed)."""
        try:
            return parse_keyed_request(m.value, m.key)
        except ContractError as exc:
            code, reason, issues = exc.code, str(exc), exc.issues
        except Exception as exc:  # a parser bug must cost one message, never the scheduler
            log.exception(
                "a message could not be parsed", extra={"offset": m.offset, "partition": m.partition}
            )
            code, reason, issues = "unreadable", f"the message could not be read: {exc!r}"[:2000], []
        try:
            self.dead_letters.send(m, code, reason, issues)
        except Exception as dl_exc:
            log.warning(
                "could not dead-letter; will retry", extra={"offset": m.offset, "error": repr(dl_exc)}
            )
            progress.failed(m)
        return None

    def _schedule_groups(
        self,
        accepted: list[tuple[Message, GenerationRequest]],
        vectors: dict[str, list[float]],
        progress: Progress,
    ) -> None:
        """Schedule per compatibility key, under that key's ledger mutex and with the index held."""
        groups: dict[str, list[tuple[Message, GenerationRequest]]] = defaultdict(list)
        for m, request in accepted:
            groups[request.compatibility_key].append((m, request))
        for compat in sorted(groups):
            pending = list(groups[compat])
            try:
                with (
                    self.ledger.mutex(
                        f"group:{compat}", ttl_s=self.settings.group_lock_lease_s, owner=self.instance
                    ),
                    self._index_for(pending, vectors) as index_up,
                ):
                    while pending:
                        m, request = pending[0]
                        try:
                            self._schedule(
                                request,
                                vectors.get(request.job_id) if index_up else None,
                                origin=f"{m.topic}:{m.partition}:{m.offset}",
                            )
                        except Exception as exc:
                            self._failed(m, progress, exc, request)
                        pending.pop(0)
            except Exception as exc:
                for m, request in pending:
                    self._failed(m, progress, exc, request)

    @contextmanager
    def _index_for(
        self, group: list[tuple[Message, GenerationRequest]], vectors: dict[str, list[float]]
    ) -> Iterator[bool]:
        """Hold the index for a group that may reuse; True if it is up. A group of ``reuse: off`` requests
        never opens it, and an index that cannot be opened means full compute for the group, not rejection."""
        if not any(r.job_id in vectors for _, r in group):
            yield False
            return
        with ExitStack() as held:
            try:
                held.enter_context(self.index.hold())
            except Exception as exc:
                self._index_down(exc, len(group))
                yield False
                return
            yield True

    def _index_down(self, exc: BaseException, requests: int) -> None:
        self.stats.index_unavailable += requests
        METRICS.index_unavailable.inc(requests)
        log.warning(
            "donor index unavailable; scheduling without reuse (full compute)",
            extra={"requests": requests, "error": repr(exc)[:500]},
        )

    def _failed(
        self,
        m: Message,
        progress: Progress,
        exc: BaseException,
        request: GenerationRequest | None,
        *,
        claimed: bool = True,
    ) -> None:
        """A message could not be scheduled: retry it (transient), or dead-letter it after max_attempts.
        ``claimed=False``: the request's claim is not (known to be) this message's — it sent again the id of a
        request taken before, or claiming failed — so neither its claim nor its state is this message's to change."""
        if request is not None and claimed:
            try:
                self.ledger.release(request.job_id)
            except Exception as release_exc:  # the lease expires by itself
                log.warning("could not release claim", extra={"error": repr(release_exc)})
        key = (m.topic, m.partition, m.offset)
        if transient(exc):
            log.warning(
                "a backing service failed; the message will be retried",
                extra={"offset": m.offset, "partition": m.partition, "error": repr(exc)},
            )
            METRICS.retries.labels(cause="backing_service").inc()
            progress.failed(m)
            return
        attempts = self._attempts[key] = self._attempts.get(key, 0) + 1
        log.error(
            "scheduling failed",
            exc_info=exc,
            extra={"offset": m.offset, "attempt": attempts, "max_attempts": self.settings.max_attempts},
        )
        if attempts < self.settings.max_attempts:
            METRICS.retries.labels(cause="error").inc()
            progress.failed(m)
            return
        del self._attempts[key]
        try:
            rejected = self.dead_letters.send(
                m,
                "scheduling_failed",
                f"scheduling failed {attempts} times: {exc!r}",
                [],
                request=request,
                claimed=claimed,
            )
            if request is not None and claimed:
                self.ledger.set_state(
                    request.job_id, RequestState.DEAD_LETTERED, origin=f"{m.topic}:{m.partition}:{m.offset}"
                )
                if rejected is not None:  # copies of it that wait are answered by its answer (a failure
                    self.resends.try_answer_waiting(rejected)  # must not send the dead letter round again)
        except Exception as dl_exc:
            log.warning("could not dead-letter; will retry", extra={"error": repr(dl_exc)})
            progress.failed(m)

    def _embed_requests(self, requests: Sequence[GenerationRequest]) -> dict[str, list[float]]:
        wanted = [r for r in requests if r.reuse is ReusePolicy.AUTO]
        prompts = sorted({r.prompt for r in wanted})
        by_prompt = dict(zip(prompts, self.embedder.embed(prompts), strict=True))
        return {r.job_id: by_prompt[r.prompt] for r in wanted}

    def _candidate_sets(
        self, vector: list[float], compat: str, tenant: str | None
    ) -> tuple[list[Candidate], list[Candidate]]:
        """(the candidates ``tenant`` may use, everyone's); ``tenant=None``: the two are everyone's.

        Everyone's nearest entries of a status are searched first; when they all belong to the tenant they are
        also its own nearest (its entries are a subset of everyone's), so the usual single-tenant traffic costs
        one search per status, not two.
        """
        statuses = (
            (DonorStatus.READY, DonorStatus.RUNNING) if self.settings.grouping else (DonorStatus.READY,)
        )
        own: list[Candidate] = []
        everyone: list[Candidate] = []
        for status in statuses:
            found = self._search(vector, compat, None, status)
            everyone += found
            if tenant is None or all(c.tenant == tenant for c in found):
                own += found
            else:
                own += self._search(vector, compat, tenant, status)
        return own, everyone

    def _search(
        self, vector: list[float], compat: str, tenant: str | None, status: DonorStatus
    ) -> list[Candidate]:
        hits = self.index.search(
            vector, compat_key=compat, tenant=tenant, limit=self.settings.search_limit, status=status
        )
        return [
            Candidate(
                request_id=h.entry.request_id,
                prompt=h.entry.prompt,
                tenant=h.entry.tenant,
                similarity=_clamp(h.similarity),
                ready=h.entry.ready,
                trajectory_prefix=h.entry.trajectory_prefix,
                seed=h.entry.seed,
            )
            for h in hits
        ]

    def decide(self, request: GenerationRequest, vector: list[float] | None) -> Decision:
        """Search the index and choose (donor, role, plan) for one request; counts blocked cross-tenant gains."""
        if request.reuse is ReusePolicy.OFF or vector is None:
            return decide(request, [], self.planner, grouping=False)
        compat = request.compatibility_key
        cross = self.settings.cross_tenant_reuse
        candidates, everyone = self._candidate_sets(vector, compat, None if cross else request.tenant)
        if request.keep_seed:  # its video must be its own seed's sample: only donors made with that seed
            candidates = [c for c in candidates if c.seed == request.seed]
        decision = decide(request, candidates, self.planner, grouping=self.settings.grouping)
        blocked = False
        if not cross and any(c.tenant != request.tenant for c in everyone):
            unrestricted = decide(request, everyone, self.planner, grouping=self.settings.grouping)
            gain = blocked_gain(request.tenant, decision, unrestricted)
            if gain > 0 and unrestricted.donor is not None:
                blocked = True
                self.stats.cross_tenant_blocked += 1
                log.info(
                    "a better donor of another tenant was not used (cross-tenant reuse is off)",
                    extra={
                        "request_id": request.request_id,
                        "tenant": request.tenant,
                        "blocked_donor": unrestricted.donor.request_id,
                        "blocked_tenant": unrestricted.donor.tenant,
                        "blocked_similarity": round(unrestricted.donor.similarity, 4),
                        "steps_forgone_estimate": gain,
                    },
                )
        METRICS.count_lookup(decision, cross_tenant_blocked=blocked)
        return decision

    def _index_leader(
        self, request: GenerationRequest, decision: Decision, vector: list[float] | None
    ) -> DonorEntry | None:
        """A leader is indexed as running, so later similar requests can follow it (None: not a leader, or the
        index is down: it still runs)."""
        if decision.role is not Role.LEADER or vector is None:
            return None
        rid = request.job_id
        entry = DonorEntry(
            request_id=rid,
            tenant=request.tenant,
            compat_key=request.compatibility_key,
            prompt=request.prompt,
            trajectory_prefix=trajectory_prefix(rid),
            status=DonorStatus.RUNNING,
            model=request.model,
            num_steps=request.num_steps,
            # the seed of the noise it starts from, when it is its own (``Feedback._index_donor``)
            seed=request.seed if decision.donor is None or not decision.plan.reuses else None,
            created_at=self.clock(),
        )
        try:
            self.index.upsert(entry, vector)
        except Exception as exc:  # followers cannot find this leader; it still runs
            self._index_down(exc, 1)
            return None
        return entry

    def _schedule(self, request: GenerationRequest, vector: list[float] | None, *, origin: str = "") -> None:
        rid = request.job_id  # a donor is known by its job id: request ids are per tenant
        try:
            with METRICS.phase("search"):
                decision = self.decide(request, vector)
        except Exception as exc:
            if vector is None:
                raise
            self._index_down(exc, 1)
            vector = None
            decision = self.decide(request, None)
        donor = decision.donor
        leader_entry = self._index_leader(request, decision, vector)
        order = WorkOrder(
            request=request,
            plan=decision.plan,
            role=decision.role,
            donor=None
            if donor is None
            else DonorRef(
                request_id=donor.request_id,
                similarity=donor.similarity,
                trajectory_prefix=donor.trajectory_prefix,
                wait_s=self.settings.follower_wait_s if decision.role is Role.FOLLOWER else 0.0,
            ),
        )
        try:
            with METRICS.phase("dispatch"):
                self.dispatcher.generate(order)
        except BaseException:
            if leader_entry is not None:
                try:
                    self.index.delete([rid])
                except Exception as exc:  # the leader entry goes stale and is dropped by maintenance
                    log.warning("could not remove an undispatched leader", extra={"error": repr(exc)})
            raise
        if decision.chosen is not None and donor is not None:
            self.planner.chosen(decision.chosen.choice, request.model, donor.similarity)
        self._record_dispatch(request, decision, order, origin)
        try:
            self.exact.running(request)
        except Exception as exc:  # identical requests then run too; nothing is lost
            log.warning("could not record the running request for exact hits", extra={"error": repr(exc)})
        self._count(decision)
        plan = decision.plan
        log.info(
            "request dispatched",
            extra={
                "request_id": request.request_id,
                "job": rid,
                "tenant": request.tenant,
                "model": request.model,
                "role": str(decision.role),
                "donor": donor.request_id if donor else None,
                "similarity": round(donor.similarity, 4) if donor else None,
                "plan": f"k1={plan.stage1_steps} k2={plan.stage2_steps} k3={plan.stage3_steps} α={plan.alpha}",
                "plan_row": decision.chosen.choice.row if decision.chosen else None,
                "why": decision.reason,
                "considered": [c.summary() for c in decision.considered],
                "priority": request.priority,
            },
        )

    def _record_dispatch(
        self, request: GenerationRequest, decision: Decision, order: WorkOrder, origin: str = ""
    ) -> None:
        rid = request.job_id
        donor = decision.donor
        record = RequestRecord(
            request_id=rid,
            tenant=request.tenant,
            prompt=request.prompt,
            model=request.model,
            compat_key=request.compatibility_key,
            num_steps=request.num_steps,
            reuse=request.reuse,
            role=decision.role,
            donor_id=donor.request_id if donor else None,
            similarity=donor.similarity if donor else None,
            planned_steps_saved=decision.steps_saved_estimate,
            verified_plan=decision.chosen is not None and decision.chosen.choice.verified,
            scheduler=self.instance,
            order=order.model_dump_json(),
            origin=origin,
            dispatched_at=self.clock(),
        )
        # The order is on the broker: from here on the message counts as handled (a retry would duplicate
        # the work), so the record is written with a few quick retries and a failure is only logged.
        for attempt in range(3):
            try:
                self.ledger.record_dispatch(record)
                break
            except Exception as exc:
                if attempt == 2:
                    log.error(
                        "order sent but its dispatch could not be recorded; its result will not be indexed",
                        extra={"request_id": request.request_id, "job": rid, "error": repr(exc)},
                    )
                time.sleep(0.1 * (attempt + 1))

    def _count(self, decision: Decision) -> None:
        self.stats.dispatched += 1
        METRICS.count_dispatch(decision)
        if decision.role is Role.LEADER:
            self.stats.leaders += 1
        elif decision.role is Role.FOLLOWER:
            self.stats.followers += 1
        if decision.donor is not None and decision.role is Role.SOLO:
            self.stats.with_donor += 1
        if not decision.plan.reuses:
            self.stats.full += 1
