"""Scenarios that break a backing store: S3 down and restarted, S3 hung (SIGSTOP), the donor index unavailable,
a stored donor trajectory corrupted (bytes flipped with its sha256 kept, and truncated)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import signal
import time
from pathlib import Path

from chorus_sched.index_lock import FolderLock
from workers.bench.faults.accounting import Received, Sent
from workers.bench.faults.context import Run


def _wave(run: Run, start: int, count: int, *, reuse_off_every: int = 0) -> list[Sent]:
    messages = []
    for i in range(start, start + count):
        off = reuse_off_every and i % reuse_off_every == 0
        messages.append(run.request(i, reuse="off" if off else "auto"))
    return run.publish(messages)


def _answered_by(run: Run, sent: list[Sent], moment: float) -> int:
    """How many of ``sent`` had a result by ``moment`` (served while the fault lasted)."""
    keys = {s.key for s in sent}
    return sum(1 for r in run.results() if r.key in keys and r.arrived_at <= moment)


def s3_down(run: Run) -> None:
    """Stop the S3 stand-in (it keeps its objects) for ``s3_down_s`` with requests in flight, start it again."""
    sizes = run.sizes
    half = max(1, sizes.requests // 2)
    _wave(run, 0, half)
    run.wait_results(1, within_s=60)
    run.stack.stop_s3()
    down_at = time.monotonic()
    run.say(f"S3 down for {sizes.s3_down_s:.0f} s")
    during = _wave(run, half, sizes.requests - half)
    run.sleep(max(0.0, sizes.s3_down_s - (time.monotonic() - down_at)))
    try:
        run.stack.start_s3()
    except Exception as exc:
        run.notes.append(f"S3 did not come back: {exc!r}"[:300])
        run.checks["s3 restarted"] = False
        return
    run.fault_end = time.monotonic()
    run.wait_for(within_s=sizes.deadline_s)
    run.figures.update(
        s3_down_s=round(run.fault_end - down_at, 1),
        sent_while_down=len(during),
        answered_while_down=_answered_by(run, run.sent, run.fault_end) - _answered_by(run, run.sent, down_at),
    )


def s3_hang(run: Run) -> None:
    """SIGSTOP the S3 stand-in for ``s3_hang_s`` with requests in flight (connections accepted, never answered)."""
    sizes = run.sizes
    half = max(1, sizes.requests // 2)
    _wave(run, 0, half)
    run.wait_results(1, within_s=60)
    s3 = run.stack.s3
    assert s3 is not None
    os.kill(s3.process.pid, signal.SIGSTOP)
    try:
        run.say(f"S3 hung for {sizes.s3_hang_s:.0f} s")
        _wave(run, half, sizes.requests - half)
        run.sleep(sizes.s3_hang_s)
    finally:
        os.kill(s3.process.pid, signal.SIGCONT)
    run.fault_end = time.monotonic()
    run.wait_for(within_s=sizes.deadline_s)


def index_unavailable(run: Run) -> None:
    """The donor index unavailable, twice: Qdrant's storage held open by another client (the scheduler's open
    fails), then the index's own lock held (the scheduler's open waits). A quarter of the requests say
    ``reuse: off``. Requests should be computed in full, not rejected or stalled."""
    from qdrant_client import QdrantClient

    sizes = run.sizes
    path = Path(run.stack.scheduler_settings.resolved_qdrant_path)
    half = max(1, sizes.requests // 2)
    with FolderLock.exclusive(path):
        client = QdrantClient(path=str(path))  # takes Qdrant's own lock on the folder
    try:
        run.say(f"Qdrant storage held by another client for {sizes.index_hold_s:.0f} s")
        first = _wave(run, 0, half, reuse_off_every=4)
        run.sleep(sizes.index_hold_s)
    finally:
        client.close()
    first_end = time.monotonic()
    with FolderLock.exclusive(path):
        run.say(f"index lock held for {sizes.index_hold_s:.0f} s")
        second = _wave(run, half, sizes.requests - half, reuse_off_every=4)
        run.sleep(sizes.index_hold_s)
    run.fault_end = time.monotonic()
    run.wait_for(within_s=sizes.deadline_s)
    # Latency, not loss: how many were served while the index was still unavailable (none: they waited it out).
    run.figures.update(
        storage_held={"sent": len(first), "answered_while_held": _answered_by(run, first, first_end)},
        lock_held={"sent": len(second), "answered_while_held": _answered_by(run, second, run.fault_end)},
    )


# --- corrupt donor --------------------------------------------------------------------------------------------


def _one(run: Run, rid: str, text: str, seed: int) -> Received | None:
    """Send one request, wait for its result, then for the scheduler to index it (so it can be a donor)."""
    message = run.request(seed, text=text, name=rid)
    run.publish([message])
    key = (run.tenant, f"{run.prefix}{rid}")
    run.wait_for({key}, within_s=run.sizes.deadline_s)
    with contextlib.suppress(Exception):
        run.stack.wait_idle(timeout_s=30)
    return run.result_of(key)


def corrupt_trajectory(run: Run, trajectory_uri: str, mode: str) -> int:
    """Damage every step object of a stored trajectory, keeping the sha256 its writer stored: ``flip`` inverts
    64 bytes in the middle, ``truncate`` keeps the first half. Returns how many objects were damaged."""
    store = run.stack.object_store()
    prefix = store.key_of(trajectory_uri)
    prefix = prefix if prefix.endswith("/") else prefix.rsplit("/", 1)[0] + "/"
    damaged = 0
    for obj in list(store.list(prefix)):
        if "step-" not in obj.key:
            continue
        data = store.get(obj.key)
        sha = hashlib.sha256(data).hexdigest()
        if mode == "flip":
            mid = len(data) // 2
            bad = data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 64]) + data[mid + 64 :]
        else:
            bad = data[: len(data) // 2]
        store.client.put_object(store.bucket, obj.key, io.BytesIO(bad), len(bad), metadata={"sha256": sha})
        damaged += 1
    return damaged


def _family(run: Run, name: str, text: str, mode: str) -> None:
    donor = _one(run, f"{name}-donor", text, seed=1)
    if donor is None or donor.status != "done" or not donor.trajectory_uri:
        run.notes.append(f"{name}: the donor was not served with a trajectory ({donor}); nothing to corrupt")
        run.checks[f"{name} donor stored"] = False
        return
    damaged = corrupt_trajectory(run, donor.trajectory_uri, mode)
    run.say(f"{name}: {damaged} step objects of {donor.request_id} damaged ({mode})")
    first = _one(run, f"{name}-after", text, seed=2)
    second = _one(run, f"{name}-again", text, seed=3)
    planned = first is not None and first.donor == donor.request_id
    run.figures[name] = {
        "damaged_objects": damaged,
        "first_donor": first.donor if first else None,
        "first_fallback": first.fallback if first else None,
        "second_donor": second.donor if second else None,
    }
    if not planned:
        run.notes.append(
            f"{name}: the damaged donor was not planned for the next request; damage not exercised"
        )
    # Detected: a request planned on the damaged donor says it fell back; and the donor is never planned again.
    run.checks[f"{name} detected"] = not planned or bool(first and first.fallback)
    run.checks[f"{name} not planned again"] = second is None or second.donor != donor.request_id


def corrupt_donor(run: Run) -> None:
    _family(run, "flipped", "a red circle moving left on a gray background", "flip")
    _family(run, "truncated", "a blue square moving up on a black background", "truncate")
