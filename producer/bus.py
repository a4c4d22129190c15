"""The Kafka adapter: the only module that talks to Kafka (kafka-python).

Producers, the scheduler and the workers all publish and consume through these helpers, so topic names,
keys and client settings are decided in one place. Messages are keyed by request id, which puts every
message about one request (its submission, its result) in one partition, in order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from kafka import KafkaConsumer, KafkaProducer
from kafka.consumer.fetcher import ConsumerRecord
from kafka.structs import OffsetAndMetadata, TopicPartition

from producer.settings import KafkaSettings

log = logging.getLogger(__name__)


def client_config(settings: KafkaSettings) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap.split(","),
        "security_protocol": settings.kafka_security_protocol,
    }
    if settings.kafka_api_version_tuple is not None:
        config["api_version"] = known_api_version(settings.kafka_api_version_tuple)
    if settings.kafka_sasl_mechanism:
        config["sasl_mechanism"] = settings.kafka_sasl_mechanism
        config["sasl_plain_username"] = settings.kafka_sasl_username
        if settings.kafka_sasl_password is not None:
            config["sasl_plain_password"] = settings.kafka_sasl_password.get_secret_value()
    return config


def known_api_version(version: tuple[int, ...]) -> tuple[int, ...]:
    """``version`` as kafka-python's table of broker versions spells it: (2, 1, 0) is its (2, 1).

    kafka-python looks a configured version up as given; (2, 1, 0) is not in its table, and every client would
    log "Configured broker_version (2, 1, 0) not supported; using (2, 1)". Trailing zeros are dropped until
    the version is one it knows (or kept as given, for kafka-python to decide).
    """
    try:
        from kafka.protocol.broker_version_data import BROKER_API_VERSIONS
    except ImportError:  # another kafka-python layout: leave the version to it
        return version
    candidate = version
    while candidate not in BROKER_API_VERSIONS and len(candidate) > 2 and candidate[-1] == 0:
        candidate = candidate[:-1]
    return candidate if candidate in BROKER_API_VERSIONS else version


def make_producer(settings: KafkaSettings, **overrides: Any) -> KafkaProducer:
    # acks=all + retries: a request or result acknowledged to the caller is on the broker.
    config = {**client_config(settings), "acks": "all", "retries": 5, "linger_ms": 5, **overrides}
    return KafkaProducer(**config)


def make_consumer(
    settings: KafkaSettings,
    topics: Iterable[str],
    *,
    group_id: str | None,
    auto_offset_reset: str = "earliest",
    **overrides: Any,
) -> KafkaConsumer:
    # Offsets are committed by the caller once the work a message asked for is durable.
    config = {
        **client_config(settings),
        "group_id": group_id,
        "auto_offset_reset": auto_offset_reset,
        "enable_auto_commit": False,
        **overrides,
    }
    return KafkaConsumer(*topics, **config)


def message_key(request_id: str) -> bytes:
    return request_id.encode()


def publish(producer: KafkaProducer, topic: str, key: str, value: bytes, *, timeout_s: float = 30.0) -> None:
    """Publish one message and wait until the broker has it."""
    metadata = producer.send(topic, key=message_key(key), value=value).get(timeout=timeout_s)
    log.debug("published", extra={"topic": topic, "partition": metadata.partition, "offset": metadata.offset})


def consumer_lag(consumer: KafkaConsumer) -> dict[TopicPartition, int]:
    """Messages not yet consumed, per assigned partition (end offset minus position)."""
    assigned = consumer.assignment()
    if not assigned:
        return {}
    ends = consumer.end_offsets(list(assigned))
    return {tp: max(0, ends[tp] - consumer.position(tp)) for tp in assigned}


def poll_records(
    consumer: KafkaConsumer, *, timeout_s: float, poll_ms: int = 500
) -> Iterator[ConsumerRecord]:
    """Yield records as they arrive until ``timeout_s`` passes; the caller stops early by breaking.

    A plain iterator with ``consumer_timeout_ms`` gives up while a group is still joining (which takes
    seconds); polling against a deadline does not.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batches = consumer.poll(timeout_ms=poll_ms)
        for records in batches.values():
            yield from records


def publish_many(
    producer: KafkaProducer,
    topic: str,
    items: Iterable[tuple[str, bytes]],
    *,
    timeout_s: float = 30.0,
    on_sent: Callable[[str], None] | None = None,
) -> int:
    """Publish ``(key, value)`` pairs without waiting on each, then wait until the broker has every one.

    ``on_sent(key)`` is called for each message the broker acknowledged, in order. Raises the first send
    error (a ``KafkaError``); messages before it are on the broker.
    """
    futures = [(key, producer.send(topic, key=message_key(key), value=value)) for key, value in items]
    for key, future in futures:
        future.get(timeout=timeout_s)
        if on_sent is not None:
            on_sent(key)
    return len(futures)


def tail_consumer(settings: KafkaSettings, topic: str, **overrides: Any) -> KafkaConsumer:
    """A consumer outside any consumer group that reads ``topic`` from *now* on.

    Every partition that exists is assigned at its current end offset before this returns, so a message
    published after the call is never missed; ``follow_new_partitions`` picks up partitions (or the whole
    topic) created later, from their beginning.
    """
    config = {
        **client_config(settings),
        "group_id": None,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        **overrides,
    }
    consumer = KafkaConsumer(**config)
    follow_new_partitions(consumer, topic, from_end=True)
    return consumer


def follow_new_partitions(consumer: KafkaConsumer, topic: str, *, from_end: bool = False) -> int:
    """Assign the partitions of ``topic`` that the consumer does not read yet; returns how many were added.

    New partitions start at their end offset when ``from_end`` (the initial assignment), else at their
    beginning (they appeared after the caller started listening, so everything in them is new).
    """
    known = consumer.assignment()
    found = {TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)}
    new = sorted(found - known)
    if not new:
        return 0
    consumer.assign(sorted(known | set(new)))
    offsets = consumer.end_offsets(new) if from_end else consumer.beginning_offsets(new)
    for tp in new:
        consumer.seek(tp, offsets[tp])
    log.debug("following partitions", extra={"topic": topic, "partitions": [tp.partition for tp in new]})
    return len(new)


def commit_offsets(consumer: KafkaConsumer, offsets: Mapping[TopicPartition, int]) -> None:
    """Commit, for each partition, the offset of the next message to read (last handled + 1)."""
    if offsets:
        consumer.commit({tp: OffsetAndMetadata(offset, "", -1) for tp, offset in offsets.items()})


def group_progress(settings: KafkaSettings, group_id: str, topic: str) -> dict[int, tuple[int, int]]:
    """partition → (committed offset, end offset) of ``group_id`` on ``topic``, without touching the group.

    For tests and operators: the group has handled everything published so far when the two agree everywhere.
    The committed offsets come from the admin API, so asking involves no consumer of the group.
    """
    from kafka import KafkaAdminClient

    consumer = KafkaConsumer(**client_config(settings), group_id=None, enable_auto_commit=False)
    admin = KafkaAdminClient(**client_config(settings))
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        if not tps:
            return {}
        ends = consumer.end_offsets(tps)
        committed = admin.list_group_offsets({group_id: tps}).get(group_id, {})
        return {
            tp.partition: (max(0, committed[tp].offset) if tp in committed else 0, ends[tp]) for tp in tps
        }
    finally:
        consumer.close(autocommit=False)
        admin.close()
