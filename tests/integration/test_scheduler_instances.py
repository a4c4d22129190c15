"""Two ``chorus scheduler`` processes in one consumer group over one stream, on the embedded setup: one SQLite
ledger, one Qdrant local-mode folder and one filesystem Celery broker shared through ``state_dir``.

Nothing may be lost or duplicated — not while both run, nor when one is stopped mid-stream and the other takes its
partitions over — and grouping must hold across them: every family of similar requests has exactly one leader,
whichever instance scheduled its members.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kombu import Queue

from chorus_sched.index import DonorIndex
from chorus_sched.ledger import SqliteLedger
from producer import bus
from producer.contract import DeadLetter, GenerationRequest, build_request
from producer.embedded import EmbeddedService
from producer.settings import KafkaSettings
from workers.app import EXCHANGE, app_for_broker
from workers.orders import GENERATE_TASK, Role, WorkOrder, queue_for

pytestmark = pytest.mark.integration

FAMILIES = [
    "a red circle moving left on a white background",
    "a blue square moving up on a black background",
    "a yellow triangle moving right on a gray background",
    "a green circle moving down on a brown background",
]
WAIT_S = 120.0


class Instance:
    """One ``chorus scheduler`` process and the JSON log lines it writes."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.name = name
        self.lines: list[dict[str, Any]] = []
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "chorus"), "scheduler"],
            env={**env, "CHORUS_INSTANCE_ID": name},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                self.lines.append({"event": line.rstrip()})

    def assignment(self, topic: str) -> list[int] | None:
        """Partitions of ``topic`` this instance was last assigned (None before its first assignment)."""
        found = None
        for line in list(self.lines):
            if line.get("event") == "partitions assigned" and line.get("topic") == topic:
                found = list(line["partitions"])
        return found

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self._reader.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def wait_for(condition: Any, what: str, instances: list[Instance]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        for inst in instances:
            assert inst.process.poll() is None, f"{inst.name} exited: {inst.lines[-5:]}"
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.25)


def test_two_scheduler_processes_lose_nothing_duplicate_nothing_and_group_correctly(
    kafka_settings: KafkaSettings, kafka_broker: EmbeddedService, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:8]
    state = tmp_path / "state"
    group = f"sched-{suffix}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHORUS_")}
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "CHORUS_KAFKA_BOOTSTRAP": kafka_broker.address,
            "CHORUS_KAFKA_API_VERSION": "2.1.0",
            "CHORUS_KAFKA_REQUESTS_TOPIC": kafka_settings.kafka_requests_topic,
            "CHORUS_KAFKA_RESULTS_TOPIC": kafka_settings.kafka_results_topic,
            "CHORUS_KAFKA_DEAD_LETTER_TOPIC": kafka_settings.kafka_dead_letter_topic,
            "CHORUS_KAFKA_GROUP_ID": group,
            "CHORUS_KAFKA_RESULTS_GROUP_ID": f"{group}-results",
            "CHORUS_KAFKA_METADATA_MAX_AGE_MS": "1000",
            "CHORUS_KAFKA_SESSION_TIMEOUT_MS": "6000",
            "CHORUS_KAFKA_MAX_POLL_INTERVAL_MS": "15000",
            "CHORUS_POLL_TIMEOUT_MS": "100",
            "CHORUS_STATE_DIR": str(state),
            "CHORUS_EMBEDDER": "hashing",
            "CHORUS_LOG_FORMAT": "json",
        }
    )
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
            build_request(prompt=prompt, model="toy", tenant="acme", request_id=f"f{f}-b{batch}-{i}", seed=i)
            for i in range(per_family)
            for f, prompt in enumerate(FAMILIES)
        ]

    def all_handled() -> bool:
        progress = bus.group_progress(kafka_settings, group, topic)
        return bool(progress) and all(committed >= end for committed, end in progress.values())

    a = Instance("sched-a", env)
    b = Instance("sched-b", env)
    instances = [a, b]
    try:
        # both members of the group hold partitions before the stream starts
        def split() -> bool:
            pa, pb = a.assignment(topic), b.assignment(topic)
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
        for inst in (a, b):
            inst.kill()
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
        leader_id = leaders[0].request.request_id
        for o in members:
            if o is not leaders[0]:
                assert o.role is Role.FOLLOWER and o.donor is not None and o.donor.request_id == leader_id

    # Both instances did part of the work, and the shared index holds the four running leaders.
    ledger = SqliteLedger(state / "ledger.sqlite3")
    schedulers = {rec.scheduler for rid in ids if (rec := ledger.record(rid)) is not None}
    ledger.close()
    assert schedulers == {"sched-a", "sched-b"}
    index = DonorIndex.connect(path=state / "qdrant", collection="chorus_donors", dim=384)
    entries = index.entries()
    index.close()
    assert sorted(e.request_id for e in entries) == sorted(
        o.request.request_id for o in orders if o.role is Role.LEADER
    )
    assert all(e.status == "running" for e in entries)

    # The three malformed messages were dead-lettered once each.
    consumer = bus.make_consumer(kafka_settings, [kafka_settings.kafka_dead_letter_topic], group_id=None)
    letters = []
    for record in bus.poll_records(consumer, timeout_s=WAIT_S):
        letters.append(DeadLetter.model_validate_json(record.value))
        if len(letters) == 3:
            break
    consumer.close()
    assert sorted(dl.raw() for dl in letters) == sorted([b"{not json", b'{"prompt": ""}', b"\xff"])
    assert len({(dl.partition, dl.offset) for dl in letters}) == 3
