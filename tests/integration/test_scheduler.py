"""The scheduler on real services: the Kafka-protocol broker (requests, results, dead letters), Redis (ledger and
Celery broker, keys under a prefix unique to each test), Qdrant local mode (a folder per test).

Each test runs the real consume loop (``chorus_sched.service.run``) in a thread, publishes messages as producers
and workers would, waits until the scheduler's consumer groups have committed everything published, and then
inspects what is on the Celery queues with a small kombu consumer (the same app configuration the workers use).
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kafka import KafkaProducer
from kafka.structs import TopicPartition
from kombu import Queue

from chorus_sched.dispatch import Dispatcher
from chorus_sched.embedding import HashingEmbedder, word_diff
from chorus_sched.planner import Planner, load_calibration
from chorus_sched.service import Scheduler, build_scheduler, run
from chorus_sched.settings import SchedulerSettings
from producer import bus
from producer.broker import EXCHANGE, app_for_broker
from producer.contract import (
    DeadLetter,
    DonorInfo,
    GenerationRequest,
    GenerationResult,
    ResultStatus,
    ReusePlan,
    build_request,
)
from producer.orders import (
    EVICT_TASK,
    GENERATE_TASK,
    MAINTENANCE_QUEUE,
    EvictOrder,
    Role,
    WorkOrder,
    queue_for,
)
from producer.settings import KafkaSettings

pytestmark = pytest.mark.integration

PROMPT = "a red circle moving left on a white background"
OTHER = "a green triangle moving up on a black background"
WAIT_S = 90.0


def celery_client(broker_url: str, state_dir: Path, key_prefix: str) -> Celery:
    app = app_for_broker(broker_url, state_dir=state_dir)
    if broker_url.startswith("redis://"):
        options = dict(app.conf.broker_transport_options or {})
        options["global_keyprefix"] = key_prefix
        app.conf.broker_transport_options = options
    return app


@dataclass
class Task:
    name: str
    args: list[Any]
    properties: dict[str, Any]

    @property
    def order(self) -> WorkOrder:
        return WorkOrder.model_validate_json(self.args[0])

    @property
    def evict_order(self) -> EvictOrder:
        return EvictOrder.model_validate_json(self.args[0])


def drain(app: Celery, queue: str) -> list[Task]:
    """Every message now on ``queue`` (a consumer of the queue, like a worker, that takes them all).

    Called once the scheduler has committed everything published, i.e. once every order it will send is on the
    broker, so "until empty" is all of them.
    """
    tasks = []
    with app.connection_for_read() as conn:
        simple = conn.SimpleQueue(Queue(queue, EXCHANGE, routing_key=queue, durable=True))
        while True:
            try:
                message = simple.get_nowait()
            except simple.Empty:
                break
            args, _kwargs, _embed = message.payload
            tasks.append(Task(message.headers["task"], args, dict(message.properties)))
            message.ack()
        simple.close()
    return tasks


class Harness:
    def __init__(self, settings: SchedulerSettings, app: Celery) -> None:
        self.settings = settings
        self.app = app
        self.scheduler: Scheduler
        self.scheduler, self._close = build_scheduler(
            settings, embedder=HashingEmbedder(), dispatcher=Dispatcher(app)
        )
        self.producer: KafkaProducer = bus.make_producer(settings)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=run, args=(settings, self.stop), kwargs={"scheduler": self.scheduler}, daemon=True
        )
        self.thread.start()

    def publish(self, *messages: GenerationRequest | bytes, key: str = "raw") -> None:
        for m in messages:
            if isinstance(m, bytes):
                bus.publish(self.producer, self.settings.kafka_requests_topic, key, m)
            else:
                bus.publish(self.producer, self.settings.kafka_requests_topic, m.request_id, m.to_bytes())

    def publish_result(self, result: GenerationResult) -> None:
        bus.publish(self.producer, self.settings.kafka_results_topic, result.request_id, result.to_bytes())

    def wait_handled(self) -> None:
        """Until both consumer groups have committed every message published so far."""
        for group, topic in (
            (self.settings.kafka_group_id, self.settings.kafka_requests_topic),
            (self.settings.kafka_results_group_id, self.settings.kafka_results_topic),
        ):
            deadline = time.monotonic() + WAIT_S
            while True:
                progress = bus.group_progress(self.settings, group, topic)
                if all(committed >= end for committed, end in progress.values()):
                    break
                assert self.thread.is_alive(), "the scheduler loop died"
                assert time.monotonic() < deadline, f"{group} did not handle {topic}: {progress}"
                time.sleep(0.2)

    def generate_tasks(self, model: str = "toy") -> dict[str, Task]:
        tasks = drain(self.app, queue_for(model))
        assert all(t.name == GENERATE_TASK for t in tasks)
        ids = [t.order.request.request_id for t in tasks]
        assert len(ids) == len(set(ids)), f"duplicate work orders: {ids}"
        return dict(zip(ids, tasks, strict=True))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()
        self.producer.close(timeout=10)


@pytest.fixture
def make_settings(kafka_settings: KafkaSettings, redis_url: str, tmp_path: Path) -> Iterator[Any]:
    """Settings for one test; its Redis keys (ledger and Celery broker) share one prefix, removed afterwards."""
    suffix = uuid.uuid4().hex[:8]

    def make(**overrides: Any) -> SchedulerSettings:
        fields: dict[str, Any] = {
            **kafka_settings.model_dump(),
            "state_dir": tmp_path / "state",
            "kafka_group_id": f"sched-{suffix}",
            "kafka_results_group_id": f"sched-results-{suffix}",
            "redis_url": redis_url,
            "ledger_prefix": f"test-{suffix}:",
            "broker_url": redis_url,
            "embedder": "hashing",
            "poll_timeout_ms": 100,
            "kafka_metadata_max_age_ms": 1000,
            "kafka_session_timeout_ms": 6000,
            "kafka_max_poll_interval_ms": 15000,
            "instance_id": f"sched-{suffix}",
            **overrides,
        }
        return SchedulerSettings(**fields)

    yield make
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"test-{suffix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def harness(make_settings: Any) -> Iterator[Harness]:
    settings = make_settings()
    h = Harness(settings, celery_client(settings.broker_url, settings.state_dir, settings.ledger_prefix))
    yield h
    h.close()


def request(prompt: str = PROMPT, **fields: Any) -> GenerationRequest:
    # The default tenant, whose job ids are its request ids (index and ledger keys); tenants have their own tests.
    return build_request(prompt=prompt, model="toy", tenant=fields.pop("tenant", "default"), **fields)


def done(
    rid: str, *, tenant: str = "default", nbytes: int = 1000, donor: str | None = None, **fields: Any
) -> GenerationResult:
    return GenerationResult(
        request_id=rid,
        tenant=tenant,
        status=ResultStatus.DONE,
        video_uri=f"s3://chorus/videos/{rid}.mp4",
        trajectory_uri=f"s3://chorus/trajectories/{rid}/",
        trajectory_bytes=nbytes,
        donor=DonorInfo(request_id=donor, similarity=1.0) if donor else None,
        steps_requested=4,
        steps_computed=fields.pop("steps_computed", 4),
        tokens_computed_fraction=fields.pop("tokens_computed_fraction", 1.0),  # in full unless said otherwise
        **fields,
    )


def dead_letters(settings: KafkaSettings, n: int) -> list[DeadLetter]:
    consumer = bus.make_consumer(settings, [settings.kafka_dead_letter_topic], group_id=None)
    letters = []
    for record in bus.poll_records(consumer, timeout_s=WAIT_S):
        letters.append(DeadLetter.model_validate_json(record.value))
        if len(letters) == n:
            break
    consumer.close()
    return letters


def results_of(settings: KafkaSettings, n: int) -> list[GenerationResult]:
    consumer = bus.make_consumer(settings, [settings.kafka_results_topic], group_id=None)
    out = []
    for record in bus.poll_records(consumer, timeout_s=WAIT_S):
        out.append(GenerationResult.model_validate_json(record.value))
        if len(out) == n:
            break
    consumer.close()
    return out


def test_hostile_messages_are_dead_lettered_and_the_requests_behind_them_run(harness: Harness) -> None:
    topic = harness.settings.kafka_requests_topic
    send = harness.producer.send
    # One partition's worth of poison in front of valid requests: a tombstone, a number Python will not convert,
    # a ~900 KB prompt (its dead letter must still fit the producer's request size), and an anonymous request.
    send(topic, key=b"tomb", value=None).get(timeout=30)
    harness.publish(
        b'{"request_id": "huge-seed", "prompt": "x", "seed": ' + b"9" * 5001 + b"}", key="huge-seed"
    )
    big = json.dumps({"request_id": "big", "prompt": "x" * 900_000}).encode()
    harness.publish(big, key="big")
    send(topic, key=None, value=b'{"prompt": "a red circle moving left on a gray background"}').get(
        timeout=30
    )
    valid = [request(request_id=f"after-{i}", seed=i) for i in range(3)]
    harness.publish(*valid)
    harness.wait_handled()

    assert sorted(harness.generate_tasks()) == ["after-0", "after-1", "after-2"]
    letters = dead_letters(harness.settings, 4)
    rules = sorted(letter.issues[0].rule for letter in letters)
    assert rules == ["json", "missing", "size", "tombstone"]
    sized = next(letter for letter in letters if letter.issues[0].rule == "size")
    assert sized.raw_truncated and sized.raw_size == len(big) and len(sized.to_bytes()) < 64 * 1024
    rejected = {r.request_id: r for r in results_of(harness.settings, 2)}
    assert set(rejected) == {"huge-seed", "big"}
    assert all(r.status is ResultStatus.REJECTED for r in rejected.values())


@pytest.mark.parametrize("holder", ["qdrant-client", "chorus-index-lock"])
def test_with_the_index_held_by_another_client_requests_are_computed_in_full_not_rejected(
    harness: Harness, holder: str
) -> None:
    import fcntl
    import os

    from qdrant_client import QdrantClient

    from chorus_sched.index import LOCK_FILE

    path = harness.settings.resolved_qdrant_path
    release: Callable[[], None]
    if holder == "qdrant-client":  # another Qdrant client has the local-mode folder open (its own lock)
        intruder = QdrantClient(path=path)
        release = intruder.close
    else:  # a stuck process holds the lock Chorus' own instances share the folder by
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        release = partial(os.close, fd)

    try:
        auto = request(request_id="while-down", seed=1)
        off = request(OTHER, request_id="off-while-down", reuse="off")
        harness.publish(auto, off)
        harness.wait_handled()
    finally:
        release()
    tasks = harness.generate_tasks()
    assert sorted(tasks) == ["off-while-down", "while-down"]
    assert all(t.order.plan == ReusePlan.full(4) and t.order.donor is None for t in tasks.values())
    assert harness.scheduler.stats.dead_lettered == 0
    assert harness.scheduler.stats.index_unavailable == 1  # only the reuse: auto request needed the index
    # the index is back: the next request uses it again
    harness.publish(request(request_id="after-down", seed=2))
    harness.wait_handled()
    assert harness.scheduler.index.get("after-down") is not None


def test_an_order_whose_worker_vanished_is_sent_again_by_maintenance(make_settings: Any) -> None:
    settings = make_settings(order_check_after_s=0.1, worker_lost_after_s=1.0, max_redispatches=1)
    app = celery_client(settings.broker_url, settings.state_dir, settings.ledger_prefix)
    scheduler, close = build_scheduler(settings, embedder=HashingEmbedder(), dispatcher=Dispatcher(app))
    try:
        lost = request(request_id="lost-order")
        topic = settings.kafka_requests_topic
        scheduler.handle_requests([Record(topic, 0, 0, b"lost-order", lost.to_bytes())])
        [first] = drain(app, queue_for("toy"))  # a worker took it...
        # ...started it, beat once, and was killed: its state stays PROGRESS with a heartbeat that ages.
        app.backend.store_result("lost-order", {"heartbeat_at": time.time(), "step": 1, "of": 4}, "PROGRESS")
        time.sleep(0.3)
        scheduler.maintain()
        assert drain(app, queue_for("toy")) == []  # the heartbeat is fresh: alive
        time.sleep(1.2)
        scheduler.maintain()
        [again] = drain(app, queue_for("toy"))
        assert again.order == first.order
        time.sleep(1.2)
        scheduler.maintain()  # lost a second time: answered failed, not sent a third time
        assert drain(app, queue_for("toy")) == []
        [failed] = results_of(settings, 1)
        assert failed.request_id == "lost-order" and failed.status is ResultStatus.FAILED
        assert failed.error is not None and failed.error.code == "worker_lost"
    finally:
        close()


def test_an_order_for_a_model_no_live_worker_serves_is_rejected_within_seconds(make_settings: Any) -> None:
    from producer.broker import announce_models, model_last_seen

    settings = make_settings(no_worker_after_s=1.0, watchdog_interval_s=0.5)
    app = celery_client(settings.broker_url, settings.state_dir, settings.ledger_prefix)
    # Workers run, but only for another model (what `chorus worker` announces every few seconds).
    announce_models(app, ["tiny-random-wan"], now=time.time())
    assert model_last_seen(app, "tiny-random-wan") is not None and model_last_seen(app, "toy") is None
    h = Harness(settings, app)
    try:
        started = time.monotonic()
        h.publish(request(request_id="nobody-serves-it"))
        [rejected] = results_of(settings, 1)
        assert time.monotonic() - started < 20
        assert rejected.request_id == "nobody-serves-it" and rejected.status is ResultStatus.REJECTED
        assert rejected.error is not None and rejected.error.code == "no_worker"
        assert "chorus worker --model toy" in rejected.error.message
        [letter] = dead_letters(settings, 1)
        assert letter.error.code == "no_worker" and letter.topic == settings.kafka_requests_topic
        assert GenerationRequest.model_validate_json(letter.raw()).request_id == "nobody-serves-it"
    finally:
        h.close()


def test_requests_become_one_task_each_bad_ones_are_dead_lettered_and_duplicates_skipped(
    harness: Harness,
) -> None:
    first = request(request_id="r-first", priority=5)
    off = request(OTHER, request_id="r-off", reuse="off")
    wrong_shape = b'{"request_id": "r-bad", "prompt": "x", "model": "toy", "height": 48}'
    harness.publish(first, b"\xff not json at all", key="junk")
    harness.publish(wrong_shape, key="r-bad")
    harness.publish(first, off, first)  # the first request twice more: a producer retry, a redelivery
    harness.wait_handled()

    tasks = harness.generate_tasks()
    assert sorted(tasks) == ["r-first", "r-off"]
    lead = tasks["r-first"].order
    assert lead.role is Role.LEADER and lead.plan == ReusePlan.full(4) and lead.donor is None
    assert lead.request == first
    assert tasks["r-first"].properties.get("priority") == 4  # Redis serves lower numbers first: 9 - 5
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
    assert (stats.dead_lettered, stats.duplicates, stats.dispatched) == (2, 2, 2)


def test_similar_requests_group_then_a_finished_donor_is_reused_and_its_hits_counted(
    harness: Harness,
) -> None:
    leader, follower = request(request_id="lead", seed=1), request(request_id="follow", seed=2)
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
    harness.publish(request(request_id="later", seed=3))
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
    assert later_entry is not None and later_entry.ready and later_entry.prompt == PROMPT
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
        h.publish(request(request_id="mine", tenant="acme", seed=1))  # another seed: not an exact hit
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
        h.publish(request(request_id="user", seed=1))  # another seed than d1: a donor, not an exact hit
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
        h.publish(request(request_id="slow-user", seed=2), request(request_id="user", seed=3))
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
        h.publish(request(request_id="next", seed=4))
        h.wait_handled()
        nxt = h.generate_tasks()["next"].order
        assert nxt.donor is not None and nxt.donor.request_id in {"slow-user", "user"}
    finally:
        h.close()


@dataclass(frozen=True)
class Record:
    """A consumed message as the scheduler core sees it (what kafka-python's ConsumerRecord carries)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


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
        assert (scheduler.stats.dispatched, scheduler.stats.duplicates) == (1, 1)
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
    sent = [request(request_id=f"c{i}", seed=i) for i in range(3)]
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
