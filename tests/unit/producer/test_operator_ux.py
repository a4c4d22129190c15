"""What an operator meets first (issue 19): env files, clear one-line errors, the CLI's options and version."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
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
