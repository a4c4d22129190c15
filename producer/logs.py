"""Structured logging for every Chorus process.

Code logs with the standard library and passes facts as ``extra={...}``; this module renders them either
for a terminal (rich) or as one JSON object per line (``CHORUS_LOG_FORMAT=json``) for log pipelines.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is structured data.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
            **record_fields(record),
        }
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


class ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in record_fields(record).items())
        text = f"{record.name}: {record.getMessage()}" + (f"  {fields}" if fields else "")
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


_debug = False


def set_debug(on: bool) -> None:
    """``chorus --debug``: tracebacks instead of one-line errors, and the client libraries' own logs."""
    global _debug
    _debug = on


def debug_enabled() -> bool:
    return _debug


def configure_logging(level: str = "INFO", fmt: str = "console", *, quiet_clients: bool = False) -> None:
    """Log to stderr at ``level``. Client libraries (kafka-python, urllib3, …) log their warnings too, unless
    ``quiet_clients`` (a command that reports their failures itself, in one line) and not ``--debug``."""
    handler: logging.Handler
    # Logs go to stderr so that commands printing JSON or tables on stdout stay machine-readable.
    if fmt == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
    else:
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(
            console=Console(stderr=True), show_path=False, rich_tracebacks=True, markup=False
        )
        handler.setFormatter(ConsoleFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Client libraries are chatty at INFO; their warnings still come through (unless quiet_clients).
    client_level = logging.CRITICAL + 1 if quiet_clients and not _debug else logging.WARNING
    for noisy in ("kafka", "urllib3", "botocore", "httpx", "celery.redirected"):
        logging.getLogger(noisy).setLevel(client_level)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars and warnings off while a MiniLM encoder loads (the scheduler's, the toy
    model's): a service's log carried a tqdm bar, ``chorus generate`` a "Loading weights" bar above its own, and
    tracing warned about a config field nothing here uses (``loss_type``). Restored afterwards."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
