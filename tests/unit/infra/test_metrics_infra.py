"""The monitoring configuration: Prometheus config and rules (promtool), Grafana provisioning and dashboards.

Static checks only; ``tests/integration/test_observability.py`` evaluates every query against a live Prometheus.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from chorus_sched.metrics import SchedulerMetrics
from workers.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[3]
PROM = ROOT / "infra" / "prometheus"
GRAFANA = ROOT / "infra" / "grafana"
RULE_FILES = sorted((PROM / "rules").glob("*.yml"))
RULE_TESTS = sorted((PROM / "tests").glob("*.yml"))
DASHBOARD_FILES = sorted((GRAFANA / "dashboards").glob("*.json"))

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool is not installed (Debian: prometheus)")


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert promtool is not None
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def load_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_dashboards", GRAFANA / "build_dashboards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def rules() -> list[dict[str, Any]]:
    return [r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]]


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return [p for p in out if p["type"] != "row"]


def exposed_sample_names() -> set[str]:
    registry = CollectorRegistry()
    SchedulerMetrics(registry)
    WorkerMetrics(registry)
    return {s.name for family in registry.collect() for s in family.samples}


# --- promtool ------------------------------------------------------------------------------------------------


@needs_promtool
def test_prometheus_config_and_rule_files_pass_promtool_check() -> None:
    done = run_promtool("check", "config", str(PROM / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(RULE_FILES)} rule files found" in done.stdout + done.stderr
    done = run_promtool("check", "rules", *map(str, RULE_FILES))
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
@pytest.mark.parametrize("test_file", RULE_TESTS, ids=lambda p: p.name)
def test_promtool_rule_unit_tests_pass(test_file: Path) -> None:
    done = run_promtool("test", "rules", str(test_file))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_is_labelled_explained_and_unit_tested_both_ways() -> None:
    alerts = [r for r in rules() if "alert" in r]
    assert {a["alert"] for a in alerts} >= {
        "ChorusHighErrorRatio",
        "ChorusRequestsLagGrowing",
        "ChorusDonorHitRatioCollapsed",
        "ChorusNoWorkers",
        "ChorusFallbackSpike",
    }
    fires: set[str] = set()
    quiet: set[str] = set()
    for test_file in RULE_TESTS:
        for case in yaml.safe_load(test_file.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check["exp_alerts"] else quiet).add(check["alertname"])
    for alert in alerts:
        assert alert["labels"]["severity"] in {"critical", "warning"}, alert["alert"]
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], alert["alert"]
        assert alert["alert"] in fires, f"no test makes {alert['alert']} fire"
        if alert["alert"] != "ChorusTargetDown":  # its quiet case is the healthy worker in the same test
            assert alert["alert"] in quiet, f"no test keeps {alert['alert']} quiet"


def test_rules_and_dashboards_only_name_metrics_the_services_expose() -> None:
    exposed = exposed_sample_names() | {"up"}
    recorded = {r["record"] for r in rules() if "record" in r}
    exprs = [r["expr"] for r in rules()]
    for path in DASHBOARD_FILES:
        dash = json.loads(path.read_text())
        exprs += [t["expr"] for p in panels(dash) for t in p["targets"]]
        exprs += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    assert exprs
    for expr in exprs:
        for name in re.findall(r"\b(chorus_[a-z_]+|up)\b(?=\s*[{\[),)])", expr):
            assert name in exposed, f"{name} (in {expr!r}) is not a metric the services expose"
        for name in re.findall(r"\bchorus:[a-z0-9_:]+", expr):
            assert name in recorded, f"{name} is not a recording rule"


# --- Grafana -------------------------------------------------------------------------------------------------


def test_committed_dashboards_are_what_the_builder_produces() -> None:
    builder = load_builder()
    assert builder.main(["--check"]) == 0
    assert sorted(p.name for p in DASHBOARD_FILES) == sorted(builder.DASHBOARDS)


def test_every_panel_queries_the_provisioned_datasource_by_uid() -> None:
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = provisioned["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    uids = set()
    for path in DASHBOARD_FILES:
        dash = json.loads(path.read_text())
        uids.add(dash["uid"])
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), path.name
        for p in panels(dash):
            assert p["datasource"] == {"type": "prometheus", "uid": source["uid"]}, p["title"]
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["datasource"]["uid"] == source["uid"] and t["expr"].strip(), p["title"]
            pos = p["gridPos"]
            assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, p["title"]
    assert uids == {"chorus-overview", "chorus-workers"}


def test_the_overview_and_workers_dashboards_have_the_panels_the_issue_asks_for() -> None:
    titles = {
        path.stem: {p["title"] for p in panels(json.loads(path.read_text()))} for path in DASHBOARD_FILES
    }
    assert {"Requests", "Donor hit ratio", "Estimated speedup", "End to end", "Error ratio"} <= titles[
        "chorus-overview"
    ]
    assert {
        "Busy slots",
        "Denoising per stage",
        "Celery queue depth",
        "Kafka consumer lag",
        "Fallbacks by cause",
    } <= titles["chorus-workers"]


def test_compose_mounts_the_prometheus_and_grafana_configuration() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]

    def mounts(service: str) -> dict[str, str]:
        pairs = [v.split(":")[:2] for v in services[service]["volumes"]]
        return {target: source for source, target in pairs}

    prom = mounts("prometheus")
    assert (ROOT / prom["/etc/prometheus"] / "prometheus.yml").is_file()
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    graf = mounts("grafana")
    provisioning = ROOT / graf["/etc/grafana/provisioning"]
    assert (provisioning / "datasources" / "prometheus.yml").is_file()
    provider = yaml.safe_load((provisioning / "dashboards" / "chorus.yml").read_text())["providers"][0]
    assert graf[provider["options"]["path"]] == "./infra/grafana/dashboards"
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["chorus-scheduler"]["dns_sd_configs"][0]["port"] == 9101
    assert jobs["chorus-worker"]["dns_sd_configs"][0]["port"] == 9102
    assert set(jobs["chorus-worker"]["dns_sd_configs"][0]["names"]) == {
        name for name in services if name.startswith("worker")
    }
