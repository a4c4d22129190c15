"""Commands whose issue is still open say so and fail, rather than pretend to work."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape


def not_built(command: str, issue: str) -> None:
    Console(stderr=True).print(
        f"[bold red]chorus {command}[/] is not built yet (see the {escape(issue)} issue)."
    )
    raise typer.Exit(code=2)
