"""The scheduler's decisions, with in-memory fakes of every port it is given.

``Scheduler`` takes its ledger, donor index, embedder, dispatcher and publisher as arguments; here each is a small
in-memory class (only the operations the scheduler uses), so what it decides for a poll of requests or results is
checked without Kafka, Redis, Qdrant or Celery (``tests/integration/test_scheduler.py`` runs the same flow on the
real services). The planner is the real one with the shipped calibration table.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import pytest
from kafka.structs import TopicPartition

from chorus_sched.dispatch import Dispatcher
from chorus_sched.index import DonorEntry, DonorHit, DonorIndex
from chorus_sched.ledger import RETRYABLE_STATES, Claim, Ledger, RequestRecord, RequestState
from chorus_sched.planner import Planner, load_calibration
from chorus_sched.service import Scheduler
from chorus_sched.settings import SchedulerSettings
from producer.contract import (
    DeadLetter,
    DonorInfo,
    GenerationRequest,
    GenerationResult,
    ResultStatus,
    ReuseKind,
    ReusePlan,
    build_request,
)
from producer.orders import EvictOrder, Role, WorkOrder

PROMPT = "a red circle moving left on a white background"
REQUESTS = "chorus.requests"


# --- fakes of the ports ------------------------------------------------------------------------------------


class FakeLedger:
    """Claims, states, records, marks and hit counters in dicts; a mutex that is always free. Claims follow
    ``Ledger.begin``: new, retry (a request that ended failed from another message), resumed, busy, duplicate."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}
        self.owners: dict[str, str] = {}
        self.origins: dict[str, str] = {}
        self.records: dict[str, RequestRecord] = {}
        self.marks: set[str] = set()
        self.hits: dict[str, tuple[int, float]] = {}
        self.pending: dict[str, str] = {}
        self.values: dict[str, str] = {}
        self.waiters: dict[str, list[str]] = {}

    def put_value(self, key: str, value: str, *, ttl_s: float | None = None) -> None:
        self.values[key] = value

    def get_value(self, key: str) -> str | None:
        return self.values.get(key)

    def delete_value(self, key: str) -> None:
        self.values.pop(key, None)

    def add_waiter(self, key: str, value: str) -> None:
        self.waiters.setdefault(key, []).append(value)

    def take_waiters(self, key: str) -> list[str]:
        return self.waiters.pop(key, [])

    def begin(
        self,
        request_id: str,
        *,
        owner: str,
        lease_s: float,
        state: RequestState = RequestState.ACCEPTED,
        origin: str = "",
    ) -> Claim:
        current = self.states.get(request_id)
        if current is None or (
            current in RETRYABLE_STATES and origin and origin != self.origins.get(request_id, "")
        ):
            self.states[request_id], self.owners[request_id] = state, owner
            self.origins[request_id] = origin
            return Claim("new", state, owner) if current is None else Claim("retry", current, owner)
        holder = self.owners.get(request_id)
        if current == RequestState.ACCEPTED:
            return Claim("resumed" if holder == owner else "busy", current, holder)
        return Claim("duplicate", current, holder)

    def state(self, request_id: str) -> RequestState | None:
        return self.states.get(request_id)

    def set_state(self, request_id: str, state: RequestState, *, origin: str | None = None) -> None:
        self.states[request_id] = state
        if origin is not None:
            self.origins[request_id] = origin

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def record_dispatch(self, record: RequestRecord) -> None:
        self.states[record.request_id] = RequestState.DISPATCHED
        self.records[record.request_id] = record

    def record(self, request_id: str) -> RequestRecord | None:
        return self.records.get(request_id)

    def dispatched_records(self, limit: int = 1000) -> list[RequestRecord]:
        return [r for rid, r in self.records.items() if self.states.get(rid) == RequestState.DISPATCHED][
            :limit
        ]

    def mark_once(self, key: str) -> bool:
        fresh = key not in self.marks
        self.marks.add(key)
        return fresh

    def is_marked(self, key: str) -> bool:
        return key in self.marks

    def add_hit(self, donor_id: str, steps_saved: float) -> tuple[int, float]:
        hits, total = self.hits.get(donor_id, (0, 0.0))
        self.hits[donor_id] = (hits + 1, total + steps_saved)
        return self.hits[donor_id]

    def add_pending_evictions(self, request_ids: Sequence[str], reason: str) -> None:
        self.pending.update(dict.fromkeys(request_ids, reason))

    def pending_evictions(self) -> dict[str, str]:
        return dict(self.pending)

    def remove_pending_evictions(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.pending.pop(rid, None)

    @contextmanager
    def mutex(self, name: str, **_: Any) -> Iterator[None]:
        yield

    def purge_expired(self) -> int:
        return 0


class FakeIndex:
    """Donor entries and their vectors in a dict; search is exact cosine similarity over the matching entries."""

    def __init__(self) -> None:
        self.points: dict[str, tuple[DonorEntry, list[float]]] = {}

    @contextmanager
    def hold(self) -> Iterator[None]:
        yield

    def upsert(self, entry: DonorEntry, vector: Sequence[float]) -> None:
        self.points[entry.request_id] = (entry, list(vector))

    def search(
        self,
        vector: Sequence[float],
        *,
        compat_key: str,
        tenant: str | None,
        limit: int = 5,
        status: str | None = None,
    ) -> list[DonorHit]:
        hits = [
            DonorHit(entry=entry, similarity=cosine(vector, v))
            for entry, v in self.points.values()
            if entry.compat_key == compat_key
            and (tenant is None or entry.tenant == tenant)
            and (status is None or entry.status == status)
        ]
        return sorted(hits, key=lambda h: -h.similarity)[:limit]

    def get(self, request_id: str) -> DonorEntry | None:
        point = self.points.get(request_id)
        return None if point is None else point[0]

    def set_fields(self, request_id: str, fields: Mapping[str, Any]) -> DonorEntry | None:
        point = self.points.get(request_id)
        if point is None:
            return None
        updated = DonorEntry.model_validate({**point[0].model_dump(), **fields})
        self.points[request_id] = (updated, point[1])
        return updated

    def delete(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.points.pop(rid, None)

    def entries(self) -> list[DonorEntry]:
        return [entry for entry, _ in self.points.values()]


class FakeEmbedder:
    """Bag-of-words vectors over a growing vocabulary: the same prompt, the same vector."""

    name = "fake"
    dim = 64

    def __init__(self) -> None:
        self.vocabulary: dict[str, int] = {}
        self.calls: list[list[str]] = []

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        out = []
        for text in texts:
            vector = [0.0] * self.dim
            for word in text.lower().split():
                vector[self.vocabulary.setdefault(word, len(self.vocabulary) % self.dim)] += 1.0
            out.append(vector)
        return out


class FakeDispatcher:
    def __init__(self) -> None:
        self.orders: list[WorkOrder] = []
        self.evictions: list[EvictOrder] = []
        self.forgotten: list[str] = []

    def generate(self, order: WorkOrder) -> None:
        self.orders.append(order)

    def forget(self, task_id: str) -> None:
        self.forgotten.append(task_id)

    def evict(self, order: EvictOrder) -> None:
        self.evictions.append(order)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0


@dataclass
class Msg:
    """A record as the scheduler reads it from the requests (or results) topic."""

    value: bytes
    offset: int
    key: bytes | None = None
    topic: str = REQUESTS
    partition: int = 0


@dataclass
class Ports:
    scheduler: Scheduler
    ledger: FakeLedger
    index: FakeIndex
    embedder: FakeEmbedder
    dispatcher: FakeDispatcher
    published: list[tuple[str, str, bytes]]

    def on(self, topic: str) -> list[bytes]:
        return [value for t, _, value in self.published if t == topic]


@pytest.fixture
def ports(tmp_path: Any) -> Ports:
    settings = SchedulerSettings(state_dir=tmp_path, instance_id="unit", kafka_requests_topic=REQUESTS)
    ledger, index, embedder, dispatcher = FakeLedger(), FakeIndex(), FakeEmbedder(), FakeDispatcher()
    published: list[tuple[str, str, bytes]] = []
    scheduler = Scheduler(
        settings,
        embedder=embedder,
        index=cast(DonorIndex, index),
        ledger=cast(Ledger, ledger),
        dispatcher=cast(Dispatcher, dispatcher),
        publish=lambda topic, key, value: published.append((topic, key, value)),
        planner=Planner(load_calibration()),
        clock=lambda: 1000.0,
    )
    return Ports(scheduler, ledger, index, embedder, dispatcher, published)


def request(prompt: str = PROMPT, **fields: Any) -> GenerationRequest:
    # The default tenant, whose job ids are its request ids; tenancy has its own tests below.
    return build_request(prompt=prompt, model="toy", tenant=fields.pop("tenant", "default"), **fields)


def done(rid: str, *, nbytes: int = 1000, **fields: Any) -> GenerationResult:
    return GenerationResult(
        request_id=rid,
        tenant=fields.pop("tenant", "default"),
        status=ResultStatus.DONE,
        video_uri=f"s3://chorus/videos/{rid}.mp4",
        trajectory_uri=f"s3://chorus/trajectories/{rid}/",
        trajectory_bytes=nbytes,
        steps_requested=4,
        steps_computed=fields.pop("steps_computed", 4),
        tokens_computed_fraction=fields.pop("tokens_computed_fraction", 1.0),  # in full unless said otherwise
        **fields,
    )


# --- requests --------------------------------------------------------------------------------------------------


def test_a_valid_request_becomes_one_dispatched_order(ports: Ports) -> None:
    first = request(request_id="r-first", priority=5)
    outcome = ports.scheduler.handle_requests([Msg(first.to_bytes(), 7, b"r-first")])

    assert outcome.commit == {TopicPartition(REQUESTS, 0): 8} and outcome.retry == {}
    [order] = ports.dispatcher.orders
    assert order.request == first
    assert order.role is Role.LEADER and order.plan == ReusePlan.full(4) and order.donor is None
    # a leader is indexed as running, so the next similar request can follow it
    entry = ports.index.get("r-first")
    assert (
        entry is not None and entry.status == "running" and entry.trajectory_prefix == "trajectories/r-first/"
    )
    assert ports.ledger.state("r-first") == "dispatched"
    record = ports.ledger.record("r-first")
    assert record is not None and record.role == str(Role.LEADER) and record.scheduler == "unit"
    assert ports.embedder.calls == [[PROMPT]]
    assert ports.published == []
    stats = ports.scheduler.stats
    assert (stats.requests, stats.dispatched, stats.leaders, stats.full) == (1, 1, 1, 1)


def test_requests_of_one_poll_are_embedded_as_one_batch_and_a_similar_one_follows_the_leader(
    ports: Ports,
) -> None:
    lead, follow = request(request_id="lead", seed=1), request(request_id="follow", seed=2)
    off = request("a green triangle moving up", request_id="off", reuse="off")
    ports.scheduler.handle_requests([Msg(m.to_bytes(), i) for i, m in enumerate((lead, follow, off))])

    assert ports.embedder.calls == [[PROMPT]]  # one batch, each distinct prompt once, none for reuse "off"
    orders = {o.request.request_id: o for o in ports.dispatcher.orders}
    assert orders["lead"].role is Role.LEADER
    assert orders["follow"].role is Role.FOLLOWER
    assert orders["follow"].donor is not None and orders["follow"].donor.request_id == "lead"
    assert orders["follow"].plan.reuses
    assert orders["off"].role is Role.SOLO and orders["off"].plan == ReusePlan.full(4)
    assert ports.index.get("off") is None  # reuse off: never a leader, never indexed


def test_a_malformed_message_is_dead_lettered_and_the_batch_goes_on(ports: Ports) -> None:
    wrong_shape = b'{"request_id": "r-bad", "prompt": "x", "model": "toy", "height": 48}'
    good = request(request_id="r-good")
    outcome = ports.scheduler.handle_requests(
        [
            Msg(b"\xff not json at all", 0, b"junk"),
            Msg(wrong_shape, 1, b"r-bad"),
            Msg(good.to_bytes(), 2, b"r-good"),
        ]
    )

    assert outcome.commit == {TopicPartition(REQUESTS, 0): 3} and outcome.retry == {}
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["r-good"]
    letters = [
        DeadLetter.model_validate_json(v) for v in ports.on(ports.scheduler.settings.kafka_dead_letter_topic)
    ]
    by_key = {dl.key_b64: dl for dl in letters}
    junk = by_key[base64.b64encode(b"junk").decode()]
    assert junk.raw() == b"\xff not json at all" and junk.error.code == "invalid_request"
    assert (junk.topic, junk.partition, junk.offset) == (REQUESTS, 0, 0)
    bad = by_key[base64.b64encode(b"r-bad").decode()]
    assert bad.raw() == wrong_shape
    assert [(i.field, i.rule) for i in bad.issues] == [("height", "model_shape")]
    # the producer waiting for r-bad learns why; so does whoever keyed the unreadable message "junk" (the key is
    # a request's handle by contract)
    results = [
        GenerationResult.model_validate_json(v)
        for v in ports.on(ports.scheduler.settings.kafka_results_topic)
    ]
    assert [(r.request_id, r.status) for r in results] == [
        ("junk", ResultStatus.REJECTED),
        ("r-bad", ResultStatus.REJECTED),
    ]
    assert ports.scheduler.stats.dead_lettered == 2

    # a redelivered bad message is not dead-lettered twice
    ports.scheduler.handle_requests([Msg(wrong_shape, 1, b"r-bad")])
    assert ports.scheduler.stats.dead_lettered == 2


def test_a_duplicate_request_id_is_skipped(ports: Ports) -> None:
    twice = request(request_id="twice").to_bytes()
    outcome = ports.scheduler.handle_requests([Msg(twice, 10), Msg(twice, 11)])  # two copies in one poll
    assert outcome.commit == {TopicPartition(REQUESTS, 0): 12} and outcome.retry == {}
    outcome = ports.scheduler.handle_requests([Msg(twice, 12)])  # and a redelivery in a later poll
    assert outcome.commit == {TopicPartition(REQUESTS, 0): 13} and outcome.retry == {}

    assert [o.request.request_id for o in ports.dispatcher.orders] == ["twice"]
    assert (ports.scheduler.stats.dispatched, ports.scheduler.stats.duplicates) == (1, 2)


def test_a_request_another_instance_is_scheduling_is_left_for_a_retry(ports: Ports) -> None:
    ports.ledger.begin("theirs", owner="other-instance", lease_s=60.0)
    outcome = ports.scheduler.handle_requests([Msg(request(request_id="theirs").to_bytes(), 4)])
    assert outcome.retry == {TopicPartition(REQUESTS, 0): 4} and outcome.commit == {}
    assert ports.dispatcher.orders == [] and ports.scheduler.stats.busy == 1


def test_a_failed_dispatch_is_retried_and_its_claim_and_leader_entry_dropped(ports: Ports) -> None:
    def broker_down(order: WorkOrder) -> None:
        raise OSError("broker unreachable")

    ports.dispatcher.generate = broker_down  # type: ignore[method-assign]
    outcome = ports.scheduler.handle_requests([Msg(request(request_id="r").to_bytes(), 5)])
    assert outcome.retry == {TopicPartition(REQUESTS, 0): 5} and outcome.commit == {}
    assert ports.ledger.state("r") is None and ports.index.get("r") is None
    assert ports.scheduler.stats.dead_lettered == 0


# --- results ---------------------------------------------------------------------------------------------------


def test_a_result_feeds_the_donor_index_and_a_later_similar_request_reuses_it(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="lead", seed=1).to_bytes(), 0)])
    outcome = ports.scheduler.handle_results([Msg(done("lead", nbytes=1234).to_bytes(), 0, topic="results")])

    assert outcome.commit == {TopicPartition("results", 0): 1} and outcome.retry == {}
    entry = ports.index.get("lead")
    assert entry is not None and entry.ready and entry.bytes == 1234
    assert entry.trajectory_uri == "s3://chorus/trajectories/lead/" and entry.created_at == 1000.0
    assert ports.ledger.state("lead") == "done"
    assert ports.scheduler.stats.donors_indexed == 1

    ports.scheduler.handle_requests([Msg(request(request_id="later", seed=3).to_bytes(), 1)])
    later = ports.dispatcher.orders[-1]
    assert later.role is Role.SOLO and later.donor is not None and later.donor.request_id == "lead"
    assert later.plan.reuses and later.donor.wait_s == 0

    # the result of a request that used the donor counts a hit and the steps it saved, once
    hit = done(
        "later",
        donor=DonorInfo(request_id="lead", similarity=1.0),
        plan=later.plan,
        steps_computed=2,
        tokens_computed_fraction=0.5,
    ).to_bytes()
    ports.scheduler.handle_results([Msg(hit, 1, topic="results"), Msg(hit, 2, topic="results")])
    entry = ports.index.get("lead")
    assert entry is not None and (entry.hits, entry.steps_saved, entry.last_hit_at) == (1, 2.0, 1000.0)
    # a request that was not a leader becomes a donor too, from the ledger's record of it
    later_entry = ports.index.get("later")
    assert later_entry is not None and later_entry.ready


def test_a_failed_leader_is_evicted_and_its_objects_ordered_deleted(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="lead").to_bytes(), 0)])
    failed = GenerationResult(request_id="lead", tenant="default", status=ResultStatus.FAILED)
    ports.scheduler.handle_results([Msg(failed.to_bytes(), 0, topic="results")])

    assert ports.index.get("lead") is None
    assert ports.ledger.state("lead") == "failed"  # evicted from the index, and open to being sent again
    assert [(e.request_ids, e.reason) for e in ports.dispatcher.evictions] == [(["lead"], "leader failed")]
    assert ports.ledger.pending_evictions() == {}


def test_results_of_requests_this_deployment_did_not_dispatch_are_ignored(ports: Ports) -> None:
    outcome = ports.scheduler.handle_results(
        [Msg(done("stranger").to_bytes(), 0, topic="results"), Msg(b"not a result", 1, topic="results")]
    )
    assert outcome.commit == {TopicPartition("results", 0): 2} and outcome.retry == {}
    assert ports.index.points == {} and ports.scheduler.stats.results == 0


# --- tenants ---------------------------------------------------------------------------------------------------


def test_two_tenants_may_use_one_request_id_and_each_is_served_and_indexed_as_its_own(ports: Ports) -> None:
    a = request(request_id="same", tenant="tenant-a", seed=1)
    b = request("a blue square moving up on a white background", request_id="same", tenant="tenant-b", seed=2)
    ports.scheduler.handle_requests([Msg(a.to_bytes(), 0, b"same"), Msg(b.to_bytes(), 1, b"same")])
    assert [(o.request.tenant, o.request.request_id) for o in ports.dispatcher.orders] == [
        ("tenant-a", "same"),
        ("tenant-b", "same"),
    ]
    assert ports.scheduler.stats.duplicates == 0
    assert ports.ledger.state("tenant-a~same") == ports.ledger.state("tenant-b~same") == "dispatched"

    ports.scheduler.handle_results([Msg(done("same", tenant="tenant-b").to_bytes(), 0, topic="results")])
    assert (
        ports.ledger.state("tenant-b~same") == "done" and ports.ledger.state("tenant-a~same") == "dispatched"
    )
    entry_b = ports.index.get("tenant-b~same")
    assert entry_b is not None and entry_b.tenant == "tenant-b" and entry_b.prompt == b.prompt


def test_a_request_sent_again_after_it_failed_is_scheduled_anew(ports: Ports) -> None:
    first = request(request_id="again")
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0, b"again")])
    failed = GenerationResult(request_id="again", tenant="default", status=ResultStatus.FAILED)
    ports.scheduler.handle_results([Msg(failed.to_bytes(), 0, topic="results")])
    # the same message redelivered is still a duplicate; a new message with the id is a new attempt
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0, b"again")])
    assert len(ports.dispatcher.orders) == 1
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 9, b"again")])
    assert len(ports.dispatcher.orders) == 2 and ports.ledger.state("again") == "dispatched"
    # the ended order's marks are cleared: a worker must run the new order under the same task id, not skip it
    assert ports.dispatcher.forgotten == ["again"]


# --- exact hits ------------------------------------------------------------------------------------------------


def results_on(ports: Ports) -> list[GenerationResult]:
    return [
        GenerationResult.model_validate_json(v)
        for v in ports.on(ports.scheduler.settings.kafka_results_topic)
    ]


def test_an_identical_request_is_answered_from_the_stored_result_with_no_worker(ports: Ports) -> None:
    first = request(request_id="orig", seed=7)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    ports.scheduler.handle_results([Msg(done("orig").to_bytes(), 0, topic="results")])
    again = request(request_id="again", seed=7)  # same fingerprint, another id
    ports.scheduler.handle_requests([Msg(again.to_bytes(), 1)])

    assert [o.request.request_id for o in ports.dispatcher.orders] == ["orig"]  # no second order
    [answer] = results_on(ports)
    assert answer.request_id == "again" and answer.status is ResultStatus.DONE
    assert answer.reuse is ReuseKind.EXACT and answer.served_from == "orig"
    assert (answer.steps_computed, answer.tokens_computed_fraction) == (0, 0.0) and answer.saved_compute
    assert answer.video_uri == "s3://chorus/videos/orig.mp4"
    assert ports.scheduler.stats.exact_hits == 1 and ports.ledger.state("again") == "done"
    # its redelivery is a duplicate, not a second answer
    ports.scheduler.handle_requests([Msg(again.to_bytes(), 1)])
    assert len(results_on(ports)) == 1


@pytest.mark.parametrize(
    "other",
    [
        {"seed": 8},
        {"tenant": "someone-else"},
        {"reuse": "off"},
        {"prompt": "a red circle moving left on a black background"},
    ],
)
def test_a_request_that_differs_in_what_shapes_the_video_or_in_tenant_is_not_an_exact_hit(
    ports: Ports, other: dict[str, Any]
) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="orig", seed=7).to_bytes(), 0)])
    ports.scheduler.handle_results([Msg(done("orig").to_bytes(), 0, topic="results")])
    fields = {"request_id": "other", "seed": 7, **other}
    ports.scheduler.handle_requests([Msg(request(fields.pop("prompt", PROMPT), **fields).to_bytes(), 1)])
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["orig", "other"]
    assert ports.scheduler.stats.exact_hits == 0 and results_on(ports) == []


def test_identical_requests_in_flight_are_coalesced_onto_the_one_running(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="runner", seed=3).to_bytes(), 0)])
    twins = [request(request_id=f"twin-{i}", seed=3) for i in range(2)]
    ports.scheduler.handle_requests([Msg(t.to_bytes(), 1 + i) for i, t in enumerate(twins)])
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["runner"]  # run once
    assert results_on(ports) == []
    ports.scheduler.handle_results([Msg(done("runner").to_bytes(), 0, topic="results")])
    answers = results_on(ports)
    assert sorted(a.request_id for a in answers) == ["twin-0", "twin-1"]
    assert all(a.reuse is ReuseKind.EXACT and a.served_from == "runner" for a in answers)


def test_requests_waiting_for_a_run_that_failed_are_run_in_full(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="runner", seed=3).to_bytes(), 0)])
    ports.scheduler.handle_requests([Msg(request(request_id="twin", seed=3).to_bytes(), 1)])
    failed = GenerationResult(request_id="runner", tenant="default", status=ResultStatus.FAILED)
    ports.scheduler.handle_results([Msg(failed.to_bytes(), 0, topic="results")])
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["runner", "twin"]
    assert ports.dispatcher.orders[-1].plan == ReusePlan.full(4) and results_on(ports) == []
    assert ports.ledger.state("twin") == "dispatched"


def test_a_request_that_keeps_its_seed_takes_no_donor_of_another_seed(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="donor", seed=1).to_bytes(), 0)])
    ports.scheduler.handle_results([Msg(done("donor").to_bytes(), 0, topic="results")])
    ports.scheduler.handle_requests([Msg(request(request_id="mine", seed=2, keep_seed=True).to_bytes(), 1)])
    ports.scheduler.handle_requests([Msg(request(request_id="any", seed=3).to_bytes(), 2)])
    mine, anyone = ports.dispatcher.orders[1:]
    assert mine.donor is None and mine.plan == ReusePlan.full(4)
    assert anyone.donor is not None and anyone.donor.request_id == "donor" and anyone.plan.reuses


def test_a_run_that_ends_while_an_identical_request_starts_waiting_still_answers_it(ports: Ports) -> None:
    # The result of the running request is handled between the newcomer's check and its push onto the waiting
    # list (another thread or instance): the newcomer must be answered, not left waiting forever.
    ports.scheduler.handle_requests([Msg(request(request_id="runner", seed=3).to_bytes(), 0)])
    exact, ledger = ports.scheduler.exact, ports.ledger
    push = ledger.add_waiter

    def push_after_the_result(key: str, value: str) -> None:
        record = ledger.record("runner")
        assert record is not None
        exact.on_result(record, done("runner"))  # takes an empty list, stores the result
        push(key, value)

    ledger.add_waiter = push_after_the_result  # type: ignore[method-assign]
    ports.scheduler.handle_requests([Msg(request(request_id="late-twin", seed=3).to_bytes(), 1)])
    [answer] = results_on(ports)
    assert answer.request_id == "late-twin" and answer.reuse is ReuseKind.EXACT
    assert ledger.waiters == {} or all(not v for v in ledger.waiters.values())


def test_waiters_not_yet_answered_when_publishing_fails_wait_again(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="runner", seed=3).to_bytes(), 0)])
    twins = [request(request_id=f"twin-{i}", seed=3) for i in range(2)]
    ports.scheduler.handle_requests([Msg(t.to_bytes(), 1 + i) for i, t in enumerate(twins)])
    record = ports.ledger.record("runner")
    assert record is not None

    def kafka_down(topic: str, key: str, value: bytes) -> None:
        raise OSError("results topic unreachable")

    exact = ports.scheduler.exact
    publish, exact.publish = exact.publish, kafka_down
    with pytest.raises(OSError):
        exact.on_result(record, done("runner"))
    exact.publish = publish
    exact.on_result(record, done("runner"))  # the result is handled again (the message was not committed)
    assert sorted(a.request_id for a in results_on(ports)) == ["twin-0", "twin-1"]


def test_an_exact_hit_carries_what_its_source_says_of_seed_and_prompt(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="orig", seed=7).to_bytes(), 0)])
    source = done("orig", seed_honoured=False, prompt_tokens_used=32, prompt_truncated=True)
    ports.scheduler.handle_results([Msg(source.to_bytes(), 0, topic="results")])
    ports.scheduler.handle_requests([Msg(request(request_id="again", seed=7).to_bytes(), 1)])
    [answer] = results_on(ports)
    assert (answer.seed_honoured, answer.prompt_tokens_used, answer.prompt_truncated) == (False, 32, True)
    # a request that keeps its seed is not served a video that did not honour it
    ports.scheduler.handle_requests([Msg(request(request_id="mine", seed=7, keep_seed=True).to_bytes(), 2)])
    assert ports.dispatcher.orders[-1].request.request_id == "mine"
