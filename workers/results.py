"""Assembling a worker's ``GenerationResult`` and publishing it to the results topic.

Torch-free on purpose: the Celery tasks import it at module level, and its assembly rules are unit-tested
without a model. Every result carries the request's id and tenant, the planned donor and plan (``fallback``
says when the donor was not used after all), what was actually computed and the seconds of each phase.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from kafka import KafkaProducer
from kafka.errors import KafkaError

from producer import bus
from producer.contract import (
    DonorInfo,
    ErrorInfo,
    GenerationResult,
    PhaseTimings,
    ResultStatus,
    ReuseKind,
    VerificationReport,
)
from producer.orders import WorkOrder
from producer.parsing import salvage_identity, salvage_json
from producer.settings import KafkaSettings
from workers.failures import FailureCode
from workers.metrics import metrics

log = logging.getLogger(__name__)


class ResultNotPublished(RuntimeError):
    """The results topic did not take the result; the task retries publishing ``result`` (a bounded number of
    times), not the order. ``result`` is an attribute, not an argument: Celery rebuilds an exception from its
    message alone."""

    def __init__(self, message: str, result: GenerationResult | None = None) -> None:
        super().__init__(message)
        self.result = result


class PhaseClock:
    """Seconds per phase of one request; ``with clock.phase("fetch"): …`` adds to that phase."""

    PHASES = ("prepare", "fetch", "denoise", "decode", "upload")

    def __init__(self, started: float | None = None) -> None:
        # ``started``: the ``time.perf_counter()`` at which the worker took the order (the task's start), so the
        # clock can say how long the worker spent on it in all (``worker_s``).
        self.started = time.perf_counter() if started is None else started
        self.seconds: dict[str, float] = dict.fromkeys(self.PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds:
            raise KeyError(f"unknown phase {name!r}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        if name not in self.seconds:
            raise KeyError(f"unknown phase {name!r}")
        self.seconds[name] += max(0.0, seconds)

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Re-attribute ``seconds`` measured under ``src`` to ``dst`` (never below zero)."""
        moved = min(max(0.0, seconds), self.seconds[src])
        self.seconds[src] -= moved
        self.seconds[dst] += moved

    def timings(self, queue_s: float) -> PhaseTimings:
        return PhaseTimings(
            queue_s=max(0.0, queue_s),
            fetch_s=self.seconds["fetch"],
            denoise_s=self.seconds["denoise"],
            decode_s=self.seconds["decode"],
            upload_s=self.seconds["upload"],
            prepare_s=self.seconds["prepare"],
            worker_s=max(0.0, time.perf_counter() - self.started),
        )


def queue_seconds(accepted_at: datetime, started_at: datetime | None = None) -> float:
    """Seconds between the scheduler accepting a request and a worker starting it (0 if clocks disagree)."""
    started_at = started_at or datetime.now(UTC)
    return max(0.0, (started_at - accepted_at).total_seconds())


def done_result(
    order: WorkOrder,
    *,
    video_uri: str,
    trajectory_uri: str | None,
    trajectory_bytes: int,
    steps_computed: int,
    tokens_computed_fraction: float,
    fallback: str | None,
    timings: PhaseTimings,
    worker: str | None,
    donor_gone: bool = False,
    noise_seed: int | None,
    prompt_tokens_used: int | None = None,
    prompt_truncated: bool = False,
    verification: VerificationReport | None = None,
) -> GenerationResult:
    request = order.request
    reuse = reuse_kind(
        had_donor=order.donor is not None,
        steps_computed=steps_computed,
        steps_requested=request.num_steps,
        tokens_computed_fraction=tokens_computed_fraction,
    )
    return GenerationResult(
        request_id=request.request_id,
        tenant=request.tenant,
        status=ResultStatus.DONE,
        video_uri=video_uri,
        trajectory_uri=trajectory_uri,
        trajectory_bytes=trajectory_bytes if trajectory_uri else 0,
        donor=_donor_info(order),
        plan=order.plan,
        steps_computed=steps_computed,
        steps_requested=request.num_steps,
        tokens_computed_fraction=min(1.0, max(0.0, tokens_computed_fraction)),
        fallback=fallback,
        donor_gone=donor_gone,
        timings=timings,
        worker=worker,
        reuse=reuse,
        seed_honoured=seed_honoured(noise_seed, seed=request.seed),
        request_key=request.answer_key,
        prompt_tokens_used=prompt_tokens_used,
        prompt_truncated=prompt_truncated,
        verification=verification,
    )


def failed_result(
    request_id: str,
    code: FailureCode,
    message: str,
    *,
    order: WorkOrder | None = None,
    tenant: str = "default",
    timings: PhaseTimings | None = None,
    worker: str | None = None,
) -> GenerationResult:
    request = order.request if order is not None else None
    return GenerationResult(
        request_id=request_id,
        tenant=request.tenant if request is not None else tenant,
        status=ResultStatus.FAILED,
        error=ErrorInfo(code=code, message=message[:2000]),
        donor=_donor_info(order) if order is not None else None,
        plan=order.plan if order is not None else None,
        steps_requested=request.num_steps if request is not None else 0,
        timings=timings or PhaseTimings(),
        worker=worker,
        request_key=request.answer_key if request is not None else None,
    )


def reuse_kind(
    *, had_donor: bool, steps_computed: int, steps_requested: int, tokens_computed_fraction: float
) -> ReuseKind:
    """Stage 1 if steps were skipped outright, Stage 2 if only tokens were; none if everything was computed."""
    if not had_donor or tokens_computed_fraction >= 1.0 - 1e-6:
        return ReuseKind.NONE
    return ReuseKind.STAGE1 if steps_computed < steps_requested else ReuseKind.STAGE2


def seed_honoured(noise_seed: int | None, *, seed: int) -> bool:
    """Whether the video is the requested seed's own sample: not when it started from the noise of a donor made
    with another seed (a valid video for the prompt, but another sample), nor when that noise's seed is not
    known (``GenerationOutput.noise_seed``)."""
    return noise_seed == seed


def _donor_info(order: WorkOrder) -> DonorInfo | None:
    if order.donor is None:
        return None
    # The order names its donor by job id; the result by the donor's tenant and request id.
    return DonorInfo.of_job(order.donor.request_id, order.donor.similarity)


def salvage_ids(raw: str | bytes) -> tuple[str | None, str]:
    """(request id, tenant) of an order that failed validation, if its JSON still names them."""
    order = salvage_json(raw)
    return salvage_identity(order.get("request") if isinstance(order, dict) else None)


class ResultPublisher:
    """Publishes results keyed by request id; one Kafka producer per process, created on first use."""

    def __init__(self, settings: KafkaSettings, *, timeout_s: float = 30.0) -> None:
        self.settings = settings
        self.timeout_s = timeout_s
        self._producer: KafkaProducer | None = None
        self._making = threading.Lock()

    def publish(self, result: GenerationResult) -> None:
        try:
            with self._making:  # a threads pool's first results leave together: one producer, not one each
                if self._producer is None:
                    self._producer = bus.make_producer(self.settings)
                producer = self._producer
            started = time.perf_counter()
            bus.publish(
                producer,
                self.settings.kafka_results_topic,
                result.request_id,
                result.to_bytes(),
                timeout_s=self.timeout_s,
            )
            # The worker's own share of delivering a result (it waits for the broker's ack before taking the
            # next order); the hop on to the result's reader is not worker time (chorus bench serve: deliver).
            metrics().phase_seconds.labels(phase="publish").observe(time.perf_counter() - started)
        except KafkaError as exc:
            metrics().publish_errors.inc()
            raise ResultNotPublished(
                f"result of {result.request_id} not published to {self.settings.kafka_results_topic}: {exc!r}",
                result,
            ) from exc
        log.info(
            "result published",
            extra={
                "request_id": result.request_id,
                "status": str(result.status),
                "topic": self.settings.kafka_results_topic,
            },
        )

    def close(self) -> None:
        with self._making:  # not while a publish makes one
            producer, self._producer = self._producer, None
        if producer is not None:
            producer.close(timeout=5)
