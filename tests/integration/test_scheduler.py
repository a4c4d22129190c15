"""The scheduler on real services: the Kafka-protocol broker (requests, results, dead letters), Redis (ledger and
Celery broker, keys under a prefix unique to each test), Qdrant local mode (a folder per test).

Each test runs the real consume loop (``chorus_sched.service.run``) in a thread, publishes messages as producers
and workers would, waits until the scheduler's consumer groups have committed everything published, and then
inspects what is on the Celery queues with a small kombu consumer (the same app configuration the workers use).
"""

from __future__ import annotations

import base64
import time
from typing import Any

import pytest
from kafka.structs import TopicPartition

from chorus_sched.dispatch import Dispatcher
from chorus_sched.embedding import HashingEmbedder, word_diff
from chorus_sched.planner import Planner, load_calibration
from chorus_sched.service import build_scheduler
from producer import bus
from producer.contract import (
    GenerationResult,
    ResultStatus,
    ReusePlan,
)
from producer.orders import (
    EVICT_TASK,
    MAINTENANCE_QUEUE,
    Role,
    queue_for,
)
from tests.helpers.scheduler_fakes import recased
from tests.helpers.scheduler_harness import (
    OTHER,
    PROMPT,
    WAIT_S,
    Harness,
    Record,
    celery_client,
    dead_letters,
    done,
    drain,
    request,
    results_of,
)

pytestmark = pytest.mark.integration


def test_requests_become_one_task_each_bad_ones_are_dead_lettered_and_copies_run_once(
    harness: Harness,
) -> None:
    first = request(request_id="r-first", priority=5)
    off = request(OTHER, request_id="r-off", reuse="off")
    wrong_shape = b'{"request_id": "r-bad", "prompt": "x", "model": "toy", "height": 48}'
    harness.publish(first, b"\xff not json at all", key="junk")
    harness.publish(wrong_shape, key="r-bad")
    harness.publish(first, off, first)  # the first request twice more: new messages with a taken id
    harness.wait_handled()

    tasks = harness.generate_tasks()
    assert sorted(tasks) == ["r-first", "r-off"]
    lead = tasks["r-first"].order
    assert lead.role is Role.LEADER and lead.plan == ReusePlan.full(4) and lead.donor is None
    assert lead.request == first
    assert tasks["r-first"].properties.get("priority") == 4  # Redis serves lower numbers first: 9 - 5
    # what Celery logs of the order ("Task received", failures) names it without the tenant's prompt
    shown = tasks["r-first"].headers["argsrepr"]
    assert "r-first" in shown and "toy" in shown and first.prompt not in shown
    solo = tasks["r-off"].order
    assert solo.role is Role.SOLO and solo.plan == ReusePlan.full(4)
    assert harness.scheduler.index.get("r-off") is None  # reuse off: never a leader, never indexed
    running = harness.scheduler.index.get("r-first")
    assert running is not None and running.status == "running"

    letters = {dl.key_b64: dl for dl in dead_letters(harness.settings, 2)}
    junk = letters[base64.b64encode(b"junk").decode()]
    assert junk.raw() == b"\xff not json at all"
    assert junk.error.code == "invalid_request" and "not UTF-8" in junk.error.message
    assert junk.topic == harness.settings.kafka_requests_topic and junk.offset >= 0
    bad = letters[base64.b64encode(b"r-bad").decode()]
    assert bad.raw() == wrong_shape
    assert [(i.field, i.rule) for i in bad.issues] == [("height", "model_shape")]
    # the producer waiting for r-bad learns why
    # two rejected results: r-bad's, and the unreadable message's under its key "junk"
    rejected = [r for r in results_of(harness.settings, 2) if r.request_id == "r-bad"]
    assert rejected and rejected[0].status is ResultStatus.REJECTED
    assert rejected[0].error is not None and "height" in rejected[0].error.message
    stats = harness.scheduler.stats
    # the copies run never; each is answered when r-first finishes (chorus_sched/resend.py)
    assert (stats.dead_lettered, stats.resent, stats.dispatched) == (2, 2, 2)


def test_similar_requests_group_then_a_finished_donor_is_reused_and_its_hits_counted(
    harness: Harness,
) -> None:
    # the same words in another text: a follower (the very same text would wait for the leader's video whole)
    leader, follower = (
        request(request_id="lead", seed=1),
        request(recased(PROMPT), request_id="follow", seed=2),
    )
    harness.publish(leader)
    harness.wait_handled()
    harness.publish(follower, request(OTHER, request_id="unrelated"))
    harness.wait_handled()
    tasks = harness.generate_tasks()
    assert tasks["lead"].order.role is Role.LEADER
    f = tasks["follow"].order
    assert f.role is Role.FOLLOWER
    assert f.donor is not None and f.donor.request_id == "lead"
    assert f.donor.trajectory_prefix == "trajectories/lead/"
    assert f.donor.wait_s == harness.settings.follower_wait_s > 0
    # same prompt, 4 steps: the shipped table's plan for an identical prompt
    shipped = Planner(load_calibration()).plan(1.0, word_diff(PROMPT, PROMPT), 4).plan
    assert shipped.stage1_steps > 0
    assert (f.plan.stage1_steps, f.plan.stage2_steps, f.plan.stage3_steps) == (
        shipped.stage1_steps,
        shipped.stage2_steps,
        shipped.stage3_steps,
    )
    assert tasks["unrelated"].order.role is Role.LEADER  # nothing similar to follow

    # the leader's worker reports: its entry becomes a finished donor
    harness.publish_result(done("lead", nbytes=1234))
    harness.wait_handled()
    entry = harness.scheduler.index.get("lead")
    assert entry is not None and entry.ready and entry.bytes == 1234
    assert entry.trajectory_uri == "s3://chorus/trajectories/lead/"

    # a later similar request takes the finished donor
    harness.publish(request(recased(PROMPT, 2), request_id="later", seed=3))
    harness.wait_handled()
    later = harness.generate_tasks()["later"].order
    assert later.role is Role.SOLO and later.donor is not None and later.donor.request_id == "lead"
    assert later.plan.reuses and later.donor.wait_s == 0

    # results of requests that used the donor count hits and steps saved, once each
    hit = done("later", donor="lead", plan=later.plan, steps_computed=2, tokens_computed_fraction=0.5)
    harness.publish_result(hit)
    harness.publish_result(hit)  # a redelivered result counts once
    harness.publish_result(done("follow", donor="lead", plan=f.plan, fallback="leader too slow"))
    harness.wait_handled()
    entry = harness.scheduler.index.get("lead")
    assert entry is not None and (entry.hits, entry.steps_saved) == (1, 2.0) and entry.last_hit_at
    # requests that were not leaders become donors too, from the ledger's record of them
    later_entry = harness.scheduler.index.get("later")
    assert later_entry is not None and later_entry.ready and later_entry.prompt == recased(PROMPT, 2)
    assert later_entry.tenant == "default" and later_entry.compat_key == request().compatibility_key


def test_a_better_donor_of_another_tenant_is_blocked_and_counted(harness: Harness) -> None:
    harness.publish(request(request_id="theirs", tenant="globex"))
    harness.wait_handled()
    harness.publish_result(done("theirs", tenant="globex"))
    harness.wait_handled()
    harness.publish(request(request_id="mine", tenant="acme", seed=1))  # another seed: not an exact hit
    harness.wait_handled()
    order = harness.generate_tasks()["mine"].order
    assert order.donor is None and order.role is Role.LEADER and not order.plan.reuses
    assert harness.scheduler.stats.cross_tenant_blocked == 1


def test_cross_tenant_reuse_when_allowed(make_settings: Any) -> None:
    settings = make_settings(cross_tenant_reuse=True)
    h = Harness(settings, celery_client(settings.broker_url, settings.state_dir, settings.ledger_prefix))
    try:
        h.publish(request(request_id="theirs", tenant="globex"))
        h.wait_handled()
        h.publish_result(done("theirs", tenant="globex"))
        h.wait_handled()
        h.publish(request(recased(PROMPT), request_id="mine", tenant="acme", seed=1))  # another text: a donor
        h.wait_handled()
        order = h.generate_tasks()["mine"].order
        # another tenant's donor is named by its job id (tenant~request id)
        assert (
            order.donor is not None and order.donor.request_id == "globex~theirs" and order.role is Role.SOLO
        )
        assert h.scheduler.stats.cross_tenant_blocked == 0
    finally:
        h.close()


def test_eviction_removes_the_point_then_orders_the_objects_deleted(make_settings: Any) -> None:
    settings = make_settings(cache_budget_bytes=1500, evict_interval_s=3600)
    h = Harness(settings, celery_client(settings.broker_url, settings.state_dir, settings.ledger_prefix))
    try:
        h.publish(
            request(request_id="d1"),
            request(OTHER, request_id="d2"),
            request("a blue square", request_id="d3"),
        )
        h.wait_handled()
        h.publish_result(done("d1", nbytes=1000))
        h.publish_result(done("d2", nbytes=1000))
        h.publish_result(GenerationResult(request_id="d3", tenant="default", status=ResultStatus.FAILED))
        h.wait_handled()
        assert h.scheduler.index.get("d3") is None  # a failed leader's entry goes at once
        # one used donor is worth more than the unused one
        h.publish(request(recased(PROMPT), request_id="user", seed=1))  # another text than d1's: a donor
        h.wait_handled()
        user = h.generate_tasks()["user"].order
        assert user.donor is not None and user.donor.request_id == "d1"
        h.publish_result(
            done("user", donor="d1", plan=user.plan, steps_computed=2, tokens_computed_fraction=0.5, nbytes=0)
        )
        h.wait_handled()
        assert h.scheduler.maintain() == ["d2"]  # 2000 bytes over a 1500 budget: the unused one goes
        assert h.scheduler.index.get("d2") is None and h.scheduler.index.get("d1") is not None
        assert h.scheduler.ledger.state("d2") == "evicted"
        orders = drain(h.app, MAINTENANCE_QUEUE)
        assert all(t.name == EVICT_TASK for t in orders)
        evicted = {(tuple(t.evict_order.request_ids), t.evict_order.reason) for t in orders}
        assert evicted == {(("d3",), "leader failed"), (("d2",), "budget")}
        assert h.scheduler.ledger.pending_evictions() == {}
        # a late result of an evicted donor does not bring it back
        h.publish_result(done("d2", nbytes=1000))
        h.wait_handled()
        assert h.scheduler.index.get("d2") is None
    finally:
        h.close()


def test_a_donor_a_worker_found_gone_is_evicted_and_not_offered_again(make_settings: Any) -> None:
    settings = make_settings(evict_interval_s=3600)
    h = Harness(settings, celery_client(settings.broker_url, settings.state_dir, settings.ledger_prefix))
    try:
        h.publish(request(request_id="gone"))
        h.wait_handled()
        h.publish_result(done("gone"))
        h.wait_handled()
        h.publish(
            request(recased(PROMPT, 1), request_id="slow-user", seed=2),
            request(recased(PROMPT, 2), request_id="user", seed=3),
        )
        h.wait_handled()
        tasks = h.generate_tasks()
        for rid in ("slow-user", "user"):
            ref = tasks[rid].order.donor
            assert ref is not None and ref.request_id == "gone"
        # a fallback that says nothing about the donor itself (a transient S3 error) keeps it
        h.publish_result(
            done("slow-user", donor="gone", plan=tasks["slow-user"].order.plan, fallback="donor unreadable")
        )
        h.wait_handled()
        assert h.scheduler.index.get("gone") is not None
        # a worker found its objects missing: the entry goes, and the workers are told to delete what is left
        h.publish_result(
            done(
                "user",
                donor="gone",
                plan=tasks["user"].order.plan,
                fallback="donor header is not in the store",
                donor_gone=True,
            )
        )
        h.wait_handled()
        assert h.scheduler.index.get("gone") is None and h.scheduler.ledger.state("gone") == "evicted"
        orders = drain(h.app, MAINTENANCE_QUEUE)
        assert {(tuple(t.evict_order.request_ids), t.evict_order.reason) for t in orders} == {
            (("gone",), "donor-gone")
        }
        # the next similar request takes one of the requests that ran in full, not the gone donor
        h.publish(request(recased(PROMPT, 4), request_id="next", seed=4))
        h.wait_handled()
        nxt = h.generate_tasks()["next"].order
        assert nxt.donor is not None and nxt.donor.request_id in {"slow-user", "user"}
    finally:
        h.close()


def test_a_request_claimed_by_a_crashed_instance_is_retried_then_taken_over_once_its_lease_expires(
    make_settings: Any,
) -> None:
    settings = make_settings()
    app = celery_client(settings.broker_url, settings.state_dir, settings.ledger_prefix)
    scheduler, close = build_scheduler(settings, embedder=HashingEmbedder(), dispatcher=Dispatcher(app))
    try:
        orphan = request(request_id="orphan")
        record = Record(settings.kafka_requests_topic, 2, 7, b"orphan", orphan.to_bytes())
        tp = TopicPartition(settings.kafka_requests_topic, 2)
        assert scheduler.ledger.begin("orphan", owner="crashed-instance", lease_s=0.5).outcome == "new"
        # the crashed instance's lease is live: not ours to run, not to be committed — retried later
        outcome = scheduler.handle_requests([record])
        assert outcome.retry == {tp: 7} and outcome.commit == {}
        assert drain(app, queue_for("toy")) == []
        time.sleep(0.6)
        outcome = scheduler.handle_requests([record])
        assert outcome.retry == {} and outcome.commit == {tp: 8}
        tasks = drain(app, queue_for("toy"))
        assert [t.order.request.request_id for t in tasks] == ["orphan"]
        # and once more (a redelivery): a duplicate, committed, no new task
        assert scheduler.handle_requests([record]).commit == {tp: 8}
        assert drain(app, queue_for("toy")) == []
        assert (scheduler.stats.busy, scheduler.stats.dispatched, scheduler.stats.duplicates) == (1, 1, 1)
    finally:
        close()


def test_copies_of_a_request_within_one_poll_run_once(make_settings: Any) -> None:
    settings = make_settings()
    app = celery_client(settings.broker_url, settings.state_dir, settings.ledger_prefix)
    scheduler, close = build_scheduler(settings, embedder=HashingEmbedder(), dispatcher=Dispatcher(app))
    try:
        twice = request(request_id="twice").to_bytes()
        topic = settings.kafka_requests_topic
        outcome = scheduler.handle_requests(
            [Record(topic, 1, 10, b"twice", twice), Record(topic, 1, 11, b"twice", twice)]
        )
        assert outcome.commit == {TopicPartition(topic, 1): 12} and outcome.retry == {}
        assert [t.order.request.request_id for t in drain(app, queue_for("toy"))] == ["twice"]
        assert (scheduler.stats.dispatched, scheduler.stats.resent) == (1, 1)
    finally:
        close()


class BrokenEmbedder(HashingEmbedder):
    def embed(self, texts: Any) -> list[list[float]]:
        if texts != ["warm-up"]:
            raise ValueError("embedding model returned garbage")
        return super().embed(texts)


def test_a_request_that_keeps_failing_is_dead_lettered_after_max_attempts(make_settings: Any) -> None:
    settings = make_settings(max_attempts=2)
    app = celery_client(settings.broker_url, settings.state_dir, settings.ledger_prefix)
    scheduler, close = build_scheduler(settings, embedder=BrokenEmbedder(), dispatcher=Dispatcher(app))
    try:
        bad = request(request_id="cursed")
        record = Record(settings.kafka_requests_topic, 0, 3, b"cursed", bad.to_bytes())
        tp = TopicPartition(settings.kafka_requests_topic, 0)
        assert scheduler.handle_requests([record]).retry == {tp: 3}
        assert scheduler.ledger.state("cursed") is None  # the claim was released for the retry
        outcome = scheduler.handle_requests([record])
        assert outcome.retry == {} and outcome.commit == {tp: 4}
        [letter] = dead_letters(settings, 1)
        assert letter.error.code == "scheduling_failed" and "garbage" in letter.error.message
        assert letter.raw() == bad.to_bytes() and letter.offset == 3
        assert scheduler.ledger.state("cursed") == "dead_lettered"
        assert scheduler.handle_requests([record]).commit == {tp: 4}  # redelivered: recognized, not retried
        assert drain(app, queue_for("toy")) == []
    finally:
        close()


def test_redelivery_after_a_crash_between_dispatch_and_commit_does_not_duplicate(make_settings: Any) -> None:
    settings = make_settings()
    app = celery_client(settings.broker_url, settings.state_dir, settings.ledger_prefix)
    # An instance that handles a poll and dies before committing: its orders are on the broker, its offsets not.
    scheduler, close = build_scheduler(settings, embedder=HashingEmbedder(), dispatcher=Dispatcher(app))
    producer = bus.make_producer(settings)
    sent = [request(recased(PROMPT, i), request_id=f"c{i}", seed=i) for i in range(3)]
    for r in sent:
        bus.publish(producer, settings.kafka_requests_topic, r.request_id, r.to_bytes())
    producer.close()
    consumer = bus.make_consumer(
        settings,
        [settings.kafka_requests_topic],
        group_id=settings.kafka_group_id,
        session_timeout_ms=settings.kafka_session_timeout_ms,
        max_poll_interval_ms=settings.kafka_max_poll_interval_ms,
    )
    records = []
    for record in bus.poll_records(consumer, timeout_s=WAIT_S):
        records.append(record)
        if len(records) == len(sent):
            break
    outcome = scheduler.handle_requests(records)
    assert not outcome.retry and sum(outcome.commit.values()) > 0
    consumer.close(autocommit=False)  # crash: nothing committed
    close()

    h = Harness(settings, app)  # a fresh instance of the same group reads everything again
    try:
        h.wait_handled()
        tasks = h.generate_tasks()
        assert sorted(tasks) == ["c0", "c1", "c2"]
        assert h.scheduler.stats.duplicates == 3 and h.scheduler.stats.dispatched == 0
    finally:
        h.close()
