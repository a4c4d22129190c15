"""What every ``chorus`` command shares: the global options (``chorus --env-file …``), given to the root command
before the subcommand's name."""

from __future__ import annotations

from pathlib import Path

import typer

from producer.settings import use_env_file


def root(
    env_file: Path | None = typer.Option(
        None,
        "--env-file",
        help="Read CHORUS_* settings from this file too (e.g. .chorus/stack.env of `chorus demo --keep-running`); "
        "the environment wins over it. Same as CHORUS_ENV_FILE.",
    ),
) -> None:
    """Chorus: serve text-to-video diffusion requests cheaper by reusing work from similar requests."""
    use_env_file(env_file)
