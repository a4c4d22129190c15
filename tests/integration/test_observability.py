"""Metrics, dashboards and rules against a real Prometheus scraping a live run of the embedded stack.

A Prometheus (the Debian package) is started first, with a temporary config that scrapes the scheduler and the
worker of an ``EmbeddedStack`` every second and loads the committed rule files. Once it has scraped both
processes at their starting (zero) values, two waves of ``tiny-random-wan`` requests in families go through the
stack: group leaders, a follower, finished donors reused, requests no donor fits, another tenant's request, a
``reuse: off`` request and an invalid one. Then:

- every dashboard panel query and template-variable query evaluates without error and returns series, and every
  recording and alert rule is healthy and its expression returns series (an alert's comparisons are evaluated
  with ``bool`` so a quiet alert still shows its signal);
- the hit ratio, steps saved and estimated speedup Prometheus computes (raw totals, and the overview's panels
  evaluated at the last scrape) agree with the results the run published on the results topic;
- the worker's prefork pool processes each counted in their own files, and /metrics reports the sum of all.

Nothing is asserted on how long anything took.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from producer import bus
from producer.contract import GenerationRequest, GenerationResult, ResultStatus, ReusePolicy, build_request
from producer.local.config import StackOptions
from producer.local.processes import free_port
from producer.local.stack import EmbeddedStack
from producer.sdk import ChorusClient
from tests.helpers import topics
from tests.helpers.scheduler_fakes import recased

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RULE_FILES = sorted((ROOT / "infra" / "prometheus" / "rules").glob("*.yml"))
DASHBOARDS = sorted((ROOT / "infra" / "grafana" / "dashboards").glob("*.json"))
PROMETHEUS = shutil.which("prometheus")
MODEL = "tiny-random-wan"
STEPS = 10  # enough steps for the planner to reuse a donor that differs by one word
WAIT_S = 300.0

RED = "a red circle moving left on a white background"
BLUE = "a blue circle moving left on a white background"
TRIANGLE = "a green triangle moving up on a black background"
SQUARE = "a yellow square moving down on a gray background"


# --- Prometheus ----------------------------------------------------------------------------------------------


class PromError(AssertionError):
    pass


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]

    def api(self, path: str, **params: Any) -> Any:
        encoded = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None}, doseq=True)
        # Queries go as POST forms (long expressions); the other endpoints answer GET only.
        post = path in ("query", "query_range")
        url = f"{self.url}/api/v1/{path}" + ("" if post or not encoded else f"?{encoded}")
        try:
            with urllib.request.urlopen(url, data=encoded.encode() if post else None, timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise PromError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr, time=at)["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return list(self.api("query_range", query=expr, start=start, end=end, step=step)["result"])

    def value(self, expr: str, at: float | None = None) -> float:
        result = self.query(expr, at)
        assert len(result) == 1, f"{expr}: {result}"
        return float(result[0]["value"][1])


def start_prometheus(tmp: Path, jobs: dict[str, list[str]]) -> Prometheus:
    assert PROMETHEUS is not None
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in RULE_FILES],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}", process)
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return prom
        except (urllib.error.URLError, OSError):
            pass
        assert time.monotonic() < deadline, "Prometheus did not become ready"
        time.sleep(0.2)


def wait_until(what: str, check: Any, timeout_s: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


# --- the run -------------------------------------------------------------------------------------------------


@dataclass
class Run:
    prom: Prometheus
    stack: EmbeddedStack
    started: float  # before Prometheus started
    ended: float
    requests: dict[str, GenerationRequest]
    results: dict[str, GenerationResult]
    rejected_ids: list[str]
    child_counts: dict[int, float]  # pool process pid → results it counted
    exposed_total: float

    def window(self) -> str:
        """A Grafana interval that covers the whole run (for $__range and $__rate_interval)."""
        return f"{math.ceil(time.time() - self.started) + 30}s"


def request(rid: str, prompt: str, seed: int, **fields: Any) -> GenerationRequest:
    fields.setdefault("tenant", "acme")
    return build_request(request_id=rid, prompt=prompt, model=MODEL, num_steps=STEPS, seed=seed, **fields)


def read_topic(settings: Any, topic: str) -> list[bytes]:
    """Every message on ``topic`` from the beginning (no consumer group)."""
    return [value for _, value in topics.read_topic(settings, topic)]


def per_process_counts(mp_dir: Path) -> dict[int, float]:
    """chorus_worker_requests_total counted in each process' own file (read one file at a time)."""
    counts: dict[int, float] = {}
    for path in sorted(mp_dir.glob("counter_*.db")):
        pid = int(path.stem.split("_")[1])
        with tempfile.TemporaryDirectory() as one:
            shutil.copy(path, Path(one) / path.name)
            collector = MultiProcessCollector(None, path=one)
            counts[pid] = sum(
                s.value
                for family in collector.collect()
                if family.name == "chorus_worker_requests"
                for s in family.samples
                if s.name == "chorus_worker_requests_total"
            )
    return counts


def exposed(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian: prometheus)")
    tmp = tmp_path_factory.mktemp("observability")
    started = time.time()
    sched_port, worker_port = free_port(), free_port()
    while worker_port == sched_port:
        worker_port = free_port()
    # Prometheus first, so it sees every series of the services from its starting value.
    prom = start_prometheus(
        tmp,
        {
            "chorus-scheduler": [f"127.0.0.1:{sched_port}"],
            "chorus-worker": [f"127.0.0.1:{worker_port}"],
        },
    )
    options = StackOptions(
        state_dir=tmp / "state",
        models=[MODEL],
        embedder="hashing",
        worker_concurrency=2,
        preload=False,  # the models load on the first orders, while Prometheus watches
        persist_s3=False,
        scheduler_metrics_port=sched_port,
        worker_metrics_port=worker_port,
        extra_env={"CHORUS_EVICT_INTERVAL_S": "1", "CHORUS_POLL_TIMEOUT_MS": "100"},
    )
    try:
        with EmbeddedStack(options) as stack:
            worker = stack.workers[0]
            mp_dir = Path(
                wait_until(
                    "the worker's multiprocess folder",
                    lambda: next(
                        (
                            e["multiprocess_dir"]
                            for e in worker.read_events()
                            if e.get("event") == "metrics exposed"
                        ),
                        None,
                    ),
                )
            )

            def scraped() -> bool:
                for job, metric in (
                    ("chorus-scheduler", "chorus_requests_received_total"),
                    ("chorus-worker", "chorus_worker_pool_slots"),
                ):
                    if not prom.query(f'{metric}{{job="{job}"}}'):
                        return False
                return True

            wait_until("the first scrapes", scraped)
            assert prom.value("sum(chorus_requests_received_total)") == 0

            wave1 = [
                request("obs-a1", RED, 1),  # leader: nothing in the index
                request("obs-b1", TRIANGLE, 1),  # leader: the running red leader does not fit it
                # follows the running red leader (the same words; the very same text would wait for its video)
                request("obs-a2", recased(RED), 2),
            ]
            wave2 = [
                request("obs-a3", BLUE, 3),  # a finished red donor, one word apart
                request("obs-b2", recased(TRIANGLE), 2),  # the finished triangle
                request("obs-c1", SQUARE, 1),  # no donor fits
                request("obs-z1", RED, 4, tenant="zeta"),  # acme's red donors are not zeta's
                request("obs-off", RED, 5, reuse=ReusePolicy.OFF),  # no lookup at all
            ]
            invalid = json.dumps({"request_id": "obs-bad", "prompt": " ", "model": MODEL}).encode()
            settings = stack.producer_settings
            with ChorusClient(settings) as client, client.watch_results() as watcher:
                for r in wave1:
                    client.submit(r)
                bus.publish(client.producer, settings.kafka_requests_topic, "obs-bad", invalid)
                got = list(watcher.wait([r.request_id for r in wave1] + ["obs-bad"], timeout_s=WAIT_S))
                assert len(got) == len(wave1) + 1
                stack.wait_idle(timeout_s=WAIT_S)  # the first wave's donors are indexed
                for r in wave2:
                    client.submit(r)
                got = list(watcher.wait([r.request_id for r in wave2], timeout_s=WAIT_S))
                assert len(got) == len(wave2)
            stack.wait_idle(timeout_s=WAIT_S)

            results: dict[str, GenerationResult] = {}
            for raw in read_topic(settings, settings.kafka_results_topic):
                result = GenerationResult.model_validate_json(raw)
                results.setdefault(result.request_id, result)
            child_counts = {pid: n for pid, n in per_process_counts(mp_dir).items() if pid != worker.pid}
            exposed_total = exposed(worker.metrics_url, "chorus_worker_requests_total")

            # Prometheus has caught up once its last samples equal what the processes expose now (nothing
            # more happens), and the recording rules have been evaluated on them.
            finals = {
                "sum(chorus_worker_requests_total)": exposed_total,
                "sum(chorus_donor_hits_total)": exposed(
                    stack.schedulers[0].metrics_url, "chorus_donor_hits_total"
                ),
                "sum(chorus_scheduler_results_total)": exposed(
                    stack.schedulers[0].metrics_url, "chorus_scheduler_results_total"
                ),
            }
            wait_until(
                "Prometheus to scrape the final values",
                lambda: all(prom.query(q) and prom.value(q) == v for q, v in finals.items()),
            )
            time.sleep(3)  # a few more scrapes and rule evaluations
            yield Run(
                prom=prom,
                stack=stack,
                started=started,
                ended=time.time(),
                requests={r.request_id: r for r in wave1 + wave2},
                results=results,
                rejected_ids=["obs-bad"],
                child_counts=child_counts,
                exposed_total=exposed_total,
            )
    finally:
        prom.process.terminate()
        try:
            prom.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            prom.process.kill()
            prom.process.wait(timeout=10)


# --- helpers over the committed configuration ----------------------------------------------------------------


def grafana(expr: str, window: str) -> str:
    return (
        expr.replace("$__rate_interval", window)
        .replace("$__range", window)
        .replace("$__interval", "5s")
        .replace('=~"$instance"', '=~".*"')
    )


def panels() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        for p in dash["panels"]:
            for panel in [p, *p.get("panels", [])]:
                if panel["type"] != "row":
                    out.append((f"{dash['uid']}/{panel['title']}", panel))
    return out


def rules() -> list[dict[str, Any]]:
    return [r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]]


def with_bool(expr: str) -> str:
    """``expr`` with ``bool`` after every comparison outside label matchers and strings, so a comparison keeps
    its series (0 or 1) instead of filtering them out."""
    out: list[str] = []
    depth, quote, i = 0, "", 0
    while i < len(expr):
        ch = expr[i]
        if quote:
            out.append(ch)
            if ch == "\\":
                out.append(expr[i + 1])
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'`":
            quote = ch
            out.append(ch)
        elif ch == "{":
            depth += 1
            out.append(ch)
        elif ch == "}":
            depth -= 1
            out.append(ch)
        elif depth == 0 and expr[i : i + 2] in ("==", "!=", ">=", "<="):
            out.append(expr[i : i + 2] + " bool")
            i += 1
        elif depth == 0 and ch in "<>":
            out.append(ch + " bool")
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def test_with_bool_leaves_label_matchers_alone() -> None:
    assert (
        with_bool('a{x!="1",y=~"b|c"} >= 2 and b < 1/60') == 'a{x!="1",y=~"b|c"} >= bool 2 and b < bool 1/60'
    )


# --- the checks ----------------------------------------------------------------------------------------------


def test_every_dashboard_query_evaluates_and_returns_series(run: Run) -> None:
    window = run.window()
    end = time.time()
    checked = 0
    empty: list[str] = []
    nan_only: list[str] = []
    for name, panel in panels():
        for target in panel["targets"]:
            expr = grafana(target["expr"], window)
            if target.get("instant"):
                result = run.prom.query(expr, at=end)
            else:
                result = run.prom.query_range(expr, start=run.started, end=end, step=5)
            checked += 1
            if not result:
                empty.append(f"{name} [{target['refId']}]: {expr}")
            points = [
                float(v)
                for r in result
                for v in ([r["value"][1]] if "value" in r else [p[1] for p in r["values"]])
            ]
            if points and all(math.isnan(v) for v in points):
                nan_only.append(f"{name} [{target['refId']}]")
    print(f"\n{checked} dashboard queries; only NaN (no traffic of that kind in the run): {nan_only}")
    assert checked >= 40
    assert not empty, "queries that returned no series:\n" + "\n".join(empty)
    for path in DASHBOARDS:
        for variable in json.loads(path.read_text())["templating"]["list"]:
            metric, label = variable["definition"].removeprefix("label_values(").rstrip(")").split(", ")
            values = run.prom.api(f"label/{label}/values", **{"match[]": metric})
            assert values == [f"127.0.0.1:{run.stack.workers[0].metrics_port}"], variable["name"]


def test_every_rule_is_healthy_and_every_expression_returns_series(run: Run) -> None:
    groups = run.prom.api("rules")["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    committed = rules()
    assert len(loaded) == len(committed)
    for rule in committed:
        name = rule.get("record") or rule["alert"]
        assert loaded[name]["health"] == "ok", (name, loaded[name].get("lastError"))
        assert run.prom.query(rule["expr"]) is not None  # evaluates without error
        if "record" in rule:
            assert run.prom.query(rule["record"]), f"recording rule {name} recorded nothing"
            assert run.prom.query(rule["expr"]), f"{name}: {rule['expr']}"
        else:
            assert run.prom.query(with_bool(rule["expr"])), f"alert {name}: {with_bool(rule['expr'])}"
    # a healthy run: the alerts about missing processes evaluate to "no"
    assert (
        run.prom.value(with_bool(next(r["expr"] for r in committed if r.get("alert") == "ChorusNoWorkers")))
        == 0
    )
    assert (
        run.prom.value(
            with_bool(next(r["expr"] for r in committed if r.get("alert") == "ChorusSchedulerDown"))
        )
        == 0
    )


def _last_scrape(prom: Prometheus, job: str) -> float:
    return prom.value(f'max(timestamp(up{{job="{job}"}}))')


def _panel_expr(title: str) -> str:
    (panel,) = [p for name, p in panels() if name == f"chorus-overview/{title}" and p["type"] == "stat"]
    return str(panel["targets"][0]["expr"])


def test_hit_ratio_steps_saved_and_speedup_agree_with_the_published_results(run: Run) -> None:
    results = run.results
    generated = {rid: r for rid, r in results.items() if rid in run.requests}
    assert set(generated) == set(run.requests), "a request has no result"
    assert [results[rid].status for rid in run.rejected_ids] == [ResultStatus.REJECTED]
    assert all(r.status is ResultStatus.DONE for r in generated.values()), {
        rid: r.error for rid, r in generated.items() if r.error
    }
    looked_up = [r for rid, r in generated.items() if run.requests[rid].reuse is ReusePolicy.AUTO]
    hits = [r for r in looked_up if r.donor is not None]
    used = [
        r
        for r in generated.values()
        if r.donor is not None and r.saved_compute  # the one definition of a hit: fewer token-steps
    ]
    saved_by_donors = sum(
        r.steps_requested * (1 - r.tokens_computed_fraction) for r in used if r.steps_computed
    )
    requested = sum(r.steps_requested for r in generated.values())
    token_steps = sum(r.steps_requested * r.tokens_computed_fraction for r in generated.values())
    print(
        f"\nresults: {len(generated)} generated, {len(looked_up)} looked up, {len(hits)} with a donor, "
        f"{len(used)} used it; token-steps saved {saved_by_donors:.4f}; requested {requested}, "
        f"computed {token_steps:.4f}"
    )
    # the workload exercised what it is meant to
    assert 0 < len(hits) < len(looked_up) and saved_by_donors > 0

    prom = run.prom
    hit_ratio = prom.value('sum(chorus_donor_lookups_total{outcome="hit"}) / sum(chorus_donor_lookups_total)')
    steps_saved = prom.value("sum(chorus_donor_steps_saved_total)")
    worker_saved = prom.value(
        "sum(chorus_worker_steps_requested_total) - sum(chorus_worker_token_steps_computed_total)"
    )
    reuse_ratio = prom.value(
        'sum(chorus_worker_requests_total{status="done",reuse="donor"}) / sum(chorus_worker_requests_total{status="done"})'
    )
    print(
        f"prometheus: hit ratio {hit_ratio:.6f} (results {len(hits) / len(looked_up):.6f}), donor steps saved "
        f"{steps_saved:.6f} (results {saved_by_donors:.6f}), worker token-steps saved {worker_saved:.6f} "
        f"(results {requested - token_steps:.6f}), reuse ratio {reuse_ratio:.6f} "
        f"(results {len(used) / len(generated):.6f})"
    )
    assert hit_ratio == pytest.approx(len(hits) / len(looked_up), rel=1e-12)
    assert steps_saved == pytest.approx(saved_by_donors, rel=1e-9)
    assert worker_saved == pytest.approx(requested - token_steps, rel=1e-9, abs=1e-9)
    assert reuse_ratio == pytest.approx(len(used) / len(generated), rel=1e-12)
    assert prom.value("sum(chorus_worker_requests_total)") == len(generated)
    assert prom.value("sum(chorus_requests_rejected_total)") == len(run.rejected_ids)
    assert prom.value("sum(chorus_requests_accepted_total)") == len(generated)
    assert prom.value("sum(chorus_donor_lookups_total)") == len(looked_up)

    # The overview's stat panels over the whole run, evaluated at each target's last scrape (so increase() has
    # nothing to extrapolate), give the same figures.
    window = run.window()
    at_sched, at_worker = _last_scrape(prom, "chorus-scheduler"), _last_scrape(prom, "chorus-worker")
    panel_hit = prom.value(grafana(_panel_expr("Donor hit ratio"), window), at=at_sched)
    panel_saved = prom.value(grafana(_panel_expr("Token-steps saved"), window), at=at_sched)
    panel_speedup = prom.value(grafana(_panel_expr("Estimated speedup"), window), at=at_worker)
    print(
        f"panels: hit ratio {panel_hit:.6f}, token-steps saved {panel_saved:.6f}, speedup {panel_speedup:.6f} "
        f"(results {requested / token_steps:.6f})"
    )
    assert panel_hit == pytest.approx(len(hits) / len(looked_up), rel=1e-9)
    assert panel_saved == pytest.approx(saved_by_donors, rel=1e-9)
    assert panel_speedup == pytest.approx(requested / token_steps, rel=1e-9)


def test_every_pool_process_counted_in_its_own_file_and_metrics_reports_the_sum(run: Run) -> None:
    counted = {pid: n for pid, n in run.child_counts.items() if n}
    print(f"\nresults counted per pool process: {counted}; /metrics total {run.exposed_total}")
    assert len(counted) >= 2, f"expected orders on both pool processes: {run.child_counts}"
    assert sum(counted.values()) == run.exposed_total == len(run.requests)
    # both pool processes are up and idle now
    assert run.prom.value("sum(chorus_worker_pool_slots)") == 2
    assert run.prom.value("sum(chorus_worker_busy_slots)") == 0
    assert run.prom.value(f'sum(chorus_worker_models_loaded{{model="{MODEL}"}})') == len(counted)
