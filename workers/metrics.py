"""The workers' Prometheus metrics, prometheus-client's multiprocess mode, and the ``/metrics`` endpoint.

A ``chorus worker`` is one Celery main process and a prefork pool of child processes that run the orders. Each
child counts in its own memory-mapped files, and the main process serves the sum of all of them:

1. ``chorus worker`` calls ``serve`` before the pool forks (and before any metric exists): ``enable_multiprocess``
   points ``PROMETHEUS_MULTIPROC_DIR`` at a folder (the variable's value if set, else a fresh private temporary
   folder, removed at exit), deletes the ``*.db`` files a previous run left there, and makes prometheus-client
   create every value from now on in a per-process file (``<type>_<pid>.db``);
2. the HTTP server runs in the main process and answers each scrape with a ``MultiProcessCollector`` over that
   folder: counters and histograms are summed over every process that ever wrote (so a child that exited, or
   was killed, loses none of its counts), gauges are combined as each gauge's ``multiprocess_mode`` says;
3. a child that exits normally calls ``mark_process_dead`` for itself (Celery's ``worker_process_shutdown``),
   and at every scrape the main process does the same for any child whose pid is gone (killed, crashed), so
   ``livesum`` gauges (busy slots, pool slots, loaded models) drop a dead child's share at once.

Outside ``chorus worker`` (tests, a runner used in-process) the same metrics live in the default registry.

=============================================================  =========  =======================================
metric                                                         type       where
=============================================================  =========  =======================================
``chorus_worker_requests_total{model,role,status,reuse}``      counter    each result published (runner)
``chorus_worker_failures_total{code}``                         counter    each ``failed`` result, by error code
``chorus_worker_phase_duration_seconds{phase}``                histogram  queue, fetch, denoise, decode, upload,
                                                                          publish (result → broker ack)
``chorus_worker_denoise_stage_duration_seconds{stage}``        histogram  denoising wall time of stages 1, 2, 3
``chorus_request_duration_seconds{status}``                    histogram  submission → result published
``chorus_worker_steps_requested_total{model}``                 counter    denoising steps asked for (done)
``chorus_worker_steps_computed_total{model}``                  counter    transformer passes run (done)
``chorus_worker_token_steps_computed_total{model}``            counter    steps × tokens-computed fraction, and a
                                                                          rejected donor check's pass (done)
``chorus_worker_tokens_computed_fraction{role}``               histogram  per done request
``chorus_worker_fallbacks_total{cause}``                       counter    each planned reuse that did not happen
``chorus_worker_follower_wait_seconds``                        histogram  a follower's time blocked on its leader
``chorus_worker_model_load_duration_seconds{model}``           histogram  each model load (once per process)
``chorus_worker_models_loaded{model}``                         gauge      processes holding the model (livesum)
``chorus_worker_pool_slots``                                   gauge      processes (threads) taking orders
``chorus_worker_busy_slots``                                   gauge      those running an order now
``chorus_worker_evicted_objects_total``                        counter    S3 objects deleted by eviction orders
``chorus_worker_result_publish_errors_total``                  counter    results the results topic refused
=============================================================  =========  =======================================

``reuse`` is ``donor`` (the planned donor was used), ``fallback`` (it was planned but not used; see
``chorus_worker_fallbacks_total``) or ``none`` (no donor was planned). Steps saved (token-steps) are
``steps_requested − token_steps_computed``; the estimated speedup is ``steps_requested / token_steps_computed``.
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from producer.catalog import CATALOG
from producer.metrics_server import Exposition, listen, zero_series
from producer.orders import Role
from workers.engine.fallback import FallbackCause
from workers.failures import FailureCode

if TYPE_CHECKING:
    from producer.contract import GenerationResult
    from producer.orders import WorkOrder
    from workers.engine.engine import GenerationOutput
    from workers.settings import WorkerSettings

log = logging.getLogger(__name__)

MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"

ROLES: Final = (Role.LEADER, Role.FOLLOWER, Role.SOLO)
STATUSES: Final = ("done", "failed")
REUSE: Final = ("donor", "fallback", "none")
PHASES: Final = ("queue", "fetch", "denoise", "decode", "upload", "publish")
STAGES: Final = ("1", "2", "3")
FAILURE_CODES: Final = (*FailureCode, "other")
FALLBACK_CAUSES: Final = tuple(FallbackCause)  # the engine decides each fallback and names its cause
UNKNOWN_MODEL: Final = "unknown"

PHASE_BUCKETS_S: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
)  # fmt: skip
REQUEST_BUCKETS_S: Final = (
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
)  # fmt: skip
LOAD_BUCKETS_S: Final = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
FRACTION_BUCKETS: Final = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self._results(registry)
        self._compute(registry)
        self._pool(registry)
        self._initialise_labels()

    def _results(self, registry: CollectorRegistry | None) -> None:
        """What was published, and how long it took: results, failures, phases, stages, end to end."""
        self.requests = Counter(
            "chorus_worker_requests",
            "Results published, by model, group role, status and reuse (donor: a hit, it computed fewer "
            "token-steps than in full; fallback: a donor was planned but nothing was saved; none: no donor).",
            ["model", "role", "status", "reuse"],
            registry=registry,
        )
        self.failures = Counter(
            "chorus_worker_failures",
            "`failed` results, by error code.",
            ["code"],
            registry=registry,
        )
        self.phase_seconds = Histogram(
            "chorus_worker_phase_duration_seconds",
            "Per-request latency of each worker phase: queue (accepted by the scheduler → started), fetch "
            "(donor download and waiting for a leader), denoise, decode, upload, publish (the result produced to "
            "the results topic until the broker acknowledged it).",
            ["phase"],
            buckets=PHASE_BUCKETS_S,
            registry=registry,
        )
        self.stage_seconds = Histogram(
            "chorus_worker_denoise_stage_duration_seconds",
            "Denoising wall time per reuse stage (1: replayed from the donor, 2: divergent tokens only, "
            "3: full), for each request that ran the stage.",
            ["stage"],
            buckets=PHASE_BUCKETS_S,
            registry=registry,
        )
        self.request_seconds = Histogram(
            "chorus_request_duration_seconds",
            "End to end: request submitted → its result published, by status.",
            ["status"],
            buckets=REQUEST_BUCKETS_S,
            registry=registry,
        )

    def _compute(self, registry: CollectorRegistry | None) -> None:
        """What was computed: steps requested and computed, token-steps, fallbacks, follower waits."""
        self.steps_requested = Counter(
            "chorus_worker_steps_requested",
            "Denoising steps requested by finished requests.",
            ["model"],
            registry=registry,
        )
        self.steps_computed = Counter(
            "chorus_worker_steps_computed",
            "Transformer passes run for finished requests (a partial Stage-2 step counts as one).",
            ["model"],
            registry=registry,
        )
        self.token_steps_computed = Counter(
            "chorus_worker_token_steps_computed",
            "Steps weighted by the fraction of tokens computed: steps_requested × tokens_computed_fraction.",
            ["model"],
            registry=registry,
        )
        self.tokens_fraction = Histogram(
            "chorus_worker_tokens_computed_fraction",
            "Mean fraction of tokens computed per requested step, per finished request, by role.",
            ["role"],
            buckets=FRACTION_BUCKETS,
            registry=registry,
        )
        self.fallbacks = Counter(
            "chorus_worker_fallbacks",
            "Planned donor reuse that did not happen (the work was computed instead), by cause.",
            ["cause"],
            registry=registry,
        )
        self.follower_wait = Histogram(
            "chorus_worker_follower_wait_seconds",
            "Seconds a follower spent blocked on its running leader's steps.",
            buckets=PHASE_BUCKETS_S,
            registry=registry,
        )

    def _pool(self, registry: CollectorRegistry | None) -> None:
        """The process pool: model loads, loaded models, slots, evictions, publish errors."""
        self.model_load_seconds = Histogram(
            "chorus_worker_model_load_duration_seconds",
            "Time to load a model into a worker process (once per process and model).",
            ["model"],
            buckets=LOAD_BUCKETS_S,
            registry=registry,
        )
        self.models_loaded = Gauge(
            "chorus_worker_models_loaded",
            "Worker processes holding the model in memory.",
            ["model"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.pool_slots = Gauge(
            "chorus_worker_pool_slots",
            "Execution slots (prefork processes, or threads) taking orders.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.busy_slots = Gauge(
            "chorus_worker_busy_slots",
            "Execution slots running an order now.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.evicted_objects = Counter(
            "chorus_worker_evicted_objects",
            "S3 objects deleted by eviction orders.",
            registry=registry,
        )
        self.publish_errors = Counter(
            "chorus_worker_result_publish_errors",
            "Results the results topic did not take (the order is retried).",
            registry=registry,
        )

    def _initialise_labels(self) -> None:
        models = [*sorted(CATALOG), UNKNOWN_MODEL]
        zero_series(self.requests, model=models, role=ROLES, status=STATUSES, reuse=REUSE)
        for per_model in (
            self.steps_requested,
            self.steps_computed,
            self.token_steps_computed,
            self.model_load_seconds,
            self.models_loaded,
        ):
            zero_series(per_model, model=models)
        zero_series(self.failures, code=FAILURE_CODES)
        zero_series(self.phase_seconds, phase=PHASES)
        zero_series(self.stage_seconds, stage=STAGES)
        zero_series(self.request_seconds, status=STATUSES)
        zero_series(self.tokens_fraction, role=ROLES)
        zero_series(self.fallbacks, cause=FALLBACK_CAUSES)


_METRICS: WorkerMetrics | None = None
_METRICS_LOCK = threading.Lock()


def metrics() -> WorkerMetrics:
    """The process' worker metrics, created on first use (after ``enable_multiprocess``, when it is called)."""
    global _METRICS
    with _METRICS_LOCK:
        if _METRICS is None:
            _METRICS = WorkerMetrics()
        return _METRICS


# ------------------------------------------------------------------------------------------- call sites


def model_label(model: str | None) -> str:
    return model if model in CATALOG else UNKNOWN_MODEL


def reuse_label(result: GenerationResult) -> str:
    """``donor``: a hit, i.e. it computed fewer token-steps than in full (``GenerationResult.saved_compute``);
    ``fallback``: a donor was planned but nothing was saved (a fallback, or a plan that recomputed every token);
    ``none``: no donor was planned."""
    if result.donor is None:
        return "none"
    return "donor" if result.saved_compute else "fallback"


def observe_result(result: GenerationResult, order: WorkOrder | None) -> None:
    """Count one published result (call once, after it was published)."""
    m = metrics()
    model = model_label(order.request.model if order is not None else None)
    role = str(order.role if order is not None else Role.SOLO)
    status = str(result.status) if str(result.status) in STATUSES else "failed"
    m.requests.labels(model=model, role=role, status=status, reuse=reuse_label(result)).inc()
    if order is not None:
        e2e = (result.completed_at - order.request.submitted_at).total_seconds()
        m.request_seconds.labels(status=status).observe(max(0.0, e2e))
    if status != "done":
        code = result.error.code if result.error is not None else "other"
        m.failures.labels(code=code if code in FAILURE_CODES else "other").inc()
        return
    t = result.timings
    for phase, seconds in (
        ("queue", t.queue_s),
        ("fetch", t.fetch_s),
        ("denoise", t.denoise_s),
        ("decode", t.decode_s),
        ("upload", t.upload_s),
    ):
        m.phase_seconds.labels(phase=phase).observe(seconds)
    m.steps_requested.labels(model=model).inc(result.steps_requested)
    m.steps_computed.labels(model=model).inc(result.steps_computed)
    # What the worker computed, the donor check's thrown-away pass too (the result's fraction leaves it out: it
    # says what the video is made of): the saving read from these counters is the one the GPU saw.
    wasted = result.verification.wasted_tokens_fraction if result.verification is not None else 0.0
    m.token_steps_computed.labels(model=model).inc(
        result.steps_requested * result.tokens_computed_fraction + wasted
    )
    m.tokens_fraction.labels(role=role).observe(result.tokens_computed_fraction)


def observe_generation(output: GenerationOutput, *, follower: bool, waited_s: float) -> None:
    """Stage timings of one engine run, and a follower's time blocked on its leader."""
    m = metrics()
    for stage in sorted({s.stage for s in output.steps}):
        m.stage_seconds.labels(stage=str(stage)).observe(output.stage_seconds.get(stage, 0.0))
    if follower:
        m.follower_wait.observe(max(0.0, waited_s))


def count_fallback(cause: str) -> None:
    metrics().fallbacks.labels(cause=cause if cause in FALLBACK_CAUSES else "donor_unavailable").inc()


def model_loaded(model: str, seconds: float) -> None:
    m = metrics()
    m.model_load_seconds.labels(model=model_label(model)).observe(seconds)
    m.models_loaded.labels(model=model_label(model)).inc()


@contextmanager
def busy() -> Iterator[None]:
    """Counts the block as one busy slot."""
    gauge = metrics().busy_slots
    gauge.inc()
    try:
        yield
    finally:
        gauge.dec()


# ----------------------------------------------------------------------------------- multiprocess mode


def multiprocess_dir() -> Path | None:
    value = os.environ.get(MULTIPROC_ENV)
    return Path(value) if value else None


def enable_multiprocess(directory: Path | None = None) -> Path:
    """Switch this process (and the processes it forks later) to multiprocess metrics; returns the folder.

    Must run before the first worker metric is created. The folder is ``directory``, else
    ``$PROMETHEUS_MULTIPROC_DIR``, else a new private temporary folder (removed when this process exits);
    files a previous run left in it are deleted (prometheus-client requires a clean folder per run).
    """
    if _METRICS is not None:
        raise RuntimeError("worker metrics already exist; multiprocess mode must be enabled before")
    path = directory or multiprocess_dir()
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="chorus-worker-metrics-"))
        owner = os.getpid()

        def _remove() -> None:
            if os.getpid() == owner:  # a forked child inherits atexit handlers
                shutil.rmtree(path, ignore_errors=True)

        atexit.register(_remove)
    path.mkdir(parents=True, exist_ok=True)
    for stale in glob.glob(os.path.join(path, "*.db")):
        os.remove(stale)
    os.environ[MULTIPROC_ENV] = str(path)
    # prometheus-client picks the value class when it is first imported; it may have been imported before the
    # variable was set (by any module), so pick again now, as no worker metric exists yet.
    from prometheus_client import values

    values.ValueClass = values.get_value_class()
    return path


_LIVE_FILE = re.compile(r"^gauge_live\w+?_(\d+)\.db$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead_processes(path: Path) -> list[int]:
    """``mark_process_dead`` for every process whose live-gauge files remain but which no longer exists."""
    dead = set()
    for name in os.listdir(path):
        match = _LIVE_FILE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            dead.add(int(match.group(1)))
    for pid in sorted(dead):
        mark_process_dead(pid, str(path))
    return sorted(dead)


class SweepingMultiProcessCollector(MultiProcessCollector):
    """A ``MultiProcessCollector`` that first forgets the live gauges of processes that died."""

    def __init__(self, registry: CollectorRegistry | None, path: Path) -> None:
        super().__init__(registry, str(path))
        self.dir_path = path

    def collect(self) -> Iterable[Metric]:
        try:
            sweep_dead_processes(self.dir_path)
        except OSError as exc:
            log.warning("dead worker processes not swept", extra={"error": repr(exc)})
        return super().collect()


def multiprocess_registry(path: Path) -> CollectorRegistry:
    registry = CollectorRegistry()
    SweepingMultiProcessCollector(registry, path)
    return registry


def on_process_init(**_: Any) -> None:
    """A pool process started (Celery ``worker_process_init``): one more slot takes orders."""
    metrics().pool_slots.set(1)


def on_process_exit(pid: int | None = None, **_: Any) -> None:
    """A pool process is exiting (Celery ``worker_process_shutdown``, sent in the child): drop its live gauges."""
    path = multiprocess_dir()
    if path is not None:
        mark_process_dead(pid or os.getpid(), str(path))


# ------------------------------------------------------------------------------------------- exposition


def serve(settings: WorkerSettings, *, slots_in_main: int = 0, addr: str | None = None) -> Exposition | None:
    """Enable multiprocess mode and serve ``/metrics`` on ``settings.metrics_port`` at ``addr`` (default
    ``settings.metrics_bind_address``) from this (main) process.

    Call before the pool forks. ``slots_in_main``: execution slots of this process itself (solo and threads
    pools run orders in the main process; prefork children count themselves in ``on_process_init``).
    Port 0 disables the endpoint; a port in use is logged and the worker runs on without it.
    """
    if settings.metrics_port == 0:
        log.info("metrics not exposed (metrics_port is 0)")
        return None
    addr = addr or settings.metrics_bind_address
    path = enable_multiprocess()
    endpoint = listen(settings.metrics_port, addr=addr, registry=multiprocess_registry(path))
    if endpoint is None:
        return None
    m = metrics()
    if slots_in_main:
        m.pool_slots.set(slots_in_main)
    log.info("metrics exposed", extra={"port": endpoint.port, "addr": addr, "multiprocess_dir": str(path)})
    return Exposition(port=endpoint.port, close=endpoint.close, path=path)
