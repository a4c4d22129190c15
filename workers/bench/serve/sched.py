"""``chorus bench sched``: the scheduler's own cost per request, with workers that answer at once.

The production scheduler (``chorus_sched.service.run``: both consumer loops, the SQLite ledger, Qdrant local
mode, the MiniLM embedder, the shipped calibration table) runs in this process against the embedded Kafka-protocol
broker (a helper process, as in ``chorus demo``). Its dispatcher is the one part replaced: ``InstantWorkers`` takes
each order, notes the time and answers it at once with a ``done`` result on the results topic (from a thread of
its own), so what is measured is the scheduler and nothing behind it. Requests are the ``mixed`` trace's toy
prompts (``workers.bench.serve.trace``), so exact hits, coalescing, donor searches and plans all happen.

First the handlers alone (``workers.bench.serve.sched_direct``: called directly, timed, then profiled). Then
two measurements through Kafka (``--core N`` pins the process to one core with ``os.sched_setaffinity``; the broker helper
keeps its own):

1. **latency** at a fixed open-loop rate (default 100 requests/s), published from a process of its own
   (``workers.bench.serve.pacer``): the added latency of each dispatched request, from the publisher handing it
   to its Kafka producer to the scheduler's order reaching the dispatcher (``added_ms``), and the part of it
   spent in the scheduler, from the poll that read it reaching the handler to its order's dispatch
   (``in_scheduler_ms``: parse and validate, claim, exact-hit check, embed, search, plan, dispatch, and waiting
   behind the requests of the same poll). Before the scheduler starts, the same traffic through the same
   broker to a bare consumer (``broker``) gives what the Kafka path alone adds;
2. **sustained rate**: a backlog of requests published before the scheduler reads them, drained as fast as it can;
   the rate is requests handled per second of draining. On a machine other work shares, that wall-clock rate
   says as much about the other work as about the scheduler, so the CPU time of the two consumer threads
   (``/proc/self/task/<tid>/stat``: polls, handlers, commits) is read too: ``cpu_ms_per_request``, and its
   inverse, ``one_core_capacity`` (requests per second one core could sustain). A second backlog (the trace
   at the next seed) is drained under ``cProfile`` (both consumer threads' handlers, wall clock) for the
   milliseconds per request of each scheduler phase and the top functions; the profiler's own cost inflates
   those (``profiled_cpu_ms_per_request`` against ``cpu_ms_per_request`` says by how much).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import os
import pstats
import queue
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from chorus_sched.batch import BatchOutcome, Message
from chorus_sched.dispatch import Dispatcher
from chorus_sched.service import Scheduler, build_scheduler, run
from chorus_sched.settings import SchedulerSettings
from producer import bus
from producer.contract import GenerationRequest, GenerationResult, ResultStatus
from producer.local.config import MOCK_KAFKA_API_VERSION
from producer.local.standins import EmbeddedService, start_service
from producer.orders import EvictOrder, WorkOrder, trajectory_prefix
from workers.bench.serve import report, trace
from workers.bench.serve.pacer import publish_paced
from workers.bench.serve.replay import Shape, requests_for
from workers.bench.serve.sched_direct import PHASES, phase_ms, profile_direct

FORMAT = "chorus-bench-sched/1"
Handler = Callable[[Sequence[Message]], BatchOutcome]
SHAPE = Shape("toy", 4)
# The backlog report's phases: the direct measurement's, under the names this report has always used.
PHASE_FUNCTIONS = {
    {"embed_request": "embed", "results": "feedback"}.get(phase, phase): functions
    for phase, functions in PHASES.items()
}


class InstantWorkers(Dispatcher):
    """A dispatcher whose 'workers' answer each order at once: the order's time is noted and a ``done`` result
    (with a trajectory URI, so the scheduler indexes a donor) goes to the results topic from a thread."""

    def __init__(self, settings: SchedulerSettings) -> None:  # no Celery app: nothing is sent to a broker
        self.broker_url = "instant://"
        self.settings = settings
        self.dispatched: dict[str, float] = {}
        self._orders: queue.Queue[WorkOrder | None] = queue.Queue()
        self._thread = threading.Thread(target=self._answer, name="instant-workers", daemon=True)
        self._thread.start()

    def generate(self, order: WorkOrder) -> None:
        self.dispatched[order.request.request_id] = time.monotonic()
        self._orders.put(order)

    def _answer(self) -> None:
        producer = bus.make_producer(self.settings)
        try:
            while (order := self._orders.get()) is not None:
                request = order.request
                job = request.job_id
                result = GenerationResult(
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
                # Not flushed one by one: results then leave in the producer's batches (5 ms linger), which the
                # embedded broker hands out one per partition per fetch, as a real broker hands out all it has.
                producer.send(self.settings.kafka_results_topic, key=job.encode(), value=result.to_bytes())
                self._orders.task_done()
        finally:
            producer.close(timeout=5)

    def idle(self) -> bool:
        return self._orders.unfinished_tasks == 0

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
        self._orders.put(None)
        self._thread.join(timeout=10)


@dataclass(frozen=True)
class SchedOptions:
    rate: float = 100.0
    latency_requests: int = 1000
    backlog: int = 2000
    direct_requests: int = 200  # per pass of the direct measurement (``sched_direct``)
    seed: int = 0
    core: int | None = None  # None: not pinned
    state_dir: Path | None = None


@dataclass
class _Harness:
    settings: SchedulerSettings
    scheduler: Scheduler
    workers: InstantWorkers
    profiles: dict[str, cProfile.Profile]
    profiling: threading.Event
    polled: dict[str, float] = field(default_factory=dict)  # request id → when its poll reached the handler
    poll_sizes: list[int] = field(default_factory=list)  # requests per poll handed to the handler
    result_poll_sizes: list[int] = field(default_factory=list)  # results per poll handed to feedback
    requests_before: int = 0
    results_before: int = 0
    # The scheduler's counts as of its handlers' last *return*: it counts a request when it admits it, before the
    # poll's embedding and scheduling, so a drain that waited on its counts alone ended (and stopped its clock
    # and its profile) while the last poll was still being scheduled.
    requests_done: int = 0
    results_done: int = 0

    def mark(self) -> None:
        """Count the scheduler's handled requests and results from now on."""
        self.requests_before = self.requests_done = self.scheduler.stats.requests
        self.results_before = self.results_done = self.scheduler.stats.results

    def profiled(self, name: str, handle: Handler) -> Handler:
        """``handle`` profiled while ``profiling`` is set (cProfile sees only the thread that enables it)."""
        # Wall clock: with thread CPU time as its timer, cProfile attributed several times the threads' measured
        # CPU time to long C calls (MiniLM's graph, SQLite's commits) in some runs. Wall time also counts what
        # a handler waits for (the interpreter lock, a commit's fsync), which is what a backlog waits for too.
        profile = self.profiles[name] = cProfile.Profile(time.perf_counter)

        def wrapped(messages: Sequence[Message]) -> BatchOutcome:
            if name == "results":
                self.result_poll_sizes.append(len(messages))
            elif name == "requests":
                self.poll_sizes.append(len(messages))
                now = time.monotonic()
                for m in messages:
                    if m.key is not None:
                        self.polled.setdefault(m.key.decode(errors="replace"), now)
            try:
                if not self.profiling.is_set():
                    return handle(messages)
                profile.enable()
                try:
                    return handle(messages)
                finally:
                    profile.disable()
            finally:
                self._returned(name)

        return wrapped

    def _returned(self, name: str) -> None:
        stats = self.scheduler.stats
        if name == "requests":
            self.requests_done = stats.requests
        else:
            self.results_done = stats.results


def run_sched(options: SchedOptions, say: Callable[[str], None]) -> dict[str, Any]:
    root = options.state_dir or Path(tempfile.mkdtemp(prefix="chorus-sched-"))
    root.mkdir(parents=True, exist_ok=True)
    # Started before pinning: the broker keeps a core of its own.
    probe_before = report.speed_probe_ms()
    kafka = start_service("kafka", log_path=root / "kafka.log")
    core = _pin(options.core) if options.core is not None else None
    direct = profile_direct(root / "direct", options.direct_requests, options.seed, say)
    try:
        broker = _broker_baseline(_settings(root, kafka), options)
        with _scheduler(root, kafka) as harness:
            where = f"on core {core}" if core is not None else "(not pinned)"
            say(f"scheduler up {where}; {options.latency_requests} requests at {options.rate:g}/s")
            latency = _latency(harness, options)
            say(f"backlog of {options.backlog} requests, then another profiled")
            sustained = _sustained(harness, options)
    finally:
        kafka.stop()
    if options.state_dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "format": FORMAT,
        "machine": {
            "cores": os.cpu_count(),
            "pinned_core": core,
            "load_average": list(os.getloadavg()),
            "speed_probe_ms": [probe_before, report.speed_probe_ms()],  # before, after: lower is faster
        },
        "embedder": harness.settings.embedder,
        # auto, float32 or bfloat16 as set, and what the vectors were (MiniLM's ``numbers``)
        "embed_precision": harness.settings.embed_precision,
        "embed_numbers": getattr(getattr(harness.scheduler.embedder, "inner", None), "numbers", None),
        "direct": direct,
        "latency": latency,
        "broker": broker,
        "sustained": sustained,
    }


def _pin(core: int) -> int | None:
    if not hasattr(os, "sched_setaffinity"):
        return None
    os.sched_setaffinity(0, {core})
    return core


LOOP_THREADS = ("chorus-requests", "chorus-results")


def loop_cpu_s() -> float:
    """CPU seconds (user + system) the scheduler's consumer-loop threads have used so far (Linux; 0 elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0.0
    for thread in threading.enumerate():
        if thread.name not in LOOP_THREADS or thread.native_id is None:
            continue
        try:
            stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[
            1
        ].split()  # after the command name: state is first, utime 12th, stime 13th
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _settings(root: Path, kafka: EmbeddedService) -> SchedulerSettings:
    return SchedulerSettings(
        state_dir=root,
        kafka_bootstrap=kafka.address,
        kafka_api_version=MOCK_KAFKA_API_VERSION,
        kafka_metadata_max_age_ms=1000,
        instance_id="bench-sched",
    )


@contextlib.contextmanager
def _scheduler(root: Path, kafka: EmbeddedService) -> Iterator[_Harness]:
    settings = _settings(root, kafka)
    _create_topics(settings)
    workers = InstantWorkers(settings)
    scheduler, close = build_scheduler(settings, dispatcher=workers)
    harness = _Harness(settings, scheduler, workers, {}, threading.Event())
    # ``run`` hands the loops these attributes; the instance's own shadow the class' methods.
    scheduler.handle_requests = harness.profiled("requests", scheduler.handle_requests)  # type: ignore[method-assign,assignment]
    scheduler.handle_results = harness.profiled("results", scheduler.handle_results)  # type: ignore[method-assign,assignment]
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=run, args=(settings, stop), kwargs={"scheduler": scheduler, "on_ready": ready.set}, daemon=True
    )
    thread.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the scheduler did not start within 120 s")
        time.sleep(3)  # the consumer groups' first assignment
        yield harness
    finally:
        stop.set()
        thread.join(timeout=60)
        close()


def _create_topics(settings: SchedulerSettings) -> None:
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
                    raise RuntimeError(f"topic {topic} was not created")
                time.sleep(0.1)
    finally:
        producer.close(timeout=5)


def _requests(options: SchedOptions, n: int, tag: str) -> list[GenerationRequest]:
    items = trace.generate(trace.TraceSpec(requests=n, seed=options.seed))
    return requests_for(items, SHAPE, prefix=f"{tag}-", reuse="auto")


def _latency(harness: _Harness, options: SchedOptions) -> dict[str, Any]:
    requests = _requests(options, options.latency_requests, "lat")
    harness.mark()
    sent_at, offered_s = publish_paced(
        harness.settings,
        harness.settings.kafka_requests_topic,
        [(r.request_id.encode(), r.to_bytes()) for r in requests],
        options.rate,
    )
    sent = {key.decode(): at for key, at in sent_at.items()}
    _wait_settled(harness, requests, timeout_s=600)
    dispatched = harness.workers.dispatched
    ms = [(dispatched[r] - sent[r]) * 1000 for r in sent if r in dispatched]
    inside = [
        (dispatched[r] - harness.polled[r]) * 1000 for r in sent if r in dispatched and r in harness.polled
    ]
    return {
        "rate": options.rate,
        "offered_rate": round(len(requests) / offered_s, 1),
        "requests": len(requests),
        "dispatched": len(ms),
        "answered_without_order": len(requests) - len(ms),
        "added_ms": _quantiles(ms),
        "in_scheduler_ms": _quantiles(inside),
    }


def _mean(values: Sequence[int], digits: int = 1) -> float:
    return round(statistics.mean(values), digits) if values else 0.0


def _quantiles(ms: Sequence[float]) -> dict[str, float]:
    return {f"p{q}": round(report.percentile(ms, q), 2) for q in (50, 95, 99)} | {
        "max": round(max(ms, default=float("nan")), 2)
    }


# Per poll of the broker baseline's busy consumer: about what the scheduler spends on a poll at 100 requests/s.
BUSY_WORK_S = 0.02


def _broker_baseline(settings: SchedulerSettings, options: SchedOptions) -> dict[str, Any]:
    """What the Kafka path alone adds at the latency pass's rate: published → handed to a consumer of its own
    group on a topic of its own, same client settings, no scheduler; then again with a consumer that spends
    ``BUSY_WORK_S`` after each poll, as a scheduler does. The embedded broker (librdkafka's mock cluster) holds a
    fetch until ``fetch_max_wait_ms`` runs out and answers with at most one producer batch per partition (its
    Fetch handler's "FIXME: Multiple messageSets"), so a consumer that works between polls reads a few records
    per round trip and falls behind; a real broker answers as soon as data arrives, with all of it."""
    idle = _broker_pass(settings, options, "chorus-bench-probe", work_s=0.0)
    busy = _broker_pass(settings, options, "chorus-bench-probe-busy", work_s=BUSY_WORK_S)
    return idle | {"busy": {"work_ms_per_poll": BUSY_WORK_S * 1000} | busy}


def _broker_pass(
    settings: SchedulerSettings, options: SchedOptions, topic: str, *, work_s: float
) -> dict[str, Any]:
    consumer = bus.make_consumer(settings, [topic], group_id=topic, auto_offset_reset="latest")
    received: dict[bytes, float] = {}
    polls: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(timeout_ms=100)
        stop = threading.Event()

        def consume() -> None:
            while not stop.is_set():
                batch = consumer.poll(timeout_ms=settings.poll_timeout_ms)
                now = time.monotonic()
                for records in batch.values():
                    for record in records:
                        received[record.key] = now
                if batch:
                    polls.append(sum(len(records) for records in batch.values()))
                    consumer.commit()
                    time.sleep(work_s)

        reader = threading.Thread(target=consume, name="bench-probe", daemon=True)
        reader.start()
        messages = [(f"probe-{i}".encode(), b"x" * 300) for i in range(options.latency_requests)]
        sent, _ = publish_paced(settings, topic, messages, options.rate)
        settle = time.monotonic() + 30
        while len(received) < len(sent) and time.monotonic() < settle:
            time.sleep(0.05)
        stop.set()
        reader.join(timeout=10)
    finally:
        consumer.close()
    ms = [(received[k] - t) * 1000 for k, t in sent.items() if k in received]
    return {
        "messages": len(sent),
        "received": len(ms),
        "records_per_poll": _mean(polls, digits=2),
        "delivery_ms": _quantiles(ms),
    }


def _sustained(harness: _Harness, options: SchedOptions) -> dict[str, Any]:
    """A backlog drained as fast as the scheduler can: requests per second and CPU per request, unprofiled; then
    another backlog (other prompts, so no exact hits on the first or on the latency pass) drained under the
    profiler for where the time goes. cProfile's hooks cost more than the scheduler's own Python on short calls
    (word alignments, planner rows), so a profiled drain overstates the cost per request: its CPU time is
    reported apart."""
    # Each pass its own seed: a trace of the latency pass's length and seed is the same requests, which the
    # scheduler would answer as exact hits (with ``--latency-requests`` equal to ``--backlog``, all of them).
    measured = _drain(
        harness, _requests(replace(options, seed=options.seed + 1), options.backlog, "bl"), profiled=False
    )
    requests = _requests(replace(options, seed=options.seed + 2), options.backlog, "blp")
    profiled = _drain(harness, requests, profiled=True)
    phases, top = _profile_summary(harness.profiles, profiled["handled"])
    return measured | {
        "profiled_cpu_ms_per_request": profiled["cpu_ms_per_request"],
        "ms_per_request": phases,
        "top_functions": top,
    }


def _drain(harness: _Harness, requests: Sequence[GenerationRequest], *, profiled: bool) -> dict[str, Any]:
    stats = harness.scheduler.stats
    harness.mark()
    before = stats.requests
    if profiled:
        harness.profiling.set()
    polls_before, result_polls_before = len(harness.poll_sizes), len(harness.result_poll_sizes)
    # Big producer batches: the embedded broker answers a fetch with one producer batch per partition, so a
    # backlog sent record by record would be read a few records per round trip, which a real broker does not do.
    producer = bus.make_producer(harness.settings, linger_ms=100, batch_size=1 << 20)
    cpu_before = loop_cpu_s()
    start = time.monotonic()
    try:
        for request in requests:
            value = request.model_copy(update={"submitted_at": _now()}).to_bytes()
            producer.send(harness.settings.kafka_requests_topic, key=request.request_id.encode(), value=value)
        producer.flush(timeout=60)
    finally:
        producer.close(timeout=5)
    published_s = time.monotonic() - start
    drained = _wait_settled(harness, requests, timeout_s=1200)
    cpu_s = loop_cpu_s() - cpu_before
    harness.profiling.clear()
    drain_s = drained - start
    handled = stats.requests - before
    return {
        "requests": len(requests),
        "handled": handled,
        "publish_s": round(published_s, 2),
        "drain_s": round(drain_s, 2),
        "rate": round(handled / drain_s, 1) if drain_s > 0 else None,
        "wall_ms_per_request": round(drain_s / handled * 1000, 3) if handled else None,
        "cpu_ms_per_request": round(cpu_s / handled * 1000, 3) if handled else None,
        "one_core_capacity": round(handled / cpu_s, 1) if cpu_s > 0 else None,
        "requests_per_poll": _mean(harness.poll_sizes[polls_before:]),
        "results_per_poll": _mean(harness.result_poll_sizes[result_polls_before:]),
    }


def _wait_settled(harness: _Harness, requests: Sequence[GenerationRequest], *, timeout_s: float) -> float:
    """Wait until the scheduler's handlers have returned from every request and from the result of every order
    it sent; returns the monotonic time they had. Counted from its own stats as of those returns (asking Kafka
    would take this core from it)."""
    workers = harness.workers
    want = {r.request_id for r in requests}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # Handled first: once the last poll's handler returned, every order it sent is in ``dispatched``.
        handled = harness.requests_done - harness.requests_before
        sent = sum(1 for r in want if r in workers.dispatched)
        answered = harness.results_done - harness.results_before
        if handled >= len(want) and answered >= sent and workers.idle():
            return time.monotonic()
        time.sleep(0.02)
    raise RuntimeError(f"the scheduler did not catch up within {timeout_s:.0f} s")


def _now() -> datetime:
    return datetime.now(UTC)


def _profile_summary(
    profiles: dict[str, cProfile.Profile], handled: int
) -> tuple[dict[str, float], list[str]]:
    """Milliseconds per request of each phase (cumulative time of its functions), and the top functions by own
    time across both consumer threads."""
    merged: pstats.Stats | None = None
    for profile in profiles.values():
        profile.create_stats()
        if not getattr(profile, "stats", None):
            continue  # a thread that ran nothing while profiled (no result came back in that drain, say)
        stats = pstats.Stats(profile)
        if merged is None:
            merged = stats
        else:
            merged.add(stats)
    if merged is None or handled == 0:
        return {}, []
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = merged.stats  # type: ignore[attr-defined]
    total = sum(tt for (_, _, tt, _, _) in raw.values())
    phases = phase_ms(raw, handled, PHASE_FUNCTIONS)
    phases["all_handlers"] = round(total / handled * 1000, 3)
    out = io.StringIO()
    merged.stream = out  # type: ignore[attr-defined]
    merged.sort_stats("tottime").print_stats(15)
    lines = [ln.rstrip() for ln in out.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
    return phases, lines[start:]
