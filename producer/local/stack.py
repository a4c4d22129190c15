"""The whole Chorus path on one machine, with no server to install: ``EmbeddedStack``.

It starts the embedded stand-ins (``producer.embedded``: librdkafka's mock cluster for Kafka, moto for S3 with its
objects persisted under the state directory), then ``chorus scheduler`` and ``chorus worker`` processes whose
environment points at them, waits until every process says it is ready, and stops everything in order::

    from producer.stack import EmbeddedStack, StackOptions
    from producer.sdk import ChorusClient
    from producer.contract import build_request

    with EmbeddedStack(StackOptions(state_dir=Path(".chorus"), models=["tiny-random-wan"])) as stack:
        with ChorusClient(stack.producer_settings) as client:
            watcher = client.watch_results()
            request = build_request(prompt="a red circle moving left", model="tiny-random-wan")
            client.submit(request)
            result = next(watcher.wait([request.request_id], timeout_s=120))
        video = stack.object_store().get(stack.object_store().key_of(result.video_uri))
        print(stack.metrics_urls, stack.log_files)

The services run their production code paths; only their environment differs (``CHORUS_*``: the Kafka bootstrap
address and API version of the mock cluster, the S3 endpoint with credentials generated per stack, the state
directory, where the scheduler keeps its SQLite ledger and Qdrant local-mode index and the Celery filesystem
broker lives, and a metrics port per process). Everything a run leaves behind lives in the state directory:

- ``logs/<name>.log``: each process' output (JSON log lines, ``CHORUS_LOG_FORMAT=json``);
- ``s3/``: the object store's snapshot (written when the stack stops, restored when it starts);
- ``ledger.sqlite3``, ``qdrant/``, ``celery/``: the scheduler's and the broker's embedded state.

Kafka keeps nothing: the mock cluster is in memory, and topics start empty on every start.

Readiness is observed, not assumed: a scheduler is ready once its consumers were assigned the partitions of the
requests and results topics (the ``partitions assigned`` log event), a worker once Celery logged that it is ready
and (with ``preload``) each pool process logged ``model loaded`` for every model it serves. A process that exits,
or a model that cannot be loaded, fails ``start`` with the tail of that process' log.

Stopping sends SIGTERM to the schedulers, then to the workers (a warm shutdown: running orders finish), waits,
then kills what is left (each service runs in its own process group, so pool processes go too); then the S3
stand-in writes its snapshot and the Kafka one exits. ``stop`` runs on errors and Ctrl-C too (use ``with``). A
service whose parent dies receives SIGTERM (Linux ``PR_SET_PDEATHSIG``), and a stand-in exits when its stdin
closes, so nothing outlives a killed parent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from producer.catalog import CATALOG
from producer.embedded import EmbeddedService, start_service
from producer.settings import ProducerSettings

if TYPE_CHECKING:
    from chorus_sched.settings import SchedulerSettings
    from workers.settings import WorkerSettings
    from workers.store import ObjectStore

log = logging.getLogger(__name__)

Role = Literal["scheduler", "worker"]
# The mock cluster speaks ApiVersions ≤ v2; kafka-python must be told the version (see producer/settings.py).
MOCK_KAFKA_API_VERSION = "2.1.0"
_POLL_S = 0.2


class StackError(RuntimeError):
    """The stack could not start (or a process of it died)."""


class StackOptions(BaseModel):
    """What to run. Ports set to 0 are picked free on loopback when the stack starts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state_dir: Path = Path(".chorus")
    models: list[str] = Field(default_factory=lambda: ["toy"], min_length=1)
    schedulers: int = Field(default=1, ge=1, le=16)
    workers: int = Field(default=1, ge=0, le=16)
    worker_concurrency: int = Field(default=1, ge=1, le=64)
    embedder: Literal["minilm", "hashing"] = "minilm"
    # Metrics port of the first scheduler / worker process; the next ones take the following ports.
    scheduler_metrics_port: int = Field(default=0, ge=0, le=65535)
    worker_metrics_port: int = Field(default=0, ge=0, le=65535)
    # Load the models in every worker process when it starts (readiness then includes the model load).
    preload: bool = True
    s3_bucket: str = "chorus"
    # Keep S3 objects across runs in state_dir/s3 (restored on start, written on stop).
    persist_s3: bool = True
    # Added to (and overriding) every service's environment, e.g. {"CHORUS_FOLLOWER_WAIT_S": "10"}.
    extra_env: dict[str, str] = Field(default_factory=dict)
    ready_timeout_s: float = Field(default=300.0, gt=0)
    stop_timeout_s: float = Field(default=60.0, gt=0)

    @field_validator("models")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        unknown = [m for m in value if m not in CATALOG]
        if unknown:
            raise ValueError(f"unknown model(s) {unknown}; known: {sorted(CATALOG)}")
        return list(dict.fromkeys(value))

    @model_validator(mode="after")
    def _ports_apart(self) -> Self:
        s, w = self.scheduler_metrics_port, self.worker_metrics_port
        if s and w:
            sched = set(range(s, s + self.schedulers))
            if sched & set(range(w, w + self.workers)):
                raise ValueError("scheduler and worker metrics port ranges overlap")
        return self


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
        _kill_group(self)
        return int(self.process.returncode)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def _kill_group(p: ServiceProcess) -> None:
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


def _dying_with_parent(argv: list[str]) -> list[str]:
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


class EmbeddedStack:
    """Kafka and S3 stand-ins, schedulers and workers on loopback; a context manager (``start``/``stop``)."""

    def __init__(self, options: StackOptions | None = None, **fields: Any) -> None:
        if options is not None and fields:
            raise TypeError("give StackOptions or keyword fields, not both")
        self.options = options or StackOptions(**fields)
        self.state_dir = Path(self.options.state_dir).resolve()
        self.log_dir = self.state_dir / "logs"
        self.kafka: EmbeddedService | None = None
        self.s3: EmbeddedService | None = None
        self.processes: list[ServiceProcess] = []
        self.env: dict[str, str] = {}
        self._s3_access_key = ""
        self._s3_secret_key = ""
        self._started = False

    # --- lifecycle ------------------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._started

    def __enter__(self) -> Self:
        # ``with EmbeddedStack(...) as stack`` starts it; ``with stack`` after ``stack.start()`` only stops it.
        return self if self._started else self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> Self:
        """Start everything and return once every process is ready; on any failure, stop what started."""
        if self._started:
            raise StackError("the stack is already started")
        self._started = True
        self.processes = []  # a stopped stack may be started again (the processes of its last run stay listed)
        opts = self.options
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            self.kafka = start_service("kafka", log_path=self.log_dir / "kafka.log")
            self.s3 = start_service(
                "s3",
                persist_dir=self.state_dir / "s3" if opts.persist_s3 else None,
                log_path=self.log_dir / "s3.log",
                ready_timeout=120.0,
            )
            self._s3_access_key = "chorus-" + secrets.token_hex(6)
            self._s3_secret_key = secrets.token_urlsafe(24)
            self.env = self._base_env()
            self._create_topics()
            self._ensure_bucket()
            ports = self._metrics_ports()
            cli = chorus_command()
            for i in range(opts.schedulers):
                name = f"scheduler-{i}"
                self._spawn(name, "scheduler", [*cli, "scheduler"], ports[name], {"CHORUS_INSTANCE_ID": name})
            for i in range(opts.workers):
                name = f"worker-{i}"
                argv = [*cli, "worker", "--concurrency", str(opts.worker_concurrency)]
                argv += [a for m in opts.models for a in ("--model", m)]
                argv += ["--hostname", f"{name}@{socket.gethostname()}"]
                argv += ["--preload"] if opts.preload else []
                self._spawn(name, "worker", argv, ports[name], {})
            self._wait_ready()
            log.info(
                "stack ready",
                extra={
                    "state_dir": str(self.state_dir),
                    "kafka": self.kafka.address,
                    "s3": self.s3.address,
                    "processes": {p.name: p.pid for p in self.processes},
                    "seconds": round(time.monotonic() - started, 1),
                },
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the schedulers, then the workers, then the stand-ins (S3 writes its snapshot). Idempotent.

        A second Ctrl-C while stopping kills whatever is still running at once.
        """
        try:
            self._terminate([p for p in self.processes if p.role == "scheduler"])
            self._terminate([p for p in self.processes if p.role == "worker"])
            for service in (self.s3, self.kafka):
                if service is not None:
                    service.stop()
        except BaseException:
            self._kill_all()
            raise
        finally:
            self.s3 = self.kafka = None
            self._started = False

    def _terminate(self, group: list[ServiceProcess]) -> None:
        for p in group:
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    p.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.options.stop_timeout_s
        for p in group:
            try:
                p.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("process did not stop in time; killing it", extra={"process": p.name})
            _kill_group(p)

    def _kill_all(self) -> None:
        for p in self.processes:
            _kill_group(p)
        for service in (self.s3, self.kafka):
            if service is not None and service.process.poll() is None:
                service.process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    service.process.wait(timeout=10)

    # --- what clients need ------------------------------------------------------------------------------------

    @property
    def kafka_address(self) -> str:
        if self.kafka is None:
            raise StackError("the stack is not running")
        return self.kafka.address

    @property
    def s3_endpoint(self) -> str:
        if self.s3 is None:
            raise StackError("the stack is not running")
        return self.s3.address

    def _settings_fields(self) -> dict[str, str]:
        if not self.env:
            raise StackError("the stack is not running")
        return {k[len("CHORUS_") :].lower(): v for k, v in self.env.items() if k.startswith("CHORUS_")}

    @property
    def producer_settings(self) -> ProducerSettings:
        """Settings of a client of this stack (``ChorusClient``, ``ResultWatcher``, ``chorus produce``)."""
        return ProducerSettings(**self._settings_fields())  # type: ignore[arg-type]

    @property
    def worker_settings(self) -> WorkerSettings:
        """The workers' settings: S3 endpoint, bucket and credentials, broker, topics."""
        from workers.settings import WorkerSettings

        fields = {k: v for k, v in self._settings_fields().items() if k != "metrics_port"}
        return WorkerSettings(**fields)  # type: ignore[arg-type]

    @property
    def scheduler_settings(self) -> SchedulerSettings:
        from chorus_sched.settings import SchedulerSettings

        fields = {
            k: v for k, v in self._settings_fields().items() if k not in ("metrics_port", "instance_id")
        }
        return SchedulerSettings(**fields)  # type: ignore[arg-type]

    def object_store(self) -> ObjectStore:
        """A client of the stack's object store (the same adapter the workers use)."""
        from workers.store import ObjectStore

        return ObjectStore.from_settings(self.worker_settings)

    def client_env(self) -> dict[str, str]:
        """An environment for running ``chorus produce`` (or any Chorus command) against this stack."""
        return dict(self.env)

    @property
    def schedulers(self) -> list[ServiceProcess]:
        return [p for p in self.processes if p.role == "scheduler"]

    @property
    def workers(self) -> list[ServiceProcess]:
        return [p for p in self.processes if p.role == "worker"]

    @property
    def metrics_urls(self) -> dict[str, str]:
        return {p.name: p.metrics_url for p in self.processes}

    @property
    def log_files(self) -> dict[str, Path]:
        files = {p.name: p.log_path for p in self.processes}
        for service in (self.kafka, self.s3):
            if service is not None and service.log_path is not None:
                files[service.kind] = service.log_path
        return files

    def metrics_up(self, timeout_s: float = 1.0) -> dict[str, bool]:
        """Whether each process answers on its metrics URL now."""
        up: dict[str, bool] = {}
        for p in self.processes:
            try:
                with urllib.request.urlopen(p.metrics_url, timeout=timeout_s) as response:
                    up[p.name] = response.status == 200
            except (urllib.error.URLError, OSError):
                up[p.name] = False
        return up

    def check(self) -> None:
        """Raise ``StackError`` if a process of the stack has exited."""
        for p in self.processes:
            if not p.alive():
                raise StackError(
                    f"{p.name} exited with status {p.process.returncode}; the end of {p.log_path}:\n"
                    + p.log_tail()
                )
        for service in (self.kafka, self.s3):
            if service is not None and service.process.poll() is not None:
                raise StackError(
                    f"the embedded {service.kind} exited with status {service.process.returncode}"
                )

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Wait until the schedulers have handled (committed) every message on the requests and results topics,
        so every result that arrived is in the donor index — call it before ``stop`` to keep all donors."""
        from producer import bus

        sched = self.scheduler_settings
        groups = [
            (sched.kafka_group_id, sched.kafka_requests_topic),
            (sched.kafka_results_group_id, sched.kafka_results_topic),
        ]
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            progress = [bus.group_progress(sched, g, t) for g, t in groups]
            if all(all(c >= e for c, e in p.values()) for p in progress):
                return
            if time.monotonic() > deadline:
                raise StackError(f"the schedulers did not catch up within {timeout_s:.0f} s: {progress}")
            time.sleep(0.25)

    # --- internals -------------------------------------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        assert self.kafka is not None and self.s3 is not None
        opts = self.options
        env = dict(os.environ)
        env.update(
            {
                "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "CHORUS_STATE_DIR": str(self.state_dir),
                "CHORUS_LOG_FORMAT": "json",
                "CHORUS_KAFKA_BOOTSTRAP": self.kafka.address,
                "CHORUS_KAFKA_API_VERSION": MOCK_KAFKA_API_VERSION,
                "CHORUS_S3_ENDPOINT": self.s3.address,
                "CHORUS_S3_SECURE": "false",
                "CHORUS_S3_BUCKET": opts.s3_bucket,
                "CHORUS_S3_ACCESS_KEY": self._s3_access_key,
                "CHORUS_S3_SECRET_KEY": self._s3_secret_key,
                # The embedded defaults, whatever the calling environment says.
                "CHORUS_BROKER_URL": "",
                "CHORUS_RESULT_BACKEND": "",
                "CHORUS_REDIS_URL": "",
                "CHORUS_QDRANT_URL": "",
                "CHORUS_QDRANT_PATH": "",
                "CHORUS_EMBEDDER": opts.embedder,
                "CHORUS_WORKER_MODELS": ",".join(opts.models),
                # Consumers see the (pre-created) topics' partitions within a second of joining.
                "CHORUS_KAFKA_METADATA_MAX_AGE_MS": "1000",
            }
        )
        env.update(opts.extra_env)
        return env

    def _metrics_ports(self) -> dict[str, int]:
        opts = self.options
        ports: dict[str, int] = {}
        taken: set[int] = set()
        for role, count, first in (
            ("scheduler", opts.schedulers, opts.scheduler_metrics_port),
            ("worker", opts.workers, opts.worker_metrics_port),
        ):
            for i in range(count):
                port = first + i if first else free_port(taken)
                taken.add(port)
                ports[f"{role}-{i}"] = port
        return ports

    def _create_topics(self) -> None:
        """Create the topics now (the mock cluster creates a topic on first metadata request), so the
        schedulers' consumer groups are assigned partitions right away."""
        from producer import bus

        settings = self.producer_settings
        producer = bus.make_producer(settings)
        try:
            for topic in (
                settings.kafka_requests_topic,
                settings.kafka_results_topic,
                settings.kafka_dead_letter_topic,
            ):
                deadline = time.monotonic() + 30
                while not producer.partitions_for(topic):
                    if time.monotonic() > deadline:
                        raise StackError(f"topic {topic} was not created")
                    time.sleep(_POLL_S)
        finally:
            producer.close(timeout=5)

    def _ensure_bucket(self) -> None:
        self.object_store().ensure_bucket()

    def _spawn(self, name: str, role: Role, argv: list[str], port: int, env: dict[str, str]) -> None:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
            out.flush()
            offset = out.tell()
            process = subprocess.Popen(
                _dying_with_parent(argv),
                env={**self.env, "CHORUS_METRICS_PORT": str(port), **env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir,
                start_new_session=True,  # Ctrl-C reaches the stack, which stops services in order
            )
        proc = ServiceProcess(name, role, argv, log_path, port, process, _read_offset=offset)
        self.processes.append(proc)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.options.ready_timeout_s
        partitions = self._partitions()
        pending = list(self.processes)
        while pending:
            self.check()
            for p in list(pending):
                if self._ready(p, partitions):
                    pending.remove(p)
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                tail = pending[0].log_tail()
                raise StackError(
                    f"not ready within {self.options.ready_timeout_s:.0f} s: {names}; "
                    f"the end of {pending[0].log_path}:\n{tail}"
                )
            if pending:
                time.sleep(_POLL_S)

    def _partitions(self) -> dict[str, set[int]]:
        from kafka import KafkaConsumer

        from producer import bus

        settings = self.producer_settings
        consumer = KafkaConsumer(**bus.client_config(settings), group_id=None, enable_auto_commit=False)
        try:
            return {
                topic: set(consumer.partitions_for_topic(topic) or ())
                for topic in (settings.kafka_requests_topic, settings.kafka_results_topic)
            }
        finally:
            consumer.close(autocommit=False)

    def _ready(self, p: ServiceProcess, partitions: dict[str, set[int]]) -> bool:
        events = p.read_events()
        if p.role == "worker":
            for e in events:
                if e.get("event") == "model not preloaded":
                    raise StackError(
                        f"{p.name} could not load model {e.get('model')!r}: {e.get('error')} "
                        f"(log: {p.log_path})"
                    )
            celery_ready = any(
                e.get("logger") == "celery.apps.worker" and str(e.get("event", "")).endswith(" ready.")
                for e in events
            )
            if not self.options.preload:
                return celery_ready
            loaded = sum(1 for e in events if e.get("event") == "model loaded")
            return celery_ready and loaded >= self.options.worker_concurrency * len(self.options.models)
        # A scheduler: assigned its share of both topics, and together the schedulers cover every partition.
        for topic, expected in partitions.items():
            if self._assignment(p, topic) is None:
                return False
            covered: set[int] = set()
            for other in self.schedulers:
                covered |= set(self._assignment(other, topic) or ())
            if not expected <= covered:
                return False
        return True

    @staticmethod
    def _assignment(p: ServiceProcess, topic: str) -> list[int] | None:
        latest = None
        for e in p.read_events():
            if e.get("event") == "partitions assigned" and e.get("topic") == topic:
                latest = list(e.get("partitions") or [])
        return latest


def wipe_state(state_dir: Path) -> None:
    """Remove a stack's state directory (``chorus demo --fresh``); refuses paths that are not one."""
    path = Path(state_dir).resolve()
    if not path.exists():
        return
    markers = ("logs", "s3", "ledger.sqlite3", "qdrant", "celery")
    if path == Path(path.anchor) or path == Path.home() or not any((path / m).exists() for m in markers):
        raise StackError(f"{path} does not look like a Chorus state directory; not removing it")
    shutil.rmtree(path)
