"""``chorus bench sched``: its direct pass runs the production handlers on the real local stores (SQLite ledger, Qdrant
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


@pytest.mark.slow
def test_the_kafka_passes_split_the_added_latency_and_drain_both_backlogs() -> None:
    """Through the embedded broker: requests published from another process at a rate, the broker's own delivery
    time measured apart, and two backlogs drained (one measured, one profiled)."""
    from workers.bench.serve.sched import SchedOptions, run_sched

    options = SchedOptions(rate=40.0, latency_requests=24, backlog=24, direct_requests=4)
    report = run_sched(options, say=lambda _: None)
    latency, broker, sustained = report["latency"], report["broker"], report["sustained"]
    assert latency["dispatched"] + latency["answered_without_order"] == 24
    assert latency["in_scheduler_ms"]["p50"] <= latency["added_ms"]["p50"]
    assert broker["received"] == broker["messages"] == 24
    assert 0 < broker["delivery_ms"]["p50"] < 10_000
    assert broker["busy"]["messages"] == 24 and broker["busy"]["records_per_poll"] >= 1
    assert sustained["handled"] == sustained["requests"] == 24
    assert report["embed_precision"] == "auto" and report["embed_numbers"] in ("float32", "bfloat16")
    assert sustained["cpu_ms_per_request"] > 0 and sustained["profiled_cpu_ms_per_request"] > 0
    # Every phase of the profiled drain, to the last poll's dispatch: the drain ends when the handlers returned.
    phases = sustained["ms_per_request"]
    assert all(phases[p] > 0 for p in ("embed", "search", "plan", "dispatch")), phases
    assert sustained["top_functions"]
