"""The scheduler's faults on real services: hostile messages, the donor index unavailable, a worker that
vanished, a model no worker serves (harness and fixtures: tests/helpers/scheduler_harness.py, conftest.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chorus_sched.dispatch import Dispatcher
from chorus_sched.embedding import HashingEmbedder
from chorus_sched.service import build_scheduler
from producer.contract import (
    GenerationRequest,
    ResultStatus,
    ReusePlan,
)
from producer.orders import (
    queue_for,
)
from tests.helpers.scheduler_fakes import recased
from tests.helpers.scheduler_harness import (
    OTHER,
    PROMPT,
    Harness,
    Record,
    celery_client,
    dead_letters,
    drain,
    request,
    results_of,
)

pytestmark = pytest.mark.integration


def test_hostile_messages_are_dead_lettered_and_the_requests_behind_them_run(harness: Harness) -> None:
    topic = harness.settings.kafka_requests_topic
    send = harness.producer.send
    # One partition's worth of poison in front of valid requests: a tombstone, a number Python will not convert,
    # a ~900 KB prompt (its dead letter must still fit the producer's request size), and an anonymous request.
    send(topic, key=b"tomb", value=None).get(timeout=30)
    harness.publish(
        b'{"request_id": "huge-seed", "prompt": "x", "seed": ' + b"9" * 5001 + b"}", key="huge-seed"
    )
    big = json.dumps({"request_id": "big", "prompt": "x" * 900_000}).encode()
    harness.publish(big, key="big")
    send(topic, key=None, value=b'{"prompt": "a red circle moving left on a gray background"}').get(
        timeout=30
    )
    valid = [request(recased(PROMPT, i), request_id=f"after-{i}", seed=i) for i in range(3)]
    harness.publish(*valid)
    harness.wait_handled()

    assert sorted(harness.generate_tasks()) == ["after-0", "after-1", "after-2"]
    letters = dead_letters(harness.settings, 4)
    rules = sorted(letter.issues[0].rule for letter in letters)
    assert rules == ["json", "missing", "size", "tombstone"]
    sized = next(letter for letter in letters if letter.issues[0].rule == "size")
    assert sized.raw_truncated and sized.raw_size == len(big) and len(sized.to_bytes()) < 64 * 1024
    rejected = {r.request_id: r for r in results_of(harness.settings, 2)}
    assert set(rejected) == {"huge-seed", "big"}
    assert all(r.status is ResultStatus.REJECTED for r in rejected.values())


@pytest.mark.parametrize("holder", ["qdrant-client", "chorus-index-lock"])
def test_with_the_index_held_by_another_client_requests_are_computed_in_full_not_rejected(
    harness: Harness, holder: str
) -> None:
    from qdrant_client import QdrantClient

    from chorus_sched.index_lock import FolderLock

    path = harness.settings.resolved_qdrant_path
    release: Callable[[], None]
    if holder == "qdrant-client":  # another Qdrant client has the local-mode folder open (its own lock)
        with FolderLock.exclusive(Path(path)):  # the scheduler, which keeps the folder open, lets go first
            intruder = QdrantClient(path=path)
        release = intruder.close
    else:  # a stuck process holds the lock Chorus' own instances share the folder by
        stuck = FolderLock(Path(path), wait_s=60)
        stuck.acquire()
        release = stuck.release

    try:
        auto = request(request_id="while-down", seed=1)
        off = request(OTHER, request_id="off-while-down", reuse="off")
        harness.publish(auto, off)
        harness.wait_handled()
    finally:
        release()
    tasks = harness.generate_tasks()
    assert sorted(tasks) == ["off-while-down", "while-down"]
    assert all(t.order.plan == ReusePlan.full(4) and t.order.donor is None for t in tasks.values())
    assert harness.scheduler.stats.dead_lettered == 0
    assert harness.scheduler.stats.index_unavailable == 1  # only the reuse: auto request needed the index
    # the index is back: the next request uses it again
    harness.publish(request(recased(OTHER), request_id="after-down", seed=2))  # not while-down's twin
    harness.wait_handled()
    assert harness.scheduler.index.get("after-down") is not None


def test_an_order_whose_worker_vanished_is_sent_again_by_maintenance(make_settings: Any) -> None:
    settings = make_settings(order_check_after_s=0.1, worker_lost_after_s=1.0, max_redispatches=1)
    app = celery_client(settings.broker_url, settings.state_dir, settings.ledger_prefix)
    scheduler, close = build_scheduler(settings, embedder=HashingEmbedder(), dispatcher=Dispatcher(app))
    try:
        lost = request(request_id="lost-order")
        topic = settings.kafka_requests_topic
        scheduler.handle_requests([Record(topic, 0, 0, b"lost-order", lost.to_bytes())])
        [first] = drain(app, queue_for("toy"))  # a worker took it...
        # ...started it, beat once, and was killed: its state stays PROGRESS with a heartbeat that ages.
        app.backend.store_result("lost-order", {"heartbeat_at": time.time(), "step": 1, "of": 4}, "PROGRESS")
        time.sleep(0.3)
        scheduler.maintain()
        assert drain(app, queue_for("toy")) == []  # the heartbeat is fresh: alive
        time.sleep(1.2)
        scheduler.maintain()
        [again] = drain(app, queue_for("toy"))
        assert again.order == first.order
        time.sleep(1.2)
        scheduler.maintain()  # lost a second time: answered failed, not sent a third time
        assert drain(app, queue_for("toy")) == []
        [failed] = results_of(settings, 1)
        assert failed.request_id == "lost-order" and failed.status is ResultStatus.FAILED
        assert failed.error is not None and failed.error.code == "worker_lost"
    finally:
        close()


def test_an_order_whose_task_failed_without_an_answer_is_answered_failed(make_settings: Any) -> None:
    settings = make_settings(order_check_after_s=0.1)
    app = celery_client(settings.broker_url, settings.state_dir, settings.ledger_prefix)
    scheduler, close = build_scheduler(settings, embedder=HashingEmbedder(), dispatcher=Dispatcher(app))
    try:
        doomed = request(request_id="doomed-order")
        scheduler.handle_requests(
            [Record(settings.kafka_requests_topic, 0, 0, b"doomed-order", doomed.to_bytes())]
        )
        assert (
            len(drain(app, queue_for("toy"))) == 1
        )  # a worker took it; its task failed as Celery records it
        app.backend.mark_as_failure("doomed-order", TimeoutError("TimeLimitExceeded(960)"))
        time.sleep(0.3)
        scheduler.maintain()
        assert drain(app, queue_for("toy")) == []  # not sent again
        [failed] = results_of(settings, 1)
        assert failed.request_id == "doomed-order" and failed.status is ResultStatus.FAILED
        assert failed.error is not None and failed.error.code == "worker_failed"
        assert "TimeLimitExceeded(960)" in failed.error.message
    finally:
        close()


def test_an_order_for_a_model_no_live_worker_serves_is_rejected_within_seconds(make_settings: Any) -> None:
    from producer.broker import announce_models, model_last_seen

    settings = make_settings(no_worker_after_s=1.0, watchdog_interval_s=0.5)
    app = celery_client(settings.broker_url, settings.state_dir, settings.ledger_prefix)
    # Workers run, but only for another model (what `chorus worker` announces every few seconds).
    announce_models(app, ["tiny-random-wan"], now=time.time())
    assert model_last_seen(app, "tiny-random-wan") is not None and model_last_seen(app, "toy") is None
    h = Harness(settings, app)
    try:
        started = time.monotonic()
        h.publish(request(request_id="nobody-serves-it"))
        [rejected] = results_of(settings, 1)
        assert time.monotonic() - started < 20
        assert rejected.request_id == "nobody-serves-it" and rejected.status is ResultStatus.REJECTED
        assert rejected.error is not None and rejected.error.code == "no_worker"
        assert "chorus worker --model toy" in rejected.error.message
        [letter] = dead_letters(settings, 1)
        assert letter.error.code == "no_worker" and letter.topic == settings.kafka_requests_topic
        assert GenerationRequest.model_validate_json(letter.raw()).request_id == "nobody-serves-it"
    finally:
        h.close()
