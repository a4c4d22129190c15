"""What every ``chorus`` command shares: the global options (``chorus --debug --env-file … <command>``), and
errors an operator can act on, in one line, instead of a traceback (``ChorusGroup``; ``--debug`` shows it)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer._click.core import Context
from typer.core import TyperGroup

from producer.logs import debug_enabled, set_debug
from producer.settings import (
    ENV_FILE_VARIABLE,
    EnvFileMissing,
    UnusableSetting,
    env_file,
    is_settings_error,
    use_env_file,
)

STACK_HINT = (
    "is the stack running? start it with `./scripts/demo.sh --keep-running` and use its env file "
    "(--env-file .chorus/stack.env)"
)


def version_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"chorus {version('chorus')}"
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "chorus (not installed)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


def root(
    _version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
    debug: bool = typer.Option(
        False,
        "--debug",
        help="Show tracebacks and the client libraries' own logs instead of one-line errors.",
    ),
    env_file: Path | None = typer.Option(
        None,
        "--env-file",
        help="Read CHORUS_* settings from this file too (e.g. .chorus/stack.env of `chorus demo --keep-running`); "
        "the environment wins over it. Same as CHORUS_ENV_FILE.",
    ),
) -> None:
    """Chorus: serve text-to-video diffusion requests cheaper by reusing work from similar requests."""
    set_debug(debug)
    use_env_file(env_file)
    warn_unknown_settings()


# CHORUS_ names that are not settings yet mean something: docker-compose's host-side folder of model weights,
# and the test suite's services.
_NOT_SETTINGS = frozenset({"CHORUS_MODELS_DIR"})
_NOT_SETTINGS_PREFIXES = ("CHORUS_TEST_",)


def unknown_settings(names: Iterable[str]) -> list[tuple[str, str | None]]:
    """(name, the setting it may be a typo of) for each ``CHORUS_`` name no Chorus process reads."""
    import difflib

    from chorus_sched.settings import SchedulerSettings
    from producer.settings import ProducerSettings
    from workers.settings import WorkerSettings

    known = {ENV_FILE_VARIABLE} | {
        f"CHORUS_{field.upper()}"
        for settings in (ProducerSettings, SchedulerSettings, WorkerSettings)
        for field in settings.model_fields
    }
    unknown = []
    for name in sorted(set(names)):
        upper = name.upper()
        if not upper.startswith("CHORUS_") or upper in known or upper in _NOT_SETTINGS:
            continue
        if upper.startswith(_NOT_SETTINGS_PREFIXES):
            continue
        close = difflib.get_close_matches(upper, known, n=1, cutoff=0.8)
        unknown.append((name, close[0] if close else None))
    return unknown


def warn_unknown_settings() -> None:
    """Say which CHORUS_ names in the environment or the env file no setting reads (a typo is otherwise silently
    ignored, and the default used)."""
    names = list(os.environ)
    try:
        path = env_file()
    except EnvFileMissing:
        path = None  # the command that reads it reports that
    if path is not None:
        from dotenv import dotenv_values

        names += [k for k in dotenv_values(path) if k]
    err = Console(stderr=True)
    for name, close in unknown_settings(names):
        hint = f" (did you mean {close}?)" if close else ""
        err.print(
            f"[yellow]warning:[/] {escape(name)} is not a Chorus setting{escape(hint)}; it is ignored",
            soft_wrap=True,
        )


def broker_hint() -> str:
    """What to try when the Kafka broker cannot be reached: the env file in use may be stale, or no stack runs."""
    env_file = os.environ.get(ENV_FILE_VARIABLE, "").strip()
    if env_file:
        return f"the settings came from {env_file}: is the stack that wrote it still running?"
    return STACK_HINT


def one_line_error(exc: BaseException) -> tuple[str, int] | None:
    """(message, exit code) for a failure an operator can fix from its message alone; None for anything else."""
    from producer.bus import BrokerUnreachable

    if isinstance(exc, EnvFileMissing | UnusableSetting):
        return str(exc), 2
    if is_settings_error(exc):
        from producer.settings import settings_error_line

        return settings_error_line(exc), 2  # type: ignore[arg-type]
    if isinstance(exc, BrokerUnreachable):
        return f"{exc}; {broker_hint()}", 1
    if type(exc).__module__.startswith("kafka"):
        from producer.bus import is_bootstrap_failure

        if is_bootstrap_failure(exc):
            return f"cannot reach the Kafka broker (CHORUS_KAFKA_BOOTSTRAP): {exc}; {broker_hint()}", 1
    return None


def print_error(message: str) -> None:
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}")


class ChorusGroup(TyperGroup):
    """The root command: a failure ``one_line_error`` knows ends the command with its one line (and exit code),
    unless ``--debug``."""

    def invoke(self, ctx: Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            found = None if debug_enabled() else one_line_error(exc)
            if found is None:
                raise
            message, code = found
            print_error(message)
            raise typer.Exit(code=code) from None
