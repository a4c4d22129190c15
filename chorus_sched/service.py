"""The scheduler: requests in, work orders out; results in, donor index updated; the cache kept in budget.

Message flow, per poll of the requests topic:

1. parse each message (``parse_request``); an invalid one is dead-lettered (raw bytes, reason, topic/partition/
   offset) and, when it names a request id, answered with a ``rejected`` result — consumption goes on;
2. claim each request id in the ledger; an id already dispatched is a duplicate and is skipped, one another
   instance is scheduling right now is retried later;
3. embed the prompts of the poll as one batch;
4. per compatibility key (under a ledger mutex, with the index held): search finished donors and running
   leaders, plan each candidate (similarity + word difference), choose; a miss becomes a group leader,
   upserted into the index as ``running`` so any instance's next search finds it;
5. send the ``WorkOrder`` to the model's Celery queue, then record the dispatch in the ledger;
6. commit, per partition, up to the first message that could not be handled (which is retried).

Each topic is consumed by its own thread. Per poll of the results topic (its own consumer group): a ``done`` result with a trajectory becomes (or
finalizes) a ``ready`` donor entry; a failed leader's entry is removed; a donor that was used gets its hit and
steps saved counted once. Every ``evict_interval_s`` the cache policy runs: the chosen entries are removed from
the index, then an ``EvictOrder`` is sent for the workers to delete their objects.
"""

from __future__ import annotations

import base64
import json
import logging
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kafka.structs import TopicPartition
from pydantic import ValidationError

from chorus_sched.cache import CachePolicy, plan_evictions
from chorus_sched.dispatch import Dispatcher
from chorus_sched.embedding import Embedder
from chorus_sched.grouping import Candidate, Decision, blocked_gain, decide
from chorus_sched.index import DonorEntry, DonorIndex
from chorus_sched.ledger import Ledger, LedgerError, RequestRecord
from chorus_sched.metrics import METRICS
from chorus_sched.planner import Planner
from chorus_sched.settings import SchedulerSettings
from producer import bus
from producer.contract import (
    ContractError,
    DeadLetter,
    ErrorInfo,
    FieldIssue,
    GenerationRequest,
    GenerationResult,
    ResultStatus,
    ReusePolicy,
    parse_request,
)
from workers.orders import DonorRef, EvictOrder, Role, WorkOrder, trajectory_prefix

log = logging.getLogger(__name__)


class Message(Protocol):
    """What the scheduler reads of a Kafka record (``kafka.consumer.fetcher.ConsumerRecord`` has it)."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def key(self) -> bytes | None: ...

    @property
    def value(self) -> bytes: ...


class Publisher(Protocol):
    def __call__(self, topic: str, key: str, value: bytes) -> None: ...


@dataclass
class SchedulerStats:
    requests: int = 0
    dead_lettered: int = 0
    duplicates: int = 0
    busy: int = 0
    dispatched: int = 0
    leaders: int = 0
    followers: int = 0
    with_donor: int = 0
    full: int = 0
    cross_tenant_blocked: int = 0
    retries: int = 0
    results: int = 0
    donors_indexed: int = 0
    hits: int = 0
    evicted: int = 0
    evict_orders: int = 0


@dataclass
class BatchOutcome:
    """Offsets to commit (next to read) and partitions to rewind (first offset to handle again)."""

    commit: dict[TopicPartition, int] = field(default_factory=dict)
    retry: dict[TopicPartition, int] = field(default_factory=dict)


class _Progress:
    def __init__(self) -> None:
        self._next: dict[TopicPartition, int] = {}
        self._first: dict[TopicPartition, int] = {}
        self._failed: dict[TopicPartition, int] = {}

    def seen(self, m: Message) -> None:
        tp = TopicPartition(m.topic, m.partition)
        self._next[tp] = max(self._next.get(tp, 0), m.offset + 1)
        self._first[tp] = min(self._first.get(tp, m.offset), m.offset)

    def failed(self, m: Message) -> None:
        tp = TopicPartition(m.topic, m.partition)
        self._failed[tp] = min(self._failed.get(tp, m.offset), m.offset)

    def outcome(self) -> BatchOutcome:
        out = BatchOutcome(retry=dict(self._failed))
        for tp, nxt in self._next.items():
            upto = self._failed.get(tp, nxt)
            if upto > self._first[tp]:
                out.commit[tp] = upto
        return out


def _transient(exc: BaseException) -> bool:
    """Failures of a backing service that retrying later may cure (never a reason to drop a request)."""
    import kafka.errors
    import kombu.exceptions
    import redis.exceptions

    transient: tuple[type[BaseException], ...] = (
        OSError,
        TimeoutError,
        LedgerError,
        sqlite3.OperationalError,
        kombu.exceptions.OperationalError,
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        kafka.errors.KafkaError,
    )
    try:
        from qdrant_client.http.exceptions import ResponseHandlingException

        transient += (ResponseHandlingException,)
    except ImportError:  # pragma: no cover - depends on the qdrant-client version
        pass
    return isinstance(exc, transient)


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


def _clamp(similarity: float) -> float:
    return max(-1.0, min(1.0, similarity))


class Scheduler:
    """The scheduling core, independent of how messages arrive (the run loop below feeds it from Kafka)."""

    def __init__(
        self,
        settings: SchedulerSettings,
        *,
        embedder: Embedder,
        index: DonorIndex,
        ledger: Ledger,
        dispatcher: Dispatcher,
        publish: Publisher,
        planner: Planner,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.embedder = embedder
        self.index = index
        self.ledger = ledger
        self.dispatcher = dispatcher
        self.publish = publish
        self.planner = planner
        self.clock = clock
        self.instance = settings.resolved_instance_id
        self.stats = SchedulerStats()
        self.policy = CachePolicy(
            budget_bytes=settings.cache_budget_bytes,
            ttl_s=settings.donor_ttl_s,
            half_life_s=settings.cache_half_life_s,
            new_entry_credit=settings.cache_new_entry_credit,
            leader_stale_s=settings.leader_stale_s,
        )
        self._attempts: dict[tuple[str, int, int], int] = {}
        if planner.table.embedder != embedder.name:
            log.warning(
                "the calibration table was made for another embedder: its similarity thresholds may not fit",
                extra={"table_embedder": planner.table.embedder, "embedder": embedder.name},
            )

    # ------------------------------------------------------------------------------------------- requests
    def handle_requests(self, messages: Sequence[Message]) -> BatchOutcome:
        progress = _Progress()
        accepted: list[tuple[Message, GenerationRequest]] = []
        in_batch: set[str] = set()
        for m in messages:
            progress.seen(m)
            self.stats.requests += 1
            METRICS.requests_received.inc()
            try:
                request = parse_request(m.value)
            except ContractError as exc:
                try:
                    self._dead_letter(m, exc.code, str(exc), exc.issues)
                except Exception as dl_exc:
                    log.warning(
                        "could not dead-letter; will retry", extra={"offset": m.offset, "error": repr(dl_exc)}
                    )
                    progress.failed(m)
                continue
            try:
                claim = self.ledger.begin(
                    request.request_id, owner=self.instance, lease_s=self.settings.claim_lease_s
                )
            except Exception as exc:
                self._failed(m, progress, exc, request)
                continue
            # A second copy within this poll finds our own fresh lease ("resumed"): it is a duplicate too.
            if claim.outcome == "duplicate" or request.request_id in in_batch:
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
            else:
                if claim.outcome == "resumed":
                    log.info(
                        "resuming a request whose scheduling did not finish",
                        extra={"request_id": request.request_id, "previous_owner": claim.owner},
                    )
                accepted.append((m, request))
                in_batch.add(request.request_id)
        if not accepted:
            return self._finish(progress)
        # A poll interleaves partitions arbitrarily; scheduling in submission order lets an earlier request lead
        # the later similar ones, as it would have had they arrived in separate polls (stable for equal times).
        accepted.sort(key=lambda item: item[1].submitted_at)

        try:
            with METRICS.phase("embed"):
                vectors = self._embed_requests([r for _, r in accepted])
        except Exception as exc:
            for m, request in accepted:
                self._failed(m, progress, exc, request)
            return self._finish(progress)

        groups: dict[str, list[tuple[Message, GenerationRequest]]] = defaultdict(list)
        for m, request in accepted:
            groups[request.compatibility_key].append((m, request))
        for compat in sorted(groups):
            pending = list(groups[compat])
            try:
                with (
                    self.ledger.mutex(f"group:{compat}", ttl_s=self.settings.claim_lease_s),
                    self.index.hold(),
                ):
                    while pending:
                        m, request = pending[0]
                        try:
                            self._schedule(request, vectors.get(request.request_id))
                        except Exception as exc:
                            self._failed(m, progress, exc, request)
                        pending.pop(0)
            except Exception as exc:
                for m, request in pending:
                    self._failed(m, progress, exc, request)
        return self._finish(progress)

    def _finish(self, progress: _Progress) -> BatchOutcome:
        outcome = progress.outcome()
        self.stats.retries += len(outcome.retry)
        return outcome

    def _failed(
        self, m: Message, progress: _Progress, exc: BaseException, request: GenerationRequest | None
    ) -> None:
        """A message could not be scheduled: retry it (transient), or dead-letter it after max_attempts."""
        if request is not None:
            try:
                self.ledger.release(request.request_id)
            except Exception as release_exc:  # the lease expires by itself
                log.warning("could not release claim", extra={"error": repr(release_exc)})
        key = (m.topic, m.partition, m.offset)
        if _transient(exc):
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
            self._dead_letter(m, "scheduling_failed", f"scheduling failed {attempts} times: {exc!r}", [])
            if request is not None:
                self.ledger.set_state(request.request_id, "dead_lettered")
        except Exception as dl_exc:
            log.warning("could not dead-letter; will retry", extra={"error": repr(dl_exc)})
            progress.failed(m)

    def _dead_letter(self, m: Message, code: str, message: str, issues: list[FieldIssue]) -> None:
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

    def _embed_requests(self, requests: Sequence[GenerationRequest]) -> dict[str, list[float]]:
        wanted = [r for r in requests if r.reuse is ReusePolicy.AUTO]
        prompts = sorted({r.prompt for r in wanted})
        by_prompt = dict(zip(prompts, self.embedder.embed(prompts), strict=True))
        return {r.request_id: by_prompt[r.prompt] for r in wanted}

    def _candidates(self, vector: list[float], compat: str, tenant: str | None) -> list[Candidate]:
        hits = self.index.search(
            vector, compat_key=compat, tenant=tenant, limit=self.settings.search_limit, status="ready"
        )
        if self.settings.grouping:
            hits += self.index.search(
                vector, compat_key=compat, tenant=tenant, limit=self.settings.search_limit, status="running"
            )
        return [
            Candidate(
                request_id=h.entry.request_id,
                prompt=h.entry.prompt,
                tenant=h.entry.tenant,
                similarity=_clamp(h.similarity),
                ready=h.entry.ready,
                trajectory_prefix=h.entry.trajectory_prefix,
            )
            for h in hits
        ]

    def decide(self, request: GenerationRequest, vector: list[float] | None) -> Decision:
        """Search the index and choose (donor, role, plan) for one request; counts blocked cross-tenant gains."""
        if request.reuse is ReusePolicy.OFF or vector is None:
            return decide(request, [], self.planner, grouping=False)
        compat = request.compatibility_key
        cross = self.settings.cross_tenant_reuse
        candidates = self._candidates(vector, compat, None if cross else request.tenant)
        decision = decide(request, candidates, self.planner, grouping=self.settings.grouping)
        blocked = False
        if not cross:
            everyone = self._candidates(vector, compat, None)
            if any(c.tenant != request.tenant for c in everyone):
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

    def _schedule(self, request: GenerationRequest, vector: list[float] | None) -> None:
        rid = request.request_id
        with METRICS.phase("search"):
            decision = self.decide(request, vector)
        donor = decision.donor
        leader_entry = None
        if decision.role is Role.LEADER and vector is not None:
            leader_entry = DonorEntry(
                request_id=rid,
                tenant=request.tenant,
                compat_key=request.compatibility_key,
                prompt=request.prompt,
                trajectory_prefix=trajectory_prefix(rid),
                status="running",
                model=request.model,
                num_steps=request.num_steps,
                created_at=self.clock(),
            )
            self.index.upsert(leader_entry, vector)
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
                self.index.delete([rid])
            raise
        record = RequestRecord(
            request_id=rid,
            tenant=request.tenant,
            prompt=request.prompt,
            model=request.model,
            compat_key=request.compatibility_key,
            num_steps=request.num_steps,
            reuse=str(request.reuse),
            role=str(decision.role),
            donor_id=donor.request_id if donor else None,
            similarity=donor.similarity if donor else None,
            planned_steps_saved=decision.steps_saved_estimate,
            scheduler=self.instance,
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
                        extra={"request_id": rid, "error": repr(exc)},
                    )
                time.sleep(0.1 * (attempt + 1))
        self._count(decision)
        plan = decision.plan
        log.info(
            "request dispatched",
            extra={
                "request_id": rid,
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

    # -------------------------------------------------------------------------------------------- results
    def handle_results(self, messages: Sequence[Message]) -> BatchOutcome:
        progress = _Progress()
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
                                exc_info=not _transient(exc),
                                extra={"request_id": result.request_id, "error": repr(exc)},
                            )
                            progress.failed(m)
            except Exception as exc:  # the index could not be opened
                log.warning("donor index unavailable; results will be retried", extra={"error": repr(exc)})
                for m, _ in results:
                    progress.failed(m)
        return self._finish(progress)

    def _on_result(self, result: GenerationResult) -> None:
        rid = result.request_id
        record = self.ledger.record(rid)
        if record is None:
            log.debug(
                "result of a request this deployment did not dispatch (or has forgotten)",
                extra={"request_id": rid},
            )
            return
        self.stats.results += 1
        METRICS.results.labels(status=str(result.status)).inc()
        state = self.ledger.state(rid)
        leader = record.role == str(Role.LEADER)
        if result.status is ResultStatus.DONE:
            if state != "evicted":
                self.ledger.set_state(rid, "done")
            if record.reuse == str(ReusePolicy.OFF):
                log.info("result not indexed: the request opted out of reuse", extra={"request_id": rid})
            elif state == "evicted":
                log.info(
                    "result not indexed: the entry was evicted before it finished", extra={"request_id": rid}
                )
            elif result.trajectory_uri:
                self._index_donor(record, result)
            elif leader and (entry := self.index.get(rid)) is not None and not entry.ready:
                self._evict({rid: "leader finished without a stored trajectory"})
            self._count_hit(result)
            self._drop_gone_donor(result)
        else:
            if state != "done":
                self.ledger.set_state(rid, "failed")
            entry = self.index.get(rid)
            if entry is not None and not entry.ready:
                self._evict({rid: f"leader {result.status}"})
            log.info(
                "request did not finish",
                extra={
                    "request_id": rid,
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
                extra={"request_id": rid, "trajectory_uri": result.trajectory_uri},
            )
        fields = {
            "status": "ready",
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
                "request_id": rid,
                "bytes": result.trajectory_bytes,
                "was_leader": updated is not None,
                "compat_key": record.compat_key,
                "tenant": record.tenant,
            },
        )

    def _drop_gone_donor(self, result: GenerationResult) -> None:
        """A worker found the planned donor's objects missing, corrupt or incompatible: stop offering it, and let
        the eviction order delete whatever of it is left in the store."""
        if not result.donor_gone or result.donor is None:
            return
        donor_id = result.donor.request_id
        entry = self.index.get(donor_id)
        if entry is None or not entry.ready:
            return
        log.warning(
            "donor unusable at fetch; evicting it",
            extra={"request_id": result.request_id, "donor": donor_id, "fallback": result.fallback},
        )
        self._evict({donor_id: "donor-gone"})

    def _count_hit(self, result: GenerationResult) -> None:
        if result.donor is None:
            return
        donor_id = result.donor.request_id
        if result.fallback is not None or result.plan is None or not result.plan.reuses:
            log.info(
                "planned donor was not used",
                extra={"request_id": result.request_id, "donor": donor_id, "fallback": result.fallback},
            )
            return
        if not self.ledger.mark_once(f"hit:{result.request_id}"):
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

    # --------------------------------------------------------------------------------------------- cache
    def maintain(self) -> list[str]:
        """Send evictions left pending, then apply the cache policy; returns the request ids evicted now."""
        self._flush_evictions()
        with self.ledger.mutex("evict", ttl_s=self.settings.claim_lease_s):
            entries = self.index.entries()
            evictions = plan_evictions(entries, self.clock(), self.policy)
            if evictions:
                total = sum(e.bytes for e in entries if e.ready)
                log.info(
                    "cache policy evicts donors",
                    extra={
                        "evictions": [asdict(e) for e in evictions],
                        "bytes_before": total,
                        "budget_bytes": self.policy.budget_bytes,
                    },
                )
                self._evict({e.request_id: e.reason for e in evictions})
            METRICS.observe_cache(entries, evicted=[e.request_id for e in evictions])
        self.ledger.purge_expired()
        return [e.request_id for e in evictions]

    def _evict(self, reasons: dict[str, str]) -> None:
        """Remove the index entries, then order the workers to delete the objects (pending until sent)."""
        by_reason: dict[str, list[str]] = defaultdict(list)
        for rid, reason in reasons.items():
            by_reason[reason].append(rid)
        for reason, ids in by_reason.items():
            self.ledger.add_pending_evictions(ids, reason)
            for rid in ids:
                self.ledger.set_state(rid, "evicted")
            self.index.delete(ids)
            self.stats.evicted += len(ids)
            METRICS.count_evictions(reason, len(ids))
        self._flush_evictions()

    def _flush_evictions(self) -> None:
        pending = self.ledger.pending_evictions()
        by_reason: dict[str, list[str]] = defaultdict(list)
        for rid, reason in sorted(pending.items()):
            by_reason[reason].append(rid)
        for reason, ids in by_reason.items():
            try:
                self.dispatcher.evict(EvictOrder(request_ids=ids, reason=reason))
            except Exception as exc:
                log.warning(
                    "evict order not sent; will retry", extra={"request_ids": ids, "error": repr(exc)}
                )
                continue
            self.ledger.remove_pending_evictions(ids)
            self.stats.evict_orders += 1
            METRICS.evict_orders.inc()
            log.info("evict order sent", extra={"request_ids": ids, "reason": reason})


# ------------------------------------------------------------------------------------------------ service


def build_scheduler(
    settings: SchedulerSettings,
    *,
    embedder: Embedder | None = None,
    dispatcher: Dispatcher | None = None,
    publish: Publisher | None = None,
) -> tuple[Scheduler, Callable[[], None]]:
    """A scheduler wired to the services ``settings`` names, and a function that closes them."""
    from chorus_sched.embedding import make_embedder
    from chorus_sched.ledger import open_ledger
    from chorus_sched.planner import load_calibration

    planner = Planner(load_calibration(settings.calibration_path))
    embedder = embedder or make_embedder(settings.embedder)
    dim = len(embedder.embed(["warm-up"])[0])  # load the model now, not on the first request
    index = DonorIndex.connect(
        url=settings.qdrant_url,
        path=settings.resolved_qdrant_path,
        api_key=settings.qdrant_api_key,
        collection=settings.qdrant_collection,
        dim=dim,
    )
    ledger = open_ledger(
        settings.redis_url,
        state_dir=settings.state_dir,
        prefix=settings.ledger_prefix,
        ttl_s=settings.ledger_ttl_s,
    )
    dispatcher = dispatcher or Dispatcher.for_broker(settings.broker_url, state_dir=settings.state_dir)
    producer = None
    if publish is None:
        producer = bus.make_producer(settings)

        def publish(topic: str, key: str, value: bytes) -> None:
            assert producer is not None
            bus.publish(producer, topic, key, value)

    scheduler = Scheduler(
        settings,
        embedder=embedder,
        index=index,
        ledger=ledger,
        dispatcher=dispatcher,
        publish=publish,
        planner=planner,
    )

    def close() -> None:
        for step in (
            (lambda: producer.close(timeout=10)) if producer is not None else None,
            index.close,
            ledger.close,
            dispatcher.close,
        ):
            if step is None:
                continue
            try:
                step()
            except Exception as exc:
                log.warning("error while closing", extra={"error": repr(exc)})

    return scheduler, close


def _records(batches: dict[Any, list[Any]]) -> list[Any]:
    return [r for records in batches.values() for r in records]


# Consecutive failed polls after which a consumer loop leaves the group and joins again as a new member.
REJOIN_AFTER_POLL_FAILURES = 5


class _Loop:
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

    def _run(self) -> None:
        from kafka import ConsumerRebalanceListener
        from kafka.errors import CommitFailedError, KafkaError

        topic, client_id = self.topic, self.client_id

        class _Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
                log.info(
                    "partitions revoked",
                    extra={"topic": topic, "partitions": sorted(tp.partition for tp in revoked)},
                )

            def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
                log.info(
                    "partitions assigned",
                    extra={
                        "topic": topic,
                        "client": client_id,
                        "partitions": sorted(tp.partition for tp in assigned),
                    },
                )

        settings = self.settings

        def open_consumer() -> Any:
            consumer = bus.make_consumer(
                settings,
                [],
                group_id=self.group_id,
                client_id=client_id,
                max_poll_records=settings.poll_max_records,
                metadata_max_age_ms=settings.kafka_metadata_max_age_ms,
                session_timeout_ms=settings.kafka_session_timeout_ms,
                heartbeat_interval_ms=max(100, settings.kafka_session_timeout_ms // 3),
                max_poll_interval_ms=settings.kafka_max_poll_interval_ms,
            )
            consumer.subscribe([topic], listener=_Listener())
            return consumer

        def close_consumer(consumer: Any) -> None:
            try:
                consumer.close(autocommit=False)
            except Exception as exc:
                log.warning("error while closing a consumer", extra={"topic": topic, "error": repr(exc)})

        consumer = open_consumer()
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
                        close_consumer(consumer)
                        consumer = open_consumer()
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
            close_consumer(consumer)


def run(
    settings: SchedulerSettings,
    stop: threading.Event,
    *,
    scheduler: Scheduler | None = None,
    on_ready: Callable[[], None] | None = None,
) -> SchedulerStats:
    """Consume requests and results until ``stop`` is set; commits only what is handled. Returns the stats.

    Raises ``RuntimeError`` if a consumer loop failed (after stopping the other one).
    """
    close: Callable[[], None] = lambda: None  # noqa: E731
    if scheduler is None:
        scheduler, close = build_scheduler(settings)
    instance = scheduler.instance
    next_maintenance = time.monotonic()

    def maintain() -> None:
        nonlocal next_maintenance
        if time.monotonic() < next_maintenance:
            return
        try:
            scheduler.maintain()
        except Exception as exc:
            log.warning("cache maintenance failed; will retry", extra={"error": repr(exc)})
        next_maintenance = time.monotonic() + settings.evict_interval_s

    loops = [
        _Loop(
            settings,
            name="requests",
            topic=settings.kafka_requests_topic,
            group_id=settings.kafka_group_id,
            client_id=instance,
            handle=scheduler.handle_requests,
            stop=stop,
        ),
        _Loop(
            settings,
            name="results",
            topic=settings.kafka_results_topic,
            group_id=settings.kafka_results_group_id,
            client_id=f"{instance}-results",
            handle=scheduler.handle_results,
            stop=stop,
            after_poll=maintain,
        ),
    ]
    log.info(
        "scheduler started",
        extra={
            "instance": instance,
            "requests_topic": settings.kafka_requests_topic,
            "results_topic": settings.kafka_results_topic,
            "group": settings.kafka_group_id,
            "embedder": scheduler.embedder.name,
            "calibration_provisional": scheduler.planner.table.provisional,
            "index": settings.qdrant_url or str(scheduler.index.path),
            "broker": scheduler.dispatcher.broker_url,
            "ledger": type(scheduler.ledger).__name__,
        },
    )
    try:
        for loop in loops:
            loop.thread.start()
        if on_ready is not None:
            on_ready()
        stop.wait()
    finally:
        stop.set()
        for loop in loops:
            loop.thread.join()
        log.info("scheduler stopped", extra={"instance": instance, "stats": asdict(scheduler.stats)})
        close()
    failed = [loop for loop in loops if loop.error is not None]
    if failed:
        raise RuntimeError(f"the {failed[0].name} loop failed: {failed[0].error!r}") from failed[0].error
    return scheduler.stats
