"""The workers' configuration (environment prefix ``CHORUS_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from producer.settings import KafkaSettings


class WorkerSettings(KafkaSettings):
    # Celery broker and result backend. Empty means the embedded filesystem transport under state_dir.
    broker_url: str = ""
    result_backend: str = ""
    s3_endpoint: str = "127.0.0.1:9000"
    s3_secure: bool = False
    s3_region: str = "us-east-1"
    s3_bucket: str = "chorus"
    s3_access_key: SecretStr | None = None
    s3_secret_key: SecretStr | None = None
    metrics_port: int = Field(default=9102, ge=0, le=65535)
    device: str = "cpu"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # Local diffusers directory of Wan2.1-T2V-1.3B; weights are never downloaded at run time.
    wan21_dir: Path | None = None
    # Overrides the committed toy weights (a directory with config.json and model.safetensors).
    toy_weights_dir: Path | None = None
    video_format: Literal["mp4", "gif"] = "mp4"
