"""Scenarios that kill processes: a worker's pool process (three times), the whole worker, the scheduler.

Each publishes valid toy requests in two waves around the fault, so there is work in flight when it strikes and
new work after it; the fault ends when the killed service is started again (for the pool, at the last kill:
Celery starts the replacement itself).
"""

from __future__ import annotations

import os
import signal
import time

from producer.readiness import ReadinessEvent
from workers.bench.faults import traffic
from workers.bench.faults.context import Run
from workers.bench.faults.observe import children

WORKER = "worker-0"
SCHEDULER = "scheduler-0"


def _requests(run: Run, start: int, count: int) -> list[traffic.Message]:
    return [run.request(i) for i in range(start, start + count)]


def _finished(run: Run, request_id: str) -> bool:
    if any(r.request_id == request_id for r in run.results()):
        return True
    return any(
        e.get("event") == "order done" and e.get("request_id") == request_id for e in run.worker_events()
    )


def next_order_started(run: Run, *, since: int, exclude: set[str], within_s: float) -> tuple[str, int] | None:
    """The first order of this scenario a worker logged as started after event number ``since`` and not in
    ``exclude`` (with the event count to continue from), or None if none started within ``within_s``."""
    until = time.monotonic() + within_s
    while time.monotonic() < until:
        events = run.worker_events()
        for i in range(since, len(events)):
            rid = str(events[i].get("request_id") or "")
            if (
                events[i].get("event") == "order started"
                and rid.startswith(run.prefix)
                and rid not in exclude
            ):
                return rid, i + 1
        since = len(events)
        run.sleep(0.02)
    return None


def _pool_replaced(run: Run, old: list[int], *, since: int, within_s: float) -> bool:
    """Wait until the worker has a pool process that is not one of ``old`` and that loaded its model."""
    until = time.monotonic() + within_s
    worker = run.process(WORKER)
    while time.monotonic() < until:
        fresh = [pid for pid in children(worker.pid) if pid not in old]
        events = run.worker_events()[since:]
        if fresh and any(e.get("event") == ReadinessEvent.MODEL_LOADED for e in events):
            return True
        run.sleep(0.2)
    return False


def pool_process_kill(run: Run) -> None:
    """SIGKILL the worker's pool process while an order runs, ``kills`` times, each time a different order."""
    sizes = run.sizes
    run.publish(_requests(run, 0, sizes.requests))
    killed: set[str] = set()
    in_flight = 0
    since = 0
    for k in range(sizes.kills):
        found = next_order_started(run, since=since, exclude=killed, within_s=60)
        if found is None:
            run.notes.append(f"kill {k + 1}: no order of this scenario started within 60 s; stopped killing")
            break
        rid, since = found
        pids = children(run.process(WORKER).pid)
        running = not _finished(run, rid)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        run.fault_end = time.monotonic()
        killed.add(rid)
        in_flight += running
        run.say(f"killed pool process {pids} while {rid} {'ran' if running else 'had just finished'}")
        mark = len(run.worker_events())
        if not _pool_replaced(run, pids, since=mark, within_s=90):
            run.notes.append(f"kill {k + 1}: no new pool process loaded the model within 90 s")
            break
    run.figures.update(
        pool_kills=len(killed), kills_with_order_running=in_flight, killed_orders=sorted(killed)
    )
    run.notes.append(f"{len(killed)} pool kills; {in_flight} struck while the order was still running")
    run.wait_for(within_s=sizes.deadline_s)


def worker_kill(run: Run) -> None:
    """SIGKILL the whole worker (its process group) with an order running, then start a new worker."""
    sizes = run.sizes
    half = max(1, sizes.requests // 2)
    run.publish(_requests(run, 0, half))
    found = next_order_started(run, since=0, exclude=set(), within_s=60)
    if found is None:
        run.notes.append("no order started within 60 s: the worker was killed idle")
    running = found is not None and not _finished(run, found[0])
    run.kill(WORKER)
    run.figures.update(order_in_flight=found[0] if found else None, order_was_running=running)
    run.say(
        f"killed {WORKER} (order {found[0] if found else None} {'running' if running else 'not running'})"
    )
    run.sleep(1.0)
    run.fault_end = time.monotonic()
    if not run.restart(WORKER):
        return
    run.publish(_requests(run, half, sizes.requests - half))
    run.wait_for(within_s=sizes.deadline_s)


def scheduler_kill(run: Run) -> None:
    """SIGKILL the scheduler once results are flowing, start it again, then send a second wave."""
    sizes = run.sizes
    half = max(1, sizes.requests // 2)
    run.publish(_requests(run, 0, half))
    if not run.wait_results(min(2, half), within_s=60):
        run.notes.append("no result within 60 s before the kill")
    run.kill(SCHEDULER)
    run.say(f"killed {SCHEDULER}")
    run.fault_end = time.monotonic()
    if not run.restart(SCHEDULER):
        return
    run.publish(_requests(run, half, sizes.requests - half))
    run.wait_for(within_s=sizes.deadline_s)
