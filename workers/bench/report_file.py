"""What every ``chorus bench`` command does with its JSON report: names the command that made it, and writes it."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any


def stamped(name: str, report: dict[str, Any]) -> dict[str, Any]:
    """``report`` headed by the command as it was typed: ``chorus bench NAME`` and the arguments after it."""
    given = sys.argv[sys.argv.index(name) + 1 :] if name in sys.argv else []
    return {"command": shlex.join(["chorus", "bench", name, *given]), **report}


def write_report(report: dict[str, Any], out: Path | None) -> str:
    """The report as JSON text, also written to ``out`` (its folder made) when given."""
    text = json.dumps(report, indent=1)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return text
