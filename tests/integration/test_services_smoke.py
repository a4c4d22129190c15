"""Each backing-service fixture round-trips real data through the adapter the services use."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from chorus_sched.index import DonorEntry, DonorIndex
from chorus_sched.ledger import RequestState
from chorus_sched.ledger_stores import ledger_from_url
from producer import bus
from producer.contract import build_request
from producer.local.standins import EmbeddedService
from producer.parsing import parse_request
from producer.settings import KafkaSettings
from workers.store import ObjectMissing, ObjectStore

pytestmark = pytest.mark.integration


def test_kafka_round_trips_requests_through_a_consumer_group(kafka_settings: KafkaSettings) -> None:
    producer = bus.make_producer(kafka_settings)
    sent = [build_request(prompt=f"a red circle moving left #{i}", seed=i) for i in range(10)]
    for request in sent:
        bus.publish(producer, kafka_settings.kafka_requests_topic, request.request_id, request.to_bytes())
    producer.close()

    consumer = bus.make_consumer(kafka_settings, [kafka_settings.kafka_requests_topic], group_id="smoke")
    received = {}
    for message in bus.poll_records(consumer, timeout_s=60):
        request = parse_request(message.value)
        assert message.key == bus.message_key(request.request_id)
        received[request.request_id] = request
        if len(received) == len(sent):
            break
    consumer.commit()
    assert received == {r.request_id: r for r in sent}
    assert sum(bus.consumer_lag(consumer).values()) == 0
    consumer.close()


def test_consumers_wait_at_the_broker_no_longer_than_the_setting(kafka_settings: KafkaSettings) -> None:
    # the embedded broker holds a fetch for its full wait: kafka-python's 500 ms default delayed every hop
    assert KafkaSettings.model_fields["kafka_fetch_max_wait_ms"].default == 50
    quick = kafka_settings.model_copy(update={"kafka_fetch_max_wait_ms": 20})
    grouped = bus.make_consumer(quick, [quick.kafka_requests_topic], group_id=None)
    tail = bus.tail_consumer(quick, quick.kafka_results_topic)
    try:
        assert grouped.config["fetch_max_wait_ms"] == tail.config["fetch_max_wait_ms"] == 20
    finally:
        grouped.close()
        tail.close()


def test_s3_round_trips_objects_through_the_minio_client(s3_server: EmbeddedService) -> None:
    store = ObjectStore(
        s3_server.address, f"smoke-{uuid.uuid4().hex[:8]}", access_key="test", secret_key="test"
    )
    store.ensure_bucket()
    payload = os.urandom(3 * 1024 * 1024)
    stored = store.put("trajectories/r1/full.safetensors", payload)
    assert stored.uri == f"s3://{store.bucket}/trajectories/r1/full.safetensors"
    assert store.get(stored.key) == payload
    assert [o.key for o in store.list("trajectories/")] == [stored.key]
    assert store.delete_prefix("trajectories/r1/") == 1
    with pytest.raises(ObjectMissing):
        store.get(stored.key)


def test_redis_ledger_claims_each_request_once(redis_url: str) -> None:
    ledger = ledger_from_url(redis_url, prefix=f"smoke:{uuid.uuid4().hex}:", ttl_s=60)
    assert ledger.claim("r1") is True
    assert ledger.claim("r1") is False
    ledger.set_state("r1", RequestState.DISPATCHED)
    assert ledger.state("r1") == "dispatched"
    ledger.release("r1")
    assert ledger.state("r1") is None


def test_qdrant_local_mode_finds_donors_by_key_and_tenant_and_persists(qdrant_path: Path) -> None:
    index = DonorIndex.connect(path=qdrant_path, collection="donors", dim=3)
    index.upsert(
        DonorEntry(request_id="a", tenant="t1", compat_key="k", prompt="p", trajectory_prefix="t/a"),
        [1, 0, 0],
    )
    index.upsert(
        DonorEntry(request_id="b", tenant="t2", compat_key="k", prompt="p", trajectory_prefix="t/b"),
        [1, 1, 0],
    )
    index.upsert(
        DonorEntry(request_id="c", tenant="t1", compat_key="k2", prompt="p", trajectory_prefix="t/c"),
        [1, 0, 0],
    )
    hits = index.search([1, 0, 0], compat_key="k", tenant="t1")
    assert [h.entry.request_id for h in hits] == ["a"]
    assert hits[0].similarity == pytest.approx(1.0)
    assert [h.entry.request_id for h in index.search([1, 0, 0], compat_key="k", tenant=None)] == ["a", "b"]
    index.close()

    reopened = DonorIndex.connect(path=qdrant_path, collection="donors", dim=3)
    assert reopened.count() == 3
    reopened.delete(["a"])
    assert reopened.get("a") is None and reopened.get("b") is not None
    reopened.close()
