"""The scheduler's handlers called directly, one request per poll: cost per request and where it goes.

``Scheduler.handle_requests`` and ``Scheduler.handle_results`` run in this thread on messages built here (no
Kafka, no consumer threads), with the production parts behind them: the SQLite ledger, Qdrant local mode, the
MiniLM embedder, the shipped calibration table. The dispatcher only records orders; each order's ``done``
result is handed straight back to ``handle_results``, so the donor index grows as in service. One request per
call is what a poll holds at a moderate rate (at 100 requests/s a poll rarely finds more than one or two).

Two passes over the same kind of traffic: one timed (wall and this thread's CPU time per request, no
profiler), one under ``cProfile`` with the wall clock as timer (so waits — a SQLite commit's fsync, a lock —
show up where they happen, which a CPU profile hides). On a machine other work shares, wall time includes
waiting for a core; the CPU time does not.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chorus_sched.dispatch import Dispatcher
from chorus_sched.service import Scheduler, build_scheduler
from chorus_sched.settings import SchedulerSettings
from producer.contract import GenerationRequest, GenerationResult, ResultStatus
from producer.orders import EvictOrder, WorkOrder, trajectory_prefix
from workers.bench.serve import report, trace
from workers.bench.serve.replay import Shape, requests_for

SHAPE = Shape("toy", 4)
# Phase → the (module file, function) pairs whose cumulative time is that phase (they do not nest in one another).
# Qualified by file: a bare name also matched the service's wrapper of the same name (``handle_results``), which
# counted feedback twice.
PHASES: dict[str, tuple[tuple[str, str], ...]] = {
    "validate": (("parsing.py", "parse_keyed_request"),),
    "claim": (("ledger_sqlite.py", "begin"), ("ledger_redis.py", "begin")),
    "exact": (("exact.py", "admit"),),
    "embed_request": (("intake.py", "_embed_requests"),),
    "search": (("intake.py", "_candidate_sets"),),
    "plan": (("planner.py", "plan"),),
    "dispatch": (
        ("intake.py", "_record_dispatch"),
        ("sched_direct.py", "generate"),
        ("sched.py", "generate"),
    ),
    "results": (("feedback.py", "handle_results"),),
}


@dataclass(frozen=True)
class Record:
    """A Kafka record as the scheduler reads one (``chorus_sched.batch.Message``)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


class RecordingDispatcher(Dispatcher):
    """Keeps the orders; nothing goes to a broker (no Celery app)."""

    def __init__(self) -> None:
        self.broker_url = "recording://"
        self.orders: list[WorkOrder] = []

    def generate(self, order: WorkOrder) -> None:
        self.orders.append(order)

    def task_state(self, task_id: str) -> tuple[str, float | None]:
        return "SUCCESS", None

    def model_last_seen(self, model: str) -> float | None:
        return time.time()

    def forget(self, task_id: str) -> None:
        pass

    def mark_answered(self, task_id: str) -> None:
        pass

    def evict(self, order: EvictOrder) -> None:
        pass

    def close(self) -> None:
        pass


def _result_of(order: WorkOrder) -> GenerationResult:
    request, job = order.request, order.request.job_id
    return GenerationResult(
        request_id=request.request_id,
        tenant=request.tenant,
        status=ResultStatus.DONE,
        video_uri=f"s3://bench/videos/{job}.mp4",
        trajectory_uri=f"s3://bench/{trajectory_prefix(job)}",
        trajectory_bytes=1000,
        plan=order.plan,
        steps_computed=request.num_steps,
        steps_requested=request.num_steps,
        tokens_computed_fraction=1.0,
    )


class _Feeder:
    def __init__(
        self, scheduler: Scheduler, dispatcher: RecordingDispatcher, settings: SchedulerSettings
    ) -> None:
        self.scheduler, self.dispatcher, self.settings = scheduler, dispatcher, settings
        self.offset = 0

    def one(self, request: GenerationRequest) -> None:
        """One request through intake, then the results of the orders it caused through feedback."""
        self.offset += 1
        before = len(self.dispatcher.orders)
        key = request.request_id.encode()
        topic = self.settings.kafka_requests_topic
        self.scheduler.handle_requests([Record(topic, 0, self.offset, key, request.to_bytes())])
        for order in self.dispatcher.orders[before:]:
            self.offset += 1
            result = _result_of(order)
            record = Record(self.settings.kafka_results_topic, 0, self.offset, key, result.to_bytes())
            self.scheduler.handle_results([record])


def profile_direct(root: Path, n: int, seed: int, say: Callable[[str], None]) -> dict[str, Any]:
    settings = SchedulerSettings(state_dir=root, instance_id="bench-direct", kafka_bootstrap="127.0.0.1:9")
    dispatcher = RecordingDispatcher()
    scheduler, close = build_scheduler(settings, dispatcher=dispatcher, publish=lambda *_: None)
    feeder = _Feeder(scheduler, dispatcher, settings)
    try:
        items = trace.generate(trace.TraceSpec(requests=2 * n, seed=seed))
        requests = requests_for(items, SHAPE, prefix="direct-", reuse="auto")
        say(f"direct: {n} requests timed, then {n} profiled")
        wall: list[float] = []
        cpu: list[float] = []
        for request in requests[:n]:
            w, c = time.perf_counter(), time.thread_time()
            feeder.one(request)
            wall.append(time.perf_counter() - w)
            cpu.append(time.thread_time() - c)
        profile = cProfile.Profile(time.perf_counter)
        profile.enable()
        for request in requests[n:]:
            feeder.one(request)
        profile.disable()
        opens = scheduler.index.opens
    finally:
        close()
    phases, top = summarize_profile(profile, n)
    wall_ms = [w * 1000 for w in wall]
    return {
        "requests": n,
        "orders": len(dispatcher.orders),
        "index_opens": opens,  # local mode: how often the folder was opened (each reads every point)
        "wall_ms_per_request": {f"p{q}": round(report.percentile(wall_ms, q), 2) for q in (50, 95, 99)}
        | {"mean": round(sum(wall_ms) / n, 2)},
        "cpu_ms_per_request": round(sum(cpu) / n * 1000, 2),
        "one_core_capacity": round(n / sum(cpu), 1) if sum(cpu) > 0 else None,
        "profile_wall_ms_per_request": phases,
        "top_functions": top,
    }


def summarize_profile(profile: cProfile.Profile, n: int) -> tuple[dict[str, float], list[str]]:
    stats = pstats.Stats(profile)
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = stats.stats  # type: ignore[attr-defined]
    phases = phase_ms(raw, n, PHASES)
    phases["all"] = round(sum(tt for (_, _, tt, _, _) in raw.values()) / n * 1000, 3)
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(12)
    lines = [ln.rstrip() for ln in out.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
    return phases, lines[start:]


def phase_ms(
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]],
    n: int,
    phases: dict[str, tuple[tuple[str, str], ...]],
) -> dict[str, float]:
    """Milliseconds per request of each phase: the cumulative time of its functions, in our modules only."""
    return {
        phase: round(
            sum(
                ct
                for (path, _, func), (_, _, _, ct, _) in raw.items()
                if _ours(path) and (Path(path).name, func) in wanted
            )
            / n
            * 1000,
            3,
        )
        for phase, wanted in phases.items()
    }


def _ours(path: str) -> bool:
    return "site-packages" not in path and any(p in path for p in ("chorus_sched", "producer", "workers"))
