"""The ``chorus scheduler`` and ``chorus worker`` processes of a local stack: how they are started (in a process
group of their own, dying with their parent), watched (their JSON log lines) and stopped."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

Role = Literal["scheduler", "worker"]


@dataclass
class ServiceProcess:
    """One ``chorus scheduler`` or ``chorus worker`` process of the stack."""

    name: str
    role: Role
    argv: list[str]
    log_path: Path
    metrics_port: int
    process: subprocess.Popen[bytes]
    events: list[dict[str, Any]] = field(default_factory=list)
    _read_offset: int = 0
    _partial: bytes = b""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def alive(self) -> bool:
        return self.process.poll() is None

    def read_events(self) -> list[dict[str, Any]]:
        """Parse the JSON log lines written since the last call; returns all parsed so far."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._read_offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.events
        self._read_offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            text = line.strip()
            if not text.startswith(b"{"):
                continue  # banners and warnings printed outside the logging system
            with contextlib.suppress(ValueError):
                event = json.loads(text)
                if isinstance(event, dict):
                    self.events.append(event)
        return self.events

    def stop(self, timeout_s: float = 60.0) -> int:
        """Stop this process alone (SIGTERM; after ``timeout_s`` its whole process group is killed); returns its
        exit status. The stack's ``stop`` skips a process stopped this way."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("process did not stop in time; killing it", extra={"process": self.name})
        kill_group(self)
        return int(self.process.returncode)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def kill_group(p: ServiceProcess) -> None:
    # The service led its own process group: whatever is left of it (pool processes) goes too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.process.wait(timeout=10)


def free_port(taken: set[int] | None = None) -> int:
    """A TCP port free on 127.0.0.1 now (and not in ``taken``)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not taken or port not in taken:
            return port


def chorus_command() -> list[str]:
    """How to run the ``chorus`` CLI of this environment."""
    script = Path(sys.executable).with_name("chorus")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from producer.cli import main; main()"]


# Runs first in a service's process, then execs the service (keeping the pid): asks the kernel to SIGTERM it when
# the process that started it dies (Linux PR_SET_PDEATHSIG, which survives exec), and gives up if that already
# happened. A program of its own rather than a ``preexec_fn``, which is unsafe in a process with threads.
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(143)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def dying_with_parent(argv: list[str]) -> list[str]:
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]
