"""A real Celery worker (in-process thread, solo pool) on the real Redis broker runs work orders end to end.

Everything it touches is real: Redis (keys under a prefix unique to this module), the Kafka-protocol broker
(topics unique to this module), the S3 server (a bucket unique to this module), and the engine on the
``tiny-random-wan`` model. Results are read from the results topic with the SDK; objects are checked with the
minio adapter and the video is downloaded with boto3 as an independent client.
"""

from __future__ import annotations

import io
import json
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import imageio_ffmpeg
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from producer.broker import app_for_broker, send_evict, send_generate
from producer.contract import GenerationRequest, GenerationResult, ResultStatus, ReusePlan, build_request
from producer.local.standins import EmbeddedService
from producer.orders import (
    GENERATE_TASK,
    MAINTENANCE_QUEUE,
    DonorRef,
    EvictOrder,
    Role,
    WorkOrder,
    abandoned_key,
    header_key,
    heartbeat_of,
    queue_for,
    trajectory_prefix,
)
from producer.sdk import ResultWatcher
from tests.helpers.stored import stored_objects
from tests.helpers.topics import read_topic
from workers.app import create_app
from workers.engine.trajectory import decode_head
from workers.runner import wait_for_uploads
from workers.settings import WorkerSettings
from workers.store import ObjectStore

pytestmark = pytest.mark.integration

MODEL = "tiny-random-wan"
RESULT_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def wsettings(
    kafka_broker: EmbeddedService,
    s3_server: EmbeddedService,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> WorkerSettings:
    suffix = uuid.uuid4().hex[:8]
    return WorkerSettings(
        state_dir=tmp_path_factory.mktemp("worker-state"),
        broker_url=redis_url,
        broker_key_prefix=f"test-{suffix}:",
        kafka_bootstrap=kafka_broker.address,
        kafka_api_version="2.1.0",
        kafka_requests_topic=f"requests-{suffix}",
        kafka_results_topic=f"results-{suffix}",
        s3_endpoint=s3_server.address,
        s3_bucket=f"worker-{suffix}",
        s3_access_key="test",
        s3_secret_key="test",
        follower_poll_s=0.1,
        trajectory_pack_max_bytes=8
        << 20,  # small trajectories packed into one object (tests pass 0 to stream)
        task_max_attempts=3,
    )


@pytest.fixture(scope="module")
def store(wsettings: WorkerSettings) -> ObjectStore:
    store = ObjectStore.from_settings(wsettings)
    store.ensure_bucket()
    return store


@pytest.fixture(scope="module")
def results(wsettings: WorkerSettings) -> Iterator[ResultWatcher]:
    watcher = ResultWatcher(wsettings)
    yield watcher
    watcher.close()


@pytest.fixture(scope="module")
def client(wsettings: WorkerSettings) -> Celery:
    """The scheduler's view: a client app built with the factory it uses."""
    return app_for_broker(
        wsettings.broker_url, state_dir=wsettings.state_dir, broker_key_prefix=wsettings.broker_key_prefix
    )


@pytest.fixture(scope="module")
def worker(wsettings: WorkerSettings, results: ResultWatcher) -> Iterator[Celery]:
    app = create_app(wsettings)
    queues = [queue_for(MODEL), queue_for("wan2.1-t2v-1.3b"), MAINTENANCE_QUEUE]
    with start_worker(
        app, pool="solo", perform_ping_check=False, queues=queues, loglevel="WARNING", shutdown_timeout=60
    ):
        yield app
    from workers.runner import close_runners

    close_runners()


def order_for(request: GenerationRequest, plan: ReusePlan | None = None, **fields: Any) -> WorkOrder:
    return WorkOrder(request=request, plan=plan or ReusePlan.full(request.num_steps), **fields)


def run(client: Celery, results: ResultWatcher, order: WorkOrder) -> tuple[GenerationResult, dict[str, Any]]:
    """Dispatch one order; return its result from the results topic and the Celery task's summary, once the
    worker (in this process) has also stored the trajectory, which it finishes after the result."""
    async_result = send_generate(client, order)
    (result,) = list(results.wait([order.request.request_id], timeout_s=RESULT_TIMEOUT_S))
    summary = async_result.get(timeout=60)
    assert wait_for_uploads(60)
    assert summary["request_id"] == order.request.request_id
    return result, summary


def donor_ref(request_id: str, similarity: float = 0.9, **fields: Any) -> DonorRef:
    return DonorRef(
        request_id=request_id,
        similarity=similarity,
        trajectory_prefix=trajectory_prefix(request_id),
        **fields,
    )


@pytest.fixture(scope="module")
def donor(worker: Celery, client: Celery, results: ResultWatcher) -> GenerationResult:
    """A finished SOLO request: its trajectory serves the reuse tests."""
    request = build_request(prompt="a red circle moving left on a white background", model=MODEL, seed=3)
    result, _ = run(client, results, order_for(request))
    assert result.status is ResultStatus.DONE, result.error
    return result


def request_like(
    prompt: str = "a blue circle moving left on a white background", **fields: Any
) -> GenerationRequest:
    return build_request(prompt=prompt, model=MODEL, seed=3, **fields)


REUSE_PLAN = ReusePlan(stage1_steps=1, stage2_steps=2, stage3_steps=1, alpha=2.0)


def test_a_solo_order_publishes_its_result_and_stores_video_and_trajectory(
    worker: Celery,
    client: Celery,
    results: ResultWatcher,
    store: ObjectStore,
    wsettings: WorkerSettings,
    tmp_path: Path,
) -> None:
    request = build_request(prompt="a green square moving up", model=MODEL, seed=11)
    result, summary = run(client, results, order_for(request))

    assert result.status is ResultStatus.DONE and result.error is None, result.error
    assert (summary["status"], summary["attempt"], summary["video_uri"]) == ("done", 1, result.video_uri)
    assert (result.steps_computed, result.steps_requested, result.tokens_computed_fraction) == (4, 4, 1.0)
    assert result.fallback is None and result.donor is None
    assert result.worker and result.timings.denoise_s > 0 and result.timings.upload_s > 0

    # The trajectory of a solo order (nobody read it while it ran): one object holding every step, its size
    # reported exactly.
    prefix = trajectory_prefix(request.request_id)
    assert result.trajectory_uri == store.uri(prefix)
    objects = stored_objects(store, prefix, result.trajectory_bytes)
    assert set(objects) == {header_key(prefix)}
    assert result.trajectory_bytes == sum(objects.values())
    meta, _, steps = decode_head(store.get_verified(header_key(prefix)))
    assert meta.request_id == request.request_id and [r.index for r in steps or []] == [0, 1, 2, 3]

    # The video, fetched by its URI with boto3 (an independent S3 client), is an mp4 of the request's frames.
    assert result.video_uri == f"s3://{wsettings.s3_bucket}/videos/{request.request_id}.mp4"
    bucket, key = result.video_uri.removeprefix("s3://").split("/", 1)
    s3 = boto3.client(
        "s3",
        endpoint_url=f"http://{wsettings.s3_endpoint}",
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    )
    obj = s3.get_object(Bucket=bucket, Key=key)
    data = obj["Body"].read()
    assert obj["ContentType"] == "video/mp4"
    assert data[4:8] == b"ftyp"
    path = tmp_path / "video.mp4"
    path.write_bytes(data)
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    assert tuple(meta["size"]) == (request.width, request.height)
    assert sum(1 for _ in reader) == request.num_frames


def test_a_finished_donor_is_reused(donor: GenerationResult, client: Celery, results: ResultWatcher) -> None:
    order = order_for(request_like(), REUSE_PLAN, donor=donor_ref(donor.request_id, 0.93))
    result, _ = run(client, results, order)
    assert result.status is ResultStatus.DONE, result.error
    assert result.fallback is None
    assert result.donor is not None and (result.donor.request_id, result.donor.similarity) == (
        donor.request_id,
        0.93,
    )
    assert result.plan == REUSE_PLAN
    # Stage 1 computed nothing, Stage 2 only a share of the tokens.
    assert result.steps_computed <= 3 and result.tokens_computed_fraction < 1.0
    assert result.timings.fetch_s > 0


def test_an_evicted_donor_is_deleted_and_then_runs_in_full(
    worker: Celery, client: Celery, results: ResultWatcher, store: ObjectStore
) -> None:
    first, _ = run(client, results, order_for(request_like("a yellow star spinning")))
    prefix = trajectory_prefix(first.request_id)
    assert len(list(store.list(prefix))) == 1  # packed

    evicted = send_evict(client, EvictOrder(request_ids=[first.request_id, "never-existed"], reason="test"))
    assert evicted.get(timeout=60) == {"deleted": {first.request_id: 1, "never-existed": 0}}
    assert list(store.list(prefix)) == []
    assert store.exists(f"videos/{first.request_id}.mp4")  # videos are the users', eviction keeps them

    order = order_for(
        request_like("a yellow star spinning fast"), REUSE_PLAN, donor=donor_ref(first.request_id)
    )
    result, _ = run(client, results, order)
    assert result.status is ResultStatus.DONE, result.error
    assert (result.steps_computed, result.tokens_computed_fraction) == (4, 1.0)
    assert result.fallback is not None and "not in the store" in result.fallback
    assert result.donor is not None and result.donor.request_id == first.request_id
    assert result.donor_gone  # the scheduler is told to stop offering it


def test_a_corrupt_donor_runs_in_full(
    donor: GenerationResult, client: Celery, results: ResultWatcher, store: ObjectStore
) -> None:
    # A copy of the donor whose trajectory (packed: one object) was damaged after upload.
    source, target = trajectory_prefix(donor.request_id), trajectory_prefix("corrupt-copy")
    for obj in store.list(source):
        data = store.get(obj.key)
        if obj.key == header_key(source):
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        store.put(target + obj.key.removeprefix(source), data)
    order = order_for(request_like(), REUSE_PLAN, donor=donor_ref("corrupt-copy"))
    result, _ = run(client, results, order)
    assert result.status is ResultStatus.DONE, result.error
    assert result.steps_computed == 4 and result.fallback is not None and "sha256" in result.fallback
    assert result.donor_gone


def test_a_donor_with_flipped_bytes_and_its_checksum_kept_is_given_up(
    donor: GenerationResult, client: Celery, results: ResultWatcher, store: ObjectStore
) -> None:
    # The object's bytes changed but the sha256 stored with it did not (bit rot, a bad copy): the worker must
    # report the donor gone, so the scheduler evicts it instead of planning it again for every similar request.
    source, target = trajectory_prefix(donor.request_id), trajectory_prefix("rotten-copy")
    for obj in store.list(source):
        data = store.get(obj.key)
        claimed = (store.client.stat_object(store.bucket, obj.key).metadata or {}).get("x-amz-meta-sha256")
        if obj.key == header_key(source):
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        store.client.put_object(
            store.bucket,
            target + obj.key.removeprefix(source),
            io.BytesIO(data),
            length=len(data),
            metadata={"sha256": claimed} if claimed else None,
        )
    order = order_for(request_like(), REUSE_PLAN, donor=donor_ref("rotten-copy"))
    result, _ = run(client, results, order)
    assert result.status is ResultStatus.DONE, result.error
    assert result.steps_computed == 4 and result.fallback is not None and "sha256" in result.fallback
    assert result.donor_gone


def test_an_incompatible_donor_runs_in_full(worker: Celery, client: Celery, results: ResultWatcher) -> None:
    other_shape, _ = run(client, results, order_for(request_like("a tiny red dot", num_frames=4)))
    order = order_for(request_like("a tiny blue dot"), REUSE_PLAN, donor=donor_ref(other_shape.request_id))
    result, _ = run(client, results, order)
    assert result.status is ResultStatus.DONE, result.error
    assert result.steps_computed == 4
    assert (
        result.fallback is not None
        and "incompatible donor" in result.fallback
        and "num_frames" in result.fallback
    )
    assert result.donor_gone


def test_a_follower_whose_leader_never_uploads_runs_in_full_after_its_deadline(
    worker: Celery, client: Celery, results: ResultWatcher
) -> None:
    order = order_for(
        request_like("a purple triangle"),
        REUSE_PLAN,
        donor=donor_ref("leader-that-never-came", wait_s=1.0),
        role=Role.FOLLOWER,
    )
    result, _ = run(client, results, order)
    assert result.status is ResultStatus.DONE, result.error
    assert (result.steps_computed, result.tokens_computed_fraction) == (4, 1.0)
    assert result.fallback is not None and "not uploaded within 1 s" in result.fallback
    assert not result.donor_gone  # a late leader is no reason to forget it
    # It waited (at least) its deadline, and that wait is reported as fetch time, not denoise.
    assert result.timings.fetch_s >= 1.0


def test_a_broken_order_is_answered_failed_with_the_reason(
    worker: Celery, client: Celery, results: ResultWatcher
) -> None:
    request = request_like("a broken order")
    raw = order_for(request).model_dump(mode="json")
    raw["plan"] = {"stage1_steps": -1, "stage2_steps": 0, "stage3_steps": 4}
    async_result = client.send_task(GENERATE_TASK, args=[json.dumps(raw)], task_id=request.request_id)
    (result,) = list(results.wait([request.request_id], timeout_s=RESULT_TIMEOUT_S))
    assert result.status is ResultStatus.FAILED
    assert result.error is not None and result.error.code == "invalid_order"
    assert "stage1_steps" in result.error.message
    assert async_result.get(timeout=60)["error"] == "invalid_order"


def test_a_model_that_cannot_load_fails_once_without_retries(
    worker: Celery, client: Celery, results: ResultWatcher
) -> None:
    request = build_request(prompt="a cat", model="wan2.1-t2v-1.3b")
    result, summary = run(client, results, order_for(request))
    assert result.status is ResultStatus.FAILED
    assert result.error is not None and result.error.code == "model_unavailable"
    assert "CHORUS_WAN21_DIR" in result.error.message
    assert summary["attempt"] == 1 and summary["status"] == "failed"


def test_an_order_delivered_too_often_is_answered_failed(
    worker: Celery, client: Celery, results: ResultWatcher, wsettings: WorkerSettings
) -> None:
    request = request_like("an order that keeps killing its worker")
    # As if three earlier deliveries had died with their worker.
    backend = worker.backend
    backend.set(backend.get_key_for_task(request.request_id, key=".attempts"), b"3")
    result, summary = run(client, results, order_for(request))
    assert result.status is ResultStatus.FAILED
    assert result.error is not None and result.error.code == "too_many_attempts"
    assert summary["attempt"] == wsettings.task_max_attempts + 1


def test_a_result_kafka_refused_is_published_again_without_running_the_order_again(
    worker: Celery, client: Celery, results: ResultWatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kafka.errors

    import workers.results
    from workers.runner import Runner

    request = request_like("an order whose first result Kafka refuses")
    publish = workers.results.bus.publish
    refused: list[str] = []
    ran: list[str] = []

    beating: list[str] = []

    def flaky_publish(producer: Any, topic: str, key: str, value: bytes, **kw: Any) -> None:
        if key == request.request_id and not refused:
            refused.append(key)
            raise kafka.errors.KafkaTimeoutError("flush timed out")  # a broker blip
        if (
            key == request.request_id
        ):  # the retry: the task still says it is alive (else the watchdog re-sends)
            meta = worker.backend.get_task_meta(key)
            beating.append(meta["status"] if heartbeat_of(meta.get("result")) else "no heartbeat")
        publish(producer, topic, key, value, **kw)

    run_safely = Runner._run_safely

    def counted(self: Runner, order: WorkOrder, *args: Any, **kw: Any) -> GenerationResult:
        ran.append(order.request.request_id)
        return run_safely(self, order, *args, **kw)

    monkeypatch.setattr(workers.results.bus, "publish", flaky_publish)
    monkeypatch.setattr(Runner, "_run_safely", counted)
    result, summary = run(client, results, order_for(request))
    assert refused == [request.request_id] and beating == ["PROGRESS"]
    assert result.status is ResultStatus.DONE and summary["status"] == "done"
    assert ran == [request.request_id]  # the retry published the result it had; the order ran once
    assert summary["attempt"] == 1  # one delivery: the task published it again itself


def test_a_second_copy_of_an_answered_order_is_skipped_not_run_again(
    worker: Celery,
    client: Celery,
    results: ResultWatcher,
    wsettings: WorkerSettings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The broker requeued an order whose pool process died, and the scheduler's watchdog sent it again: two
    # deliveries of one task id. The first publishes the result; the second must not publish another.
    order = order_for(request_like("an order sent twice"))
    first, _ = run(client, results, order)
    assert first.status is ResultStatus.DONE
    caplog.set_level(logging.INFO, logger="workers.tasks")
    send_generate(client, order)
    deadline = time.monotonic() + 60
    # The worker runs in this process: its log says when it saw (and skipped) the second delivery. (Celery does
    # not overwrite a task's stored SUCCESS, so the backend cannot tell.)
    while not any(
        r.getMessage() == "order already answered; this delivery is skipped" for r in caplog.records
    ):
        assert time.monotonic() < deadline, "the second delivery was not skipped"
        time.sleep(0.2)
    # Both deliveries have ended: a second result, if any, is on the topic by now.
    records = read_topic(wsettings, wsettings.kafka_results_topic)
    published = sum(
        GenerationResult.model_validate_json(value).request_id == order.request.request_id
        for _, value in records
    )
    read = len(records)
    assert published == 1, f"{published} results of this order among {read} read"


def test_an_order_forgotten_after_its_request_ended_runs_again_under_the_same_task_id(
    worker: Celery, client: Celery, results: ResultWatcher, wsettings: WorkerSettings
) -> None:
    # A request that ended (failed, rejected) and is sent again reuses its job id as task id: the scheduler
    # forgets the ended order's marks, so the new order runs instead of being skipped as already answered.
    from producer.broker import forget_order

    order = order_for(request_like("an order sent again after it ended"))
    first, _ = run(client, results, order)
    assert first.status is ResultStatus.DONE
    forget_order(client, order.request.job_id)
    send_generate(client, order)
    deadline, published = time.monotonic() + 120, 0
    while published < 2 and time.monotonic() < deadline:
        published = sum(
            GenerationResult.model_validate_json(value).request_id == order.request.request_id
            for _, value in read_topic(wsettings, wsettings.kafka_results_topic)
        )
        time.sleep(0.5)
    assert published == 2


def test_gif_videos_are_stored_as_gif(
    wsettings: WorkerSettings, results: ResultWatcher, store: ObjectStore
) -> None:
    from workers.runner import Runner

    runner = Runner(wsettings.model_copy(update={"video_format": "gif"}))
    request = request_like("a gif of a circle")
    try:
        result = runner.handle(order_for(request).model_dump_json(), worker="test")
    finally:
        runner.publisher.close()
    assert result.status is ResultStatus.DONE, result.error
    assert result.video_uri == store.uri(f"videos/{request.request_id}.gif")
    assert store.get(store.key_of(result.video_uri))[:4] == b"GIF8"
    (published,) = list(results.wait([request.request_id], timeout_s=RESULT_TIMEOUT_S))
    assert published == result


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "packed"])
def test_a_leader_that_fails_midway_leaves_no_partial_trajectory(
    wsettings: WorkerSettings,
    results: ResultWatcher,
    store: ObjectStore,
    caplog: pytest.LogCaptureFixture,
    streamed: bool,
) -> None:
    from workers.runner import Runner

    def fail_at_step_two(done: int, total: int) -> None:
        if done == 2:
            raise RuntimeError("the device fell over")

    caplog.set_level(logging.INFO, logger="workers.runner")
    if streamed:  # the default, and what a trajectory too large to pack is
        wsettings = wsettings.model_copy(update={"trajectory_pack_max_bytes": 0})
    runner = Runner(wsettings)
    request = request_like(f"a leader that fails, {'streamed' if streamed else 'packed'}")
    order = order_for(request, role=Role.LEADER)
    try:
        result = runner.handle(order.model_dump_json(), worker="test", progress=fail_at_step_two)
    finally:
        runner.publisher.close()
    assert result.status is ResultStatus.FAILED
    assert result.error is not None and result.error.code == "engine_error"
    assert "the device fell over" in result.error.message
    # Streamed: header and the first steps were uploaded for followers, then deleted: nobody may take them for a
    # donor (what was still queued when it failed is dropped, not uploaded first). Packed: nothing was uploaded
    # (it would have been, whole, after the last step).
    deleted = [
        r.__dict__["objects"] for r in caplog.records if r.getMessage() == "partial trajectory deleted"
    ]
    if streamed:
        assert len(deleted) == 1 and 1 <= deleted[0] <= 3  # header, and up to steps 0 and 1
    else:
        assert deleted == []
    assert list(store.list(trajectory_prefix(request.request_id))) == []
    (published,) = list(results.wait([request.request_id], timeout_s=RESULT_TIMEOUT_S))
    assert published.status is ResultStatus.FAILED


def test_a_leader_that_starts_clears_a_mark_that_it_was_gone(
    wsettings: WorkerSettings, results: ResultWatcher, store: ObjectStore
) -> None:
    # Left by a follower of an earlier run under this job id (or one that waited while this order was queued):
    # it would make every follower of this run give up at once.
    from workers.runner import Runner

    request = request_like("a leader run again under its job id")
    marker = abandoned_key(trajectory_prefix(request.job_id))
    store.put(marker, b"", content_type="text/plain")
    runner = Runner(wsettings)
    try:
        result = runner.handle(order_for(request, role=Role.LEADER).model_dump_json(), worker="test")
        assert runner.wait_for_uploads(60)
    finally:
        runner.publisher.close()
    assert result.status is ResultStatus.DONE, result.error
    assert not store.exists(marker)
    (published,) = list(results.wait([request.request_id], timeout_s=RESULT_TIMEOUT_S))
    assert published.status is ResultStatus.DONE
