"""Two ``chorus scheduler`` processes in one consumer group over one stream, on the embedded setup: one SQLite
ledger, one Qdrant local-mode folder and one filesystem Celery broker shared through ``state_dir``.

Nothing may be lost or duplicated — not while both run, nor when one is stopped mid-stream and the other takes its
partitions over — and grouping must hold across them: every family of similar requests has exactly one leader,
whichever instance scheduled its members.

The processes run in an ``EmbeddedStack`` (two schedulers, no worker), which starts them once the topics exist and
returns when both hold partitions.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from kombu import Queue

from chorus_sched.index import DonorIndex
from chorus_sched.ledger_sqlite import SqliteLedger
from producer import bus
from producer.broker import EXCHANGE, app_for_broker
from producer.contract import DeadLetter, GenerationRequest, build_request
from producer.local.config import StackOptions
from producer.local.processes import ServiceProcess
from producer.local.stack import EmbeddedStack
from producer.orders import GENERATE_TASK, Role, WorkOrder, queue_for
from producer.readiness import ReadinessEvent
from tests.helpers.scheduler_fakes import recased
from tests.helpers.topics import read_topic

pytestmark = pytest.mark.integration

FAMILIES = [
    "a red circle moving left on a white background",
    "a blue square moving up on a black background",
    "a yellow triangle moving right on a gray background",
    "a green circle moving down on a brown background",
]
WAIT_S = 120.0


def assignment(instance: ServiceProcess, topic: str) -> list[int] | None:
    """Partitions of ``topic`` the instance was last assigned (None before its first assignment)."""
    found = None
    for line in list(instance.read_events()):
        if line.get("event") == ReadinessEvent.PARTITIONS_ASSIGNED and line.get("topic") == topic:
            found = list(line["partitions"])
    return found


def wait_for(condition: Any, what: str, instances: list[ServiceProcess]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        for inst in instances:
            assert inst.alive(), f"{inst.name} exited: {inst.log_tail(5)}"
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.25)


def test_two_scheduler_processes_lose_nothing_duplicate_nothing_and_group_correctly(tmp_path: Path) -> None:
    options = StackOptions(
        state_dir=tmp_path / "state",
        models=["toy"],
        schedulers=2,
        workers=0,
        embedder="hashing",
        persist_s3=False,
        extra_env={
            "CHORUS_KAFKA_SESSION_TIMEOUT_MS": "6000",
            "CHORUS_KAFKA_MAX_POLL_INTERVAL_MS": "15000",
            "CHORUS_POLL_TIMEOUT_MS": "100",
        },
    )
    with EmbeddedStack(options) as stack:
        _check_two_instances(stack)


def _check_two_instances(stack: EmbeddedStack) -> None:
    state = stack.state_dir
    kafka_settings = stack.producer_settings
    group = stack.scheduler_settings.kafka_group_id
    topic = kafka_settings.kafka_requests_topic
    producer = bus.make_producer(kafka_settings)
    producer.partitions_for(topic)  # the topic exists before the group forms

    def publish(*messages: GenerationRequest | bytes) -> None:
        for m in messages:
            if isinstance(m, bytes):
                bus.publish(producer, topic, "junk", m)
            else:
                bus.publish(producer, topic, m.request_id, m.to_bytes())

    def family_requests(batch: int, per_family: int) -> list[GenerationRequest]:
        return [
            build_request(
                # the family's words in another text each (the very same text would wait for the first's video)
                prompt=recased(prompt, 100 * batch + i),
                model="toy",
                tenant="acme",
                request_id=f"f{f}-b{batch}-{i}",
                seed=100 * batch + i,
            )
            for i in range(per_family)
            for f, prompt in enumerate(FAMILIES)
        ]

    def all_handled() -> bool:
        progress = bus.group_progress(kafka_settings, group, topic)
        return bool(progress) and all(committed >= end for committed, end in progress.values())

    a, b = stack.schedulers
    instances = [a, b]
    try:
        # both members of the group hold partitions before the stream starts
        def split() -> bool:
            pa, pb = assignment(a, topic), assignment(b, topic)
            return bool(pa) and bool(pb) and sorted((pa or []) + (pb or [])) == [0, 1, 2, 3]

        wait_for(split, "both instances hold requests partitions", instances)

        first = family_requests(1, 6)
        publish(*first[:12], b"{not json", *first[:2], *first[12:], first[5], b'{"prompt": ""}')
        wait_for(all_handled, "the first batch is handled", instances)

        assert a.stop() == 0  # one instance leaves mid-stream; the other takes its partitions over
        instances = [b]
        second = family_requests(2, 3)
        publish(*second, *first[6:9], b"\xff")
        wait_for(all_handled, "the second batch is handled", instances)
        assert b.stop() == 0
    finally:
        producer.close()

    # Every valid request id is on the queue exactly once.
    app = app_for_broker("", state_dir=state)
    orders: list[WorkOrder] = []
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(
            Queue(queue_for("toy"), EXCHANGE, routing_key=queue_for("toy"), durable=True)
        )
        while True:
            try:
                message = queue.get_nowait()
            except queue.Empty:
                break
            assert message.headers["task"] == GENERATE_TASK
            orders.append(WorkOrder.model_validate_json(message.payload[0][0]))
            message.ack()
        queue.close()
    ids = [o.request.request_id for o in orders]
    assert len(ids) == len(set(ids)), "a request was dispatched twice"
    assert sorted(ids) == sorted(r.request_id for r in first + second)

    # Each family has exactly one leader; every other member follows it.
    for f in range(len(FAMILIES)):
        members = [o for o in orders if o.request.request_id.startswith(f"f{f}-")]
        leaders = [o for o in members if o.role is Role.LEADER]
        assert len(leaders) == 1, [(o.request.request_id, o.role) for o in members]
        leader_id = leaders[0].request.job_id  # donors are named by job id (tenant~request id)
        for o in members:
            if o is not leaders[0]:
                assert o.role is Role.FOLLOWER and o.donor is not None and o.donor.request_id == leader_id

    # Both instances did part of the work, and the shared index holds the four running leaders.
    ledger = SqliteLedger(state / "ledger.sqlite3")
    schedulers = {rec.scheduler for o in orders if (rec := ledger.record(o.request.job_id)) is not None}
    ledger.close()
    assert schedulers == {a.name, b.name}
    index = DonorIndex.connect(path=state / "qdrant", collection="chorus_donors", dim=384)
    entries = index.entries()
    index.close()
    assert sorted(e.request_id for e in entries) == sorted(
        o.request.job_id for o in orders if o.role is Role.LEADER
    )
    assert all(e.status == "running" for e in entries)

    # The three malformed messages were dead-lettered once each.
    deadline = time.monotonic() + WAIT_S
    while True:
        letters = [
            DeadLetter.model_validate_json(value)
            for _, value in read_topic(kafka_settings, kafka_settings.kafka_dead_letter_topic)
        ]
        if len(letters) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    # what the schedulers said about dead letters, for a failure to be read without the run's state folder
    said = [
        line
        for process in stack.schedulers
        for line in process.log_path.read_text(errors="replace").splitlines()
        if "dead-letter" in line
    ]
    assert sorted(dl.raw() for dl in letters) == sorted([b"{not json", b'{"prompt": ""}', b"\xff"]), said
    assert len({(dl.partition, dl.offset) for dl in letters}) == 3
