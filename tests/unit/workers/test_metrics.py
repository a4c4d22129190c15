"""Worker metrics: definitions, what one result counts, and multiprocess aggregation across forked processes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from producer.contract import (
    DonorInfo,
    ErrorInfo,
    GenerationResult,
    PhaseTimings,
    ResultStatus,
    ReusePlan,
    VerificationReport,
    build_request,
)
from producer.orders import DonorRef, Role, WorkOrder
from workers import metrics as wm

MODEL = "tiny-random-wan"


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, (name, labels)
    return value


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> tuple[wm.WorkerMetrics, CollectorRegistry]:
    """The module's metrics replaced by a set on a registry of its own."""
    registry = CollectorRegistry()
    m = wm.WorkerMetrics(registry)
    monkeypatch.setattr(wm, "_METRICS", m)
    return m, registry


def order(role: Role = Role.SOLO, *, donor: bool = True, steps: int = 4) -> WorkOrder:
    request = build_request(prompt="a red circle moving left", model=MODEL, num_steps=steps)
    plan = ReusePlan(stage1_steps=1, stage2_steps=2, stage3_steps=1) if donor else ReusePlan.full(steps)
    ref = DonorRef(request_id="d1", similarity=0.9, trajectory_prefix="trajectories/d1/") if donor else None
    return WorkOrder(request=request, plan=plan, role=role, donor=ref)


def result_for(o: WorkOrder, *, fallback: str | None = None, tcf: float = 0.5) -> GenerationResult:
    return GenerationResult(
        request_id=o.request.request_id,
        status=ResultStatus.DONE,
        video_uri="s3://b/v.mp4",
        donor=DonorInfo(request_id=o.donor.request_id, similarity=o.donor.similarity) if o.donor else None,
        plan=o.plan,
        steps_computed=3,
        steps_requested=o.request.num_steps,
        tokens_computed_fraction=tcf,
        fallback=fallback,
        timings=PhaseTimings(queue_s=0.5, fetch_s=0.1, denoise_s=2.0, decode_s=0.2, upload_s=0.05),
        completed_at=o.request.submitted_at + timedelta(seconds=7),
    )


def test_names_follow_prometheus_conventions_and_every_label_is_bounded() -> None:
    registry = CollectorRegistry()
    wm.WorkerMetrics(registry)
    families = list(registry.collect())
    assert families, "no metric registered"
    unitless_ok = {"chorus_worker_tokens_computed_fraction"}
    for family in families:
        assert family.name.startswith("chorus_"), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds") or family.name in unitless_ok, family.name
        for s in family.samples:
            assert not {"request_id", "prompt", "tenant", "pid", "worker"} & set(s.labels), s
    # Every labelled series exists at zero before anything happened (so rate() sees the first event).
    assert sample(registry, "chorus_worker_requests_total", model=MODEL, role="follower", status="done",
                  reuse="donor") == 0  # fmt: skip
    assert sample(registry, "chorus_worker_fallbacks_total", cause="leader_wait_timeout") == 0
    assert sample(registry, "chorus_worker_phase_duration_seconds_count", phase="queue") == 0


def test_a_done_result_that_used_its_donor_counts_steps_phases_and_latency(
    fresh: tuple[wm.WorkerMetrics, CollectorRegistry],
) -> None:
    _, registry = fresh
    o = order(Role.FOLLOWER)
    wm.observe_result(result_for(o, tcf=0.375), o)
    labels = {"model": MODEL, "role": "follower", "status": "done", "reuse": "donor"}
    assert sample(registry, "chorus_worker_requests_total", **labels) == 1
    assert sample(registry, "chorus_worker_steps_requested_total", model=MODEL) == 4
    assert sample(registry, "chorus_worker_steps_computed_total", model=MODEL) == 3
    assert sample(registry, "chorus_worker_token_steps_computed_total", model=MODEL) == pytest.approx(1.5)
    assert sample(registry, "chorus_worker_phase_duration_seconds_sum", phase="denoise") == pytest.approx(2.0)
    assert sample(registry, "chorus_worker_phase_duration_seconds_count", phase="upload") == 1
    assert sample(registry, "chorus_request_duration_seconds_sum", status="done") == pytest.approx(7.0)
    assert sample(registry, "chorus_worker_tokens_computed_fraction_count", role="follower") == 1


def test_a_rejected_donor_checks_thrown_away_pass_counts_as_computed(
    fresh: tuple[wm.WorkerMetrics, CollectorRegistry],
) -> None:
    _, registry = fresh
    o = order(Role.FOLLOWER)
    check = VerificationReport(
        decision="rejected", signal=0.9, step=1, stage1_steps=0, wasted_tokens_fraction=0.5
    )
    wm.observe_result(result_for(o, tcf=1.0).model_copy(update={"verification": check}), o)
    # the four steps in full, and half a step thrown away
    assert sample(registry, "chorus_worker_token_steps_computed_total", model=MODEL) == pytest.approx(4.5)


def test_reuse_label_matches_what_the_scheduler_counts_as_a_hit(
    fresh: tuple[wm.WorkerMetrics, CollectorRegistry],
) -> None:
    _, registry = fresh
    with_donor, no_donor = order(), order(donor=False)
    # A hit saves compute (GenerationResult.saved_compute): a planned donor that ended computing every token is
    # not one, fallback or not; one that still saved some token-steps despite a fallback is.
    wm.observe_result(result_for(with_donor, fallback="donor step unavailable", tcf=1.0), with_donor)
    wm.observe_result(result_for(with_donor, tcf=1.0), with_donor)
    wm.observe_result(result_for(no_donor, tcf=1.0), no_donor)
    base = {"model": MODEL, "role": "solo", "status": "done"}
    assert sample(registry, "chorus_worker_requests_total", **base, reuse="fallback") == 2
    assert sample(registry, "chorus_worker_requests_total", **base, reuse="none") == 1
    assert sample(registry, "chorus_worker_requests_total", **base, reuse="donor") == 0
    wm.observe_result(result_for(with_donor, fallback="donor step unavailable", tcf=0.5), with_donor)
    assert sample(registry, "chorus_worker_requests_total", **base, reuse="donor") == 1


def test_a_failed_result_counts_its_code_and_no_steps(
    fresh: tuple[wm.WorkerMetrics, CollectorRegistry],
) -> None:
    _, registry = fresh
    o = order(donor=False)
    failed = GenerationResult(
        request_id=o.request.request_id,
        status=ResultStatus.FAILED,
        error=ErrorInfo(code="engine_error", message="boom"),
        steps_requested=4,
    )
    wm.observe_result(failed, o)
    invalid = GenerationResult(
        request_id="r2", status=ResultStatus.FAILED, error=ErrorInfo(code="something_new", message="?")
    )
    wm.observe_result(invalid, None)
    assert sample(registry, "chorus_worker_failures_total", code="engine_error") == 1
    assert sample(registry, "chorus_worker_failures_total", code="other") == 1
    assert sample(registry, "chorus_worker_requests_total", model="unknown", role="solo", status="failed",
                  reuse="none") == 1  # fmt: skip
    assert sample(registry, "chorus_worker_steps_requested_total", model=MODEL) == 0


def test_fallback_causes_and_busy_slots(fresh: tuple[wm.WorkerMetrics, CollectorRegistry]) -> None:
    _, registry = fresh
    wm.count_fallback("leader_wait_timeout")
    wm.count_fallback("not-a-cause")  # never an unbounded label
    assert sample(registry, "chorus_worker_fallbacks_total", cause="leader_wait_timeout") == 1
    assert sample(registry, "chorus_worker_fallbacks_total", cause="donor_unavailable") == 1
    with wm.busy():
        assert sample(registry, "chorus_worker_busy_slots") == 1
    assert sample(registry, "chorus_worker_busy_slots") == 0
    wm.model_loaded(MODEL, 1.25)
    assert sample(registry, "chorus_worker_model_load_duration_seconds_sum", model=MODEL) == 1.25
    assert sample(registry, "chorus_worker_models_loaded", model=MODEL) == 1


# --- multiprocess mode ---------------------------------------------------------------------------------------

# Runs in a fresh interpreter: the parent serves /metrics the way `chorus worker` does, then forks three
# children like a prefork pool: one exits cleanly, one is SIGKILLed, one stays busy while the parent is scraped.
PROBE = textwrap.dedent(
    """
    import json, multiprocessing, os, signal, sys, urllib.request
    import prometheus_client  # imported before multiprocess mode is enabled, on purpose
    from workers import metrics as wm
    from workers.settings import WorkerSettings

    port, path = int(sys.argv[1]), sys.argv[2]
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    exposition = wm.serve(WorkerSettings(metrics_port=port), addr="127.0.0.1")
    assert exposition is not None

    def scrape():
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()

    def child(n, mode, ready, release):
        wm.on_process_init()
        counter = wm.metrics().requests.labels(model="tiny-random-wan", role="solo", status="done", reuse="none")
        for _ in range(n):
            counter.inc()
            wm.metrics().phase_seconds.labels(phase="denoise").observe(0.5)
        if mode == "clean":
            wm.on_process_exit(pid=os.getpid())
        elif mode == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            with wm.busy():
                ready.set()
                release.wait(60)
            wm.on_process_exit(pid=os.getpid())

    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    procs = {mode: ctx.Process(target=child, args=(n, mode, ready, release))
             for n, mode in ((3, "clean"), (5, "killed"), (7, "stay"))}
    for p in procs.values():
        p.start()
    procs["clean"].join(60)
    procs["killed"].join(60)
    assert ready.wait(60)
    during = scrape()
    release.set()
    procs["stay"].join(60)
    after = scrape()
    pids = sorted({int(f.rsplit("_", 1)[1][:-3]) for f in os.listdir(path) if f.startswith("counter_")})
    print(json.dumps({"during": during, "after": after, "counter_pids": pids, "parent": os.getpid(),
                      "exitcodes": {m: p.exitcode for m, p in procs.items()}}))
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def values(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_counts_from_every_forked_process_arrive_and_dead_processes_leave_the_live_gauges(
    tmp_path: Path,
) -> None:
    path = tmp_path / "mp"
    path.mkdir()
    (path / "counter_999999.db").write_bytes(b"left over from a previous run")  # must be wiped, not read
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(free_port()), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["exitcodes"] == {"clean": 0, "killed": -9, "stay": 0}
    # One counter file per process that counted: the parent (zeros) and the three children.
    assert len(out["counter_pids"]) == 4 and out["parent"] in out["counter_pids"]

    key = ("chorus_worker_requests_total",
           frozenset({"model": "tiny-random-wan", "role": "solo", "status": "done", "reuse": "none"}.items()))  # fmt: skip
    during, after = values(out["during"]), values(out["after"])
    # Counters: the sum over all three children, including the one killed without any cleanup.
    assert during[key] == after[key] == 3 + 5 + 7
    hist = ("chorus_worker_phase_duration_seconds_count", frozenset({"phase": "denoise"}.items()))
    assert after[hist] == 15
    # Live gauges: only the child still running counts (the killed one was swept at scrape time).
    assert during[("chorus_worker_pool_slots", frozenset())] == 1
    assert during[("chorus_worker_busy_slots", frozenset())] == 1
    assert after[("chorus_worker_pool_slots", frozenset())] == 0
    assert after[("chorus_worker_busy_slots", frozenset())] == 0


def test_enabling_multiprocess_mode_after_a_metric_exists_is_refused(
    fresh: tuple[wm.WorkerMetrics, CollectorRegistry], tmp_path: Path
) -> None:
    with pytest.raises(RuntimeError, match="before"):
        wm.enable_multiprocess(tmp_path)


def test_sweep_marks_only_processes_that_are_gone(tmp_path: Path) -> None:
    import os

    (tmp_path / f"gauge_livesum_{os.getpid()}.db").write_bytes(b"")
    (tmp_path / "gauge_livesum_999999999.db").write_bytes(b"")
    (tmp_path / "counter_999999999.db").write_bytes(b"")
    assert wm.sweep_dead_processes(tmp_path) == [999999999]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "counter_999999999.db",
        f"gauge_livesum_{os.getpid()}.db",
    ]
