"""What the scheduler's and the workers' Prometheus metrics share: the ``/metrics`` endpoint and the series made up
front.

``chorus_sched.metrics`` and ``workers.metrics`` each define their own metrics (the workers in prometheus-client's
multiprocess mode); both create every labelled series at zero when their metrics are made (``zero_series``) and
serve them with ``listen``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


@dataclass
class Exposition:
    """A ``/metrics`` endpoint being served; ``close`` stops it (and whatever was started with it)."""

    port: int
    close: Callable[[], None]
    path: Path | None = None  # the workers' multiprocess folder


def listen(port: int, *, addr: str, registry: CollectorRegistry = REGISTRY) -> Exposition | None:
    """Serve ``registry`` on ``addr:port`` from a daemon thread. A port that cannot be taken is logged and gives
    None: not fatal, the service runs on and Prometheus reports the missing target (``up == 0``)."""
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        log.error("metrics not exposed: cannot listen", extra={"port": port, "error": repr(exc)})
        return None

    def close() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)

    return Exposition(port=int(server.server_port), close=close)


def zero_series(metric: Any, **values: Iterable[str]) -> None:
    """Create the series of ``metric`` for every combination of ``values`` (label name → its values) at zero, so that
    ``rate``/``increase`` see the first event too."""
    names = list(values)
    for combination in itertools.product(*values.values()):
        metric.labels(**dict(zip(names, combination, strict=True)))
