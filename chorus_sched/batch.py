"""What the scheduler's parts share: the message they read, the outcome of a batch, the stats they count.

``Intake`` (requests), ``Feedback`` (results) and ``CacheMaintenance`` each take a poll's messages or a timer tick
and count into one ``SchedulerStats``; a batch handler reports, per partition, the offsets to commit and the first
offset to read again (``BatchOutcome``, built by ``Progress``). ``transient`` tells a failure of a backing service,
which a later retry may cure, from a fault of the message itself.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from typing import Protocol

from kafka.structs import TopicPartition

from chorus_sched.ledger import LedgerError


class Message(Protocol):
    """What the scheduler reads of a Kafka record (``kafka.consumer.fetcher.ConsumerRecord`` has it)."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def key(self) -> bytes | None: ...

    @property
    def value(self) -> bytes: ...


class Publisher(Protocol):
    def __call__(self, topic: str, key: str, value: bytes) -> None: ...


@dataclass
class SchedulerStats:
    requests: int = 0
    dead_lettered: int = 0
    duplicates: int = 0  # the claimed message read again: skipped
    resent: int = 0  # a new message with a taken id: answered (chorus_sched.resend)
    busy: int = 0
    dispatched: int = 0
    leaders: int = 0
    followers: int = 0
    with_donor: int = 0
    full: int = 0
    cross_tenant_blocked: int = 0
    index_unavailable: int = 0
    exact_hits: int = 0
    retries: int = 0
    results: int = 0
    donors_indexed: int = 0
    hits: int = 0
    evicted: int = 0
    evict_orders: int = 0


@dataclass
class BatchOutcome:
    """Offsets to commit (next to read) and partitions to rewind (first offset to handle again)."""

    commit: dict[TopicPartition, int] = field(default_factory=dict)
    retry: dict[TopicPartition, int] = field(default_factory=dict)


class Progress:
    def __init__(self) -> None:
        self._next: dict[TopicPartition, int] = {}
        self._first: dict[TopicPartition, int] = {}
        self._failed: dict[TopicPartition, int] = {}

    def seen(self, m: Message) -> None:
        tp = TopicPartition(m.topic, m.partition)
        self._next[tp] = max(self._next.get(tp, 0), m.offset + 1)
        self._first[tp] = min(self._first.get(tp, m.offset), m.offset)

    def failed(self, m: Message) -> None:
        tp = TopicPartition(m.topic, m.partition)
        self._failed[tp] = min(self._failed.get(tp, m.offset), m.offset)

    def outcome(self) -> BatchOutcome:
        out = BatchOutcome(retry=dict(self._failed))
        for tp, nxt in self._next.items():
            upto = self._failed.get(tp, nxt)
            if upto > self._first[tp]:
                out.commit[tp] = upto
        return out


def transient(exc: BaseException) -> bool:
    """Failures of a backing service that retrying later may cure (never a reason to drop a request)."""
    import kafka.errors
    import kombu.exceptions
    import redis.exceptions

    transient: tuple[type[BaseException], ...] = (
        OSError,
        TimeoutError,
        LedgerError,
        sqlite3.OperationalError,
        kombu.exceptions.OperationalError,
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        kafka.errors.KafkaError,
    )
    try:
        from qdrant_client.http.exceptions import ResponseHandlingException

        transient += (ResponseHandlingException,)
    except ImportError:  # pragma: no cover - depends on the qdrant-client version
        pass
    return isinstance(exc, transient)


def finish(progress: Progress, stats: SchedulerStats) -> BatchOutcome:
    """The batch's outcome, its partitions to rewind counted as retries."""
    outcome = progress.outcome()
    stats.retries += len(outcome.retry)
    return outcome
