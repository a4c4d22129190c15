"""The lock Chorus processes share a Qdrant local-mode folder by, and the courtesy that lets one keep it.

Qdrant local mode admits one process per folder, and opening the folder is the costly part of an index
operation: the client reads every stored point and builds its schema parser (``chorus bench sched``: most of the
scheduler's time per request went there when the folder was opened per operation). So a process may keep the
folder open between operations, and lets go as soon as another process wants it:

- ``<path>/.chorus-index.lock`` is taken with ``flock`` (exclusive) for as long as a process has the folder open;
  the kernel releases it when the process dies;
- a process that finds it taken announces itself with a marker file in ``<path>/.chorus-index.waiting/`` and
  polls, touching the marker at every poll; the holder looks for markers at the end of every operation (and,
  idle, every poll interval: ``chorus_sched.index``) and closes the folder. A marker whose pid is gone or that
  nobody touched for ``STALE_MARKER_S`` is a dead waiter's and is removed (a live waiter whose marker was
  removed writes it again at its next poll);
- a process that comes back while others are announced waits its turn behind them instead of taking the lock
  back first.

A process that waits longer than its ``wait_s`` gives up with ``IndexUnavailable`` (the scheduler then computes
requests in full instead of stalling). Tools that do not follow this protocol (a plain ``QdrantClient(path)``)
find the folder busy while a scheduler keeps it open; ``FolderLock.exclusive`` takes it for them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_FILE = ".chorus-index.lock"
WAITING_DIR = ".chorus-index.waiting"
STALE_MARKER_S = 2.0  # waiters touch their marker every poll (20 ms)


class IndexUnavailable(RuntimeError):
    """The index cannot be opened now (another process holds it past the wait, or the server is down)."""


class FolderLock:
    """One process' handle on the folder's lock: ``acquire`` (waiting at most ``wait_s``), ``release``, and
    ``others_waiting`` (whether another holder-to-be has announced itself)."""

    def __init__(self, path: Path, wait_s: float, poll_s: float = 0.02) -> None:
        self.path = path
        self.wait_s = wait_s
        self.poll_s = poll_s
        self._fd: int | None = None
        self._token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._waiting = path / WAITING_DIR
        _LOCKS.add(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._take(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor releases the lock

    def others_waiting(self) -> bool:
        """Whether a live process other than this handle has announced that it waits for the lock."""
        try:
            names = [e.name for e in os.scandir(self._waiting)]
        except FileNotFoundError:
            return False
        now = time.time()
        for name in names:
            if name == self._token:
                continue
            marker = self._waiting / name
            try:
                fresh = now - marker.stat().st_mtime < STALE_MARKER_S
            except FileNotFoundError:
                continue
            if fresh and _alive(name):
                return True
            with contextlib.suppress(FileNotFoundError):
                marker.unlink()  # a dead (or stopped) waiter's marker
        return False

    def _take(self, fd: int) -> None:
        start = time.monotonic()
        next_report = start + 2.0
        announced = False
        try:
            while True:
                # Behind announced waiters, try only once announced too (then all compete on equal terms).
                if announced or not self.others_waiting():
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        return
                    except BlockingIOError:
                        pass
                self._waiting.mkdir(exist_ok=True)
                (self._waiting / self._token).touch()  # announce, and show it is still waiting
                announced = True
                now = time.monotonic()
                if now - start >= self.wait_s:
                    raise IndexUnavailable(
                        f"index at {self.path} held by another process for over {self.wait_s:g} s"
                    )
                if now >= next_report:
                    log.warning(
                        "waiting for the index lock",
                        extra={"path": str(self.path), "waited_s": round(now - start, 1)},
                    )
                    next_report = now + 5.0
                time.sleep(self.poll_s)
        finally:
            if announced:
                with contextlib.suppress(FileNotFoundError):
                    (self._waiting / self._token).unlink()

    @classmethod
    @contextlib.contextmanager
    def exclusive(cls, path: Path, wait_s: float = 60.0) -> Iterator[None]:
        """The folder's lock for the block: every Chorus process lets go of the index (and none opens it) until
        the block ends. For tools and tests that then use the folder, or hold it, outside this protocol."""
        lock = cls(Path(path), wait_s)
        lock.acquire()
        try:
            yield
        finally:
            lock.release()


_LOCKS: weakref.WeakSet[FolderLock] = weakref.WeakSet()


def _forget_locks_in_child() -> None:
    """A forked child shares the parent's open lock descriptions: it closes its copies (the parent keeps the
    lock) and takes the lock anew, under its own pid, if it opens the index."""
    for lock in list(_LOCKS):
        if lock._fd is not None:
            os.close(lock._fd)
            lock._fd = None
        lock._token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


os.register_at_fork(after_in_child=_forget_locks_in_child)


def _alive(marker: str) -> bool:
    pid_text = marker.split("-", 1)[0]
    if not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True
