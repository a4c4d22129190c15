"""``chorus bench serve``: one embedded stack, each model's trace replayed with reuse and then with ``reuse: off``.

The stack is the one ``chorus demo`` and ``chorus bench faults`` run (``producer.local.stack.EmbeddedStack``:
Kafka-protocol broker, scheduler with Qdrant local mode, Celery worker processes, the S3 stand-in), started once
on a fresh state directory; one worker process serves every model benchmarked, so both passes of a model run on
the same worker, in the same run. Per model:

1. warm-up requests (not counted: a model's first passes are slower), reuse off, prompts outside the trace;
2. the trace with ``reuse: auto`` — its donors are only its own earlier requests (fresh index);
3. the same trace (prompts, seeds, arrival times) with ``reuse: off`` — after the reuse pass, so its results can
   give the reuse pass nothing.

Besides wall-clock throughput, each pass records the CPU seconds per request of the worker's and the scheduler's
process groups (``/proc``): on a machine other work shares, a pass's wall time depends on that work, its CPU time
much less (``compare.cpu_throughput_ratio``). The scheduler's time per request comes from its own histogram ``chorus_scheduler_phase_duration_seconds``
(embed per poll, search and plan per request, dispatch per order), read before and after each pass, and the
worker's seconds producing each result from the worker's ``chorus_worker_phase_duration_seconds`` the same way
(``publish``: the worker's share of delivering a result; the rest of the hop is ``deliver``). For the toy
model every video is read back from the object store and judged by ``workers.toy.checker`` against the
attributes its prompt asks for.

Models (``MODELS``): ``toy`` (the committed toy model, whatever weights ``workers/toy/weights`` holds) and ``mid``
(the catalog's ``tiny-random-wan`` with the Wan2.1-1.3B-width random weights, ``CHORUS_RANDOM_WAN_WIDTH=wan-width``,
at 4 frames of 64×64: 64 video tokens against 512 text tokens, CFG 5).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from producer.contract import ResultStatus
from producer.local.config import StackOptions
from producer.local.processes import ServiceProcess
from producer.local.stack import EmbeddedStack
from producer.sdk import ChorusClient, ResultWatcher
from workers.bench.faults.observe import group_cpu_s
from workers.bench.serve import report, trace
from workers.bench.serve.replay import Observation, Shape, replay, requests_for
from workers.bench.serve.trace import TraceSpec

FORMAT = "chorus-bench-serve/1"
SCHED_METRIC = "chorus_scheduler_phase_duration_seconds"
WORKER_METRIC = "chorus_worker_phase_duration_seconds"
Say = Callable[[str], None]


@dataclass(frozen=True)
class ModelRun:
    name: str
    shape: Shape
    requests: int  # trace length (full size)
    quick_requests: int
    judge: bool  # read every video back and check it (toy)


MODELS: dict[str, ModelRun] = {
    "toy": ModelRun("toy", Shape("toy", 4), requests=120, quick_requests=32, judge=True),
    "mid": ModelRun(
        "mid",
        Shape("tiny-random-wan", 4, num_frames=4, height=64, width=64, guidance_scale=5.0),
        requests=60,
        quick_requests=16,
        judge=False,
    ),
}
# ``tiny-random-wan`` at its own tiny size: the machinery alone, fast (tests). Not with ``mid``, which puts other
# weights behind the same catalog name.
MODELS["tiny"] = ModelRun("tiny", Shape("tiny-random-wan", 4), requests=24, quick_requests=8, judge=False)
WARMUPS = 2
# Each pass starts with the worker's prompt-encoding cache (an LRU, ``CHORUS_PROMPT_CACHE_SIZE``) holding none of
# the trace's prompts: without this, the second pass found every prompt the first had encoded and skipped the
# text encoder (toy, fresh trace: ~10 ms of a 115 ms request, to the no-reuse pass's credit). The stack's
# worker gets this cache size, and this many other prompts (1 step, reuse off) are sent before each pass.
PROMPT_CACHE_SIZE = 64


@dataclass(frozen=True)
class ServeOptions:
    models: tuple[str, ...] = ("toy", "mid")
    kind: trace.TraceKind = trace.TraceKind.MIXED
    requests: int | None = None  # None: the model's size (quick or full)
    seed: int = 0
    rate: float | None = None
    num_steps: int | None = None  # None: each model's (4)
    quick: bool = False
    timeout_s: float = 900.0
    state_dir: Path | None = None


def run_serve(
    options: ServeOptions, say: Say, progress: Callable[[str, int], Callable[[], None]]
) -> dict[str, Any]:
    """Run the benchmark; returns the report. ``progress(label, total)`` gives a function to call per result."""
    unknown = [m for m in options.models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    if {"tiny", "mid"} <= set(options.models):
        raise ValueError("tiny and mid both run as tiny-random-wan (other weights): benchmark them apart")
    runs = [MODELS[m] for m in options.models]
    root = options.state_dir or Path(tempfile.mkdtemp(prefix="chorus-serve-"))
    env = {"CHORUS_PROMPT_CACHE_SIZE": str(PROMPT_CACHE_SIZE)}
    if "mid" in options.models:
        env["CHORUS_RANDOM_WAN_WIDTH"] = "wan-width"
    stack_options = StackOptions(
        state_dir=root / "stack",
        models=sorted({r.shape.model for r in runs}),
        persist_s3=False,
        extra_env=env,
        ready_timeout_s=300,
        stop_timeout_s=30,
    )
    started, started_at = time.monotonic(), datetime.now(UTC)
    load_before = os.getloadavg()
    probe_before = report.speed_probe_ms()
    say(f"starting the embedded stack in {stack_options.state_dir}")
    entries: list[dict[str, Any]] = []
    with EmbeddedStack(stack_options) as stack:
        stack_s = time.monotonic() - started
        with ChorusClient(stack.producer_settings) as client, client.watch_results() as watcher:
            for run in runs:
                entries.append(_run_model(stack, client, watcher, run, options, say, progress))
    ok = bool(entries) and all(e["ok"] for e in entries)
    if options.state_dir is None and ok:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "format": FORMAT,
        "started_at": started_at.isoformat(),
        "wall_s": round(time.monotonic() - started, 1),
        "stack_start_s": round(stack_s, 1),
        "quick": options.quick,
        "ok": ok,
        "machine": {
            "cores": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "speed_probe_ms": [probe_before, report.speed_probe_ms()],  # before, after: lower is faster
        },
        "stack": {"workers": 1, "worker_concurrency": 1, "schedulers": 1, "video_format": "mp4"},
        "state_dir": None if options.state_dir is None and ok else str(root),
        "models": entries,
    }


def _run_model(
    stack: EmbeddedStack,
    client: ChorusClient,
    watcher: ResultWatcher,
    run: ModelRun,
    options: ServeOptions,
    say: Say,
    progress: Callable[[str, int], Callable[[], None]],
) -> dict[str, Any]:
    size = options.requests or (run.quick_requests if options.quick else run.requests)
    spec = TraceSpec(kind=options.kind, requests=size, seed=options.seed, rate=options.rate)
    items = trace.generate(spec)
    shape = replace(run.shape, num_steps=options.num_steps) if options.num_steps else run.shape
    tag = f"sv{secrets.token_hex(3)}-{run.name}"
    say(f"[bold]▶ {run.name}[/]: {size} requests, {spec.kind} trace, {shape.num_steps} steps")
    _warm_up(client, watcher, shape, tag, options.timeout_s)
    passes: dict[str, dict[str, Any]] = {}
    observed: dict[str, list[Observation]] = {}
    for n, reuse in enumerate(("auto", "off")):
        _flush_prompt_cache(client, watcher, shape, f"{tag}-flush{n}-", 987_700 + n, options.timeout_s)
        before = _phase_sums(stack.schedulers, SCHED_METRIC)
        worker_before = _phase_sums(stack.workers, WORKER_METRIC)
        cpu_before = _cpu(stack)
        load_before = os.getloadavg()[0]
        requests = requests_for(items, shape, prefix=f"{tag}-{reuse}-", reuse=reuse)
        tick = progress(f"{run.name} reuse {reuse}", len(requests))
        obs, start = replay(
            client,
            watcher,
            items,
            requests,
            timeout_s=options.timeout_s,
            on_result=_ignore_arg(tick),
            check=stack.check,
        )
        stack.wait_idle(timeout_s=60)
        summary = report.summarize(
            obs,
            start,
            publish_s=_mean_delta(worker_before, _phase_sums(stack.workers, WORKER_METRIC), "publish"),
        )
        summary["scheduler"] = _scheduler_delta(
            before, _phase_sums(stack.schedulers, SCHED_METRIC), len(requests)
        )
        cpu_after = _cpu(stack)
        summary["cpu"] = {
            f"{role}_s_per_request": round((cpu_after[role] - cpu_before[role]) / len(requests), 4)
            for role in cpu_after
        }
        summary["load_average_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        if run.judge:
            summary["quality"] = _judge(stack, obs)
        passes["reuse" if reuse == "auto" else "no_reuse"] = summary
        observed[reuse] = obs
        say(_line(run.name, reuse, summary))
    ok = all(p["status"].get(str(ResultStatus.DONE), 0) == p["requests"] for p in passes.values())
    return {
        "model": run.name,
        "catalog_model": shape.model,
        "shape": shape.fields(),
        "ok": ok,
        "trace": spec.describe() | {"variants": trace.variant_counts(items)},
        "reuse": passes["reuse"],
        "no_reuse": passes["no_reuse"],
        "compare": report.compare(passes["reuse"], passes["no_reuse"]),
        "latencies_s": {k: [round(o.latency_s, 4) for o in v] for k, v in observed.items()},
        "by_variant": _by_variant(observed["auto"]),
    }


def _ignore_arg(tick: Callable[[], None]) -> Callable[[Observation], None]:
    return lambda _: tick()


def _warm_up(client: ChorusClient, watcher: ResultWatcher, shape: Shape, tag: str, timeout_s: float) -> None:
    spec = TraceSpec(kind=trace.TraceKind.FRESH, requests=WARMUPS, seed=987_654)
    items = trace.generate(spec)
    requests = requests_for(items, shape, prefix=f"{tag}-warm-", reuse="off")
    replay(client, watcher, items, requests, timeout_s=timeout_s)


def _flush_prompt_cache(
    client: ChorusClient, watcher: ResultWatcher, shape: Shape, prefix: str, seed: int, timeout_s: float
) -> None:
    """Fill the worker's prompt cache with prompts outside the trace (see ``PROMPT_CACHE_SIZE``)."""
    spec = TraceSpec(kind=trace.TraceKind.FRESH, requests=PROMPT_CACHE_SIZE, seed=seed)
    items = trace.generate(spec)
    requests = requests_for(items, replace(shape, num_steps=1), prefix=prefix, reuse="off")
    replay(client, watcher, items, requests, timeout_s=timeout_s)


def _by_variant(observations: Sequence[Observation]) -> dict[str, dict[str, Any]]:
    """Per variant of the reuse pass: how many, how many hit, mean steps computed and latency."""
    out: dict[str, dict[str, Any]] = {}
    for variant in trace.Variant:
        group = [o for o in observations if o.item.variant is variant]
        if not group:
            continue
        out[str(variant)] = {
            "requests": len(group),
            "hits": sum(report.is_hit(o.result) for o in group),
            "reuse": sorted({str(o.result.reuse) for o in group}),
            "steps_computed_mean": round(sum(o.result.steps_computed for o in group) / len(group), 2),
            "latency_p50_s": round(report.percentile([o.latency_s for o in group], 50), 4),
        }
    return out


def _cpu(stack: EmbeddedStack) -> dict[str, float]:
    """CPU seconds used so far by the worker and by the scheduler process groups (pool processes included).

    Wall-clock throughput on a machine other work shares depends on that work; CPU time per request does not
    (much), so the report gives both."""
    return {
        "worker": sum(group_cpu_s(p.pid) for p in stack.workers),
        "scheduler": sum(group_cpu_s(p.pid) for p in stack.schedulers),
    }


def _phase_sums(processes: Sequence[ServiceProcess], metric: str) -> dict[str, tuple[float, float]]:
    """(sum of seconds, count) per phase of a phase histogram, summed over the processes' metrics endpoints."""
    totals: dict[str, list[float]] = {}
    for process in processes:
        with urllib.request.urlopen(process.metrics_url, timeout=5) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name != metric:
                continue
            for sample in family.samples:
                phase = sample.labels.get("phase", "")
                slot = totals.setdefault(phase, [0.0, 0.0])
                if sample.name.endswith("_sum"):
                    slot[0] += sample.value
                elif sample.name.endswith("_count"):
                    slot[1] += sample.value
    return {k: (v[0], v[1]) for k, v in totals.items()}


def _mean_delta(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], phase: str
) -> float | None:
    """Mean seconds of ``phase`` over the observations made between the two readings (None: none made)."""
    total, count = after.get(phase, (0.0, 0.0))
    total0, count0 = before.get(phase, (0.0, 0.0))
    return (total - total0) / (count - count0) if count > count0 else None


def _scheduler_delta(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], requests: int
) -> dict[str, Any]:
    per_phase = {
        phase: round((after[phase][0] - before.get(phase, (0.0, 0.0))[0]) / requests * 1000, 3)
        for phase in after
    }
    return {"ms_per_request": per_phase, "total_ms_per_request": round(sum(per_phase.values()), 3)}


def _judge(stack: EmbeddedStack, observations: Sequence[Observation]) -> dict[str, Any]:
    """Read each video back and check it with the toy checker: accuracy per attribute and ``all``."""
    from workers.toy import checker, world
    from workers.video import read_video

    store = stack.object_store()
    marks: list[dict[str, bool]] = []
    with tempfile.TemporaryDirectory(prefix="chorus-serve-judge-") as tmp:
        for obs in observations:
            uri = obs.result.video_uri
            if obs.result.status is not ResultStatus.DONE or uri is None:
                continue
            path = Path(tmp) / f"clip{Path(uri).suffix or '.mp4'}"
            path.write_bytes(store.get(store.key_of(uri)))
            expected = world.Attributes(**dict(obs.item.attributes))
            marks.append(checker.compare(checker.read_clip(read_video(path)), expected))
    return {"judged": len(marks), "accuracy": {k: round(v, 4) for k, v in checker.accuracy(marks).items()}}


def _line(model: str, reuse: str, s: dict[str, Any]) -> str:
    quality = s.get("quality", {}).get("accuracy", {}).get("all")
    q = f", all-attribute accuracy {quality:.3f}" if quality is not None else ""
    lat = s["latency_s"]
    return (
        f"  {model} reuse {reuse}: {s['throughput_rps']} req/s, p50 {lat['p50']:.2f} s, p99 {lat['p99']:.2f} s, "
        f"{s['hits']} hits, {s['steps_computed']}/{s['steps_requested']} steps{q}"
    )
