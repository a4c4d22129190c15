"""The log events that say a Chorus service is ready, declared once for the services that emit them and for
whatever waits on them (the local stack, tests).

A service logs the event as the message of a structured log record (``log.info(ReadinessEvent.MODEL_LOADED,
extra={...})``); with ``CHORUS_LOG_FORMAT=json`` it is the ``event`` field of the JSON line, next to the fields
listed per member below. This module imports nothing else of Chorus, so the scheduler and the workers depend on
it without depending on the local stack.
"""

from __future__ import annotations

from enum import StrEnum


class ReadinessEvent(StrEnum):
    # A scheduler's consumer was assigned partitions; fields ``topic``, ``client``, ``partitions``.
    PARTITIONS_ASSIGNED = "partitions assigned"
    # A worker process loaded a model; fields ``model``, ``device``, ``dtype``, ``load_s``, ``weights_id``.
    MODEL_LOADED = "model loaded"
    # A worker process could not preload a model (it stays up); fields ``model``, ``error``.
    MODEL_NOT_PRELOADED = "model not preloaded"
