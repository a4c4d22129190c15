"""One embedded stack per state folder: a second would share the first's Celery folders, worker names and logs.

Two stacks on one folder (``chorus demo --keep-running`` in one terminal, ``chorus demo`` in another: both default
to ``.chorus``) had the running stack's worker take the second's orders and publish to its own Kafka, so the
second waited for results that went elsewhere; its S3 stand-in then wrote an empty snapshot over the first's. The
stack holds an exclusive ``flock`` on ``<state folder>/stack.lock`` while it runs (the kernel drops it when the
process ends, however it ends) and writes its pid there to name the holder.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from producer.local.config import StackError

LOCK_NAME = "stack.lock"


class StateFolderBusy(StackError):
    """Another stack holds the state folder."""


class StateFolderLock:
    """The exclusive hold of one state folder by one running stack."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / LOCK_NAME
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Hold the folder and write this process' pid there; ``StateFolderBusy`` naming the holder if another
        stack holds it, ``StackError`` if the folder cannot be made or opened."""
        if self._file is not None:
            return
        handle = self._locked()
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._file = handle

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None

    def held_elsewhere(self) -> bool:
        """Whether another process holds the folder now (checked without keeping it, and leaving its pid)."""
        if self._file is not None or not self.path.exists():
            return False
        try:
            self._locked().close()
        except StateFolderBusy:
            return True
        return False

    def _locked(self) -> IO[str]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = self.path.open("a+")
        except OSError as exc:
            raise StackError(
                f"cannot use the state folder {self.path.parent}: {exc.strerror or exc}"
            ) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise StateFolderBusy(
                f"the state folder {self.path.parent} is in use by another Chorus stack (pid {holder}); "
                "stop that one, or give this one its own folder (--state-dir)"
            ) from None
        return handle
