from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from chorus_sched.settings import SchedulerSettings
from producer.cli import app
from producer.settings import ProducerSettings
from workers.settings import WorkerSettings


def test_settings_come_from_the_chorus_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHORUS_KAFKA_BOOTSTRAP", "kafka:9092")
    monkeypatch.setenv("CHORUS_KAFKA_API_VERSION", "2.1.0")
    monkeypatch.setenv("CHORUS_S3_SECRET_KEY", "s3cr3t")
    monkeypatch.setenv("CHORUS_STATE_DIR", "/tmp/chorus-state")
    worker = WorkerSettings()
    assert worker.kafka_bootstrap == "kafka:9092" and worker.kafka_api_version_tuple == (2, 1, 0)
    assert worker.s3_secret_key is not None and worker.s3_secret_key.get_secret_value() == "s3cr3t"
    assert "s3cr3t" not in repr(worker)
    assert SchedulerSettings().state_dir == Path("/tmp/chorus-state")


def test_defaults_need_no_environment_and_carry_no_credentials() -> None:
    worker = WorkerSettings()
    assert worker.s3_access_key is None and worker.s3_secret_key is None
    assert ProducerSettings().kafka_api_version_tuple is None


@pytest.mark.parametrize(
    ("name", "value", "field"),
    [
        ("CHORUS_KAFKA_API_VERSION", "latest", "kafka_api_version"),
        ("CHORUS_METRICS_PORT", "70000", "metrics_port"),
        ("CHORUS_LOG_LEVEL", "LOUD", "log_level"),
        ("CHORUS_DTYPE", "int8", "dtype"),
    ],
)
def test_bad_settings_name_the_field(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, field: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as excinfo:
        WorkerSettings()
    assert field in str(excinfo.value)


def test_a_structured_setting_that_is_not_json_is_one_line_naming_it() -> None:
    # pydantic-settings reads a dict- or list-typed variable as JSON before validating: its failure is not a
    # ValidationError, and it reached the operator as a traceback.
    result = CliRunner().invoke(app, ["generate", "-p", "x"], env={"CHORUS_TORCH_THREADS": "garbage"})
    assert result.exit_code == 2, result.output
    assert "invalid setting CHORUS_TORCH_THREADS: not JSON" in result.output
    assert "Traceback" not in result.output


def test_a_bad_worker_flag_is_named_as_the_flag() -> None:
    result = CliRunner().invoke(app, ["worker", "--concurrency", "0"])
    assert result.exit_code == 2 and "--concurrency" in result.output
    assert "CHORUS_WORKER_CONCURRENCY" not in result.output


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--concurrency", "2", "--autoscale"], "not both"),
        (["--pool", "solo", "--concurrency", "4"], "--pool solo runs one order at a time"),
        (["--pool", "threads", "--autoscale"], "--autoscale needs --pool prefork"),
        (["--max-processes", "4"], "bound --autoscale"),
        (
            ["--autoscale", "--min-processes", "3", "--max-processes", "2"],
            "--min-processes 3 exceeds --max-processes 2",
        ),
    ],
)
def test_worker_flags_that_cannot_all_hold_are_refused_by_their_names(flags: list[str], says: str) -> None:
    # each was taken silently (autoscale won, solo ran one at a time), or named the environment's variables
    result = CliRunner().invoke(app, ["worker", *flags])
    assert result.exit_code == 2 and says in " ".join(result.output.split()), result.output
    assert "CHORUS_WORKER" not in result.output


def test_cli_lists_every_command() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    help_text = result.output
    for command in ("demo", "produce", "scheduler", "worker", "generate", "bench", "train-toy"):
        assert command in help_text


def test_cli_help_does_not_import_torch() -> None:
    code = "import sys, producer.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_worker_whose_broker_cannot_be_reached_stops_with_one_line(tmp_path: Path) -> None:
    # Celery alone retries forever, a log line a second, and never says why the worker takes no order.
    env = {
        **os.environ,
        "CHORUS_STATE_DIR": str(tmp_path),
        "CHORUS_BROKER_URL": "redis://127.0.0.1:1/0",
        "CHORUS_BROKER_CONNECT_TIMEOUT_S": "1",
        "CHORUS_METRICS_PORT": "0",
    }
    chorus = str(Path(sys.executable).with_name("chorus"))
    result = subprocess.run(
        [chorus, "worker", "--pool", "solo", "-m", "tiny-random-wan"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    said = " ".join(result.stderr.split())
    assert "cannot reach the broker redis://127.0.0.1:1/0 within 1 s" in said and "CHORUS_BROKER_URL" in said
    assert "Traceback" not in said
