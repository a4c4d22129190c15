"""The error codes of a worker's ``failed`` results (``GenerationResult.error.code``), defined once: the runner
answers with them (``workers.results.failed_result``) and ``chorus_worker_failures_total`` is labelled by them
(``workers.metrics``). Torch-free, like both."""

from __future__ import annotations

from enum import StrEnum


class FailureCode(StrEnum):
    """Error codes of ``failed`` results (``GenerationResult.error.code``)."""

    INVALID_ORDER = "invalid_order"
    MODEL_UNAVAILABLE = "model_unavailable"
    ENGINE_ERROR = "engine_error"
    VIDEO_ERROR = "video_error"
    STORE_ERROR = "store_error"
    TIME_LIMIT = "time_limit"
    TOO_MANY_ATTEMPTS = "too_many_attempts"
    INTERNAL = "internal_error"
