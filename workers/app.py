"""The one Celery app of Chorus: broker, queues, routes, limits, all from ``WorkerSettings``.

Importable without torch: the scheduler builds its client from here (``app_for_broker``) and sends work with
``send_generate`` / ``send_evict``; the worker process builds the same app with ``create_app`` and registers
the tasks of ``workers.tasks`` on it.

Brokers:

- ``CHORUS_BROKER_URL=redis://…`` (production): Redis broker; results in Redis too unless
  ``CHORUS_RESULT_BACKEND`` says otherwise. The visibility timeout exceeds the hard time limit so a long task is
  never handed to a second worker while the first still runs it.
- empty ``broker_url`` (the embedded default): kombu's ``filesystem://`` transport in ``state_dir/celery`` with a
  ``file://`` result backend, so a laptop runs real worker processes without Redis.

Delivery semantics: ``acks_late`` + ``reject_on_worker_lost`` + prefetch 1 — an order is acknowledged only
after it ran, and one whose worker died is delivered again (up to ``task_max_attempts`` times, counted by the
task). JSON is the only serializer accepted.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

from celery import Celery
from celery.result import AsyncResult
from kombu import Exchange, Queue

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
from workers.settings import WorkerSettings

EXCHANGE = Exchange("chorus", type="direct", durable=True)
# Headroom of the broker's redelivery timer over the hard time limit.
_VISIBILITY_MARGIN_S = 300.0
_SETTINGS: weakref.WeakKeyDictionary[Celery, WorkerSettings] = weakref.WeakKeyDictionary()

# Built on first access by ``__getattr__`` below (for ``celery -A workers.app``).
app: Celery


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


def celery_config(settings: WorkerSettings) -> dict[str, Any]:
    """The Celery configuration for ``settings`` (a plain dict, so tests and tools can inspect it)."""
    transport_options: dict[str, Any] = {}
    if settings.broker_url:
        broker_url = settings.broker_url
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
            polling_interval=0.25,
        )
    return {
        "broker_url": broker_url,
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
        "worker_concurrency": settings.worker_concurrency,
        # Chorus configures logging itself (structured, CHORUS_LOG_FORMAT).
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
        "timezone": "UTC",
        "enable_utc": True,
    }


def create_app(settings: WorkerSettings | None = None, *, with_tasks: bool = True) -> Celery:
    """A configured Celery app. ``with_tasks`` registers ``chorus.generate`` and ``chorus.evict`` (workers);
    a pure client (the scheduler) needs none, since it sends tasks by name."""
    settings = settings or WorkerSettings()
    app = Celery("chorus", set_as_current=False)
    app.conf.update(celery_config(settings))
    _SETTINGS[app] = settings
    if with_tasks:
        from workers import tasks

        tasks.register(app)
    return app


def settings_of(app: Celery) -> WorkerSettings:
    """The settings ``app`` was built from (the environment's, for an app built elsewhere)."""
    settings = _SETTINGS.get(app)
    if settings is None:
        settings = _SETTINGS[app] = WorkerSettings()
    return settings


def app_for_broker(
    broker_url: str, *, state_dir: Path, result_backend: str = "", **settings_overrides: Any
) -> Celery:
    """The client app the scheduler dispatches with: same queues, routes and serializer as the workers.

    ``broker_url`` empty means the embedded filesystem transport under ``state_dir`` (the same folders the
    workers of that state dir consume). Other ``WorkerSettings`` fields (e.g. ``broker_key_prefix``) may be
    given as keywords; the rest come from the environment.
    """
    settings = WorkerSettings(
        broker_url=broker_url, result_backend=result_backend, state_dir=state_dir, **settings_overrides
    )
    app = create_app(settings, with_tasks=False)
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

    The task id is the request id, so a result (and a redelivered order) is traceable to its request.
    """
    queue = queue_for(order.request.model)
    return app.send_task(
        GENERATE_TASK,
        args=[order.model_dump_json()],
        queue=queue,
        routing_key=queue,
        exchange=EXCHANGE.name,
        task_id=options.pop("task_id", order.request.job_id),
        **options,
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


def __getattr__(name: str) -> Any:
    # `celery -A workers.app …` finds ``app`` here; building it lazily keeps importing this module free of
    # side effects (no state folders created, no environment read) for the scheduler.
    if name == "app":
        global app
        app = create_app()
        return app
    raise AttributeError(name)
