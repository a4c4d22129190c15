"""What an operator meets first (issue 19): env files, clear one-line errors, the CLI's options and version."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from producer import bus
from producer.cli import app
from producer.local import demo_command
from producer.local.config import MOCK_KAFKA_API_VERSION
from producer.settings import ENV_FILE_VARIABLE, KafkaSettings, ProducerSettings


@pytest.fixture(autouse=True)
def _no_env_file(monkeypatch: pytest.MonkeyPatch) -> None:
    # Commands set CHORUS_ENV_FILE for their process; monkeypatch puts the environment back after each test.
    monkeypatch.setenv(ENV_FILE_VARIABLE, "")


def _fake_stack(tmp_path: Path, **env: str) -> Any:
    return SimpleNamespace(state_dir=tmp_path, env=env, options=SimpleNamespace(models=["toy"]))


# --- env files ----------------------------------------------------------------------------------------------


def test_the_stack_env_file_is_read_by_settings_and_the_environment_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = _fake_stack(
        tmp_path,
        CHORUS_KAFKA_BOOTSTRAP="127.0.0.1:4242",
        CHORUS_KAFKA_API_VERSION=MOCK_KAFKA_API_VERSION,
        CHORUS_STATE_DIR=str(tmp_path / "state dir"),
        CHORUS_METRICS_PORT="9999",
        PATH="/usr/bin",
    )
    env_file = demo_command.write_env_file(stack)
    text = env_file.read_text()
    assert "CHORUS_METRICS_PORT" not in text and "PATH" not in text
    assert env_file.stat().st_mode & 0o077 == 0

    monkeypatch.setenv(ENV_FILE_VARIABLE, str(env_file))
    settings = ProducerSettings()
    assert settings.kafka_bootstrap == "127.0.0.1:4242"
    assert settings.state_dir == tmp_path / "state dir"
    monkeypatch.setenv("CHORUS_KAFKA_BOOTSTRAP", "kafka:9092")
    assert ProducerSettings().kafka_bootstrap == "kafka:9092"


def test_the_env_file_goes_when_the_kept_stack_stops(tmp_path: Path) -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    stack = _fake_stack(tmp_path, CHORUS_KAFKA_BOOTSTRAP="127.0.0.1:4242")
    stack.check = interrupted
    printed: list[str] = []
    console = SimpleNamespace(print=lambda text, *a, **k: printed.append(str(text)))
    demo_command._keep_running(console, stack)  # type: ignore[arg-type]
    assert not (tmp_path / "stack.env").exists()
    # The printed command works as typed: the chorus of this environment, with the env file as an option.
    hint = printed[0]
    assert f"{demo_command.chorus_for_shell()} produce --env-file " in hint
    assert "stack.env" in hint


def test_produce_with_a_missing_env_file_says_so_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "stack.env"
    for args in (
        ["produce", "--env-file", str(missing), "--prompt", "a red circle"],
        ["--env-file", str(missing), "produce", "--prompt", "a red circle"],
    ):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "stack.env does not exist" in " ".join(result.output.split())
        assert "Traceback" not in result.output


def test_a_dotted_api_version_is_given_to_kafka_python_as_its_table_spells_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kafka.protocol.broker_version_data import BrokerVersionData

    for configured, expected in (("2.1.0", (2, 1)), ("2.1", (2, 1)), ("0.10.0", (0, 10, 0)), ("3.9", (3, 9))):
        config = bus.client_config(KafkaSettings(kafka_api_version=configured))
        assert config["api_version"] == expected
        with caplog.at_level(logging.WARNING, logger="kafka"):
            BrokerVersionData(broker_version=config["api_version"])
        assert not caplog.records, caplog.text
    assert "api_version" not in bus.client_config(KafkaSettings(kafka_api_version="auto"))


# --- one-line errors ----------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip()]


def test_produce_without_a_broker_fails_in_seconds_with_one_actionable_line() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    result = CliRunner().invoke(app, ["produce", "--prompt", "a red circle", "--bootstrap", address])
    assert time.monotonic() - started < 5
    assert result.exit_code == 1, result.output
    [line] = _lines(result.output)
    assert line.startswith(f"error: cannot reach the Kafka broker at {address} (CHORUS_KAFKA_BOOTSTRAP)")
    assert "./scripts/demo.sh --keep-running" in line and "--env-file .chorus/stack.env" in line


def test_with_debug_the_traceback_is_shown() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    result = CliRunner().invoke(
        app, ["--debug", "produce", "--prompt", "a red circle", "--bootstrap", address]
    )
    assert result.exit_code == 1
    assert isinstance(result.exception, bus.BrokerUnreachable)


def test_a_broker_that_accepts_but_never_answers_fails_within_the_bootstrap_timeout(tmp_path: Path) -> None:
    # A port that accepts connections and says nothing (a wrong service, a dead proxy): the TCP check passes and
    # a client's first contact, bounded by kafka_bootstrap_timeout_ms, decides. Given its api version, the
    # producer used to wait a minute, and the results consumer of --wait without limit.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        address = f"127.0.0.1:{server.getsockname()[1]}"
        env_file = tmp_path / "stack.env"
        env_file.write_text(
            f'CHORUS_KAFKA_BOOTSTRAP="{address}"\nCHORUS_KAFKA_API_VERSION="2.1"\n'
            'CHORUS_KAFKA_BOOTSTRAP_TIMEOUT_MS="1500"\n'
        )
        for wait in ([], ["--wait"]):
            started = time.monotonic()
            result = CliRunner().invoke(
                app, ["produce", "--env-file", str(env_file), "--prompt", "a red circle", *wait]
            )
            assert time.monotonic() - started < 5
            assert result.exit_code == 1, result.output
            [line] = _lines(result.output)
            assert (
                f"cannot reach the Kafka broker at {address}" in line
                and "no Kafka answer within 1500 ms" in line
            )
            # The settings came from an env file: the hint asks whether its stack still runs.
            assert f"the settings came from {env_file}" in line


@pytest.mark.parametrize("command", [["produce", "--prompt", "x"], ["worker"], ["scheduler"]])
def test_a_bad_setting_is_one_line_naming_the_variable_and_the_allowed_values(
    monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    monkeypatch.setenv("CHORUS_LOG_LEVEL", "verbose")
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2, result.output
    [line] = _lines(result.output)
    assert "CHORUS_LOG_LEVEL='verbose': must be 'DEBUG', 'INFO', 'WARNING' or 'ERROR'" in line
    assert "Traceback" not in result.output


def test_settings_errors_never_show_a_credential_and_levels_take_any_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pydantic import ValidationError

    from producer.settings import settings_error_line

    monkeypatch.setenv("CHORUS_LOG_LEVEL", "debug")
    assert ProducerSettings().log_level == "DEBUG"

    monkeypatch.setenv("CHORUS_KAFKA_SASL_PASSWORD", "hunter2")
    monkeypatch.setenv("CHORUS_KAFKA_BOOTSTRAP", "")
    with pytest.raises(ValidationError) as raised:
        KafkaSettings(kafka_sasl_password=["hunter2"])
    line = settings_error_line(raised.value)
    assert "hunter2" not in line
    assert "CHORUS_KAFKA_SASL_PASSWORD:" in line and "CHORUS_KAFKA_BOOTSTRAP='':" in line


# --- the object store's endpoint ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "address", "tls", "url"),
    [
        ({"s3_endpoint": "http://127.0.0.1:33827"}, "127.0.0.1:33827", False, "http://127.0.0.1:33827"),
        ({"s3_endpoint": "https://s3.example.com/"}, "s3.example.com", True, "https://s3.example.com"),
        (
            {"s3_endpoint": "HTTPS://s3.example.com:9443", "s3_secure": True},
            "s3.example.com:9443",
            True,
            None,
        ),
        ({"s3_endpoint": "127.0.0.1:33827"}, "127.0.0.1:33827", False, "http://127.0.0.1:33827"),
        ({"s3_endpoint": "minio:9000", "s3_secure": True}, "minio:9000", True, "https://minio:9000"),
        ({}, "127.0.0.1:9000", False, "http://127.0.0.1:9000"),
    ],
)
def test_the_s3_endpoint_is_a_url_whose_scheme_decides_tls_or_a_bare_address(
    fields: dict[str, Any], address: str, tls: bool, url: str | None
) -> None:
    from workers.settings import WorkerSettings
    from workers.store import ObjectStore

    settings = WorkerSettings(**fields)
    assert (settings.s3_address, settings.s3_tls) == (address, tls)
    assert settings.s3_url == (url or f"https://{address}")
    store = ObjectStore.from_settings(settings)
    assert store.endpoint == address and store.secure == tls


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"s3_endpoint": "ftp://minio:9000"}, "scheme must be http or https"),
        ({"s3_endpoint": "http://minio:9000/bucket"}, "no path"),
        ({"s3_endpoint": "http://minio:9000", "s3_secure": True}, "contradicts the http://"),
    ],
)
def test_an_s3_endpoint_that_cannot_work_is_refused(fields: dict[str, Any], says: str) -> None:
    from pydantic import ValidationError

    from producer.settings import settings_error_line
    from workers.settings import WorkerSettings

    with pytest.raises(ValidationError) as raised:
        WorkerSettings(**fields)
    assert says in settings_error_line(raised.value)


def test_the_stack_gives_its_services_the_s3_endpoint_as_a_url(tmp_path: Path) -> None:
    from producer.local.config import StackOptions, service_env

    env = service_env(
        StackOptions(),
        state_dir=tmp_path,
        kafka_address="127.0.0.1:1",
        s3_address="127.0.0.1:33827",
        s3_access_key="a",
        s3_secret_key="b",
    )
    assert env["CHORUS_S3_ENDPOINT"] == "http://127.0.0.1:33827"


# --- the metrics endpoint's address -----------------------------------------------------------------------------


def test_both_services_serve_metrics_on_the_configured_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from chorus_sched import metrics as sched_metrics
    from chorus_sched.settings import SchedulerSettings
    from workers import metrics as worker_metrics
    from workers.settings import WorkerSettings

    asked: list[str] = []

    def listen(port: int, *, addr: str, **_: Any) -> None:
        asked.append(addr)

    monkeypatch.setattr(sched_metrics, "listen", listen)
    monkeypatch.setattr(worker_metrics, "listen", listen)
    monkeypatch.setattr(worker_metrics, "enable_multiprocess", lambda: Path("/nonexistent"))
    monkeypatch.setattr(worker_metrics, "multiprocess_registry", lambda path: None)
    assert SchedulerSettings().metrics_bind_address == WorkerSettings().metrics_bind_address == "0.0.0.0"
    monkeypatch.setenv("CHORUS_METRICS_BIND_ADDRESS", "127.0.0.1")
    sched_metrics.serve(SchedulerSettings(metrics_port=9))
    worker_metrics.serve(WorkerSettings(metrics_port=9))
    assert asked == ["127.0.0.1", "127.0.0.1"]


def test_an_endpoint_on_one_loopback_address_is_not_on_another() -> None:
    from producer.metrics_server import listen

    exposition = listen(0, addr="127.0.0.2")
    assert exposition is not None
    try:
        with socket.create_connection(("127.0.0.2", exposition.port), timeout=2):
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", exposition.port), timeout=2)
    finally:
        exposition.close()


def test_the_local_stack_serves_metrics_on_loopback(tmp_path: Path) -> None:
    from producer.local.config import StackOptions, service_env

    env = service_env(
        StackOptions(),
        state_dir=tmp_path,
        kafka_address="x:1",
        s3_address="x:2",
        s3_access_key="a",
        s3_secret_key="b",
    )
    assert env["CHORUS_METRICS_BIND_ADDRESS"] == "127.0.0.1"


# --- the command line's shape -------------------------------------------------------------------------------------


def test_version() -> None:
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"chorus {version('chorus')}"


def test_the_model_choices_are_the_catalog() -> None:
    from producer.catalog import CATALOG, ModelName

    assert sorted(m.value for m in ModelName) == sorted(CATALOG)


@pytest.mark.parametrize(
    ("command", "shown", "hidden"),
    [
        (
            ["generate"],
            [
                "--num-steps",
                "--num-frames",
                "--guidance-scale",
                "toy|tiny-random-wan|wan2.1-t2v-1.3b",
                "mp4|gif",
            ],
            ["--steps", "--frames", "--guidance "],
        ),
        (["demo"], ["--num-steps", "minilm|hashing", "toy|tiny-random-wan|wan2.1-t2v-1.3b"], ["--steps"]),
        (["produce"], ["--num-steps", "--num-frames", "--guidance-scale", "--env-file"], []),
        (["worker"], ["prefork|solo|threads", "toy|tiny-random-wan|wan2.1-t2v-1.3b"], []),
        (["bench", "engine"], ["--num-steps", "--no-fail", "--configs"], ["--steps"]),
        (["bench", "quality"], ["--num-steps", "--guidance-scale", "Repeatable"], ["--steps", "--guidance "]),
    ],
)
def test_every_command_spells_fields_alike_and_lists_its_choices(
    command: list[str], shown: list[str], hidden: list[str]
) -> None:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for name in shown:
        assert name in text, name
    for name in hidden:
        assert name not in text, name


@pytest.mark.parametrize("flag", ["--num-steps", "--steps"])
def test_the_older_option_names_still_work(flag: str) -> None:
    # 1000 steps is more than tiny-random-wan takes: the demo refuses before starting anything, naming the option.
    result = CliRunner().invoke(app, ["demo", "--model", "tiny-random-wan", flag, "1000"])
    assert result.exit_code == 2, result.output
    assert "--num-steps" in result.output


def test_an_option_under_both_its_names_is_refused() -> None:
    result = CliRunner().invoke(app, ["generate", "--prompt", "x", "--num-steps", "4", "--steps", "4"])
    assert result.exit_code == 2
    assert "give --num-steps once" in result.output


# --- latency from publication ------------------------------------------------------------------------------------


class _Sent:
    def __init__(self) -> None:
        self.values: list[bytes] = []

    def send(self, topic: str, *, key: bytes, value: bytes) -> Any:
        self.values.append(value)
        return SimpleNamespace(get=lambda timeout: SimpleNamespace(partition=0, offset=len(self.values)))

    def flush(self, timeout: float | None = None) -> None:
        """Sent at once: nothing is held."""


def test_the_sdk_stamps_submitted_at_when_it_sends_unless_it_was_set() -> None:
    from datetime import UTC, datetime, timedelta

    from producer.contract import GenerationRequest, build_request
    from producer.sdk import ChorusClient

    built = build_request(prompt="a red circle", request_id="built-early")
    replayed = build_request(
        prompt="a red circle", request_id="replay", submitted_at=datetime(2026, 1, 1, tzinfo=UTC)
    )
    time.sleep(0.2)  # as the demo built its stream, then started the stack
    client = ChorusClient(ProducerSettings())
    sent = _Sent()
    client._producer = sent
    before = datetime.now(UTC)
    client.submit(built)
    client.submit_many([build_request(prompt="a blue circle", request_id="batch"), replayed])
    stamps = {r.request_id: r.submitted_at for r in map(GenerationRequest.model_validate_json, sent.values)}
    assert stamps["built-early"] >= before and built.submitted_at < before - timedelta(seconds=0.15)
    assert stamps["batch"] >= before
    assert stamps["replay"] == datetime(2026, 1, 1, tzinfo=UTC)


def test_produce_refuses_a_timeout_of_nothing_before_sending() -> None:
    args = ["produce", "-p", "x", "--wait", "--timeout", "0", "--bootstrap", "127.0.0.1:9"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "--timeout 0" in result.output and "more than 0" in result.output


def test_the_results_table_says_when_a_prompt_was_truncated() -> None:
    from producer.cli_produce import _table
    from producer.contract import GenerationResult, ResultStatus, build_request

    request = build_request(prompt="a long prompt", request_id="long")
    done = GenerationResult(
        request_id="long", status=ResultStatus.DONE, prompt_truncated=True, prompt_tokens_used=32
    )
    console = Console(width=300, record=True)
    console.print(_table([request], {request.job_id: done}))
    assert "prompt truncated to 32 tokens" in console.export_text()


def test_the_results_table_says_when_a_planned_donor_saved_nothing() -> None:
    from producer.cli_produce import _table
    from producer.contract import DonorInfo, GenerationResult, ResultStatus, build_request

    request = build_request(prompt="a red circle that moves to the left", request_id="para")
    done = GenerationResult(
        request_id="para",
        status=ResultStatus.DONE,
        donor=DonorInfo(request_id="red", similarity=0.93),
        steps_computed=4,
        steps_requested=4,
        tokens_computed_fraction=1.0,
    )
    console = Console(width=300, record=True)
    console.print(_table([request], {request.job_id: done}))
    assert "planned donor saved nothing" in console.export_text()


def test_a_misspelled_setting_is_named_with_the_one_it_may_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pydantic-settings ignores unknown CHORUS_ names: a typo silently left the default in force
    env = tmp_path / "stack.env"
    env.write_text("CHORUS_KAFKA_BOOTSTRAPS=127.0.0.1:9\nCHORUS_S3_BUCKET=chorus\n")
    monkeypatch.setenv("CHORUS_S3_ENDPIONT", "http://127.0.0.1:9000")
    monkeypatch.setenv("CHORUS_MODELS_DIR", "/models")  # docker-compose's, not a setting: no warning
    result = CliRunner().invoke(app, ["--env-file", str(env), "produce", "--help"])
    said = " ".join(result.output.split())
    assert "CHORUS_S3_ENDPIONT is not a Chorus setting (did you mean CHORUS_S3_ENDPOINT?)" in said
    assert "CHORUS_KAFKA_BOOTSTRAPS is not a Chorus setting (did you mean CHORUS_KAFKA_BOOTSTRAP?)" in said
    assert "CHORUS_MODELS_DIR" not in said and "CHORUS_S3_BUCKET" not in said
