"""What a local stack runs (``StackOptions``) and the environment its services get: the production settings
(``CHORUS_*``) pointed at the stand-ins and the state directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from producer.catalog import CATALOG
from producer.local.processes import free_port

# The mock cluster speaks ApiVersions ≤ v2; kafka-python must be told the version (see producer/settings.py),
# spelled as kafka-python's table does (2.1, not 2.1.0: see producer.bus.known_api_version).
MOCK_KAFKA_API_VERSION = "2.1"


class StackError(RuntimeError):
    """The stack could not start (or a process of it died)."""


class StackOptions(BaseModel):
    """What to run. Ports set to 0 are picked free on loopback when the stack starts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state_dir: Path = Path(".chorus")
    models: list[str] = Field(default_factory=lambda: ["toy"], min_length=1)
    schedulers: int = Field(default=1, ge=1, le=16)
    workers: int = Field(default=1, ge=0, le=16)
    worker_concurrency: int = Field(default=1, ge=1, le=64)
    embedder: Literal["minilm", "hashing"] = "minilm"
    # Metrics port of the first scheduler / worker process; the next ones take the following ports.
    scheduler_metrics_port: int = Field(default=0, ge=0, le=65535)
    worker_metrics_port: int = Field(default=0, ge=0, le=65535)
    # Load the models in every worker process when it starts (readiness then includes the model load).
    preload: bool = True
    s3_bucket: str = "chorus"
    # Keep S3 objects across runs in state_dir/s3 (restored on start, written on stop).
    persist_s3: bool = True
    # Added to (and overriding) every service's environment, e.g. {"CHORUS_FOLLOWER_WAIT_S": "10"}.
    extra_env: dict[str, str] = Field(default_factory=dict)
    ready_timeout_s: float = Field(default=300.0, gt=0)
    stop_timeout_s: float = Field(default=60.0, gt=0)

    @field_validator("models")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        unknown = [m for m in value if m not in CATALOG]
        if unknown:
            raise ValueError(f"unknown model(s) {unknown}; known: {sorted(CATALOG)}")
        return list(dict.fromkeys(value))

    @model_validator(mode="after")
    def _ports_apart(self) -> Self:
        s, w = self.scheduler_metrics_port, self.worker_metrics_port
        if s and w:
            sched = set(range(s, s + self.schedulers))
            if sched & set(range(w, w + self.workers)):
                raise ValueError("scheduler and worker metrics port ranges overlap")
        return self


def service_env(
    opts: StackOptions,
    *,
    state_dir: Path,
    kafka_address: str,
    s3_address: str,
    s3_access_key: str,
    s3_secret_key: str,
) -> dict[str, str]:
    """The environment of every service of the stack (and of its clients)."""
    env = dict(os.environ)
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "CHORUS_STATE_DIR": str(state_dir),
            "CHORUS_LOG_FORMAT": "json",
            "CHORUS_KAFKA_BOOTSTRAP": kafka_address,
            "CHORUS_KAFKA_API_VERSION": MOCK_KAFKA_API_VERSION,
            "CHORUS_S3_ENDPOINT": f"http://{s3_address}",  # a URL, as boto3 and awscli take it
            "CHORUS_S3_BUCKET": opts.s3_bucket,
            "CHORUS_S3_ACCESS_KEY": s3_access_key,
            "CHORUS_S3_SECRET_KEY": s3_secret_key,
            # The embedded defaults, whatever the calling environment says.
            "CHORUS_BROKER_URL": "",
            "CHORUS_RESULT_BACKEND": "",
            "CHORUS_REDIS_URL": "",
            "CHORUS_QDRANT_URL": "",
            "CHORUS_QDRANT_PATH": "",
            "CHORUS_EMBEDDER": opts.embedder,
            "CHORUS_WORKER_MODELS": ",".join(opts.models),
            # Every process' /metrics on loopback only, like the stand-ins.
            "CHORUS_METRICS_BIND_ADDRESS": "127.0.0.1",
            # Consumers see the (pre-created) topics' partitions within a second of joining.
            "CHORUS_KAFKA_METADATA_MAX_AGE_MS": "1000",
        }
    )
    env.update(opts.extra_env)
    return env


def metrics_ports(opts: StackOptions) -> dict[str, int]:
    """The metrics port of each process (``scheduler-0``, ``worker-0``, …): from the options, or free ones."""
    ports: dict[str, int] = {}
    taken: set[int] = set()
    for role, count, first in (
        ("scheduler", opts.schedulers, opts.scheduler_metrics_port),
        ("worker", opts.workers, opts.worker_metrics_port),
    ):
        for i in range(count):
            port = first + i if first else free_port(taken)
            taken.add(port)
            ports[f"{role}-{i}"] = port
    return ports
