"""The scheduler's decisions, with in-memory fakes of every port it is given.

``Scheduler`` takes its ledger, donor index, embedder, dispatcher and publisher as arguments; here each is a small
in-memory class (only the operations the scheduler uses), so what it decides for a poll of requests or results is
checked without Kafka, Redis, Qdrant or Celery (``tests/integration/test_scheduler.py`` runs the same flow on the
real services). The planner is the real one with the shipped calibration table.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
from kafka.structs import TopicPartition

from producer.contract import (
    DeadLetter,
    DonorInfo,
    GenerationResult,
    ResultStatus,
    ReusePlan,
)
from producer.orders import Role, WorkOrder
from tests.helpers.scheduler_fakes import PROMPT, REQUESTS, Msg, Ports, done, make_ports, recased, request


@pytest.fixture
def ports(tmp_path: Any) -> Ports:
    return make_ports(tmp_path)


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
    lead, follow = request(request_id="lead", seed=1), request(recased(PROMPT), request_id="follow", seed=2)
    mine = request(request_id="mine", seed=3, keep_seed=True)  # the lead's text: embedded with it
    off = request("a green triangle moving up", request_id="off", reuse="off")
    polled = (lead, follow, mine, off)
    ports.scheduler.handle_requests([Msg(m.to_bytes(), i) for i, m in enumerate(polled)])

    # one batch, each distinct text once, none for reuse "off"
    assert [sorted(batch) for batch in ports.embedder.calls] == [sorted([PROMPT, recased(PROMPT)])]
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
    outcome = ports.scheduler.handle_requests([Msg(twice, 10)])  # and a redelivery in a later poll
    assert outcome.commit == {TopicPartition(REQUESTS, 0): 11} and outcome.retry == {}

    assert [o.request.request_id for o in ports.dispatcher.orders] == ["twice"]
    stats = ports.scheduler.stats
    # the copy is a new message, answered when the request finishes (tests/unit/chorus_sched/test_resend.py)
    assert (stats.dispatched, stats.duplicates, stats.resent) == (1, 1, 1)


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

    ports.scheduler.handle_requests([Msg(request(recased(PROMPT), request_id="later", seed=3).to_bytes(), 1)])
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


def test_a_request_that_keeps_its_seed_never_gets_a_donor_grown_from_another_seeds_noise(
    ports: Ports,
) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="lead", seed=1).to_bytes(), 0)])
    ports.scheduler.handle_results([Msg(done("lead").to_bytes(), 0, topic="results")])
    ports.scheduler.handle_requests([Msg(request(recased(PROMPT), request_id="later", seed=3).to_bytes(), 1)])
    later = ports.dispatcher.orders[-1]
    assert later.donor is not None and later.donor.request_id == "lead"
    # it reused lead's noise (Stage 1 or Stage 2 alike): its video is not seed 3's own sample, so it says
    reused = done(
        "later",
        donor=DonorInfo(request_id="lead", similarity=1.0),
        plan=later.plan,
        steps_computed=4,
        tokens_computed_fraction=0.5,
        seed_honoured=False,
    )
    ports.scheduler.handle_results([Msg(reused.to_bytes(), 1, topic="results")])
    entry = ports.index.get("later")
    assert entry is not None and entry.ready and entry.seed is None
    lead = ports.index.get("lead")
    assert lead is not None and lead.seed == 1
    # a donor of the same seed gave its noise: honoured, but a later reader of this trajectory cannot tell
    ports.scheduler.handle_requests(
        [Msg(request(request_id="twin-seed", seed=1, guidance_scale=3.0).to_bytes(), 3)]
    )
    same = ports.dispatcher.orders[-1]
    assert same.donor is not None
    honoured = done(
        "twin-seed", donor=DonorInfo(request_id=same.donor.request_id, similarity=1.0), plan=same.plan
    )
    ports.scheduler.handle_results([Msg(honoured.to_bytes(), 2, topic="results")])
    twin = ports.index.get("twin-seed")
    assert twin is not None and twin.ready and twin.seed is None

    strict = request(request_id="strict", seed=3, keep_seed=True)
    ports.scheduler.handle_requests([Msg(strict.to_bytes(), 2)])
    order = ports.dispatcher.orders[-1]
    assert order.request.request_id == "strict" and order.donor is None and not order.plan.reuses


def test_a_failed_leader_is_evicted_and_its_objects_ordered_deleted(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="lead").to_bytes(), 0)])
    failed = GenerationResult(request_id="lead", tenant="default", status=ResultStatus.FAILED)
    ports.scheduler.handle_results([Msg(failed.to_bytes(), 0, topic="results")])

    assert ports.index.get("lead") is None
    assert ports.ledger.state("lead") == "failed"  # evicted from the index, and open to being sent again
    assert [(e.request_ids, e.reason) for e in ports.dispatcher.evictions] == [(["lead"], "leader failed")]
    assert ports.ledger.pending_evictions() == {}


def test_a_leader_evicted_while_it_ran_has_the_trajectory_it_stored_after_ordered_deleted(
    ports: Ports,
) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="lead").to_bytes(), 0)])
    ports.scheduler.cache.evict({"lead": "leader stale"})
    ports.scheduler.handle_results([Msg(done("lead").to_bytes(), 0, topic="results")])

    assert ports.index.get("lead") is None and ports.ledger.state("lead") == "evicted"
    assert [(e.request_ids, e.reason) for e in ports.dispatcher.evictions] == [
        (["lead"], "leader stale"),
        (["lead"], "finished after its entry was evicted"),
    ]
    assert ports.scheduler.stats.evicted == 1 and ports.scheduler.stats.donors_indexed == 0
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


def test_an_embedder_off_the_calibrations_numbers_widens_the_planners_thresholds(tmp_path: Any) -> None:
    from tests.helpers.scheduler_fakes import FakeEmbedder

    class Bfloat16Like(FakeEmbedder):
        similarity_tolerance = 0.005

    ports = make_ports(tmp_path)
    assert ports.scheduler.planner.similarity_margin == 0.0
    widened = make_ports(tmp_path / "b", embedder=Bfloat16Like())
    assert widened.scheduler.planner.similarity_margin == 0.005
    assert widened.scheduler.intake.planner is widened.scheduler.planner


def test_build_scheduler_hands_the_precision_setting_to_the_embedder(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import chorus_sched.embedding
    from chorus_sched.service import build_scheduler
    from chorus_sched.settings import SchedulerSettings

    asked: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def make_embedder(kind: str, **options: Any) -> Any:
        asked.update(options, kind=kind)
        raise Stop

    monkeypatch.setattr(chorus_sched.embedding, "make_embedder", make_embedder)
    for precision in ("auto", "float32"):
        settings = SchedulerSettings(state_dir=tmp_path, embed_precision=precision)
        with pytest.raises(Stop):
            build_scheduler(settings)
        assert asked["precision"] == precision and asked["kind"] == "minilm"
