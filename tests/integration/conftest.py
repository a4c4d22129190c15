"""Fixtures of the scheduler's integration tests (tests/helpers/scheduler_harness.py has the harness)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from chorus_sched.settings import SchedulerSettings
from producer.settings import KafkaSettings
from tests.helpers.scheduler_harness import Harness, celery_client


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
