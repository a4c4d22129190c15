"""The workers' configuration (environment prefix ``CHORUS_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from producer.catalog import CATALOG
from producer.settings import BrokerSettings, KafkaSettings


class WorkerSettings(KafkaSettings, BrokerSettings):
    # The Celery broker, result backend and task time limits are BrokerSettings' (shared with the scheduler).
    # The object store's URL (http://minio:9000, https://s3.example.com), whose scheme decides TLS; a bare
    # host:port is accepted too, with TLS from s3_secure.
    s3_endpoint: str = "http://127.0.0.1:9000"
    s3_secure: bool = False
    s3_region: str = "us-east-1"
    s3_bucket: str = "chorus"
    s3_access_key: SecretStr | None = None
    s3_secret_key: SecretStr | None = None
    # Seconds one object-store call may take (connect at most 5 s), and how long a failed write is retried with
    # backoff before the request fails (stay well inside task_soft_time_limit_s).
    s3_timeout_s: float = Field(default=30.0, gt=0, le=600)
    s3_write_retry_s: float = Field(default=60.0, ge=0, le=600)
    metrics_port: int = Field(default=9102, ge=0, le=65535)
    # Address the /metrics endpoint listens on: every interface by default (Prometheus scrapes pods and hosts);
    # the local stack sets loopback.
    metrics_bind_address: str = Field(default="0.0.0.0", min_length=1)
    device: str = "cpu"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # Local diffusers directory of Wan2.1-T2V-1.3B; weights are never downloaded at run time.
    wan21_dir: Path | None = None
    # Overrides the committed toy weights (a directory with config.json and model.safetensors).
    toy_weights_dir: Path | None = None
    video_format: Literal["mp4", "gif"] = "mp4"
    # Which random weights stand behind ``tiny-random-wan``: its own tiny config, or ``wan-width`` (Wan2.1-1.3B
    # width, 2 blocks: ``workers.engine.registry.MID_CONFIG``), so a benchmark's steps cost what a real model's
    # do relative to the worker's other work (``chorus bench serve --model mid``). A benchmark knob: every worker
    # of a deployment must agree, and trajectories of the two are incompatible (their weights ids differ).
    random_wan_width: Literal["tiny", "wan-width"] = "tiny"
    # Encoded prompts a loaded model keeps (LRU): a prompt seen again, or a donor check's negative prompt, skips
    # the text encoder (23.7 ms -> 0.03 ms per request on toy2, chorus bench engine). 0 turns the cache off.
    prompt_cache_size: int = Field(default=64, ge=0, le=100_000)
    # The transformer's prompt-only work (text projection, every block's cross-attention K/V) kept per prompt for
    # as many prompts as the prompt cache, within this many MiB: the negative prompt of every CFG request and a
    # repeated prompt skip it (mid model: a Stage-1 hit computing one step 0.40 -> 0.22 s). 0 turns it off.
    text_cache_mb: int = Field(default=1024, ge=0, le=1_000_000)
    # Torch threads per model on a CPU worker (JSON in CHORUS_TORCH_THREADS, e.g. {"toy": 1}); a model not
    # named runs on torch's default, one per core. The toy model's steps are too small for a second thread,
    # which mostly spins waiting and takes the core from the scheduler beside it (chorus bench serve --quick,
    # toy: 5.7 -> 8.2 requests/s with reuse, worker CPU per request 0.22 -> 0.10 s). torch's thread count is
    # per process: under `chorus worker --pool threads` the pool's threads share it, and the last order to start
    # sets it for all of them (the prefork pool, the default, runs one order per process).
    torch_threads: dict[str, Annotated[int, Field(ge=1, le=256)]] = Field(default_factory=lambda: {"toy": 1})

    # Seconds a starting worker tries to reach its broker before it stops with one line (Celery alone retries
    # forever, a log line a second); a supervisor (compose's restart, Kubernetes) starts it again.
    broker_connect_timeout_s: float = Field(default=30.0, gt=0, le=3600)

    # --- Celery worker -------------------------------------------------------------------------------
    # Models whose queues this worker consumes (comma-separated in CHORUS_WORKER_MODELS); empty: every model
    # in the catalog that can load here (``chorus worker`` leaves out one whose device or directory is missing).
    # A worker process loads each model it serves once, on its first order for it.
    worker_models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Prefork pool size; the autoscale bounds are what `chorus worker --autoscale` uses by default.
    worker_concurrency: int = Field(default=1, ge=1, le=256)
    worker_autoscale_min: int = Field(default=1, ge=0, le=256)
    worker_autoscale_max: int = Field(default=2, ge=1, le=256)
    # Deliveries of one order (worker lost, broker redelivery) after which it is answered `failed` rather
    # than run again, so a request that kills its worker cannot loop forever.
    task_max_attempts: int = Field(default=3, ge=1, le=100)
    # How often a running worker announces the models it serves (the scheduler rejects orders for a model no live
    # worker has announced within its CHORUS_WORKER_PRESENCE_TTL_S).
    worker_presence_s: float = Field(default=5.0, gt=0, le=300)
    # How often a running order writes its heartbeat into the task state (the scheduler's watchdog reads it).
    worker_heartbeat_s: float = Field(default=5.0, gt=0, le=300)
    # Tries to publish again a result Kafka refused, from the task, 2, 4, 8, then 10 s apart (the order does not run
    # again; the tries, up to 30 s each, come out of the task's time limits); after the last the task fails, and
    # the scheduler's watchdog answers the request.
    result_publish_retries: int = Field(default=2, ge=0, le=8)

    # --- Trajectories ---------------------------------------------------------------------------------
    # How trajectories are stored in S3: float16 halves the bytes; decoding always yields float32.
    trajectory_dtype: Literal["float32", "float16"] = "float32"
    # A trajectory up to this size is stored as one object once the engine is done (an object costs a request
    # however small); a larger one step by step while the engine runs, which also lets a group leader's followers
    # start before it ends. 0 (the default): always step by step. On the toy model in `chorus bench serve`,
    # packing cut the donor fetch of a reuse pass from 11 to 5 ms per request but the upload, no longer overlapped
    # with the denoising, rose by about as much: off until a benchmark shows it pays.
    trajectory_pack_max_bytes: int = Field(default=0, ge=0)
    # How often a follower polls S3 for a step its leader has not uploaded yet.
    follower_poll_s: float = Field(default=0.2, gt=0, le=60)
    # Publish the result once the video and the trajectory's header are stored, and let the rest of the
    # trajectory's upload (what did not stream while the engine ran) end after it: the request does not wait for
    # its donor data. A worker reading a finished donor waits up to ``donor_upload_grace_s`` for an object still
    # being uploaded before it calls the donor gone (and has it evicted).
    result_before_trajectory: bool = True
    donor_upload_grace_s: float = Field(default=2.0, ge=0, le=60)

    @field_validator("worker_models", mode="before")
    @classmethod
    def _split_models(cls, value: object) -> object:
        if isinstance(value, str):
            return [m.strip() for m in value.split(",") if m.strip()]
        return value

    @field_validator("worker_models")
    @classmethod
    def _known_models(cls, value: list[str]) -> list[str]:
        unknown = [m for m in value if m not in CATALOG]
        if unknown:
            raise ValueError(f"unknown model(s) {unknown}; known: {sorted(CATALOG)}")
        return value

    @field_validator("torch_threads")
    @classmethod
    def _threads_of_known_models(cls, value: dict[str, int]) -> dict[str, int]:
        unknown = sorted(m for m in value if m not in CATALOG)
        if unknown:
            raise ValueError(
                f"CHORUS_TORCH_THREADS names unknown model(s) {unknown}; known: {sorted(CATALOG)}"
            )
        return value

    @field_validator("s3_endpoint")
    @classmethod
    def _endpoint_form(cls, value: str) -> str:
        scheme, address = _split_endpoint(value)
        if scheme not in (None, "http", "https"):
            raise ValueError(f"the scheme must be http or https, not {scheme!r}")
        if not address or "/" in address:
            raise ValueError("must be a URL such as http://minio:9000 (no path) or a host:port")
        return value

    @model_validator(mode="after")
    def _scheme_agrees_with_secure(self) -> Self:
        scheme, _ = _split_endpoint(self.s3_endpoint)
        if (
            scheme is not None
            and "s3_secure" in self.model_fields_set
            and self.s3_secure != (scheme == "https")
        ):
            raise ValueError(
                f"CHORUS_S3_SECURE={self.s3_secure} contradicts the {scheme}:// of CHORUS_S3_ENDPOINT (the scheme "
                "decides TLS; leave CHORUS_S3_SECURE unset)"
            )
        return self

    @property
    def s3_address(self) -> str:
        """host:port of the object store (what the minio client takes)."""
        return _split_endpoint(self.s3_endpoint)[1]

    @property
    def s3_tls(self) -> bool:
        """Whether the object store is spoken to over TLS: the endpoint's scheme, else ``s3_secure``."""
        scheme, _ = _split_endpoint(self.s3_endpoint)
        return self.s3_secure if scheme is None else scheme == "https"

    @property
    def s3_url(self) -> str:
        """The object store's URL with its scheme (for boto3's ``endpoint_url``, awscli's ``--endpoint-url``)."""
        return f"{'https' if self.s3_tls else 'http'}://{self.s3_address}"

    @model_validator(mode="after")
    def _consistent_limits(self) -> Self:
        if self.worker_autoscale_min > self.worker_autoscale_max:
            raise ValueError("CHORUS_WORKER_AUTOSCALE_MIN must not exceed CHORUS_WORKER_AUTOSCALE_MAX")
        return self

    @property
    def served_models(self) -> list[str]:
        return list(self.worker_models) or sorted(CATALOG)


def _split_endpoint(value: str) -> tuple[str | None, str]:
    """(scheme or None, host:port) of an endpoint given as a URL or a bare host:port; a trailing / is dropped."""
    scheme, sep, rest = value.strip().partition("://")
    if not sep:
        return None, value.strip().rstrip("/")
    return scheme.lower(), rest.rstrip("/")
