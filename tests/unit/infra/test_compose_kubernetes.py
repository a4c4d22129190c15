"""Static checks of the Kubernetes manifests in ``infra/k8s`` (base: GPU workers; ``overlays/cpu``: CPU workers).

Every manifest is parsed with pyyaml; with ``kubectl`` installed, ``kubectl kustomize`` also renders the base and the
CPU overlay and the same checks run on what it renders (skipped otherwise). Checked:

- each object has the apiVersion of its kind, every file is part of a kustomization, everything is in one namespace;
- no Secret and no credential in the manifests: credentials are ``secretKeyRef``s to a Secret created out of band;
- every ``CHORUS_*`` variable a container gets (``env`` and the ConfigMaps of ``envFrom``) is a field of the
  settings class of the command it runs, and the values pass that class's validation;
- the scheduler's replicas (and its KEDA bound) stay within the requests topic's partitions;
- workers request a GPU in the base and none in the CPU overlay, stop within the task time limit, and take no host
  port; a headless Service per Deployment exposes the metrics port for scraping;
- the workers' KEDA ScaledObject scales the worker Deployment between its bounds on a Prometheus query that names
  only metrics the services export and exactly the Celery queues those workers consume; ``promtool`` checks its
  syntax (through a rules file that records it) when installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from pydantic_settings import BaseSettings

from chorus_sched.metrics import SchedulerMetrics
from chorus_sched.settings import SchedulerSettings
from producer.orders import queue_for
from workers.metrics import WorkerMetrics
from workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "infra" / "k8s"
BASE = K8S / "base"
CPU = K8S / "overlays" / "cpu"
KUBECTL = shutil.which("kubectl")
PROMTOOL = shutil.which("promtool")

API_VERSIONS = {
    "Namespace": "v1",
    "ConfigMap": "v1",
    "Service": "v1",
    "PersistentVolumeClaim": "v1",
    "Deployment": "apps/v1",
    "ScaledObject": "keda.sh/v1alpha1",
}
SETTINGS: dict[str, type[BaseSettings]] = {"scheduler": SchedulerSettings, "worker": WorkerSettings}
CREDENTIAL_NAME = re.compile(r"(PASSWORD|SECRET|ACCESS_KEY|TOKEN|API_KEY|_USER|_USERNAME)$")
Doc = dict[str, Any]


def load(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization(folder: Path) -> Doc:
    (doc,) = load(folder / "kustomization.yaml")
    assert isinstance(doc, dict)
    return doc


def parsed_base() -> list[Doc]:
    """The base's objects as committed, with the kustomization's namespace applied."""
    kust = kustomization(BASE)
    docs: list[Doc] = []
    for name in kust["resources"]:
        for doc in load(BASE / name):
            if doc["kind"] != "Namespace":
                doc["metadata"].setdefault("namespace", kust["namespace"])
            docs.append(doc)
    return docs


def rendered(folder: Path) -> list[Doc]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed (its built-in kustomize renders the overlays)")
    out = subprocess.run(
        [KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


VARIANTS = {
    "base-parsed": lambda: parsed_base(),
    "base-rendered": lambda: rendered(BASE),
    "cpu-rendered": lambda: rendered(CPU),
}


@pytest.fixture(params=sorted(VARIANTS), scope="module")
def variant(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, VARIANTS[request.param]()


def objects(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(deployment: Doc) -> Doc:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    assert isinstance(only, dict)
    return only


def role(deployment: Doc) -> str:
    name = str(container(deployment)["args"][0])
    assert name in SETTINGS, name
    return name


def container_env(docs: list[Doc], deployment: Doc) -> dict[str, str]:
    """Every variable the container gets, as the pod would see it (secrets and field refs as placeholders)."""
    maps = objects(docs, "ConfigMap")
    spec = container(deployment)
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        assert "secretRef" not in source, "secrets are referenced key by key, so their names are checked"
        env.update({k: str(v) for k, v in maps[source["configMapRef"]["name"]]["data"].items()})
    for var in spec.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif "secretKeyRef" in var["valueFrom"]:
            env[var["name"]] = "secret-from-the-cluster"
        else:
            env[var["name"]] = "set-by-kubernetes"
    return env


def settings_env_names(cls: type[BaseSettings]) -> set[str]:
    prefix = str(cls.model_config.get("env_prefix", ""))
    return {f"{prefix}{name}".upper() for name in cls.model_fields}


def exposed_metrics() -> set[str]:
    registry = CollectorRegistry()
    SchedulerMetrics(registry)
    WorkerMetrics(registry)
    return {s.name for family in registry.collect() for s in family.samples}


def scaled_object_for(docs: list[Doc], deployment: str) -> Doc:
    (found,) = [
        s for s in objects(docs, "ScaledObject").values() if s["spec"]["scaleTargetRef"]["name"] == deployment
    ]
    return found


# --- the files -------------------------------------------------------------------------------------------------


def test_every_manifest_parses_has_its_api_version_and_belongs_to_a_kustomization() -> None:
    referenced: set[Path] = set()
    for kust_path in sorted(K8S.rglob("kustomization.yaml")):
        folder = kust_path.parent
        kust = kustomization(folder)
        assert kust["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and kust["kind"] == "Kustomization"
        referenced.add(kust_path)
        for resource in kust.get("resources", []):
            path = (folder / resource).resolve()
            referenced.add(path if path.is_file() else path / "kustomization.yaml")
        for patch in kust.get("patches", []):
            path = folder / patch["path"]
            referenced.add(path.resolve())
            docs = load(path)
            if "target" in patch:  # a JSON 6902 patch: a list of operations
                (ops,) = docs
                assert all(op["op"] in {"add", "remove", "replace", "test"} and op["path"] for op in ops)
            else:  # a strategic merge patch names what it patches
                assert all(d["kind"] in API_VERSIONS and d["metadata"]["name"] for d in docs), path
    files = {p.resolve() for p in K8S.rglob("*.yaml")}
    assert files - referenced == set(), "files no kustomization uses"
    docs = parsed_base()
    for doc in docs:
        assert API_VERSIONS.get(doc["kind"]) == doc["apiVersion"], (doc["kind"], doc["apiVersion"])
        assert doc["metadata"]["name"]
    assert {d["kind"] for d in docs} == set(API_VERSIONS)


def test_everything_lives_in_the_chorus_namespace(variant: tuple[str, list[Doc]]) -> None:
    _, docs = variant
    (namespace,) = objects(docs, "Namespace")
    assert namespace == "chorus"
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace, doc["metadata"]["name"]


def test_no_secret_is_written_in_the_manifests(variant: tuple[str, list[Doc]]) -> None:
    _, docs = variant
    assert not objects(docs, "Secret")
    for config in objects(docs, "ConfigMap").values():
        for key, value in config["data"].items():
            assert not CREDENTIAL_NAME.search(key), f"{key} belongs in the Secret"
            assert not re.search(r"://[^/@\s]+:[^/@\s]+@", str(value)), f"{key} has a password in a URL"
    for deployment in objects(docs, "Deployment").values():
        for var in container(deployment).get("env", []):
            if CREDENTIAL_NAME.search(var["name"]):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                assert ref and ref["name"] == "chorus-secrets", f"{var['name']} is not a secretKeyRef"


def test_containers_get_only_settings_their_settings_class_reads(
    variant: tuple[str, list[Doc]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, docs = variant
    roles = set()
    for name, deployment in objects(docs, "Deployment").items():
        cls = SETTINGS[role(deployment)]
        env = container_env(docs, deployment)
        chorus_vars = {k: v for k, v in env.items() if k.startswith("CHORUS_")}
        unknown = set(chorus_vars) - settings_env_names(cls)
        assert not unknown, f"{name} sets {sorted(unknown)}, which {cls.__name__} does not read"
        with monkeypatch.context() as mp:
            for key in [k for k in os.environ if k.startswith("CHORUS_")]:
                mp.delenv(key)
            for key, value in chorus_vars.items():
                mp.setenv(key, value)
            cls()  # the values validate
        roles.add(role(deployment))
    assert roles == {"scheduler", "worker"}


def test_scheduler_instances_stay_within_the_requests_topic_partitions(
    variant: tuple[str, list[Doc]],
) -> None:
    _, docs = variant
    deployment = objects(docs, "Deployment")["chorus-scheduler"]
    partitions = int(deployment["metadata"]["annotations"]["chorus/requests-topic-partitions"])
    assert 1 <= deployment["spec"]["replicas"] <= partitions
    scaled = scaled_object_for(docs, "chorus-scheduler")
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"] <= partitions
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "kafka"
    meta = trigger["metadata"]
    assert meta["allowIdleConsumers"] == "false"  # KEDA itself never goes beyond the partition count
    # The addresses come from the container's own settings: the group and topic the scheduler consumes.
    env = container_env(docs, deployment)
    settings = SchedulerSettings.model_validate(  # the values given, defaults for the rest (no environment)
        {k.removeprefix("CHORUS_").lower(): v for k, v in env.items() if k.startswith("CHORUS_KAFKA_")}
    )
    assert env[meta["bootstrapServersFromEnv"]] == settings.kafka_bootstrap
    assert env[meta["consumerGroupFromEnv"]] == settings.kafka_group_id
    assert env[meta["topicFromEnv"]] == settings.kafka_requests_topic


def test_workers_request_their_device_stop_gracefully_and_take_no_host_port(
    variant: tuple[str, list[Doc]],
) -> None:
    name, docs = variant
    deployment = objects(docs, "Deployment")["chorus-worker"]
    pod = deployment["spec"]["template"]["spec"]
    spec = container(deployment)
    env = container_env(docs, deployment)
    resources = spec["resources"]
    if name.startswith("cpu"):
        assert env["CHORUS_DEVICE"] == "cpu" and spec["image"].endswith("-cpu")
        assert "nvidia.com/gpu" not in str(deployment) and "chorus-models" not in str(docs)
        assert "--autoscale" in spec["args"]
    else:
        assert env["CHORUS_DEVICE"] == "cuda"
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        mounts = {m["name"]: m for m in spec["volumeMounts"]}
        assert mounts["models"]["readOnly"] and env["CHORUS_WAN21_DIR"].startswith(
            mounts["models"]["mountPath"]
        )
    assert pod["terminationGracePeriodSeconds"] > WorkerSettings.model_fields["task_time_limit_s"].default
    assert not pod.get("hostNetwork") and all("hostPort" not in p for p in spec["ports"])


def test_each_deployment_has_a_headless_service_for_scraping_its_metrics_port(
    variant: tuple[str, list[Doc]],
) -> None:
    _, docs = variant
    services = objects(docs, "Service")
    for name, deployment in objects(docs, "Deployment").items():
        cls = SETTINGS[role(deployment)]
        port = int(
            container_env(docs, deployment).get(
                "CHORUS_METRICS_PORT", cls.model_fields["metrics_port"].default
            )
        )
        (metrics,) = [p for p in container(deployment)["ports"] if p["name"] == "metrics"]
        assert metrics["containerPort"] == port, name
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (service,) = [s for s in services.values() if s["spec"]["selector"].items() <= labels.items()]
        assert service["spec"]["clusterIP"] == "None"  # one endpoint per pod
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, "metrics")]
        notes = service["metadata"]["annotations"]
        assert (notes["prometheus.io/scrape"], notes["prometheus.io/port"]) == ("true", str(port))
        for probe in ("readinessProbe", "livenessProbe"):
            assert container(deployment)[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}


def worker_query(docs: list[Doc]) -> tuple[Doc, str]:
    scaled = scaled_object_for(docs, "chorus-worker")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    return scaled, str(trigger["metadata"]["query"])


def test_workers_scale_on_the_queue_depth_of_the_models_they_serve(variant: tuple[str, list[Doc]]) -> None:
    _, docs = variant
    scaled, query = worker_query(docs)
    assert 0 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    assert float(trigger["metadata"]["threshold"]) > 0
    assert trigger["metadata"]["serverAddress"].startswith("http")
    exposed = exposed_metrics()
    names = re.findall(r"\b(chorus_[a-z_]+)\b(?=\s*[{\[),)])", query)
    assert "chorus_celery_queue_length" in names
    assert set(names) <= exposed, f"{sorted(set(names) - exposed)} are not metrics the services export"
    # The queues it watches are exactly those the Deployment's workers consume (one per served model).
    deployment = objects(docs, "Deployment")["chorus-worker"]
    models = container_env(docs, deployment)["CHORUS_WORKER_MODELS"].split(",")
    served = WorkerSettings(worker_models=[m.strip() for m in models if m.strip()]).served_models
    assert set(re.findall(r'queue="([^"]+)"', query)) == {queue_for(m) for m in served}


def test_the_keda_queries_are_valid_promql(tmp_path: Path) -> None:
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (Debian: prometheus)")
    queries = {"base": worker_query(parsed_base())[1]}
    if KUBECTL is not None:
        queries["cpu"] = worker_query(rendered(CPU))[1]
    rules = {
        "groups": [
            {
                "name": "keda-triggers",
                "rules": [
                    {"record": f"keda:chorus_worker_demand_{name}", "expr": q} for name, q in queries.items()
                ],
            }
        ]
    }
    path = tmp_path / "keda-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(queries)} rules found" in done.stdout
