"""What a worker does with one ``WorkOrder``: donor → engine → video → S3 → results topic.

One ``Runner`` per process and settings (``runner_for``); one loaded model + ``Engine`` per process and model
(``engine_for``), loaded on the first order for that model with its load time logged.

Donor handling never fails a request: a donor that is missing, corrupt, unreadable or incompatible makes the
request run in full, and the result's ``fallback`` says why. The engine decides every such fallback
(``workers.engine.fallback``); the runner reads the donor from S3 and reports what the engine returns. A request
that fails for any other reason (model not loadable, engine error, video encoding, the video upload, the soft time
limit) is answered with a ``failed`` result carrying an error code and message. The result keeps the scheduler's
plan and donor as they were planned; ``fallback`` and ``steps_computed`` tell what actually happened.

The result leaves once the video and the trajectory's header are stored (``WorkerSettings.result_before_trajectory``):
what of the trajectory did not stream while the engine ran is uploaded after it, and readers of a finished donor
allow for that (``S3DonorSource.grace_s``).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from celery.exceptions import SoftTimeLimitExceeded
from pydantic import SecretStr, ValidationError

from producer.catalog import CATALOG
from producer.contract import GenerationResult
from producer.logs import quiet_transformers
from producer.orders import Role, WorkOrder, trajectory_prefix, video_key
from producer.readiness import ReadinessEvent
from workers import metrics as worker_metrics
from workers import video
from workers.donors import (
    S3DonorSource,
    TrajectoryEvicted,
    TrajectoryUploader,
    UploadReport,
    clear_abandoned,
    delete_trajectory,
)
from workers.engine.bundle import ModelBundle
from workers.engine.engine import Engine, GenerationOutput
from workers.engine.errors import ModelUnavailable
from workers.engine.fallback import FallbackCause
from workers.engine.registry import MID_CONFIG, build_random_wan_bundle, load_bundle
from workers.engine.request_run import PrefetchedDonor, donor_steps, prefetch_donor
from workers.engine.trajectory import StepRecord, Trajectory
from workers.failures import FailureCode
from workers.results import (
    PhaseClock,
    ResultPublisher,
    done_result,
    failed_result,
    queue_seconds,
    salvage_ids,
)
from workers.settings import WorkerSettings
from workers.store import ObjectStore, StoreError, store_for

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
# How long a stopping worker waits for the trajectories still uploading after their results left, and how many
# may be uploading at once before the next result waits for the oldest.
UPLOADS_AT_EXIT_S = 60.0
MAX_UPLOADS_IN_FLIGHT = 4


# --- models: loaded once per process ------------------------------------------------------------------------


@dataclass
class LoadedModel:
    engine: Engine
    load_s: float
    lock: threading.Lock


_MODELS: dict[tuple[str, ...], LoadedModel] = {}
_MODELS_LOCK = threading.Lock()


def engine_for(model: str, settings: WorkerSettings) -> LoadedModel:
    """The process' engine for ``model`` on the configured device/dtype, loading it on first use."""
    key = (
        model,
        settings.device,
        settings.dtype,
        str(settings.wan21_dir),
        str(settings.toy_weights_dir),
        settings.random_wan_width,
    )
    with _MODELS_LOCK:
        loaded = _MODELS.get(key)
        if loaded is None:
            start = time.perf_counter()
            bundle = _load(model, settings)
            loaded = LoadedModel(
                Engine(
                    bundle,
                    prompt_cache_size=settings.prompt_cache_size,
                    text_cache_bytes=settings.text_cache_mb * 1024 * 1024,
                ),
                time.perf_counter() - start,
                threading.Lock(),
            )
            _MODELS[key] = loaded
            worker_metrics.model_loaded(model, loaded.load_s)
            log.info(
                ReadinessEvent.MODEL_LOADED,
                extra={
                    "model": model,
                    "device": settings.device,
                    "dtype": settings.dtype,
                    "load_s": round(loaded.load_s, 3),
                    "weights_id": bundle.weights_id,
                },
            )
    return loaded


def _load(model: str, settings: WorkerSettings) -> ModelBundle:
    if model == "tiny-random-wan" and settings.random_wan_width == "wan-width":
        # The catalog name keeps the request contract (shapes, scheduler); only the weights behind it differ.
        return build_random_wan_bundle(
            MID_CONFIG,
            spec=CATALOG[model],
            device=settings.device,
            dtype=settings.dtype,
            name="mid-random-wan",
        )
    with quiet_transformers():  # no progress bars or config warnings in a worker's log
        return load_bundle(
            model,
            device=settings.device,
            dtype=settings.dtype,
            wan21_dir=settings.wan21_dir,
            toy_weights_dir=settings.toy_weights_dir,
        )


_default_threads: int | None = None  # torch's own count for this process, before any model asked for another


def use_torch_threads(model: str, settings: WorkerSettings) -> None:
    """Run the next order on the model's torch thread count (``CHORUS_TORCH_THREADS``); a prefork pool process
    runs one order at a time, so the process-wide setting is the order's (a threads pool shares it)."""
    global _default_threads
    if settings.device != "cpu":
        return
    import torch

    if _default_threads is None:
        _default_threads = torch.get_num_threads()
    wanted = settings.torch_threads.get(model, _default_threads)
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)


def loaded_models() -> list[str]:
    return sorted({key[0] for key in _MODELS})


# --- the runner ---------------------------------------------------------------------------------------------


class Runner:
    def __init__(
        self,
        settings: WorkerSettings,
        *,
        store: ObjectStore | None = None,
        publisher: ResultPublisher | None = None,
    ) -> None:
        self.settings = settings
        self._store = store
        self.publisher = publisher or ResultPublisher(settings)
        # trajectory prefix → the thread still uploading it after its result left
        self._uploads: dict[str, threading.Thread] = {}
        self._uploads_lock = threading.Lock()

    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            self._store = store_for(self.settings)
        return self._store

    def handle(
        self,
        order_json: str,
        *,
        worker: str | None = None,
        attempt: int = 1,
        progress: Progress | None = None,
        started: float | None = None,
    ) -> GenerationResult:
        """Run one order and publish its result (raises ``ResultNotPublished`` only if Kafka refuses it).

        ``started``: the ``time.perf_counter()`` at which the task began (its checks count as ``prepare_s``)."""
        try:
            order = WorkOrder.model_validate_json(order_json)
        except ValidationError as exc:
            request_id, tenant = salvage_ids(order_json)
            message = f"work order does not validate: {exc}"
            log.error("work order rejected", extra={"request_id": request_id, "error": message[:500]})
            result = failed_result(
                request_id or "<unknown>", FailureCode.INVALID_ORDER, message, tenant=tenant, worker=worker
            )
            if request_id is not None:
                self.publisher.publish(result)
                worker_metrics.observe_result(result, None)
            return result

        request_id = order.request.request_id
        if attempt > self.settings.task_max_attempts:
            message = (
                f"delivered {attempt} times (limit {self.settings.task_max_attempts}); "
                "earlier attempts ended without a result (worker lost?)"
            )
            log.error("order given up", extra={"request_id": request_id, "attempt": attempt})
            result = failed_result(
                request_id, FailureCode.TOO_MANY_ATTEMPTS, message, order=order, worker=worker
            )
        else:
            result = self._run_safely(order, worker, progress, started)
        # ResultNotPublished carries the result: the task retries publishing it, not the order (whose trajectory
        # upload goes on meanwhile, as after any result).
        self.publisher.publish(result)
        worker_metrics.observe_result(result, order)
        return result

    def publish_again(self, order_json: str, result: GenerationResult) -> GenerationResult:
        """Publish the result ``handle`` built but could not publish (the order does not run again); raises
        ``ResultNotPublished`` again if Kafka still refuses it."""
        try:
            order: WorkOrder | None = WorkOrder.model_validate_json(order_json)
        except ValidationError:
            order = None  # answered invalid_order: its metrics count it without one
        self.publisher.publish(result)
        worker_metrics.observe_result(result, order)
        log.info(
            "result published on a retry; the order did not run again",
            extra={"request_id": result.request_id},
        )
        return result

    def _run_safely(
        self, order: WorkOrder, worker: str | None, progress: Progress | None, started: float | None = None
    ) -> GenerationResult:
        clock = PhaseClock(started)
        queue_s = queue_seconds(order.accepted_at)
        request_id = order.request.request_id
        code: FailureCode
        try:
            return self._run(order, worker, clock, queue_s, progress)
        except SoftTimeLimitExceeded:
            code, message = (
                FailureCode.TIME_LIMIT,
                f"soft time limit of {self.settings.task_soft_time_limit_s:g} s",
            )
        except ModelUnavailable as exc:
            code, message = FailureCode.MODEL_UNAVAILABLE, str(exc)
        except VideoError as exc:
            code, message = FailureCode.VIDEO_ERROR, str(exc)
        except StoreError as exc:
            code, message = FailureCode.STORE_ERROR, str(exc)
        except Exception as exc:
            code, message = FailureCode.ENGINE_ERROR, f"{type(exc).__name__}: {exc}"
            log.exception("order failed", extra={"request_id": request_id})
        log.error("order failed", extra={"request_id": request_id, "code": code, "error": message[:500]})
        return failed_result(
            request_id, code, message, order=order, timings=clock.timings(queue_s), worker=worker
        )

    def _run(
        self,
        order: WorkOrder,
        worker: str | None,
        clock: PhaseClock,
        queue_s: float,
        progress: Progress | None,
    ) -> GenerationResult:
        """Resolve the donor, denoise, store the video and the trajectory, and assemble the result."""
        request = order.request
        job = request.job_id  # object keys are per tenant: two tenants may use the same request id
        loaded = engine_for(
            request.model, self.settings
        )  # first: a model that cannot load fails before any read
        clock.add("prepare", time.perf_counter() - clock.started)
        source, given = self._donor_sources(order, clock)
        plan = order.plan
        log.info(
            "order started",
            extra={
                "request_id": request.request_id,
                "model": request.model,
                "role": str(order.role),
                "donor": order.donor.request_id if order.donor else None,
                "similarity": order.donor.similarity if order.donor else None,
                "plan": f"{plan.stage1_steps}/{plan.stage2_steps}/{plan.stage3_steps}",
                "queue_s": round(queue_s, 3),
            },
        )
        uploader = TrajectoryUploader(
            self.store,
            trajectory_prefix(job),
            storage_dtype=self.settings.trajectory_dtype,
            pack_max_bytes=self.settings.trajectory_pack_max_bytes,
        )
        output = self._denoise(loaded, order, given, source, uploader, clock, progress)
        video_uri, trajectory_uri, trajectory_bytes = self._store_outputs(order, output, uploader, clock)
        result = done_result(
            order,
            video_uri=video_uri,
            trajectory_uri=trajectory_uri,
            trajectory_bytes=trajectory_bytes,
            steps_computed=output.steps_computed,
            tokens_computed_fraction=output.tokens_computed_fraction,
            fallback=output.fallback,
            donor_gone=output.donor_gone,
            timings=clock.timings(queue_s),
            worker=worker,
            noise_seed=output.noise_seed,
            prompt_tokens_used=output.prompt_tokens_used,
            prompt_truncated=output.prompt_truncated,
            verification=output.verification,
        )
        _log_done(result)
        return result

    def _donor_sources(
        self, order: WorkOrder, clock: PhaseClock
    ) -> tuple[S3DonorSource | None, S3DonorSource | PrefetchedDonor | None]:
        """(what the engine reads the donor from, what it is handed): a follower's waiting source, a finished
        donor prefetched now (before the model is ours), or nothing."""
        plan, donor, request = order.plan, order.donor, order.request
        if not plan.reuses or donor is None:
            return None, None
        if order.role is Role.FOLLOWER:
            # The leader is still running: wait for each of its steps, up to wait_s.
            follower = S3DonorSource(
                self.store, donor.trajectory_prefix, wait_s=donor.wait_s, poll_s=self.settings.follower_poll_s
            )
            return follower, follower
        source = S3DonorSource(
            self.store, donor.trajectory_prefix, grace_s=self.settings.donor_upload_grace_s
        )
        with clock.phase("fetch"):
            given = prefetch_donor(source, plan, request.num_steps, name=donor.request_id)
        if given.source is None:
            return None, given
        log.info(
            "donor fetched",
            extra={
                "request_id": request.request_id,
                "donor": donor.request_id,
                "steps": len(donor_steps(plan, request.num_steps)),
                "bytes": source.bytes_read,
            },
        )
        return source, given

    def _denoise(
        self,
        loaded: LoadedModel,
        order: WorkOrder,
        given: S3DonorSource | PrefetchedDonor | None,
        source: S3DonorSource | None,
        uploader: TrajectoryUploader,
        clock: PhaseClock,
        progress: Progress | None,
    ) -> GenerationOutput:
        """Run the engine (a leader streams its trajectory meanwhile); count the fallback it reports."""
        # Uploads run in the background: a packed trajectory as soon as the engine is done, while the video is
        # encoded; a larger one step by step while the engine runs. The result waits for what is left.
        if order.role is Role.LEADER:
            clear_abandoned(self.store, trajectory_prefix(order.request.job_id))
        uploader.start()
        try:
            use_torch_threads(order.request.model, self.settings)
            with loaded.lock:
                output = self._generate(loaded.engine, order, given, source, uploader, clock, progress)
        except BaseException:
            # A leader that failed may have streamed part of its trajectory: nobody must take it for a donor.
            self._discard_trajectory(order.request.job_id, uploader)
            raise
        # The uploads still queued drain while the video is encoded and stored (``_store_outputs`` waits for them).
        uploader.on_done(output.trajectory)
        if output.fallback_cause is not None:
            worker_metrics.count_fallback(output.fallback_cause)
            if output.fallback_cause is FallbackCause.DONOR_INCOMPATIBLE:
                log.warning(
                    "incompatible donor",
                    extra={"request_id": order.request.request_id, "error": output.fallback},
                )
        return output

    def _store_outputs(
        self, order: WorkOrder, output: GenerationOutput, uploader: TrajectoryUploader, clock: PhaseClock
    ) -> tuple[str, str | None, int]:
        """Encode and store the video, and the trajectory (if it cannot be stored the request is still served,
        it just cannot become a donor): (video uri, trajectory uri, trajectory bytes)."""
        job, fmt = order.request.job_id, self.settings.video_format
        try:
            with clock.phase("decode"):
                video_bytes = encode_video(output, fmt)
            with clock.phase("upload"):
                stored_video = self.store.put(video_key(job, fmt), video_bytes, video.CONTENT_TYPES[fmt])
                return (stored_video.uri, *self._store_trajectory(order, output, uploader))
        except BaseException:
            # The request fails (the video, or the time limit): no result will name this trajectory. Delete what
            # was stored, or another request could take it for a donor.
            self._discard_trajectory(job, uploader)
            raise

    def _store_trajectory(
        self, order: WorkOrder, output: GenerationOutput, uploader: TrajectoryUploader
    ) -> tuple[str | None, int]:
        """(trajectory uri, bytes), or (None, 0) when the store refuses it."""
        try:
            if self.settings.result_before_trajectory:
                # The header before the result: an eviction ordered after it must find the header.
                uploader.store_header(output.trajectory)
                report = uploader.planned_report(output.trajectory)
                self._finish_later(order, uploader, output.trajectory)
            else:
                report = uploader.finish(output.trajectory)
        except StoreError as exc:
            log.warning(
                "trajectory not stored", extra={"request_id": order.request.request_id, "error": str(exc)}
            )
            self._discard_trajectory(order.request.job_id, uploader)
            return None, 0
        return self.store.uri(report.prefix), report.bytes

    def _finish_later(self, order: WorkOrder, uploader: TrajectoryUploader, trajectory: Trajectory) -> None:
        """The rest of the trajectory's upload goes on after the result leaves (the result names its exact size).
        A reader that comes before it ends waits for it (``S3DonorSource.grace_s``); if it fails, the objects are
        deleted, and the first reader's ``donor_gone`` makes the scheduler evict the entry."""
        job, request_id = order.request.job_id, order.request.request_id
        started = time.perf_counter()

        def done(outcome: UploadReport | Exception) -> None:
            seconds = round(time.perf_counter() - started, 4)
            if isinstance(outcome, TrajectoryEvicted):
                log.info(
                    "trajectory evicted while it uploaded; the rest removed",
                    extra={"request_id": request_id, "detail": str(outcome), "seconds": seconds},
                )
            elif isinstance(outcome, Exception):
                log.warning(
                    "trajectory not stored after its result left; deleting it",
                    extra={"request_id": request_id, "error": repr(outcome), "seconds": seconds},
                )
                self._discard_trajectory(job, uploader)
            else:
                log.info(
                    "trajectory stored",
                    extra={"request_id": request_id, "objects": outcome.objects, "after_result_s": seconds},
                )

        with self._uploads_lock:
            self._uploads = {p: t for p, t in self._uploads.items() if t.is_alive()}
            backlog = list(self._uploads.values())
        # Back-pressure: a slow store must not pile up threads, each holding a trajectory.
        for thread in backlog[: max(0, len(backlog) - MAX_UPLOADS_IN_FLIGHT + 1)]:
            thread.join()
        thread = uploader.finish_in_background(trajectory, done)
        with self._uploads_lock:
            self._uploads[uploader.prefix] = thread

    def wait_for_uploads(self, timeout_s: float | None = None, *, prefix: str | None = None) -> bool:
        """Wait for the trajectories still uploading (shutdown, tests, an eviction or a retry of ``prefix``);
        whether they all ended in time."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._uploads_lock:
            pending = [t for p, t in self._uploads.items() if prefix is None or p == prefix]
        for thread in pending:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in pending)

    def _discard_trajectory(self, job: str, uploader: TrajectoryUploader) -> None:
        """Delete what of ``job``'s trajectory may have been stored (a write whose reply was lost counts); what was
        still streaming is dropped, but for the put under way."""
        uploader.abandon()
        if not uploader.may_have_stored:
            return
        try:
            deleted = delete_trajectory(self.store, trajectory_prefix(job))
            if deleted:  # none when the writes that went out were refused before storing anything
                log.info("partial trajectory deleted", extra={"job": job, "objects": deleted})
        except StoreError as exc:
            log.warning("partial trajectory left in S3", extra={"job": job, "error": str(exc)})

    def _generate(
        self,
        engine: Engine,
        order: WorkOrder,
        donor: S3DonorSource | PrefetchedDonor | None,
        source: S3DonorSource | None,
        uploader: TrajectoryUploader,
        clock: PhaseClock,
        progress: Progress | None,
    ) -> GenerationOutput:
        total = order.request.num_steps

        def on_step(record: StepRecord) -> None:
            uploader.on_step(record)
            done = record.index + 1
            log.debug("step done", extra={"request_id": order.request.request_id, "step": done, "of": total})
            if progress is not None:
                progress(done, total)

        waited_before = source.busy_s if source is not None else 0.0
        start = time.perf_counter()
        output = engine.generate(
            order.request,
            order.plan,
            donor,
            on_step=on_step,
            on_start=uploader.on_start,
            progress=False,
            refuse_incompatible=False,
        )
        wall = time.perf_counter() - start
        waited = (source.busy_s - waited_before) if source is not None else 0.0
        # Time blocked on the donor (downloads and waiting for a leader) counts as fetch, not denoise.
        clock.add("fetch", waited)
        clock.add("decode", output.decode_seconds)
        clock.add("denoise", wall - waited - output.decode_seconds)
        worker_metrics.observe_generation(output, follower=order.role is Role.FOLLOWER, waited_s=waited)
        return output


class VideoError(RuntimeError):
    """The frames could not be encoded as a video."""


def encode_video(output: GenerationOutput, fmt: str) -> bytes:
    try:
        return video.encode_video(output.frames, fmt=fmt, fps=output.fps)
    except Exception as exc:
        raise VideoError(f"cannot encode {output.frames.shape} frames as {fmt}: {exc}") from exc


_RUNNERS: dict[str, Runner] = {}
# Under `chorus worker --pool threads` the pool's threads take their first orders at once: one runner (one Kafka
# producer, one store) each, not one per thread.
_RUNNERS_LOCK = threading.Lock()


def runner_for(settings: WorkerSettings) -> Runner:
    """One runner (store, Kafka producer) per process and distinct settings."""
    # The dump masks secrets: settings that differ only in credentials get runners of their own by their hash.
    secrets = [v.get_secret_value() for v in settings.__dict__.values() if isinstance(v, SecretStr)]
    key = settings.model_dump_json() + hashlib.sha256("\0".join(secrets).encode()).hexdigest()
    with _RUNNERS_LOCK:
        runner = _RUNNERS.get(key)
        if runner is None:
            runner = _RUNNERS[key] = Runner(settings)
    return runner


def wait_for_uploads(timeout_s: float | None = None, *, prefix: str | None = None) -> bool:
    """Wait for the trajectories (or the one under ``prefix``) this process' runners still upload; whether they
    all ended in time (each runner gets the whole timeout)."""
    with _RUNNERS_LOCK:
        runners = list(_RUNNERS.values())
    return all([r.wait_for_uploads(timeout_s, prefix=prefix) for r in runners])


def close_runners() -> None:
    """Let every runner's trajectory uploads end, then flush and close its Kafka producer (worker process
    shutdown, tests)."""
    if not wait_for_uploads(UPLOADS_AT_EXIT_S):
        log.warning("trajectory uploads still running at exit", extra={"timeout_s": UPLOADS_AT_EXIT_S})
    with _RUNNERS_LOCK:
        runners = list(_RUNNERS.values())
        _RUNNERS.clear()
    for runner in runners:
        runner.publisher.close()


def _log_done(result: GenerationResult) -> None:
    log.info(
        "order done",
        extra={
            "request_id": result.request_id,
            "steps_computed": result.steps_computed,
            "steps_requested": result.steps_requested,
            "tokens_computed_fraction": round(result.tokens_computed_fraction, 4),
            "fallback": result.fallback,
            "reuse": str(result.reuse),
            "seed_honoured": result.seed_honoured,
            "verification": result.verification.decision if result.verification else None,
            "video_uri": result.video_uri,
            "trajectory_bytes": result.trajectory_bytes,
            **{k: round(v, 4) for k, v in result.timings.model_dump().items()},
        },
    )
