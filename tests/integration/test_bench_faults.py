"""``chorus bench faults`` through its Python API, on two cheap scenarios scaled down from ``--quick``.

- hostile-input: tombstones, bytes that are not JSON or not UTF-8, 5,001-digit numbers, a 1 MB prompt, wrong
  types, missing ids and keys, … among valid requests: every valid one done, every hostile one dead-lettered.
- tenant-id-collision: two tenants using the same request ids each get their own result, once.

The report has the documented shape, and nothing is lost or duplicated.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from workers.bench.faults.harness import FORMAT, QUICK, run_faults

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

SCENARIO_FIELDS = {
    "name", "ok", "sent", "valid", "done", "failed", "rejected", "lost", "duplicated", "wrong_tenant",
    "scheduler_restarts", "scheduler_crashes", "scheduler_alive", "recover_s", "hostile", "checks", "notes",
}  # fmt: skip


def test_hostile_input_and_tenant_collision_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    sizes = dataclasses.replace(
        QUICK, hostile=40, hostile_valid_every=10, big_prompts=1, collision_pairs=2, deadline_s=60, settle_s=2
    )
    report = run_faults(
        ["hostile-input", "tenant-id-collision"], sizes=sizes, state_root=tmp_path, say=lambda _: None
    )
    assert report["format"] == FORMAT and isinstance(report["ok"], bool)
    entries = {e["name"]: e for e in report["scenarios"]}
    assert list(entries) == ["hostile-input", "tenant-id-collision"]
    for e in entries.values():
        assert set(e) >= SCENARIO_FIELDS, e
        assert e["error"] is None, e
        assert e["lost"] == 0 and e["duplicated"] == 0, e
        assert e["valid"] == e["done"] + e["failed"] + e["rejected"] + e["lost"]

    hostile = entries["hostile-input"]
    assert hostile["sent"] == 44 and hostile["valid"] == 4
    assert hostile["hostile"]["sent"] == 40
    assert entries["tenant-id-collision"]["valid"] == 4 and entries["tenant-id-collision"]["hostile"] is None
