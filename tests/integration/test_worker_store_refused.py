"""A worker whose object store refuses a write: what it publishes and what it leaves in the store.

The store is the real S3 server behind the minio adapter, with one key refused (as a full or failing bucket would
refuse it) or its reply lost; the runner runs in-process. The fixtures and helpers are ``test_worker``'s (its
module-scoped settings give this module its own bucket, topics and Redis prefix).
"""

from __future__ import annotations

import logging

import pytest

from producer.contract import GenerationRequest, GenerationResult, ResultStatus
from producer.orders import header_key, step_key, trajectory_prefix, video_key
from producer.sdk import ResultWatcher
from tests.integration import test_worker as _worker
from workers.settings import WorkerSettings
from workers.store import ObjectStore, StoredObject, StoreError

pytestmark = pytest.mark.integration

# test_worker's fixtures, found by name (module-scoped: this module gets its own settings, bucket and topics)
wsettings, store, results = _worker.wsettings, _worker.store, _worker.results
RESULT_TIMEOUT_S, order_for, request_like = _worker.RESULT_TIMEOUT_S, _worker.order_for, _worker.request_like


class _WriteRefused(ObjectStore):
    """The real store, except that every write of ``refused`` fails (as a full or failing bucket would), and
    every write under ``unanswered`` is stored but its reply lost (a timeout after the object reached S3)."""

    refused = ""
    unanswered = "\0"

    def put(
        self, key: str, data: bytes, content_type: str = "application/octet-stream", *, retry: bool = True
    ) -> StoredObject:
        if key == self.refused:
            raise StoreError(f"refused {key} on purpose")
        stored = super().put(key, data, content_type, retry=retry)
        if key.startswith(self.unanswered):
            raise StoreError(f"the reply to {key} was lost on purpose")
        return stored


def _handled_with_a_refused_write(
    wsettings: WorkerSettings,
    store: ObjectStore,
    request: GenerationRequest,
    refused: str,
    unanswered: str = "\0",
) -> GenerationResult:
    """``request`` run to its end (its late uploads included) by a runner whose store refuses ``refused`` (and
    loses the replies under ``unanswered``); the trajectory streamed, not packed."""
    from workers.runner import Runner

    failing = _WriteRefused(store.endpoint, store.bucket, access_key="test", secret_key="test")
    failing.refused, failing.unanswered = refused, unanswered
    runner = Runner(wsettings.model_copy(update={"trajectory_pack_max_bytes": 0}), store=failing)
    try:
        result = runner.handle(order_for(request).model_dump_json(), worker="test")
        assert runner.wait_for_uploads(60)
    finally:
        runner.publisher.close()
    return result


def _assert_served_and_no_trajectory_left(
    store: ObjectStore, results: ResultWatcher, request: GenerationRequest, result: GenerationResult
) -> None:
    """The request was served (its video stored, its result published as returned) and none of its trajectory
    is left in the store."""
    (published,) = list(results.wait([request.request_id], timeout_s=RESULT_TIMEOUT_S))
    assert published == result
    assert list(store.list(trajectory_prefix(request.request_id))) == []
    assert store.exists(f"videos/{request.request_id}.mp4")


def test_a_trajectory_whose_upload_fails_after_the_result_left_is_deleted(
    wsettings: WorkerSettings,
    results: ResultWatcher,
    store: ObjectStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="workers.runner")
    request = request_like("a donor whose last step cannot be stored")
    prefix = trajectory_prefix(request.request_id)
    result = _handled_with_a_refused_write(wsettings, store, request, step_key(prefix, request.num_steps - 1))
    # The result left before the upload ended, naming the trajectory and its exact size ...
    assert result.status is ResultStatus.DONE, result.error
    assert result.trajectory_uri == store.uri(prefix) and result.trajectory_bytes > 0
    # ... and when the upload then failed, what had been stored was deleted: a reader finds the donor gone
    # (``donor_gone``, and the scheduler evicts it) instead of a trajectory without its last step.
    failed = [
        r for r in caplog.records if r.getMessage().startswith("trajectory not stored after its result")
    ]
    assert len(failed) == 1 and "refused" in failed[0].__dict__["error"]
    _assert_served_and_no_trajectory_left(store, results, request, result)


def test_a_header_that_cannot_be_stored_keeps_the_result_from_naming_a_trajectory(
    wsettings: WorkerSettings,
    results: ResultWatcher,
    store: ObjectStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The result leaves before the trajectory's tail, but never before its header: an eviction ordered after
    # the result must find the header it deletes first. A header the store refuses means no donor at all.
    caplog.set_level(logging.INFO, logger="workers.runner")
    request = request_like("a donor whose header cannot be stored")
    prefix = trajectory_prefix(request.request_id)
    result = _handled_with_a_refused_write(wsettings, store, request, header_key(prefix))
    assert result.status is ResultStatus.DONE, result.error
    assert result.trajectory_uri is None and result.trajectory_bytes == 0
    (failed,) = [r for r in caplog.records if r.getMessage() == "trajectory not stored"]
    assert "refused" in failed.__dict__["error"]
    _assert_served_and_no_trajectory_left(store, results, request, result)


@pytest.mark.parametrize(
    "replies_lost",
    [False, True],
    ids=["the trajectory streamed", "its first write stored without a reply"],
)
def test_a_request_whose_video_cannot_be_stored_fails_and_leaves_no_trajectory(
    replies_lost: bool,
    wsettings: WorkerSettings,
    results: ResultWatcher,
    store: ObjectStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The trajectory streamed while the engine ran; the video then cannot be stored, so the request fails and
    # no result names the trajectory: what was stored is deleted, or another request could take it for a donor.
    # With the replies lost, the header reached the store but nothing counted it stored (and the stream stopped):
    # it is deleted all the same.
    caplog.set_level(logging.INFO, logger="workers.runner")
    request = request_like(f"a request whose video the store refuses ({replies_lost=})")
    prefix = trajectory_prefix(request.request_id)
    refused = video_key(request.job_id, wsettings.video_format)
    unanswered = prefix if replies_lost else "\0"
    result = _handled_with_a_refused_write(wsettings, store, request, refused, unanswered)
    assert result.status is ResultStatus.FAILED
    assert result.error is not None and result.error.code == "store_error"
    deleted = [
        r.__dict__["objects"] for r in caplog.records if r.getMessage() == "partial trajectory deleted"
    ]
    # The header alone (its reply lost, the stream stopped), or the header and the steps streamed before the
    # refusal: the last may still have been queued then, and abandoning the upload drops it unsent (one CI run
    # deleted 4 of 5). Either way nothing is left behind.
    if replies_lost:
        assert deleted == [1]
    else:
        assert len(deleted) == 1 and 1 <= deleted[0] <= 1 + request.num_steps
    assert list(store.list(prefix)) == []
    (published,) = list(results.wait([request.request_id], timeout_s=RESULT_TIMEOUT_S))
    assert published.status is ResultStatus.FAILED
