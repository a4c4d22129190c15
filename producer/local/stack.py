"""The whole Chorus path on one machine, with no server to install: ``EmbeddedStack``.

It starts the embedded stand-ins (``producer.local.standins``: librdkafka's mock cluster for Kafka, moto for S3 with its
objects persisted under the state directory), then ``chorus scheduler`` and ``chorus worker`` processes whose
environment points at them, waits until every process says it is ready, and stops everything in order::

    from producer.local.config import StackOptions
    from producer.local.stack import EmbeddedStack
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

Readiness is observed, not assumed (``producer.local.ready``): a scheduler is ready once its consumers were
assigned the partitions of the requests and results topics, a worker once Celery logged that it is ready and (with
``preload``) each pool process logged that it loaded every model it serves — the events ``ReadinessEvent`` of
``producer.readiness`` declares. A process that exits, or a model that cannot be loaded, fails ``start`` with the
tail of that process' log.

Stopping sends SIGTERM to the schedulers, then to the workers (a warm shutdown: running orders finish), waits,
then kills what is left (each service runs in its own process group, so pool processes go too); then the S3
stand-in writes its snapshot and the Kafka one exits. ``stop`` runs on errors and Ctrl-C too (use ``with``). A
service whose parent dies receives SIGTERM (Linux ``PR_SET_PDEATHSIG``), and a stand-in exits when its stdin
closes, so nothing outlives a killed parent.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from producer.local.config import StackError, StackOptions, metrics_ports, service_env
from producer.local.processes import Role, ServiceProcess, chorus_command, dying_with_parent, kill_group
from producer.local.ready import POLL_S, wait_ready
from producer.local.standins import EmbeddedService, start_service
from producer.local.state_lock import StateFolderLock
from producer.settings import ProducerSettings

if TYPE_CHECKING:
    from chorus_sched.settings import SchedulerSettings
    from workers.settings import WorkerSettings
    from workers.store import ObjectStore

log = logging.getLogger(__name__)


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
        self._folder_lock = StateFolderLock(self.state_dir)

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
            self._folder_lock.acquire()  # before anything is written there
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
            self.env = service_env(
                opts,
                state_dir=self.state_dir,
                kafka_address=self.kafka.address,
                s3_address=self.s3.address,
                s3_access_key=self._s3_access_key,
                s3_secret_key=self._s3_secret_key,
            )
            self._create_topics()
            self._ensure_bucket()
            ports = metrics_ports(opts)
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
            wait_ready(self.processes, opts, self.producer_settings, self.check)
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
            self._folder_lock.release()

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
            kill_group(p)

    def _kill_all(self) -> None:
        for p in self.processes:
            kill_group(p)
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

    # --- faults (``chorus bench faults``) ------------------------------------------------------------------

    def restart(self, name: str, *, wait: bool = True) -> ServiceProcess:
        """Start process ``name`` (``scheduler-0``, ``worker-0``, …) again with its command, port and environment,
        killing whatever is left of its process group first; with ``wait``, return once it is ready."""
        old = next((p for p in self.processes if p.name == name), None)
        if old is None:
            raise StackError(f"the stack has no process {name!r}")
        kill_group(old)
        position = self.processes.index(old)
        self.processes.remove(old)
        self._spawn(
            name,
            old.role,
            old.argv,
            old.metrics_port,
            {"CHORUS_INSTANCE_ID": name} if old.role == "scheduler" else {},
        )
        self.processes.insert(position, new := self.processes.pop())
        if wait:
            group = self.schedulers if new.role == "scheduler" else [new]

            def check() -> None:  # only the restarted process: another may be down on purpose (a fault)
                if not new.alive():
                    raise StackError(f"{name} exited with status {new.process.returncode}:\n{new.log_tail()}")

            wait_ready(group, self.options, self.producer_settings, check)
        return new

    def stop_s3(self) -> None:
        """Stop the S3 stand-in (it writes its snapshot); ``start_s3`` serves the objects again at its address."""
        if self.s3 is None:
            raise StackError("the stack is not running")
        self.s3.stop()

    def start_s3(self) -> None:
        """Start the S3 stand-in stopped by ``stop_s3`` (or killed) again on its port, from its snapshot."""
        if self.s3 is not None and self.s3.process.poll() is not None:
            host, port = self.s3.address.rsplit(":", 1)
            self.s3 = start_service(
                "s3",
                host=host,
                port=int(port),
                persist_dir=self.s3.persist_dir,
                log_path=self.s3.log_path,
                ready_timeout=120.0,
            )

    # --- internals -------------------------------------------------------------------------------------------

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
                    time.sleep(POLL_S)
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
                dying_with_parent(argv),
                env={**self.env, "CHORUS_METRICS_PORT": str(port), **env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir,
                start_new_session=True,  # Ctrl-C reaches the stack, which stops services in order
            )
        proc = ServiceProcess(name, role, argv, log_path, port, process, _read_offset=offset)
        self.processes.append(proc)


def wipe_state(state_dir: Path) -> None:
    """Remove a stack's state directory (``chorus demo --fresh``); refuses paths that are not one."""
    path = Path(state_dir).resolve()
    if not path.exists():
        return
    markers = ("logs", "s3", "ledger.sqlite3", "qdrant", "celery")
    if path == Path(path.anchor) or path == Path.home() or not any((path / m).exists() for m in markers):
        raise StackError(f"{path} does not look like a Chorus state directory; not removing it")
    if StateFolderLock(path).held_elsewhere():
        raise StackError(f"{path} is the state folder of a running Chorus stack; stop it before wiping it")
    shutil.rmtree(path)
