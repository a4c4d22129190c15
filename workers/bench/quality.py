"""``chorus bench quality``: attribute accuracy of the toy model with and without reuse."""

from __future__ import annotations

from producer.unbuilt import not_built


def bench_quality() -> None:
    """Not built yet."""
    not_built("bench quality", "[toy-model]")
