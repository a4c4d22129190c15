"""CLI commands of this package."""

from __future__ import annotations

from producer.unbuilt import not_built


def train_toy() -> None:
    """Not built yet."""
    not_built("train-toy", "[toy-model]")


def bench_quality() -> None:
    """Not built yet."""
    not_built("bench quality", "[toy-model]")
