"""Dispatch: work orders and eviction orders onto the Celery broker, through the kernel's broker module.

The client app comes from ``producer.broker.app_for_broker`` (same queues, routes and serializer as the
workers); ``chorus.generate`` goes to the request's model queue with the ``WorkOrder`` as JSON and the request id as the
task id, ``chorus.evict`` to the maintenance queue. Both calls return once the broker has the message, which
is when the scheduler may commit the Kafka offset.

Priority: a request's ``priority`` (0 = normal … 9 = most urgent) is honoured where the transport supports it.
kombu's Redis transport serves *lower* numbers first (buckets 0, 3, 6, 9), so the priority is inverted for it;
AMQP brokers serve higher numbers first (for queues declared with ``x-max-priority``); the filesystem transport
has no priorities and gets none.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from celery import Celery

from producer.broker import (
    app_for_broker,
    forget_order,
    mark_order_answered,
    model_last_seen,
    send_evict,
    send_generate,
)
from producer.orders import EvictOrder, WorkOrder, heartbeat_of

log = logging.getLogger(__name__)


def broker_priority(priority: int, broker_url: str) -> int | None:
    """The Celery ``priority`` for a request priority on this broker, or None where it has no meaning."""
    if broker_url.startswith(("redis://", "rediss://", "unix://", "sentinel://")):
        return 9 - priority
    if broker_url.startswith(("amqp://", "amqps://", "pyamqp://")):
        return priority
    return None


class Dispatcher:
    def __init__(self, app: Celery) -> None:
        self.app = app
        self.broker_url = str(app.conf.broker_url or "")

    @classmethod
    def for_broker(cls, broker_url: str, *, state_dir: Path) -> Dispatcher:
        return cls(app_for_broker(broker_url, state_dir=state_dir))

    def generate(self, order: WorkOrder) -> None:
        options: dict[str, Any] = {}
        priority = broker_priority(order.request.priority, self.broker_url)
        if priority is not None:
            options["priority"] = priority
        send_generate(self.app, order, **options)

    def task_state(self, task_id: str) -> tuple[str, float | None]:
        """The order's Celery state (PENDING until a worker starts it) and its worker's last heartbeat."""
        result = self.app.AsyncResult(task_id)
        return str(result.state), heartbeat_of(result.info)

    def failure_of(self, task_id: str) -> str:
        """Why Celery says the order's task failed (its exception, shortened), for a task in FAILURE."""
        info = self.app.AsyncResult(task_id).info
        return (repr(info) if info is not None else "no reason recorded")[:500]

    def model_last_seen(self, model: str) -> float | None:
        """When a worker last announced ``model`` (``producer.broker.announce_models``)."""
        return model_last_seen(self.app, model)

    def forget(self, task_id: str) -> None:
        """Clear an ended order's task state and marks before its request runs again under the same id."""
        forget_order(self.app, task_id)

    def mark_answered(self, task_id: str) -> None:
        """A worker that takes this order later skips it (the scheduler answered it itself)."""
        mark_order_answered(self.app, task_id)

    def evict(self, order: EvictOrder) -> None:
        send_evict(self.app, order)

    def close(self) -> None:
        self.app.close()
