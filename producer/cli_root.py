"""What every ``chorus`` command shares: the global options (``chorus --debug --env-file … <command>``), and
errors an operator can act on, in one line, instead of a traceback (``ChorusGroup``; ``--debug`` shows it)."""

from __future__ import annotations

import os
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
