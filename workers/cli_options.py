"""Option conventions the ``chorus`` commands share: one name per field across commands (the request contract's:
``--num-steps``, ``--num-frames``, ``--guidance-scale``) with the older spellings kept as hidden aliases, and list
options that repeat (``--configs tiny --configs mid``) while still taking the comma form (``--configs tiny,mid``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import typer

T = TypeVar("T")


def aliased(value: T | None, alias: T | None, name: str, alias_name: str) -> T | None:
    """The value of option ``name``, or of its hidden older spelling ``alias_name``; both given is an error."""
    if value is not None and alias is not None:
        raise typer.BadParameter(f"give {name} once ({alias_name} is its older name)")
    return value if value is not None else alias


def split_list(values: Iterable[str]) -> list[str]:
    """The items of a repeatable option whose values may also be comma-separated (``['a,b', 'c']`` → a, b, c)."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]
