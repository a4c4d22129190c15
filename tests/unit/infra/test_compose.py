"""Static checks of ``docker-compose.yml`` and the service image (there is no Docker engine here to run them).

- the file validates against the Compose Specification's JSON schema (``../shared/schemas/compose-spec.json``,
  read only when it is there: the project never depends on it);
- images are pinned by tag (the built one by the project's version); every long-running service has a health check,
  and the Chorus services' checks probe the metrics port their settings serve on;
- every stateful service keeps its data in a named volume, mounted where its own configuration says the data is;
- no credential literal: credentials are ``${VAR:?message}`` interpolations only;
- worker services publish no host port and set no container name or host name, so ``--scale worker=N`` cannot clash;
  they stop gracefully within the task time limit; the GPU profile reserves a GPU, the CPU profile does not;
- every ``CHORUS_*`` variable a service sets is a field of the settings class of the service its command runs,
  derived from the pydantic-settings classes, and the values pass that class's validation; commands parse with the
  ``chorus`` CLI; every address a service points at is a service it depends on;
- clients on the host reach Kafka (an advertised listener on localhost:29092) and the S3 API on loopback only;
- bind mounts point at files that exist (``tests/unit/infra/test_metrics_infra.py`` checks the Prometheus and Grafana
  configuration behind them), and the Dockerfile installs the torch the project pins.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from pydantic_settings import BaseSettings

from chorus_sched.settings import SchedulerSettings
from producer.cli import app as chorus_app
from workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "infra" / "Dockerfile"
SCHEMA = ROOT.parent / "shared" / "schemas" / "compose-spec.json"

# The settings class of each ``chorus`` command a container runs.
SETTINGS: dict[str, type[BaseSettings]] = {"scheduler": SchedulerSettings, "worker": WorkerSettings}
# Where each stateful image keeps its data (what its own configuration in the file says, where it says anything).
DATA_DIRS = {
    "apache/kafka": lambda s: s["environment"]["KAFKA_LOG_DIRS"],
    "redis": lambda s: "/data",
    "minio/minio": lambda s: s["command"][s["command"].index("server") + 1],
    "qdrant/qdrant": lambda s: "/qdrant/storage",
    "prom/prometheus": lambda s: _flag(s["command"], "--storage.tsdb.path"),
    "grafana/grafana": lambda s: "/var/lib/grafana",
}
STATELESS = {"minio/mc"}  # the one-shot bucket creation
CREDENTIAL_NAME = re.compile(r"(PASSWORD|SECRET|ACCESS_KEY|TOKEN|API_KEY|_USER|_USERNAME)$")
REQUIRED_VAR = re.compile(r"^\$\{[A-Z_][A-Z0-9_]*:\?[^}]+\}$")
INTERPOLATION = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)(?::?([-?])([^}]*))?\}")


def _flag(command: list[str], name: str) -> str:
    (value,) = [c.split("=", 1)[1] for c in command if c.startswith(name + "=")]
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


def chorus_role(service: dict[str, Any]) -> str | None:
    """``scheduler`` or ``worker`` for a service that runs the Chorus image, else None."""
    if not str(service.get("image", "")).startswith("chorus:"):
        return None
    role = service["command"][0]
    assert role in SETTINGS, f"unknown chorus command {service['command']}"
    return str(role)


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    assert isinstance(env, dict), "environment is written as a mapping"
    return {str(k): str(v) for k, v in env.items()}


def interpolate(value: str, host: dict[str, str]) -> str:
    """Compose's variable interpolation (``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``, ``$$``)."""

    def one(match: re.Match[str]) -> str:
        name, kind, arg = match.group(1), match.group(2), match.group(3)
        if host.get(name):
            return host[name]
        if kind == "?":
            raise KeyError(f"{name}: {arg}")
        return arg if kind == "-" else ""

    return INTERPOLATION.sub(one, value).replace("$$", "$")


def image_repo_tag(image: str) -> tuple[str, str | None]:
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return image, None
    return name, tag


def settings_env_names(cls: type[BaseSettings]) -> set[str]:
    prefix = str(cls.model_config.get("env_prefix", ""))
    return {f"{prefix}{name}".upper() for name in cls.model_fields}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in list(os.environ):
        if name.startswith("CHORUS_"):
            monkeypatch.delenv(name)
    yield monkeypatch


# --- the file as a whole ---------------------------------------------------------------------------------------


def test_the_file_validates_against_the_compose_specification(compose: dict[str, Any]) -> None:
    if not SCHEMA.is_file():
        pytest.skip(
            f"{SCHEMA} is not there (the Compose Specification schema is read from ../shared when present)"
        )
    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []


def test_images_are_pinned_and_the_chorus_image_carries_the_project_version(compose: dict[str, Any]) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for name, service in services(compose).items():
        repo, tag = image_repo_tag(service["image"])
        assert tag and tag != "latest", f"{name}: image {service['image']} is not pinned by tag"
        if "build" in service:
            assert repo == "chorus" and tag.split("-")[0] == version, f"{name}: {service['image']}"
            assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file()


def test_every_long_running_service_has_a_health_check(compose: dict[str, Any]) -> None:
    for name, service in services(compose).items():
        if service.get("restart") == "no":  # one-shot (bucket creation): others wait for it to complete
            continue
        check = service.get("healthcheck")
        assert check and check["test"] and not check.get("disable"), f"{name} has no health check"
        role = chorus_role(service)
        if role is not None:
            default = SETTINGS[role].model_fields["metrics_port"].default
            port = int(environment(service).get("CHORUS_METRICS_PORT", default))
            assert f"http://127.0.0.1:{port}/metrics" in check["test"], f"{name}: {check['test']}"


def test_persistent_data_lives_in_named_volumes(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in services(compose).items():
        repo, _ = image_repo_tag(service["image"])
        if chorus_role(service) is not None or repo in STATELESS:
            continue
        assert repo in DATA_DIRS, f"{name}: where does {repo} keep its data? (add it to DATA_DIRS)"
        data_dir = DATA_DIRS[repo](service)
        named = {
            target: source
            for source, target, *_ in (str(v).split(":") for v in service.get("volumes", []))
            if not source.startswith((".", "/", "$"))
        }
        assert data_dir in named, f"{name}: no named volume at {data_dir}"
        assert named[data_dir] in declared, f"{name}: volume {named[data_dir]} is not declared"
    redis = next(s for s in services(compose).values() if image_repo_tag(s["image"])[0] == "redis")
    assert "--appendonly" in redis["command"]  # Redis writes its data at all


def test_credentials_only_come_from_required_variables(compose: dict[str, Any]) -> None:
    found = 0
    for name, service in services(compose).items():
        for key, value in environment(service).items():
            if CREDENTIAL_NAME.search(key):
                found += 1
                assert REQUIRED_VAR.match(value), f"{name}: {key} is not a ${{VAR:?…}} interpolation"
            assert not re.search(r"://[^/@\s]+:[^/@\s]+@", value), f"{name}: {key} has a password in a URL"
    assert found >= 6  # MinIO root (×2 services) and the workers' S3 keys, Grafana's admin
    # Without the variables, Compose refuses to start rather than run with a default.
    with pytest.raises(KeyError, match="MINIO_ROOT_PASSWORD"):
        interpolate("${MINIO_ROOT_PASSWORD:?set MINIO_ROOT_PASSWORD}", {})


def test_workers_can_be_scaled_without_clashes(compose: dict[str, Any]) -> None:
    workers = {n: s for n, s in services(compose).items() if chorus_role(s) == "worker"}
    assert set(workers) == {"worker", "worker-cpu"}
    time_limit = WorkerSettings.model_fields["task_time_limit_s"].default
    for name, service in workers.items():
        for key in ("ports", "container_name", "hostname"):
            assert key not in service, f"{name} sets {key}: replicas would clash"
        grace = re.fullmatch(r"(\d+)m", service["stop_grace_period"])
        assert grace and int(grace.group(1)) * 60 >= time_limit, f"{name}: running orders are cut off"
        assert len(service["profiles"]) == 1  # one worker flavour per profile
    gpu, cpu = workers["worker"], workers["worker-cpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert environment(gpu)["CHORUS_DEVICE"] == "cuda"
    assert "deploy" not in cpu and environment(cpu)["CHORUS_DEVICE"] == "cpu"
    assert "--autoscale" in cpu["command"]  # the pool size between the settings' autoscale bounds
    assert {"CHORUS_WORKER_AUTOSCALE_MIN", "CHORUS_WORKER_AUTOSCALE_MAX"} <= set(environment(cpu))


def test_each_service_sets_only_settings_its_own_settings_class_reads(
    compose: dict[str, Any], clean_env: pytest.MonkeyPatch
) -> None:
    host = {"MINIO_ROOT_USER": "user", "MINIO_ROOT_PASSWORD": "password-password"}
    checked = set()
    for name, service in services(compose).items():
        role = chorus_role(service)
        env = environment(service)
        chorus_vars = {k for k in env if k.startswith("CHORUS_")}
        if role is None:
            assert not chorus_vars, f"{name} is not a Chorus service but sets {sorted(chorus_vars)}"
            continue
        cls = SETTINGS[role]
        unknown = chorus_vars - settings_env_names(cls)
        assert not unknown, f"{name} ({role}) sets {sorted(unknown)}, which {cls.__name__} does not read"
        # The values pass the class's validation as the container would see them.
        with pytest.MonkeyPatch.context() as mp:
            for key in chorus_vars:
                mp.setenv(key, interpolate(env[key], host))
            cls()
        checked.add(role)
    assert checked == {"scheduler", "worker"}


def test_commands_are_ones_the_chorus_cli_accepts(compose: dict[str, Any]) -> None:
    cli = typer.main.get_command(chorus_app)
    assert isinstance(cli, typer.core.TyperGroup)
    for service in services(compose).values():
        if chorus_role(service) is not None:
            command = cli.commands[service["command"][0]]
            command.make_context(service["command"][0], list(service["command"][1:]))  # raises on bad options


def test_every_address_a_service_uses_is_a_service_it_waits_for(compose: dict[str, Any]) -> None:
    all_services = services(compose)

    def waits_for(name: str) -> set[str]:
        direct = set(all_services[name].get("depends_on") or {})
        return direct | {t for d in direct for t in waits_for(d)}

    for name, service in all_services.items():
        if chorus_role(service) is None:
            continue
        for key, value in environment(service).items():
            for host in re.findall(r"(?:^|//)([a-z][a-z0-9-]*):\d+", value):
                assert host in all_services, f"{name}: {key} points at unknown host {host}"
                assert host in waits_for(name), f"{name}: {key} uses {host}, which it does not wait for"
        for dep, condition in (service.get("depends_on") or {}).items():
            expected = "service_completed_successfully" if all_services[dep].get("restart") == "no" else None
            assert condition["condition"] == (expected or "service_healthy"), f"{name} → {dep}"


def test_bind_mounts_point_at_files_that_exist(compose: dict[str, Any]) -> None:
    for name, service in services(compose).items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("./"):  # the repository's files (a ${VAR} source is the operator's)
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
    prometheus = yaml.safe_load((ROOT / "infra" / "prometheus" / "prometheus.yml").read_text())
    for rule_file in prometheus["rule_files"]:
        assert (ROOT / "infra" / "prometheus" / rule_file).is_file(), rule_file


def test_the_image_installs_what_the_project_pins() -> None:
    dockerfile = DOCKERFILE.read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (torch_pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    assert f'pip install --index-url "$TORCH_INDEX" {torch_pin}' in dockerfile
    base = re.search(r"^FROM (\S+)", dockerfile, re.M)
    assert base is not None and image_repo_tag(base.group(1))[1] not in (None, "latest")
    for package in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert f"COPY {package.rstrip('*')} ./{package.rstrip('*')}" in dockerfile
    assert 'ENTRYPOINT ["chorus"]' in dockerfile
    for line in re.findall(r"^\s*(CHORUS_[A-Z0-9_]+)=", dockerfile, re.M):
        for cls in SETTINGS.values():
            assert line in settings_env_names(cls), (
                f"the image sets {line}, which {cls.__name__} does not read"
            )
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", ".chorus"} <= set(ignored)  # the build context stays small


def test_host_clients_reach_kafka_and_the_object_store_on_loopback(compose: dict[str, Any]) -> None:
    """The README's `chorus produce --bootstrap localhost:29092`, kcat and S3 downloads work from the host."""
    all_services = services(compose)
    kafka = all_services["kafka"]
    env = environment(kafka)
    listeners = dict(item.split("://") for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    published = {str(p).rsplit(":", 1)[-1]: str(p) for p in kafka.get("ports", [])}
    for name, address in listeners.items():
        host, port = address.rsplit(":", 1)
        assert name in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"], name
        if host == "localhost":
            assert published[port] == f"127.0.0.1:{port}:{port}", "the host listener is published on loopback"
        else:
            assert host == "kafka", f"{name} advertises {host}, which containers cannot resolve"
    assert "localhost" in {a.rsplit(":", 1)[0] for a in listeners.values()}
    minio_ports = [str(p) for p in all_services["minio"]["ports"]]
    assert "127.0.0.1:9000:9000" in minio_ports
