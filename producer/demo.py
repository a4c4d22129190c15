"""CLI commands of this package."""

from __future__ import annotations

from producer.unbuilt import not_built


def demo() -> None:
    """Not built yet."""
    not_built("demo", "[deploy]")
