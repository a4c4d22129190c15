"""CLI commands of this package."""

from __future__ import annotations

from producer.unbuilt import not_built


def generate() -> None:
    """Not built yet."""
    not_built("generate", "[engine]")


def bench_engine() -> None:
    """Not built yet."""
    not_built("bench engine", "[engine]")
