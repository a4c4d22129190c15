"""The Celery broker side of Chorus, shared by the scheduler (which puts orders on it) and the workers (which take
them off): exchange, queues, routes, serializer and delivery semantics, all from ``BrokerSettings``.

Importable without torch or any worker code: the scheduler builds its client with ``app_for_broker`` and sends
work with ``send_generate`` / ``send_evict``; ``workers.app`` builds the worker's app on ``celery_config`` and
``new_app`` and registers the tasks on it. What an order is and which queue it goes to is ``producer.orders``.

Brokers:

- ``CHORUS_BROKER_URL=redis://…`` (production): Redis broker; results in Redis too unless
  ``CHORUS_RESULT_BACKEND`` says otherwise. The visibility timeout exceeds the hard time limit so a long task is
  never handed to a second worker while the first still runs it.
- empty ``broker_url`` (the embedded default): kombu's ``filesystem://`` transport in ``state_dir/celery`` (with
  atomic message files, ``producer.file_transport``) and a ``file://`` result backend, so a laptop runs real
  worker processes without Redis.

Delivery semantics: ``acks_late`` + ``reject_on_worker_lost`` + prefetch 1 — an order is acknowledged only
after it ran, and one whose worker died is delivered again (up to ``task_max_attempts`` times, counted by the
task). JSON is the only serializer accepted.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

from celery import Celery
from celery.result import AsyncResult
from kombu import Exchange, Queue
from kombu.transport import resolve_transport

from producer.file_backend import atomic_file_url
from producer.file_transport import TRANSPORT_PATH
from producer.orders import (
    EVICT_TASK,
    GENERATE_TASK,
    MAINTENANCE_QUEUE,
    EvictOrder,
    WorkOrder,
    all_queues,
    queue_for,
    route,
)
from producer.settings import BrokerSettings, UnusableSetting

EXCHANGE = Exchange("chorus", type="direct", durable=True)
# Headroom of the broker's redelivery timer over the hard time limit.
_VISIBILITY_MARGIN_S = 300.0
_SETTINGS: weakref.WeakKeyDictionary[Celery, BrokerSettings] = weakref.WeakKeyDictionary()

S = TypeVar("S", bound=BrokerSettings)


def filesystem_dirs(state_dir: Path) -> dict[str, Path]:
    """Folders of the embedded filesystem broker and result backend under ``state_dir``."""
    root = Path(state_dir).resolve() / "celery"
    return {
        "queue": root / "queue",
        "processed": root / "processed",
        "control": root / "control",
        "results": root / "results",
    }


def route_task(
    name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **_: Any
) -> dict[str, Any] | None:
    """Celery router: each task to the queue ``producer.orders.route`` names for it (None: Celery's default)."""
    try:
        raw = args[0] if args else (kwargs or {}).get("order_json")
    except (TypeError, ValueError, KeyError, IndexError):
        raw = None
    queue = route(name, raw)
    if queue is None:
        return None
    return {"queue": queue, "routing_key": queue, "exchange": EXCHANGE.name}


def celery_config(settings: BrokerSettings) -> dict[str, Any]:
    """The Celery configuration both sides share, for ``settings`` (a plain dict, so tests and tools can inspect
    it); ``workers.app.celery_config`` adds the worker pool's own."""
    transport_options: dict[str, Any] = {}
    if settings.broker_url:
        broker_url = settings.broker_url
        _check_transport(broker_url)
        result_backend: str | None = settings.result_backend or (
            broker_url if broker_url.startswith(("redis://", "rediss://")) else None
        )
        if broker_url.startswith(("redis://", "rediss://", "sqs://")):
            transport_options["visibility_timeout"] = int(settings.task_time_limit_s + _VISIBILITY_MARGIN_S)
        if settings.broker_key_prefix and broker_url.startswith(("redis://", "rediss://")):
            transport_options["global_keyprefix"] = settings.broker_key_prefix
    else:
        dirs = filesystem_dirs(settings.state_dir)
        for path in dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        broker_url = "filesystem://"
        result_backend = settings.result_backend or f"file://{dirs['results']}"
        transport_options.update(
            data_folder_in=str(dirs["queue"]),
            data_folder_out=str(dirs["queue"]),
            processed_folder=str(dirs["processed"]),
            control_folder=str(dirs["control"]),
            store_processed=False,
            # How often an idle worker looks for its next order. With prefetch 1 a worker takes the next order
            # only after acknowledging the last, so an order waited half of this on average after its
            # predecessor ended (chorus bench serve: 0.13 s median between a result and the next order's start
            # at 0.25 s, against 0.17 s of denoising per toy request). A listing of the queue folder is cheap.
            polling_interval=0.02,
        )
    if result_backend is not None:
        result_backend = atomic_file_url(result_backend)
    return {
        "broker_url": broker_url,
        # the filesystem broker with atomic message files (producer.file_transport); None: the URL's scheme
        "broker_transport": TRANSPORT_PATH if broker_url == "filesystem://" else None,
        "result_backend": result_backend,
        "broker_transport_options": transport_options,
        "result_backend_transport_options": (
            {"global_keyprefix": settings.broker_key_prefix}
            if settings.broker_key_prefix and (result_backend or "").startswith(("redis://", "rediss://"))
            else {}
        ),
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_acks_late": True,
        "task_acks_on_failure_or_timeout": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_soft_time_limit": settings.task_soft_time_limit_s,
        "task_time_limit": settings.task_time_limit_s,
        "task_track_started": True,
        "result_expires": 24 * 3600,
        "task_queues": [Queue(q, EXCHANGE, routing_key=q, durable=True) for q in all_queues()],
        "task_default_queue": MAINTENANCE_QUEUE,
        "task_default_exchange": EXCHANGE.name,
        "task_default_routing_key": MAINTENANCE_QUEUE,
        "task_create_missing_queues": False,
        "task_routes": (route_task,),
        "timezone": "UTC",
        "enable_utc": True,
    }


def _check_transport(broker_url: str) -> None:
    """Refuse a broker URL no installed kombu transport speaks now, not at the first order (where it failed
    every order). Names the scheme only: the URL may hold a password."""
    if "://" not in broker_url:
        return  # a bare host: kombu takes it as amqp
    scheme = broker_url.split("://", 1)[0].split("+", 1)[0]  # "sqla+postgresql://": the transport is "sqla"
    if "+" not in broker_url.split("://", 1)[0]:
        scheme = scheme.lower()  # as kombu reads a plain scheme
    try:
        resolve_transport(scheme)
    except (KeyError, ImportError) as exc:
        raise UnusableSetting(
            f"CHORUS_BROKER_URL: no Celery transport for {scheme + '://'!r} here ({exc}); use amqp://, "
            "redis:// or rediss://, or leave it empty for the embedded broker"
        ) from None


def new_app(settings: BrokerSettings, config: Mapping[str, Any]) -> Celery:
    """A Celery app named ``chorus`` with ``config``, remembering the ``settings`` it was built from."""
    app = Celery("chorus", set_as_current=False)
    app.conf.update(config)
    _SETTINGS[app] = settings
    return app


@overload
def settings_of(app: Celery) -> BrokerSettings: ...


@overload
def settings_of(app: Celery, kind: type[S]) -> S: ...


def settings_of(app: Celery, kind: type[BrokerSettings] = BrokerSettings) -> BrokerSettings:
    """The settings ``app`` was built from; for an app built elsewhere (or from another kind of settings), the
    environment's ``kind``, kept for the next call."""
    settings = _SETTINGS.get(app)
    if not isinstance(settings, kind):
        settings = _SETTINGS[app] = kind()
    return settings


def app_for_broker(
    broker_url: str, *, state_dir: Path, result_backend: str = "", **settings_overrides: Any
) -> Celery:
    """The client app the scheduler dispatches with: same queues, routes and serializer as the workers, no tasks
    (it sends them by name).

    ``broker_url`` empty means the embedded filesystem transport under ``state_dir`` (the same folders the
    workers of that state dir consume). Other ``BrokerSettings`` fields (e.g. ``broker_key_prefix``) may be
    given as keywords; the rest come from the environment.
    """
    settings = BrokerSettings(
        broker_url=broker_url, result_backend=result_backend, state_dir=state_dir, **settings_overrides
    )
    app = new_app(settings, celery_config(settings))
    if not settings.broker_url:
        _bind_queues(app)
    return app


def _bind_queues(app: Celery) -> None:
    """Write every queue's binding into this app's filesystem exchange table now.

    kombu's filesystem transport keeps the bindings it has declared in one process-wide state and skips writing a
    binding it has seen before, but routes by the table in each broker's own control folder: in a process that
    talks to a second filesystem broker (another state dir), the second folder never gets the binding and every
    message for that queue lands on kombu's undeliverable queue, silently. Binding on a connection with a state
    of its own writes the table whatever the process did before.
    """
    from kombu.transport.virtual import BrokerState

    with app.connection_for_write() as conn:
        channel = conn.default_channel
        conn.transport.state = BrokerState()
        for queue in app.amqp.queues.values():
            queue.bind(channel).declare()


def send_generate(app: Celery, order: WorkOrder, **options: Any) -> AsyncResult[Any]:
    """Enqueue one work order on its model's queue; returns once the broker has the message.

    The task id is the job id, so a result (and a redelivered order) is traceable to its request. What Celery
    logs of the task's arguments (its "received" and failure lines, events) names the order, never its prompt:
    prompts are the tenants' content and stay out of logs.
    """
    queue = queue_for(order.request.model)
    return app.send_task(
        GENERATE_TASK,
        args=[order.model_dump_json()],
        queue=queue,
        routing_key=queue,
        exchange=EXCHANGE.name,
        task_id=options.pop("task_id", order.request.job_id),
        argsrepr=options.pop("argsrepr", order_summary(order)),
        **options,
    )


def order_summary(order: WorkOrder) -> str:
    """A work order as logs may show it: who, which model, which plan and role, without the prompts."""
    plan = order.plan
    donor = order.donor.request_id if order.donor is not None else "-"
    return (
        f"[work order {order.request.job_id}: {order.request.model}, {order.role}, plan "
        f"{plan.stage1_steps}/{plan.stage2_steps}/{plan.stage3_steps}, donor {donor}]"
    )


def send_evict(app: Celery, order: EvictOrder, **options: Any) -> AsyncResult[Any]:
    """Enqueue an eviction on the maintenance queue (every worker pool consumes it)."""
    return app.send_task(
        EVICT_TASK,
        args=[order.model_dump_json()],
        queue=MAINTENANCE_QUEUE,
        routing_key=MAINTENANCE_QUEUE,
        exchange=EXCHANGE.name,
        **options,
    )


# Beside a task's state in the result backend: the mark that its result was published (or that the scheduler
# answered it itself), so a later delivery of the same order is skipped instead of answered twice.
ANSWERED_SUFFIX = ".answered"
# Beside it: how many times the order was delivered (workers.tasks.count_attempt).
ATTEMPTS_SUFFIX = ".attempts"


# --- which models have live workers ----------------------------------------------------------------------------
# A worker announces, every few seconds, each model it serves by writing the time under a key beside the task
# results (the result backend is the one store both sides already reach). The scheduler reads it to tell an
# order that waits for a busy worker from one that no worker will ever take.
_PRESENCE = "chorus-presence-"


def _presence_key(app: Celery, model: str) -> Any:
    return app.backend.get_key_for_task(f"{_PRESENCE}{model}")


ANY_MODEL = "*"


def announce_models(app: Celery, models: Sequence[str], *, now: float) -> None:
    """Record that a worker serving ``models`` is alive at ``now`` (unix seconds); ``ANY_MODEL`` records that some
    worker is."""
    for model in [*models, ANY_MODEL]:
        app.backend.set(_presence_key(app, model), repr(now).encode())


def model_last_seen(app: Celery, model: str) -> float | None:
    """When a worker last announced ``model`` (unix seconds), or None if none ever did (or the key expired)."""
    raw = app.backend.get(_presence_key(app, model))
    if raw is None:
        return None
    try:
        return float(raw.decode() if isinstance(raw, bytes) else raw)
    except ValueError:
        return None


def forget_order(app: Celery, task_id: str) -> None:
    """Forget what the backend holds of a task (its state, delivery count and answered mark): for a request sent
    again after it ended, whose new order reuses the task id (its job id) and must run, not be skipped."""
    backend = app.backend
    for suffix in ("", ATTEMPTS_SUFFIX, ANSWERED_SUFFIX):
        key = backend.get_key_for_task(task_id, key=suffix)
        backend.delete(key)


def mark_order_answered(app: Celery, task_id: str) -> None:
    """Mark a task answered (a worker that takes it later skips it): for an order the scheduler answered itself."""
    app.backend.set(app.backend.get_key_for_task(task_id, key=ANSWERED_SUFFIX), b"1")
