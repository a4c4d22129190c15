"""One scenario's view of the stack: publish, watch, kill and restart, all bounded in time.

A ``Run`` has a request-id prefix of its own (its results are those whose id has it); its requests are the
default tenant's unless a scenario says otherwise (``tenant-id-collision``). It records what a scenario sent
(``sent``), when its fault ended (``fault_end``), its notes, checks and figures; the harness turns that into the
scenario's report. While a scenario waits (``sleep``, ``wait_for``) the run supervises the services as an
orchestrator would: a scheduler or worker that exited without being killed on purpose is counted as a crash and
started again (at most ``MAX_RESTARTS`` times per process and scenario), and the scheduler's resident memory is
sampled.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaProducer

from producer.contract import DEFAULT_TENANT
from producer.local.processes import ServiceProcess
from producer.local.stack import EmbeddedStack
from workers.bench.faults import traffic
from workers.bench.faults.accounting import Key, Received, Sent
from workers.bench.faults.observe import Collector, group_rss_bytes
from workers.bench.faults.traffic import Message

MAX_RESTARTS = 3
POLL_S = 0.1


class ScenarioTimeout(Exception):
    """The scenario ran past its hard bound."""


@dataclass(frozen=True)
class Sizes:
    """How big each scenario is (``QUICK`` and ``FULL`` in ``workers.bench.faults.harness``)."""

    requests: int  # valid requests of a fault scenario
    kills: int  # pool processes killed by pool-process-kill
    s3_down_s: float
    s3_hang_s: float
    index_hold_s: float  # per phase: Qdrant's storage lock held, then the index's own lock
    hostile: int
    hostile_valid_every: int  # a valid request after every this many hostile ones
    big_prompts: int  # of the hostile messages, 1 MB prompts
    collision_pairs: int
    burst: int
    deadline_s: float  # how long results may take after the last send or the end of the fault
    burst_deadline_s: float
    settle_s: float  # reading on after the last expected answer, for late duplicates
    scenario_cap_s: float  # hard bound on one scenario


@dataclass
class Run:
    name: str
    stack: EmbeddedStack
    producer: KafkaProducer
    collector: Collector
    sizes: Sizes
    say: Callable[[str], None] = print
    prefix: str = ""
    tenant: str = ""
    seed_base: int = -1
    sent: list[Sent] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    fault_end: float | None = None
    scheduler_restarts: int = 0
    scheduler_crashes: int = 0
    worker_restarts: int = 0
    worker_crashes: int = 0
    peak_scheduler_rss: int = 0
    started: float = field(default_factory=time.monotonic)
    _down: set[str] = field(default_factory=set)
    _given_up: set[str] = field(default_factory=set)
    _crashes: dict[str, int] = field(default_factory=dict)
    _last_sample: float = 0.0

    def __post_init__(self) -> None:
        short = "".join(w[0] for w in self.name.split("-"))
        self.prefix = self.prefix or f"{short}-{secrets.token_hex(3)}-"
        self.tenant = self.tenant or DEFAULT_TENANT
        self.seed_base = self.seed_base if self.seed_base >= 0 else secrets.randbelow(2**40)
        self.cap = self.started + self.sizes.scenario_cap_s

    # --- publishing ---------------------------------------------------------------------------------------------

    def request(
        self,
        i: int,
        *,
        text: str | None = None,
        tenant: str | None = None,
        reuse: str = "auto",
        name: str = "",
    ) -> Message:
        """This scenario's valid request number ``i`` (id ``<prefix><name or i>``): ``traffic.prompt(i)`` unless
        ``text`` is given, and a seed no other scenario uses."""
        return traffic.valid(
            f"{self.prefix}{name or i}",
            text if text is not None else traffic.prompt(i),
            tenant=tenant or self.tenant,
            seed=self.seed_base + i,
            reuse=reuse,
        )

    def publish(self, messages: Iterable[Message], *, timeout_s: float = 60.0) -> list[Sent]:
        """Publish raw messages and wait until the broker has each; returns (and records) what was sent."""
        topic = self.stack.producer_settings.kafka_requests_topic
        pending: list[tuple[Message, Any, float]] = []
        for m in messages:
            try:
                pending.append((m, self.producer.send(topic, key=m.key, value=m.value), time.monotonic()))
            except Exception as exc:
                self.notes.append(f"could not publish a {m.kind} message: {exc!r}"[:300])
        out = []
        for m, future, at in pending:
            try:
                meta = future.get(timeout=timeout_s)
            except Exception as exc:
                self.notes.append(f"could not publish a {m.kind} message: {exc!r}"[:300])
                continue
            out.append(Sent(m.tenant, m.request_id, m.valid, m.kind, meta.partition, meta.offset, at))
        self.sent += out
        return out

    # --- what came back -----------------------------------------------------------------------------------------

    def results(self) -> list[Received]:
        return [r for r in self.collector.results() if r.request_id.startswith(self.prefix)]

    def result_of(self, key: Key) -> Received | None:
        return next((r for r in self.results() if r.key == key), None)

    def answered(self) -> set[Key]:
        return {r.key for r in self.results()}

    def wait_for(self, keys: set[Key] | None = None, *, within_s: float, letters: bool = False) -> bool:
        """Wait until every valid request sent (or ``keys``) has a result, and with ``letters`` every hostile
        message a dead letter; give up after ``within_s``. Then read on for ``settle_s`` (late duplicates)."""
        want = keys if keys is not None else {s.key for s in self.sent if s.valid and s.key is not None}
        hostile = {(s.partition, s.offset) for s in self.sent if not s.valid} if letters else set()
        until = time.monotonic() + within_s
        while True:
            missing = want - self.answered()
            if hostile:
                hostile -= {(x.partition, x.offset) for x in self.collector.letters()}
            if not missing and not hostile:
                self.sleep(self.sizes.settle_s)
                return True
            if time.monotonic() > until:
                return False
            self.sleep(0.25)

    def wait_results(self, count: int, *, within_s: float) -> bool:
        """Wait until at least ``count`` results of this scenario arrived."""
        until = time.monotonic() + within_s
        while len(self.results()) < count:
            if time.monotonic() > until:
                return False
            self.sleep(0.1)
        return True

    # --- time and supervision -------------------------------------------------------------------------------

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            self.supervise()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(POLL_S, left))

    def supervise(self) -> None:
        now = time.monotonic()
        if now > self.cap:
            raise ScenarioTimeout(f"{self.name} ran past its bound of {self.sizes.scenario_cap_s:.0f} s")
        if now - self._last_sample >= 0.5:
            self._last_sample = now
            for p in self.stack.schedulers:
                if p.alive():
                    self.peak_scheduler_rss = max(self.peak_scheduler_rss, group_rss_bytes(p.pid))
        for p in list(self.stack.processes):
            if p.alive() or p.name in self._down or p.name in self._given_up:
                continue
            self._crashed(p)

    def _crashed(self, p: ServiceProcess) -> None:
        n = self._crashes[p.name] = self._crashes.get(p.name, 0) + 1
        if p.role == "scheduler":
            self.scheduler_crashes += 1
        else:
            self.worker_crashes += 1
        self.say(f"[red]{p.name} exited (status {p.process.returncode}); crash {n}[/]")
        self.notes.append(f"{p.name} exited by itself with status {p.process.returncode} (crash {n})")
        if n > MAX_RESTARTS:
            self._given_up.add(p.name)
            self.notes.append(f"{p.name} not restarted after {MAX_RESTARTS} restarts")
            return
        self.restart(p.name)

    def process(self, name: str) -> ServiceProcess:
        return next(p for p in self.stack.processes if p.name == name)

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Kill a service's whole process group on purpose (the supervisor leaves it down until ``restart``)."""
        p = self.process(name)
        self._down.add(name)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.process.wait(timeout=10)

    def restart(self, name: str) -> bool:
        """Start ``name`` again and wait until it is ready; False (and a note) if it died while starting."""
        role = self.process(name).role
        if role == "scheduler":
            self.scheduler_restarts += 1
        else:
            self.worker_restarts += 1
        self._down.discard(name)
        try:
            self.stack.restart(name)
            return True
        except Exception as exc:
            self.notes.append(f"{name} did not come back: {str(exc)[:300]}")
            return False

    def scheduler_alive(self) -> bool:
        return all(p.alive() for p in self.stack.schedulers)

    def worker_events(self, name: str = "worker-0") -> list[dict[str, Any]]:
        return self.process(name).read_events()
