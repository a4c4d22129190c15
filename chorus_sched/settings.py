"""The scheduler's configuration (environment prefix ``CHORUS_``)."""

from __future__ import annotations

from pydantic import Field

from producer.settings import KafkaSettings


class SchedulerSettings(KafkaSettings):
    kafka_group_id: str = "chorus-scheduler"
    # Celery broker the scheduler dispatches to. Empty means the embedded filesystem transport under state_dir.
    broker_url: str = ""
    # Idempotency ledger and group coordination. Empty means an embedded store under state_dir.
    redis_url: str = ""
    # Qdrant server URL; empty means Qdrant local mode at qdrant_path (default: state_dir/qdrant).
    qdrant_url: str = ""
    qdrant_path: str = ""
    qdrant_api_key: str | None = None
    qdrant_collection: str = "chorus_donors"
    metrics_port: int = Field(default=9101, ge=0, le=65535)
    cross_tenant_reuse: bool = False
