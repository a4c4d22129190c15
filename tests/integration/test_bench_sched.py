"""``chorus bench sched``'s direct pass: the production handlers on the real local stores (SQLite ledger, Qdrant
local mode, MiniLM), fed the mixed trace. What it must show: every request dispatched or answered, the phases
measured, and the index folder opened once for the whole run (it stays open between operations)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.bench.serve.sched_direct import profile_direct

pytestmark = pytest.mark.integration


def test_the_direct_pass_reports_phases_and_opens_the_index_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "CHORUS_INDEX_KEEP_OPEN_S", "600"
    )  # no idle release on a slow machine, only the protocol
    report = profile_direct(tmp_path, n=12, seed=5, say=lambda _: None)
    assert report["requests"] == 12
    assert report["orders"] > 0
    assert report["index_opens"] == 1  # one open per operation would be dozens
    phases = report["profile_wall_ms_per_request"]
    assert phases["embed_request"] > 0 and phases["search"] > 0 and phases["results"] > 0
    assert report["cpu_ms_per_request"] > 0 and report["top_functions"]
