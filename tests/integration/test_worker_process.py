"""``chorus worker`` as a real process (prefork, 2 processes) on the embedded filesystem broker.

- A follower that starts before its leader exists takes the leader's steps as the leader uploads them.
- ``chorus produce --wait`` end to end: the CLI publishes to Kafka, a stand-in for the scheduler turns each
  request into a work order for the worker, the worker publishes results, and the CLI prints them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from producer.broker import app_for_broker, send_generate
from producer.contract import ResultStatus, ReusePlan, build_request
from producer.local.standins import EmbeddedService
from producer.orders import DonorRef, Role, WorkOrder, header_key, heartbeat_of, step_key, trajectory_prefix
from producer.sdk import ResultWatcher, read_requests
from tests.helpers.stored import stored_objects
from workers.settings import WorkerSettings
from workers.store import ObjectStore

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "tiny-random-wan"
CHORUS = str(Path(sys.executable).with_name("chorus"))
TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def wsettings(
    kafka_broker: EmbeddedService, s3_server: EmbeddedService, tmp_path_factory: pytest.TempPathFactory
) -> WorkerSettings:
    suffix = uuid.uuid4().hex[:8]
    return WorkerSettings(
        state_dir=tmp_path_factory.mktemp("fs-state"),
        broker_url="",
        kafka_bootstrap=kafka_broker.address,
        kafka_api_version="2.1.0",
        kafka_requests_topic=f"requests-{suffix}",
        kafka_results_topic=f"results-{suffix}",
        s3_endpoint=s3_server.address,
        s3_bucket=f"fs-{suffix}",
        s3_access_key="test",
        s3_secret_key="test",
        follower_poll_s=0.1,
        trajectory_pack_max_bytes=0,  # step by step, as a trajectory too large to pack is: followers stream it
    )


def chorus_env(settings: WorkerSettings) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("state_dir", "broker_url", "kafka_bootstrap", "kafka_api_version", "kafka_requests_topic",
                 "kafka_results_topic", "s3_endpoint", "s3_bucket", "follower_poll_s",
                 "trajectory_pack_max_bytes"):  # fmt: skip
        env[f"CHORUS_{name.upper()}"] = str(getattr(settings, name))
    env["CHORUS_S3_ACCESS_KEY"] = env["CHORUS_S3_SECRET_KEY"] = "test"
    env["CHORUS_LOG_FORMAT"] = "json"
    return env


@pytest.fixture(scope="module")
def worker_process(wsettings: WorkerSettings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    log_path = tmp_path_factory.mktemp("worker-log") / "worker.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [CHORUS, "worker", "--model", MODEL, "--concurrency", "2", "--no-maintenance"],
            env=chorus_env(wsettings),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield log_path
        finally:
            process.send_signal(signal.SIGTERM)  # warm shutdown
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
    banner = log_path.read_text(errors="replace")
    assert f"models {MODEL} on cpu" in banner


@pytest.fixture(scope="module")
def client(wsettings: WorkerSettings) -> Celery:
    return app_for_broker("", state_dir=wsettings.state_dir)


@pytest.fixture(scope="module")
def store(wsettings: WorkerSettings) -> ObjectStore:
    store = ObjectStore.from_settings(wsettings)
    store.ensure_bucket()
    return store


def wait_for_state(client: Celery, task_id: str, states: tuple[str, ...], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while client.AsyncResult(task_id).state not in states:
        assert time.monotonic() < deadline, f"task {task_id} never reached {states}"
        time.sleep(0.2)


def test_a_follower_streams_the_steps_of_a_leader_that_starts_after_it(
    worker_process: Path, client: Celery, wsettings: WorkerSettings, store: ObjectStore
) -> None:
    leader = build_request(prompt="a red circle moving left on a white background", model=MODEL, num_steps=6)
    follower = build_request(
        prompt="a blue circle moving left on a white background", model=MODEL, num_steps=6
    )
    plan = ReusePlan(stage1_steps=2, stage2_steps=2, stage3_steps=2, alpha=2.0)
    donor = DonorRef(
        request_id=leader.request_id,
        similarity=0.9,
        trajectory_prefix=trajectory_prefix(leader.request_id),
        wait_s=120,
    )
    with ResultWatcher(wsettings) as results:
        send_generate(client, WorkOrder(request=follower, plan=plan, donor=donor, role=Role.FOLLOWER))
        # The follower runs (and waits for a leader that does not exist yet) before the leader is even sent.
        # Running: STARTED, then PROGRESS as soon as its heartbeat thread beats (it beats while it waits, too).
        wait_for_state(client, follower.request_id, ("STARTED", "PROGRESS"), TIMEOUT_S)
        assert not store.exists(header_key(trajectory_prefix(leader.request_id)))
        beat_deadline = time.monotonic() + 30
        while heartbeat_of(client.AsyncResult(follower.request_id).info) is None:
            assert time.monotonic() < beat_deadline, "the waiting follower never beat its heartbeat"
            time.sleep(0.2)
        send_generate(client, WorkOrder(request=leader, plan=ReusePlan.full(6), role=Role.LEADER))
        got = {
            r.request_id: r
            for r in results.wait([leader.request_id, follower.request_id], timeout_s=TIMEOUT_S)
        }

    lead, follow = got[leader.request_id], got[follower.request_id]
    assert lead.status is ResultStatus.DONE and follow.status is ResultStatus.DONE, (lead.error, follow.error)
    assert lead.steps_computed == 6 and lead.fallback is None
    prefix = trajectory_prefix(leader.request_id)
    assert set(stored_objects(store, prefix, lead.trajectory_bytes)) == {header_key(prefix)} | {
        step_key(prefix, i) for i in range(6)
    }
    # The follower used the leader's trajectory: Stage 1 skipped, no fallback.
    assert follow.fallback is None
    assert follow.donor is not None and follow.donor.request_id == leader.request_id
    assert follow.steps_computed <= 4 and follow.tokens_computed_fraction < 1.0
    assert follow.timings.fetch_s > 0


def stand_in_scheduler(
    settings: WorkerSettings, client: Celery, expected: int, stop: threading.Event
) -> None:
    """What the scheduler does, minimally: every valid request becomes a full-compute SOLO work order."""
    for received in read_requests(settings, group_id="stand-in", timeout_s=TIMEOUT_S, limit=expected):
        if stop.is_set():
            return
        if received.request is not None:
            request = received.request
            send_generate(client, WorkOrder(request=request, plan=ReusePlan.full(request.num_steps)))


def test_produce_waits_for_the_results_of_its_batch(
    worker_process: Path, client: Celery, wsettings: WorkerSettings, store: ObjectStore, tmp_path: Path
) -> None:
    batch = tmp_path / "batch.jsonl"
    ids = [f"batch-{uuid.uuid4().hex[:6]}-{i}" for i in range(2)]
    batch.write_text(
        "\n".join(
            json.dumps({"request_id": rid, "prompt": f"a shape number {i}", "seed": i})
            for i, rid in enumerate(ids)
        )
        + "\n"
    )
    stop = threading.Event()
    dispatcher = threading.Thread(
        target=stand_in_scheduler, args=(wsettings, client, len(ids), stop), daemon=True
    )
    dispatcher.start()
    try:
        done = subprocess.run(
            [
                CHORUS,
                "produce",
                "--file",
                str(batch),
                "--model",
                MODEL,
                "--wait",
                "--json",
                "--timeout",
                str(TIMEOUT_S),
            ],
            env=chorus_env(wsettings),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S + 60,
        )
    finally:
        stop.set()
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["sent"] == ids and doc["missing"] == [] and doc["invalid"] == []
    assert [r["request_id"] for r in doc["results"]] == ids
    for result in doc["results"]:
        assert result["status"] == "done" and result["steps_computed"] == result["steps_requested"] == 4
        assert store.exists(store.key_of(result["video_uri"]))

    dispatcher.join(timeout=30)
    assert not dispatcher.is_alive()
