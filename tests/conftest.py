"""Session fixtures that start real backing services on loopback and tear them down.

Kafka: librdkafka's mock cluster (a real Kafka-protocol broker) in a helper process; S3: moto's server in a
helper process, spoken to with the minio client; Redis: the machine's server (started if it is down);
Qdrant: local mode in a temporary directory. All are started through the same code the demo uses.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from producer.local.standins import EmbeddedService, start_service
from producer.settings import KafkaSettings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REDIS_URL = os.environ.get("CHORUS_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_START = [
    "redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "-::1", "--port", "6379", "--save", "",
    "--appendonly", "no", "--dir", "/var/lib/redis", "--logfile", "/var/log/redis/ci.log",
]  # fmt: skip


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[EmbeddedService]:
    service = start_service("kafka")
    yield service
    service.stop()


@pytest.fixture
def kafka_settings(kafka_broker: EmbeddedService) -> KafkaSettings:
    """Kafka settings for the test broker, with topics unique to the test so tests never see each other's data."""
    suffix = uuid.uuid4().hex[:8]
    return KafkaSettings(
        kafka_bootstrap=kafka_broker.address,
        kafka_api_version="2.1.0",
        kafka_requests_topic=f"requests-{suffix}",
        kafka_results_topic=f"results-{suffix}",
        kafka_dead_letter_topic=f"dlq-{suffix}",
    )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[EmbeddedService]:
    service = start_service("s3")
    yield service
    service.stop()


def _redis_up(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def redis_url() -> str:
    if not _redis_up(REDIS_URL):
        if shutil.which("redis-server") is None:
            pytest.fail("Redis is not running and redis-server is not installed")
        Path("/var/lib/redis").mkdir(parents=True, exist_ok=True)
        Path("/var/log/redis").mkdir(parents=True, exist_ok=True)
        subprocess.run(REDIS_START, check=True)
        deadline = time.monotonic() + 10
        while not _redis_up(REDIS_URL):
            if time.monotonic() > deadline:
                pytest.fail("Redis did not come up")
            time.sleep(0.2)
    return REDIS_URL


@pytest.fixture
def qdrant_path(tmp_path: Path) -> Path:
    return tmp_path / "qdrant"
