"""The workers' Celery app: the broker side that ``producer.broker`` shares with the scheduler, the worker pool's
own settings, and the tasks of ``workers.tasks`` registered on it.

``chorus worker`` builds it with ``create_app``; ``celery -A workers.app`` finds ``app`` here (built from the
environment on first access). Brokers, delivery semantics and routing are described in ``producer.broker``.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from producer import broker
from workers import tasks
from workers.settings import WorkerSettings

# Built on first access by ``__getattr__`` below (for ``celery -A workers.app``).
app: Celery


def celery_config(settings: WorkerSettings) -> dict[str, Any]:
    """The Celery configuration of a worker for ``settings``: the broker side's, plus the pool's own."""
    return {
        **broker.celery_config(settings),
        "worker_concurrency": settings.worker_concurrency,
        # Chorus configures logging itself (structured, CHORUS_LOG_FORMAT).
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
    }


def create_app(settings: WorkerSettings | None = None) -> Celery:
    """A configured worker app with ``chorus.generate`` and ``chorus.evict`` registered."""
    settings = settings or WorkerSettings()
    app = broker.new_app(settings, celery_config(settings))
    tasks.register(app)
    return app


def __getattr__(name: str) -> Any:
    # `celery -A workers.app …` finds ``app`` here; building it lazily keeps importing this module free of
    # side effects (no state folders created, no environment read).
    if name == "app":
        global app
        app = create_app()
        return app
    raise AttributeError(name)
