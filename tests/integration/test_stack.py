"""``EmbeddedStack``: the embedded stand-ins plus real ``chorus scheduler`` and ``chorus worker`` processes.

- It starts, serves a request end to end, and stops leaving no process and no listening port behind.
- Started again over the same state directory, it still has the first run's objects (S3 snapshot) and its donor
  index: the same prompt reuses the first run's request.
- A worker that cannot load its model fails ``start`` with the reason, and nothing is left running.
- If the process that started the stack is killed outright, the services and stand-ins go too (and the object
  store still writes its snapshot).
- A snapshot interrupted between its two renames is still found.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from producer.contract import ResultStatus, build_request
from producer.local.config import StackError, StackOptions
from producer.local.stack import EmbeddedStack
from producer.local.standins import read_snapshot
from producer.orders import trajectory_header_key, trajectory_prefix, video_key
from producer.sdk import ChorusClient
from tests.helpers.stored import stored_objects

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "tiny-random-wan"
PROMPT = "a red circle moving left on a white background"
WAIT_S = 180.0


def _alive_in_groups(groups: set[int]) -> list[int]:
    """Processes (not zombies) whose process group is one of ``groups``."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp in groups and state != "Z":
            alive.append(int(entry.name))
    return alive


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def _run_one(stack: EmbeddedStack, request_id: str, seed: int):
    request = build_request(request_id=request_id, prompt=PROMPT, model=MODEL, seed=seed)
    with ChorusClient(stack.producer_settings) as client, client.watch_results() as watcher:
        client.submit(request)
        results = list(watcher.wait([request_id], timeout_s=WAIT_S))
    assert len(results) == 1, f"no result for {request_id}"
    return results[0]


def test_the_stack_serves_stops_cleanly_and_restarts_with_its_objects_and_donors(tmp_path: Path) -> None:
    options = StackOptions(state_dir=tmp_path / "state", models=[MODEL], embedder="hashing")
    with EmbeddedStack(options) as stack:
        assert [p.name for p in stack.processes] == ["scheduler-0", "worker-0"]
        assert set(stack.log_files) == {"scheduler-0", "worker-0", "kafka", "s3"}
        first = _run_one(stack, "stack-first", seed=1)
        assert first.status is ResultStatus.DONE, first.error
        assert first.donor is None and first.steps_computed == first.steps_requested
        store = stack.object_store()
        assert store.exists(video_key("stack-first", "mp4"))
        assert trajectory_header_key("stack-first") in stored_objects(
            store, trajectory_prefix("stack-first"), first.trajectory_bytes
        )
        # A model no worker of this stack serves (as the README's kcat example, against the demo stack): a clear
        # rejection within seconds, not an order that waits in a queue forever.
        started = time.monotonic()
        unserved = build_request(request_id="stack-unserved", prompt=PROMPT, model="toy")
        with ChorusClient(stack.producer_settings) as client, client.watch_results() as watcher:
            client.submit(unserved)
            [rejected] = list(watcher.wait([unserved], timeout_s=60))
        assert rejected.status is ResultStatus.REJECTED and rejected.error is not None
        assert rejected.error.code == "no_worker" and time.monotonic() - started < 30
        stack.wait_idle()
        processes = list(stack.processes)
        helpers = [s.process for s in (stack.kafka, stack.s3) if s is not None]
        ports = [p.metrics_port for p in processes] + [
            int(a.rsplit(":", 1)[1]) for a in (stack.kafka_address, stack.s3_endpoint)
        ]
        assert all(_listening(port) for port in ports[-2:])  # Kafka and S3 serve while the stack runs
        # A second stack on this folder would share its Celery folders and worker names: refused at once.
        with pytest.raises(StackError, match="in use by another Chorus stack"):
            EmbeddedStack(options).start()
    assert not stack.running
    # Nothing is left: the services (with their pool processes), the stand-ins, their ports.
    assert all(p.process.returncode is not None for p in processes)
    assert all(h.returncode is not None for h in helpers)
    assert _alive_in_groups({p.pid for p in processes}) == []
    assert [port for port in ports if _listening(port)] == []
    assert all(p.process.returncode == 0 for p in processes), [p.log_tail() for p in processes]
    snapshot = read_snapshot(options.state_dir / "s3")
    assert snapshot is not None
    assert {
        ("chorus", video_key("stack-first", "mp4")),
        ("chorus", trajectory_header_key("stack-first")),
    } <= {(o.bucket, o.key) for o in snapshot.objects}

    # A second start over the same state: the objects are back and the index still knows the first request.
    with EmbeddedStack(options) as again:
        store = again.object_store()
        assert store.exists(video_key("stack-first", "mp4"))
        assert store.get_verified(trajectory_header_key("stack-first"))
        second = _run_one(again, "stack-second", seed=2)
        assert second.status is ResultStatus.DONE, second.error
        assert second.donor is not None and second.donor.request_id == "stack-first"
        assert second.fallback is None and second.steps_computed < second.steps_requested
        restarted = list(again.processes)
    assert _alive_in_groups({p.pid for p in restarted}) == []


def test_a_worker_that_cannot_load_its_model_fails_start_and_leaves_nothing_running(tmp_path: Path) -> None:
    empty = tmp_path / "no-weights"
    empty.mkdir()
    stack = EmbeddedStack(
        StackOptions(
            state_dir=tmp_path / "state",
            models=["toy"],
            embedder="hashing",
            extra_env={"CHORUS_TOY_WEIGHTS_DIR": str(empty)},
            ready_timeout_s=WAIT_S,
        )
    )
    # found before the worker announces the model: it stops with the reason, and so does the stack's start
    with pytest.raises(
        StackError, match=r"(?s)worker-0 exited with status 2.*the toy model's weights are missing"
    ):
        stack.start()
    assert not stack.running and stack.kafka is None and stack.s3 is None
    assert all(p.process.returncode is not None for p in stack.processes)
    assert _alive_in_groups({p.pid for p in stack.processes}) == []


OWNER = """
import json, sys, time
from pathlib import Path
from producer.local.config import StackOptions
from producer.local.stack import EmbeddedStack

stack = EmbeddedStack(StackOptions(state_dir=Path(sys.argv[1]), models=["tiny-random-wan"], embedder="hashing"))
stack.start()
pids = [p.pid for p in stack.processes] + [s.process.pid for s in (stack.kafka, stack.s3) if s is not None]
print(json.dumps(pids), flush=True)
time.sleep(600)
"""


def test_services_do_not_outlive_a_killed_owner(tmp_path: Path) -> None:
    state = tmp_path / "state"
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(state)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert owner.stdout is not None
        pids = json.loads(owner.stdout.readline() or "[]")
        assert len(pids) == 4, "the stack did not start"
        owner.send_signal(signal.SIGKILL)  # no cleanup code of the owner runs
        owner.wait(timeout=10)
        deadline = time.monotonic() + WAIT_S
        while _alive_in_groups(set(pids[:2])) or any(_alive(pid) for pid in pids[2:]):
            assert time.monotonic() < deadline, "processes outlived their owner"
            time.sleep(0.5)
        assert read_snapshot(state / "s3") is not None
    finally:
        if owner.poll() is None:
            owner.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def test_a_snapshot_interrupted_between_its_renames_is_still_found(tmp_path: Path) -> None:
    complete = tmp_path / "s3.old"
    (complete / "objects").mkdir(parents=True)
    (complete / "manifest.json").write_text(
        '{"version": 1, "saved_at": "2026-01-01T00:00:00Z", "buckets": ["chorus"], "objects": []}'
    )
    found = read_snapshot(tmp_path / "s3")
    assert found is not None and found.buckets == ["chorus"]
    assert (tmp_path / "s3" / "manifest.json").is_file() and not complete.exists()
    assert read_snapshot(tmp_path / "nothing") is None
    assert not os.path.exists(tmp_path / "nothing")
