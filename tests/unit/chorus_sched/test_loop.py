"""The scheduler's consumer loop leaves the group and rejoins as a new member when its polls keep failing.

The failure is one seen on the Kafka-protocol test broker under load: a member whose SyncGroup the coordinator no
longer expects gets ``InvalidRequestError`` on every poll and never recovers by itself. What a consumer object
does is outside this test; the loop's reaction to a failing one is what is checked here, with consumers the loop
builds through ``bus.make_consumer``.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
from kafka.errors import InvalidRequestError

from chorus_sched import loop as consumer_loop
from chorus_sched.batch import BatchOutcome
from chorus_sched.loop import REJOIN_AFTER_POLL_FAILURES, ConsumerLoop
from chorus_sched.settings import SchedulerSettings


class StuckThenHealthy:
    """The first consumer fails every poll; the ones built after it poll fine."""

    built: ClassVar[list[StuckThenHealthy]] = []

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.stuck = not StuckThenHealthy.built
        self.polls = 0
        self.closed = False
        StuckThenHealthy.built.append(self)

    def subscribe(self, topics: list[str], listener: Any = None) -> None:
        self.topics = topics

    def poll(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, list[Any]]:
        self.polls += 1
        if self.stuck:
            if self.polls > 4 * REJOIN_AFTER_POLL_FAILURES:
                self.stop.set()  # never replaced: end the loop so the test fails instead of hanging
            raise InvalidRequestError()
        if self.polls >= 3:
            self.stop.set()
        return {}

    def end_offsets(self, partitions: Any) -> dict[Any, int]:
        return {}

    def assignment(self) -> set[Any]:
        return set()

    def close(self, autocommit: bool = True) -> None:
        self.closed = True


def test_a_consumer_whose_polls_keep_failing_is_replaced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    stop = threading.Event()
    StuckThenHealthy.built = []
    monkeypatch.setattr(consumer_loop.bus, "make_consumer", lambda *a, **k: StuckThenHealthy(stop))
    settings = SchedulerSettings(state_dir=tmp_path, retry_backoff_max_s=0.01, poll_timeout_ms=1)
    loop = ConsumerLoop(
        settings,
        name="requests",
        topic="chorus.requests",
        group_id="g",
        client_id="c",
        handle=lambda batch: BatchOutcome(),
        stop=stop,
    )
    loop._run()
    first, second = StuckThenHealthy.built
    assert first.polls == REJOIN_AFTER_POLL_FAILURES and first.closed
    assert second.polls == 3 and second.closed and second.topics == ["chorus.requests"]
