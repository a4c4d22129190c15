"""The Kafka adapter: the only module that talks to Kafka (kafka-python).

Producers, the scheduler and the workers all publish and consume through these helpers, so topic names,
keys and client settings are decided in one place. Messages are keyed by request id, which puts every
message about one request (its submission, its result) in one partition, in order.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from kafka import KafkaConsumer, KafkaProducer
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaTimeoutError
from kafka.structs import OffsetAndMetadata, TopicPartition

from producer.settings import KafkaSettings

log = logging.getLogger(__name__)


def client_config(settings: KafkaSettings) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap.split(","),
        "security_protocol": settings.kafka_security_protocol,
        "bootstrap_timeout_ms": settings.kafka_bootstrap_timeout_ms,
    }
    if settings.kafka_api_version_tuple is not None:
        config["api_version"] = known_api_version(settings.kafka_api_version_tuple)
    if settings.kafka_sasl_mechanism:
        config["sasl_mechanism"] = settings.kafka_sasl_mechanism
        config["sasl_plain_username"] = settings.kafka_sasl_username
        if settings.kafka_sasl_password is not None:
            config["sasl_plain_password"] = settings.kafka_sasl_password.get_secret_value()
    return config


class BrokerUnreachable(ConnectionError):
    """No bootstrap server of ``CHORUS_KAFKA_BOOTSTRAP`` accepted a connection."""

    def __init__(self, bootstrap: str, reasons: list[str]) -> None:
        self.bootstrap = bootstrap
        self.reasons = reasons
        why = "; ".join(reasons)
        super().__init__(
            f"cannot reach the Kafka broker at {bootstrap} (CHORUS_KAFKA_BOOTSTRAP)"
            + (f": {why}" if why else "")
        )


def _host_port(server: str) -> tuple[str, int]:
    address = server.strip().split("://", 1)[-1]
    if address.startswith("["):  # [::1]:9092
        host, _, rest = address[1:].partition("]")
        return host, int(rest.lstrip(":") or 9092)
    host, sep, port = address.rpartition(":")
    return (host, int(port)) if sep and port.isdigit() else (address, 9092)


def check_reachable(settings: KafkaSettings, *, connect_timeout_s: float = 3.0) -> None:
    """Return once the cluster answered; ``BrokerUnreachable`` otherwise, within seconds.

    First a TCP connection to some bootstrap server (``connect_timeout_s``: nothing listening is said at once),
    then a client's first contact with the cluster (``kafka_bootstrap_timeout_ms``: something listens but no
    Kafka answers). kafka-python's producer alone would wait its ``max_block_ms`` (a minute), logging every retry.
    """
    reasons: list[str] = []
    deadline = time.monotonic() + connect_timeout_s
    for server in [s for s in settings.kafka_bootstrap.split(",") if s.strip()]:
        try:
            host, port = _host_port(server)
            with socket.create_connection((host, port), timeout=max(0.2, deadline - time.monotonic())):
                break
        except (OSError, ValueError) as exc:
            reasons.append(f"{server.strip()}: {getattr(exc, 'strerror', None) or exc}")
    else:
        raise BrokerUnreachable(settings.kafka_bootstrap, reasons)
    probe: KafkaConsumer | None = None
    try:
        probe = KafkaConsumer(**client_config(settings), group_id=None, enable_auto_commit=False)
        _bootstrap(probe, settings)
    except KafkaTimeoutError:
        raise BrokerUnreachable(
            settings.kafka_bootstrap, [f"no Kafka answer within {settings.kafka_bootstrap_timeout_ms} ms"]
        ) from None
    finally:
        if probe is not None:
            probe.close(autocommit=False)


def is_bootstrap_failure(exc: BaseException) -> bool:
    """Whether a kafka-python error says that no broker could be reached at all."""
    return isinstance(exc, KafkaTimeoutError) and "bootstrap" in str(exc).lower()


def _bootstrap(client: KafkaConsumer, settings: KafkaSettings) -> None:
    """Contact the cluster within ``kafka_bootstrap_timeout_ms`` (KafkaTimeoutError "Unable to bootstrap").

    A consumer told its ``api_version`` does not contact the cluster when made: it starts a bootstrap with no
    deadline, and its first metadata request (``partitions_for_topic``) waits for it without limit. This waits
    for that bootstrap with one (kafka-python 3's connection manager and loop; skipped where they differ).
    """
    manager, net = getattr(client, "_manager", None), getattr(client, "_net", None)
    if manager is None or net is None or getattr(manager, "bootstrapped", True):
        return
    timeout_ms = settings.kafka_bootstrap_timeout_ms
    try:
        net.run(manager.wait_for, manager.bootstrap_async(timeout_ms), timeout_ms)
    except KafkaTimeoutError:
        raise KafkaTimeoutError(
            f"Unable to bootstrap from {settings.kafka_bootstrap} within {timeout_ms} ms"
        ) from None


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
        "fetch_max_wait_ms": settings.kafka_fetch_max_wait_ms,
        **overrides,
    }
    return KafkaConsumer(*topics, **config)


def message_key(request_id: str) -> bytes:
    return request_id.encode()


def publish(producer: KafkaProducer, topic: str, key: str, value: bytes, *, timeout_s: float = 30.0) -> None:
    """Publish one message and wait until the broker has it.

    The message is sent at once (``flush``), not after the producer's ``linger_ms``: a caller that waits for its
    one message gains nothing from lingering for others (a worker's result waited 5 ms for none)."""
    future = producer.send(topic, key=message_key(key), value=value)
    producer.flush(timeout=timeout_s)
    metadata = future.get(timeout=timeout_s)
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
        "fetch_max_wait_ms": settings.kafka_fetch_max_wait_ms,
        **overrides,
    }
    consumer = KafkaConsumer(**config)
    try:
        _bootstrap(consumer, settings)
    except BaseException:
        consumer.close()
        raise
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
