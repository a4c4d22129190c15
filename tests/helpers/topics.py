"""Reading a Kafka topic whole, outside any consumer group, for tests that count what was published.

Partitions are assigned explicitly and read to the end offsets taken at the start: a group-less consumer that
*subscribes* learns the topic's partitions only from a metadata refresh, and one that missed them waited a
full test timeout and read nothing (kafka-python refreshes every 5 minutes by default).
"""

from __future__ import annotations

import time
from typing import Any

from kafka import KafkaConsumer
from kafka.structs import TopicPartition

from producer import bus


def read_topic(settings: Any, topic: str, timeout_s: float = 60.0) -> list[tuple[str | None, bytes]]:
    """(key, value) of every message on ``topic`` from the beginning, up to its end offsets when the partitions
    were assigned (a poll may bring a few more), in partition order."""
    consumer = KafkaConsumer(**bus.client_config(settings), group_id=None, enable_auto_commit=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not (partitions := consumer.partitions_for_topic(topic)):
            assert time.monotonic() < deadline, f"topic {topic} has no partitions"
            time.sleep(0.2)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps, timeout_ms=int(timeout_s * 1000))
        out: list[tuple[str | None, bytes]] = []
        while any(consumer.position(tp, timeout_ms=5000) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"could not read {topic} to its end"
            for records in consumer.poll(timeout_ms=500).values():
                out.extend((r.key.decode() if r.key is not None else None, r.value) for r in records)
        return out
    finally:
        consumer.close(autocommit=False)
