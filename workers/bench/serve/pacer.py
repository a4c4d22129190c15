"""Publishing at a fixed rate from a process of its own, for the scheduler benchmark's latency pass.

kafka-python is pure Python: a producer in the scheduler's process needs the GIL for every step of every send,
and waits for it behind the scheduler's own threads (a switch interval, 5 ms, at a time). Measured that way, the
added latency was mostly the benchmark's producer queueing for the interpreter (p50 40-570 ms between runs at
100 requests/s). In production requests come from other processes and machines; so does this pacer's traffic.
Send times are ``time.monotonic()`` readings, which Linux's monotonic clock makes comparable across processes.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from chorus_sched.settings import SchedulerSettings
from producer import bus
from producer.contract import GenerationRequest


def publish_paced(
    settings: SchedulerSettings, topic: str, messages: Sequence[tuple[bytes, bytes]], rate: float
) -> tuple[dict[bytes, float], float]:
    """Send ``(key, value)`` pairs to ``topic`` at ``rate`` per second from a child process; (key → monotonic
    time it was handed to the producer, seconds the sending took). A value that is a request gets its
    ``submitted_at`` stamped when it is sent."""
    context = multiprocessing.get_context("spawn")  # no fork of a process with Kafka and torch threads
    # The settings object itself (pickled): a JSON dump would mask its secrets.
    args = (settings, topic, list(messages), rate, _all_cores())
    with context.Pool(1) as pool:
        pending = pool.apply_async(_publish, args)
        result: tuple[dict[bytes, float], float] = pending.get(timeout=len(messages) / rate + 120)
    return result


def _all_cores() -> list[int] | None:
    """Every core of the machine, for the child to run on even when the benchmark pinned itself (``--core``)."""
    return list(range(os.cpu_count() or 1)) if hasattr(os, "sched_setaffinity") else None


def _publish(
    settings: SchedulerSettings,
    topic: str,
    messages: list[tuple[bytes, bytes]],
    rate: float,
    cores: list[int] | None,
) -> tuple[dict[bytes, float], float]:
    if cores is not None:
        os.sched_setaffinity(0, cores)  # not the scheduler's pinned core: it would compete with it
    producer = bus.make_producer(settings, linger_ms=0)
    sent: dict[bytes, float] = {}
    start = time.monotonic()
    try:
        for i, (key, value) in enumerate(messages):
            time.sleep(max(0.0, start + i / rate - time.monotonic()))
            sent[key] = time.monotonic()
            producer.send(topic, key=key, value=_stamped(value))
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=5)
    return sent, time.monotonic() - start


def _stamped(value: bytes) -> bytes:
    try:
        request = GenerationRequest.model_validate_json(value)
    except ValueError:
        return value
    return request.model_copy(update={"submitted_at": datetime.now(UTC)}).to_bytes()
