"""Configuration by environment (prefix ``CHORUS_``), one settings object per service.

Field groups shared by several services are mixins here so every service spells an address the same way;
defaults point at the embedded setup that ``chorus demo`` starts, so nothing needs configuring locally.
Credentials have no defaults in code: they come from the environment (or the demo generates them).

Besides the environment, every settings object reads the env file that ``CHORUS_ENV_FILE`` names (``chorus
--env-file``), e.g. the ``.chorus/stack.env`` that ``chorus demo --keep-running`` writes; variables set in the
environment win over the file's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

_API_VERSION = re.compile(r"^(auto|\d+(\.\d+){1,2})$")

ENV_FILE_VARIABLE = "CHORUS_ENV_FILE"


class UnusableSetting(ValueError):
    """A setting well-formed as text that names something this process cannot use (a URL whose scheme no
    adapter speaks): raised by the adapter that reads it, when the service starts, as one line naming it."""


class EnvFileMissing(FileNotFoundError):
    """The env file named by ``CHORUS_ENV_FILE`` (or ``--env-file``) does not exist."""

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(
            f"the env file {path} does not exist ({ENV_FILE_VARIABLE} / --env-file); the demo stack writes "
            "its .chorus/stack.env while `chorus demo --keep-running` runs and removes it when the stack stops"
        )


def use_env_file(path: Path | None) -> None:
    """Make every settings object of this process (and of the processes it starts) read ``path``
    (``CHORUS_ENV_FILE``); a missing file is an error when the settings are made (``EnvFileMissing``)."""
    if path is not None:
        os.environ[ENV_FILE_VARIABLE] = str(path)


def env_file() -> Path | None:
    """The env file ``CHORUS_ENV_FILE`` names, if any; ``EnvFileMissing`` if it names no file."""
    value = os.environ.get(ENV_FILE_VARIABLE, "").strip()
    if not value:
        return None
    path = Path(value)
    if not path.is_file():
        raise EnvFileMissing(path)
    return path


_SECRET_WORDS = ("secret", "password", "key", "token")


def is_settings_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a settings object's validation error (its title is the settings class' name), or a
    variable its source could not read at all (a structured setting's value that is not JSON)."""
    return isinstance(exc, SettingsError) or (
        isinstance(exc, ValidationError) and exc.title.endswith("Settings")
    )


_UNREADABLE_FIELD = re.compile(r'field "(?P<field>\w+)"')


def settings_error_line(exc: ValidationError | SettingsError) -> str:
    """One line naming each bad variable, the value it had (never a credential's) and what it must be, e.g.
    ``invalid setting CHORUS_LOG_LEVEL='verbose': must be 'DEBUG', 'INFO', 'WARNING' or 'ERROR'``."""
    if isinstance(exc, SettingsError):
        found = _UNREADABLE_FIELD.search(str(exc))
        name = f"CHORUS_{found['field'].upper()}" if found else "a CHORUS_ variable"
        if str(exc).startswith("error parsing value"):  # a structured field's variable is read as JSON first
            return f"invalid setting {name}: not JSON; it is read as JSON (a number, a list or an object)"
        return f"invalid setting {name}: " + " ".join(str(exc).split())
    parts: list[str] = []
    for error in exc.errors(include_url=False):
        field = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
        if not field:  # a check across fields: its message names them
            parts.append(message)
            continue
        name = f"CHORUS_{field.upper()}"
        value = error.get("input")
        secret = any(w in field.lower() for w in _SECRET_WORDS)
        shown = "" if secret or isinstance(value, dict) or value is None else f"={value!r}"
        parts.append(f"{name}{shown}: {message}")
    noun = "setting" if len(parts) == 1 else "settings"
    return f"invalid {noun} " + "; ".join(parts)


class ChorusSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHORUS_", extra="ignore", validate_default=True)

    state_dir: Path = Field(default=Path(".chorus"), description="local state of the embedded setup")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["console", "json"] = "console"

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_any_case(cls, value: object) -> object:
        if isinstance(value, str) and value.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"):
            return value.upper()
        return value  # as given, so an error shows what was set

    def __init__(self, **values: Any) -> None:
        # The env file is looked up when settings are made (not when the class is defined), so a command's
        # --env-file option applies.
        if "_env_file" not in values:
            values["_env_file"] = env_file()
        super().__init__(**values)


class KafkaSettings(ChorusSettings):
    kafka_bootstrap: str = Field(default="127.0.0.1:9092", min_length=1)
    # kafka-python probes the broker version unless told; some Kafka-protocol brokers (librdkafka's mock
    # cluster) answer the probe in a form it cannot decode, so the version is configurable.
    kafka_api_version: str = "auto"
    # How long a client waits for its first contact with the cluster before it fails ("Unable to bootstrap").
    kafka_bootstrap_timeout_ms: int = Field(default=30_000, ge=100)
    # The longest a consumer's fetch waits at the broker for new records. Kafka answers as soon as records
    # arrive, but a broker that holds every fetch for the full wait (librdkafka's mock cluster, the embedded
    # stack's) adds half of it, on average, to each hop: kafka-python's 500 ms default cost the serving
    # benchmark 0.23 s a request on result delivery alone.
    kafka_fetch_max_wait_ms: int = Field(default=50, ge=1, le=10_000)
    kafka_requests_topic: str = "chorus.requests"
    kafka_results_topic: str = "chorus.results"
    kafka_dead_letter_topic: str = "chorus.requests.dlq"
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    kafka_sasl_mechanism: str | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None

    @field_validator("kafka_api_version")
    @classmethod
    def _api_version_form(cls, value: str) -> str:
        if not _API_VERSION.match(value):
            raise ValueError("must be 'auto' or a dotted version such as '2.1.0'")
        return value

    @property
    def kafka_api_version_tuple(self) -> tuple[int, ...] | None:
        if self.kafka_api_version == "auto":
            return None
        return tuple(int(p) for p in self.kafka_api_version.split("."))


class BrokerSettings(ChorusSettings):
    """The Celery broker both sides of an order use (``producer.broker``): the scheduler sends, workers consume."""

    # Celery broker and result backend. Empty means the embedded filesystem transport under state_dir.
    broker_url: str = ""
    result_backend: str = ""
    # Prefix of every Redis key the broker and result backend use, so deployments can share one Redis.
    broker_key_prefix: str = ""
    # Per-task time limits: past the soft limit the task publishes a `failed` result; past the hard limit the
    # pool kills the process (and Celery records the task as failed, without a redelivery). The broker's
    # redelivery timer (visibility timeout) outlasts the hard limit.
    task_soft_time_limit_s: float = Field(default=900.0, gt=0)
    task_time_limit_s: float = Field(default=960.0, gt=0)

    @model_validator(mode="after")
    def _hard_limit_after_soft(self) -> Self:
        if self.task_time_limit_s <= self.task_soft_time_limit_s:
            raise ValueError("CHORUS_TASK_TIME_LIMIT_S must exceed CHORUS_TASK_SOFT_TIME_LIMIT_S")
        return self


class ProducerSettings(KafkaSettings):
    result_timeout_s: float = Field(default=300.0, gt=0)
    # A producer (chorus produce, the SDK) says within seconds that it cannot reach the cluster.
    kafka_bootstrap_timeout_ms: int = Field(default=5_000, ge=100)
