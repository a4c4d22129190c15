"""The Celery tasks: thin wrappers that parse their one JSON argument and hand over.

- ``chorus.generate(order_json)`` → ``workers.runner`` (imported on first call: it brings torch and the engine,
  which a pure client of the app never needs).
- ``chorus.evict(order_json)`` → deletes the S3 objects under each evicted donor's trajectory prefix.

Neither task lets an exception escape for bad input or a failed generation: the generate task publishes a
``failed`` result instead, so Celery never retries a request forever. Only a result that could not be published
(``ResultNotPublished``) and an eviction the store refused (``StoreError``) are retried, a bounded number of times:
a result by publishing it again from the task (the order does not run again for a Kafka blip), an eviction by
Celery.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery, Task
from pydantic import ValidationError

from producer import broker
from producer.broker import ANSWERED_SUFFIX, ATTEMPTS_SUFFIX
from producer.contract import GenerationResult
from producer.orders import EVICT_TASK, GENERATE_TASK, HEARTBEAT_FIELD, EvictOrder
from workers.metrics import busy, metrics
from workers.results import ResultNotPublished
from workers.settings import WorkerSettings
from workers.store import StoreError, store_for

log = logging.getLogger(__name__)


def settings_of(app: Celery) -> WorkerSettings:
    """The settings the worker app was built from (the environment's, for an app built elsewhere)."""
    return broker.settings_of(app, WorkerSettings)


def register(app: Celery) -> None:
    """Register both tasks on ``app`` only (not shared: a client app built later must not get them)."""
    app.task(name=GENERATE_TASK, bind=True, shared=False)(generate)
    app.task(
        name=EVICT_TASK,
        bind=True,
        shared=False,
        autoretry_for=(StoreError,),
        max_retries=3,
        retry_backoff=2,
        retry_jitter=False,
    )(evict)


# The longest wait between two tries to publish a result: the tries come out of the task's own time limit.
PUBLISH_RETRY_MAX_WAIT_S = 10.0


def publish_retry_countdown(retries: int) -> float:
    """Seconds before the next try to publish a result, after ``retries`` retries: 2, 4, 8, 10, 10, ..."""
    return min(float(2 ** (retries + 1)), PUBLISH_RETRY_MAX_WAIT_S)


def generate(self: Task, order_json: str) -> dict[str, Any]:
    """Run one ``WorkOrder``; publishes its ``GenerationResult`` and returns a short summary."""
    from workers.runner import runner_for

    started = time.perf_counter()  # the checks below are the order's "prepare" phase
    settings = settings_of(self.app)
    if was_answered(self):
        # A second copy of an order that already has its result: the broker requeued it after its pool process
        # died while the scheduler's watchdog sent it again. Running it would publish a second result.
        log.info("order already answered; this delivery is skipped", extra={"task_id": self.request.id})
        return {"task_id": self.request.id, "skipped": "already answered"}
    attempt = count_attempt(self)
    runner = runner_for(settings)
    with busy(), _alive(self, settings.worker_heartbeat_s) as progress:
        try:
            result = runner.handle(
                order_json, worker=self.request.hostname, attempt=attempt, progress=progress, started=started
            )
        except ResultNotPublished as exc:
            if exc.result is None:
                raise
            result = _publish_again(runner, order_json, exc, settings.result_publish_retries)
    mark_answered(self)
    return _summary(result, attempt=attempt)


def _publish_again(
    runner: Any, order_json: str, refused: ResultNotPublished, retries: int
) -> GenerationResult:
    """Publish the result Kafka refused, ``retries`` more times with backoff, here: the order does not run again
    (minutes of GPU for a broker blip), and the task keeps beating meanwhile. Raises the last refusal (the task
    then fails, and the scheduler's watchdog answers the request)."""
    assert refused.result is not None
    for retry in range(retries):
        log.warning(
            "result not published; publishing it again (the order does not run again)",
            extra={"request_id": refused.result.request_id, "retry": retry + 1, "error": str(refused)[:300]},
        )
        time.sleep(publish_retry_countdown(retry))
        try:
            published: GenerationResult = runner.publish_again(order_json, refused.result)
            return published
        except ResultNotPublished as again:
            refused = again if again.result is not None else refused
    raise refused


@contextmanager
def _alive(task: Task, interval_s: float) -> Iterator[Callable[[int, int], None]]:
    """While the block runs, the task's state in the result backend says it is alive: a heartbeat every
    ``interval_s`` (the scheduler's watchdog tells a worker killed as a whole by a heartbeat that stops), and the
    progress the block reports (``progress(done, total)``). Best-effort."""
    state: dict[str, Any] = {}
    lock = threading.Lock()
    # Celery keeps the task's request per thread: the heartbeat thread must name the task id itself.
    task_id = task.request.id

    def beat(**fields: Any) -> None:
        with lock:
            state.update(fields, **{HEARTBEAT_FIELD: time.time()})
            try:
                task.update_state(task_id=task_id, state="PROGRESS", meta=dict(state))
            except Exception as exc:
                log.debug("task state not recorded", extra={"error": repr(exc)})

    def progress(done: int, total: int) -> None:
        beat(step=done, of=total)

    with _heartbeat(beat, interval_s):
        yield progress


def _summary(result: GenerationResult, *, attempt: int | None) -> dict[str, Any]:
    """What the task returns (Celery's result backend keeps it): the result in short."""
    return {
        "request_id": result.request_id,
        "status": str(result.status),
        "video_uri": result.video_uri,
        "trajectory_uri": result.trajectory_uri,
        "fallback": result.fallback,
        "error": result.error.code if result.error else None,
        "attempt": attempt,
    }


@contextmanager
def _heartbeat(beat: Any, interval_s: float) -> Iterator[None]:
    """Call ``beat()`` now and every ``interval_s`` seconds until the block ends."""
    stop = threading.Event()

    def loop() -> None:
        beat()
        while not stop.wait(interval_s):
            beat()

    thread = threading.Thread(target=loop, name="order-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# How long an eviction waits for this process' upload of the same trajectory (its result left before it ended).
EVICT_WAITS_FOR_UPLOAD_S = 30.0


def evict(self: Task, order_json: str) -> dict[str, Any]:
    """Delete every object under the trajectory prefix of each evicted donor (idempotent)."""
    try:
        order = EvictOrder.model_validate_json(order_json)
    except ValidationError as exc:
        log.error("evict order rejected", extra={"error": str(exc).splitlines()[0], "raw": order_json[:500]})
        return {"error": "invalid_order", "deleted": {}}
    from workers.donors import delete_trajectory  # brings torch, like the generate task's runner

    store = store_for(settings_of(self.app))
    runner = sys.modules.get("workers.runner")  # not imported: this process ran no order, uploads nothing
    if runner is not None:
        for prefix in order.prefixes:
            # A donor evicted right after its result may still be uploading here: wait for it rather than have
            # it clean up after us. (Another process' upload cleans up itself: see ``delete_trajectory``.)
            runner.wait_for_uploads(EVICT_WAITS_FOR_UPLOAD_S, prefix=prefix)
    deleted = {
        rid: delete_trajectory(store, prefix)
        for rid, prefix in zip(order.request_ids, order.prefixes, strict=True)
    }
    metrics().evicted_objects.inc(sum(deleted.values()))
    log.info(
        "evicted donor objects",
        extra={"reason": order.reason, "request_ids": order.request_ids, "objects": sum(deleted.values())},
    )
    return {"deleted": deleted}


def count_attempt(task: Task) -> int:
    """Count this delivery of the task in the result backend (1 for the first); 1 when it keeps no keys.

    A delivery is counted before any work, so an order whose worker is killed (and that the broker therefore
    delivers again) is recognised on its ``task_max_attempts``-th delivery and answered ``failed``. The counter
    lives beside the task's result (same key prefix, same expiry).
    """
    key = attempts_key(task)
    backend = task.backend
    if key is None:
        return 1
    try:
        raw = backend.get(key)
        attempt = int(raw or 0) + 1
        backend.set(key, str(attempt).encode())
    except Exception as exc:  # counting is best-effort; the order still runs
        log.warning("could not count task attempt", extra={"task_id": task.request.id, "error": repr(exc)})
        return 1
    return attempt


def attempts_key(task: Task) -> Any:
    """The backend key of a task's delivery counter (``None`` for a backend without plain keys)."""
    return _backend_key(task, ATTEMPTS_SUFFIX)


def was_answered(task: Task) -> bool:
    """Whether a delivery of this task already published its result (best-effort: False when unknown)."""
    key = _backend_key(task, ANSWERED_SUFFIX)
    try:
        return key is not None and task.backend.get(key) is not None
    except Exception as exc:
        log.warning("could not read whether the order was answered", extra={"error": repr(exc)})
        return False


def mark_answered(task: Task) -> None:
    key = _backend_key(task, ANSWERED_SUFFIX)
    try:
        if key is not None:
            task.backend.set(key, b"1")
    except Exception as exc:  # a later duplicate delivery would then run again: a second result, nothing lost
        log.warning("could not mark the order answered", extra={"error": repr(exc)})


def _backend_key(task: Task, suffix: str) -> Any:
    """A key beside the task's result in the backend (``None`` for a backend without plain keys)."""
    backend = task.backend
    if not all(callable(getattr(backend, name, None)) for name in ("get", "set", "get_key_for_task")):
        return None
    return backend.get_key_for_task(task.request.id, key=suffix)
