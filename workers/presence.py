"""A worker's presence: while it runs, it announces every model it serves (``producer.broker.announce_models``),
so the scheduler can tell an order waiting for a busy worker from one no worker will ever take."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from celery import Celery

from producer.broker import announce_models

log = logging.getLogger(__name__)


@contextmanager
def announcing(app: Celery, models: Sequence[str], interval_s: float) -> Iterator[None]:
    """Announce ``models`` now and every ``interval_s`` seconds until the block ends (best-effort)."""
    stop = threading.Event()

    def loop() -> None:
        while True:
            try:
                announce_models(app, models, now=time.time())
            except Exception as exc:  # the backend is down: the next beat may reach it
                log.warning("could not announce the served models", extra={"error": repr(exc)})
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=loop, name="presence", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
