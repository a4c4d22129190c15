"""The embedded stack's result backend: Celery's ``file://`` backend with atomic writes.

Celery's filesystem backend writes a key by truncating its file and writing the new value into it, so a reader
that opens the file between the two sees an empty or partial value. Both sides read keys others are writing: the
scheduler's watchdog reads a worker's presence (``producer.broker.model_last_seen``) and task states while the
worker rewrites them every few seconds. On a loaded machine a worker can be descheduled between truncate and
write; chorus bench faults' 1,000-request burst read an empty presence file once and rejected a valid request as
``no_worker``. Here a value is written to a temporary file beside the key and renamed over it (atomic on POSIX),
so a reader sees the old value or the new one, never a torn one.

Selected by ``producer.broker.celery_config`` through Celery's ``<backend class>+<url>`` form of
``result_backend`` for every ``file://`` backend.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from celery.backends.filesystem import FilesystemBackend
from kombu.utils.encoding import ensure_bytes

# The class path Celery resolves in "producer.file_backend:AtomicFilesystemBackend+file:///…".
BACKEND_PATH = "producer.file_backend:AtomicFilesystemBackend"


class AtomicFilesystemBackend(FilesystemBackend):
    def set(self, key: bytes, value: Any) -> None:
        path = self._filename(key)
        # A dot name beside the key: Celery's cleanup looks only at names with its key prefixes.
        temporary = self._filename(b".%s.%d-%s.tmp" % (key, os.getpid(), os.urandom(4).hex().encode()))
        try:
            with open(temporary, "wb") as out:
                out.write(ensure_bytes(value))
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise


def atomic_file_url(result_backend: str) -> str:
    """``result_backend`` with the atomic class in front when it is a plain ``file://`` URL, otherwise as is."""
    return f"{BACKEND_PATH}+{result_backend}" if result_backend.startswith("file://") else result_backend
