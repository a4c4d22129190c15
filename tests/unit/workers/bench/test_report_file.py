"""Every bench command's report names the command that made it and lands where ``--out`` says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from workers.bench.report_file import stamped, write_report


def test_the_command_is_what_was_typed_after_the_bench_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/venv/bin/chorus", "bench", "sched", "--quick", "--out", "a b.json"])
    assert stamped("sched", {"x": 1}) == {"command": "chorus bench sched --quick --out 'a b.json'", "x": 1}
    monkeypatch.setattr(sys, "argv", ["pytest"])  # called from elsewhere: the bare command
    assert list(stamped("sched", {"x": 1})) == ["command", "x"]


def test_the_report_is_written_into_a_new_folder_and_returned(tmp_path: Path) -> None:
    out = tmp_path / "new" / "report.json"
    text = write_report({"ok": True}, out)
    assert json.loads(out.read_text()) == json.loads(text) == {"ok": True}
    assert write_report({"ok": False}, None) == json.dumps({"ok": False}, indent=1)
