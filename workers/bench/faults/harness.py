"""Runs fault scenarios on embedded stacks and assembles the report of ``chorus bench faults``.

Scenarios share a stack while they leave it well: one that is not ok, raised, or left a process or stand-in down
is followed by a fresh stack (new state directory, empty Kafka), so a fault never spills into the next scenario.
Each scenario has its own request-id prefix, so only its own results count towards it; its prompts may find donors
among earlier scenarios' requests (reuse is part of what is served). Every stack is stopped however a scenario
ends.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kafka import KafkaProducer
from rich.console import Console
from rich.markup import escape

from producer import bus
from producer.local.config import StackOptions
from producer.local.stack import EmbeddedStack
from workers.bench.faults import NAMES, inputs, kills, stores
from workers.bench.faults.accounting import account, judge
from workers.bench.faults.context import Run, ScenarioTimeout, Sizes
from workers.bench.faults.observe import Collector

FORMAT = "chorus-bench-faults/1"
MB = 1024 * 1024
LISTED = 20  # lost ids and failures listed per scenario

QUICK = Sizes(
    requests=10, kills=3, s3_down_s=10, s3_hang_s=8, index_hold_s=6, hostile=300, hostile_valid_every=15,
    big_prompts=3, collision_pairs=4, burst=100, deadline_s=90, burst_deadline_s=240, settle_s=3,
    scenario_cap_s=360,
)  # fmt: skip
FULL = Sizes(
    requests=40, kills=3, s3_down_s=30, s3_hang_s=25, index_hold_s=30, hostile=2000, hostile_valid_every=50,
    big_prompts=10, collision_pairs=10, burst=1000, deadline_s=300, burst_deadline_s=2400, settle_s=5,
    scenario_cap_s=3600,
)  # fmt: skip

SCENARIOS: dict[str, Callable[[Run], None]] = {
    "pool-process-kill": kills.pool_process_kill,
    "worker-kill": kills.worker_kill,
    "scheduler-kill": kills.scheduler_kill,
    "s3-down-30s": stores.s3_down,
    "s3-hang": stores.s3_hang,
    "index-unavailable": stores.index_unavailable,
    "corrupt-donor": stores.corrupt_donor,
    "hostile-input": inputs.hostile_input,
    "tenant-id-collision": inputs.tenant_id_collision,
    "burst": inputs.burst,
}
assert tuple(SCENARIOS) == NAMES, "workers.bench.faults.NAMES lists the scenarios in order"


@dataclass
class Kit:
    """A running stack with the bench's own producer and results/dead-letter reader."""

    stack: EmbeddedStack
    producer: KafkaProducer
    collector: Collector

    @classmethod
    def start(cls, state_dir: Path, env: dict[str, str]) -> Kit:
        options = StackOptions(
            state_dir=state_dir, models=["toy"], extra_env=env, ready_timeout_s=180, stop_timeout_s=30
        )
        stack = EmbeddedStack(options).start()
        try:
            settings = stack.producer_settings
            producer = bus.make_producer(settings, max_request_size=8 * MB)
            return cls(stack, producer, Collector(settings))
        except BaseException:
            stack.stop()
            raise

    def healthy(self) -> bool:
        services = [s for s in (self.stack.kafka, self.stack.s3) if s is not None]
        return all(p.alive() for p in self.stack.processes) and all(
            s.process.poll() is None for s in services
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.collector.close()
        with contextlib.suppress(Exception):
            self.producer.close(timeout=5)
        self.stack.stop()


def run_faults(
    names: Sequence[str] | None = None,
    *,
    quick: bool = True,
    sizes: Sizes | None = None,
    state_root: Path | None = None,
    env: dict[str, str] | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the named scenarios (all, in the listed order, by default) and return the report.

    ``state_root`` holds one state directory per stack (logs included); by default a temporary one, removed when
    every scenario was ok and kept (its path in the report) otherwise.
    """
    chosen = list(names or SCENARIOS)
    unknown = [n for n in chosen if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    sizes = sizes or (QUICK if quick else FULL)
    say = say or Console(stderr=True).print
    root = state_root or Path(tempfile.mkdtemp(prefix="chorus-faults-"))
    started, started_at = time.monotonic(), datetime.now(UTC)
    entries: list[dict[str, Any]] = []
    kit: Kit | None = None
    stacks = 0
    try:
        for name in chosen:
            say(f"[bold]▶ {name}[/]")
            if kit is None:
                stacks += 1
                try:
                    kit = Kit.start(root / f"stack-{stacks}", env or {})
                except Exception as exc:
                    entries.append(_not_run(name, f"the stack did not start: {exc}"))
                    say(f"[red]✗ {name}: the stack did not start[/]")
                    continue
            entry = run_scenario(name, kit, sizes, say)
            entries.append(entry)
            say(_summary(entry))
            if not (entry["ok"] and kit.healthy()):
                kit.close()
                kit = None
    finally:
        if kit is not None:
            kit.close()
    ok = all(e["ok"] for e in entries)
    if ok and state_root is None:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "format": FORMAT,
        "started_at": started_at.isoformat(),
        "wall_s": round(time.monotonic() - started, 1),
        "quick": sizes == QUICK,
        "ok": ok,
        "stacks_started": stacks,
        "state_dir": None if ok and state_root is None else str(root),
        "sizes": asdict(sizes),
        "scenarios": entries,
    }


def run_scenario(name: str, kit: Kit, sizes: Sizes, say: Callable[[str], None]) -> dict[str, Any]:
    run = Run(name, kit.stack, kit.producer, kit.collector, sizes, say)
    error = None
    try:
        SCENARIOS[name](run)
    except ScenarioTimeout as exc:
        error = str(exc)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
        run.notes.append("traceback: " + " | ".join(traceback.format_exc().strip().splitlines()[-4:])[:800])
    tally = account(run.sent, run.results(), run.collector.letters(), fault_end=run.fault_end)
    alive = run.scheduler_alive()
    verdict = judge(tally, scheduler_crashes=run.scheduler_crashes, scheduler_alive=alive, checks=run.checks)
    hostile = asdict(tally.hostile) | {"unanswered": tally.hostile.unanswered}
    return {
        "name": name,
        "ok": verdict.ok and error is None,
        "sent": tally.sent,
        "valid": tally.valid,
        "done": tally.done,
        "failed": tally.failed,
        "rejected": tally.rejected,
        "lost": tally.lost,
        "duplicated": tally.duplicated,
        "wrong_tenant": tally.wrong_tenant,
        "shared_video": tally.shared_video,
        "scheduler_restarts": run.scheduler_restarts,
        "scheduler_crashes": run.scheduler_crashes,
        "scheduler_alive": alive,
        "worker_restarts": run.worker_restarts,
        "worker_crashes": run.worker_crashes,
        "recover_s": tally.recover_s,
        "peak_scheduler_rss_mb": round(run.peak_scheduler_rss / MB, 1),
        "wall_s": round(time.monotonic() - run.started, 1),
        "hostile": hostile if tally.hostile.sent else None,
        "checks": run.checks,
        "figures": run.figures,
        "lost_ids": tally.lost_ids[:LISTED],
        "failures": tally.failures[:LISTED],
        "why_not_ok": list(verdict.reasons) + ([f"error: {error}"] if error else []),
        "error": error,
        "notes": run.notes,
        "logs": str(kit.stack.log_dir),
    }


def _not_run(name: str, error: str) -> dict[str, Any]:
    zero = dict.fromkeys(
        ("sent", "valid", "done", "failed", "rejected", "lost", "duplicated", "wrong_tenant"), 0
    )
    return {
        "name": name,
        "ok": False,
        **zero,
        "scheduler_restarts": 0,
        "recover_s": None,
        "why_not_ok": [f"error: {error}"[:2000]],
        "error": error[:2000],
        "notes": [],
    }


def _summary(e: dict[str, Any]) -> str:
    mark = "[green]✓[/]" if e["ok"] else "[red]✗[/]"
    figures = ", ".join(
        f"{k} {e[k]}" for k in ("sent", "done", "failed", "rejected", "lost", "duplicated", "wrong_tenant")
    )
    extra = f"; recover {e['recover_s']} s" if e.get("recover_s") is not None else ""
    why = f" — {'; '.join(e['why_not_ok'])}" if e["why_not_ok"] else ""
    return f"{mark} {escape(e['name'])}: {figures}{extra} in {e.get('wall_s', 0)} s{escape(why)}"
