"""The serving path end to end on the embedded stack: real ``chorus scheduler`` and ``chorus worker`` processes,
librdkafka's Kafka-protocol mock broker, moto's S3 server, Qdrant local mode, model ``tiny-random-wan``.

One stack serves this module (one scheduler, one worker with two pool processes). Each test keeps to its own tenant,
so donors of one test are never candidates in another (the scheduler searches within a tenant), and makes the donors
it needs itself:

- a batch of families of similar prompts through ``chorus produce --file … --wait --json``: every result arrives,
  each family has one leader and every later member reuses a family donor; videos and trajectories are in S3 and
  the donor index holds an entry per request, with the hits the results imply;
- a request published by ``kcat`` completes; ``kcat`` reads its result, and boto3 downloads and decodes the video;
- the same request id published three times yields one dispatch, one run and one result;
- malformed messages land on the dead-letter topic with their reason, and later requests still complete;
- a donor deleted from S3 after the scheduler planned with it: the request completes in full, ``fallback`` says why;
- a follower whose leader never runs completes in full once its wait runs out;
- a donor found missing at fetch is evicted (the worker says so in ``donor_gone``) and not planned again.

The last two must act between two steps of the pipeline. They pause the worker's whole process group (SIGSTOP) so
that an order the scheduler has dispatched cannot be fetched yet, and wait until the scheduler logged the dispatch:
the interleaving is forced, not raced. The orphaned leader's order is taken off the broker queue by the test (as if
the worker that took it had hung), so its follower can only find nothing.

Eviction is in ``test_e2e_eviction.py`` (it needs a tiny cache budget), two schedulers and three workers in
``test_e2e_scale.py``. Nothing here asserts how long anything took.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import imageio_ffmpeg
import pytest
from kombu import Queue

from chorus_sched.index import DonorEntry
from producer import bus
from producer.broker import EXCHANGE, app_for_broker
from producer.contract import DeadLetter, GenerationResult, ResultStatus, build_request
from producer.local.stack import EmbeddedStack
from producer.orders import (
    Role,
    WorkOrder,
    abandoned_key,
    queue_for,
    trajectory_prefix,
)
from producer.sdk import ChorusClient, ResultWatcher
from tests.helpers.e2e import (
    CHORUS,
    FOLLOWER_WAIT_S,
    KCAT,
    MODEL,
    STEPS,
    WAIT_S,
    check_ran_once,
    check_stored,
    donor_index,
    events,
    paused,
    read_topic,
    request,
    results_on_topic,
    stack_options,
    submit_and_wait,
    wait_for,
    wait_results,
)
from tests.helpers.stored import stored_objects

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    root = tmp_path_factory.mktemp("e2e")
    with EmbeddedStack(stack_options(root / "state", worker_concurrency=2)) as running:
        yield running


# --- tests ---------------------------------------------------------------------------------------------------------

FAMILIES = {
    "red": "a red circle moving left on a white background",
    "green": "a green square moving up on a black background",
    "yellow": "a yellow triangle moving right on a gray background",
}


def test_a_batch_of_families_through_chorus_produce(stack: EmbeddedStack, tmp_path: Path) -> None:
    tenant = "batch"
    lines: list[dict[str, Any]] = []
    for family, prompt in FAMILIES.items():
        # again in other case (the same words: a Stage-1 donor; the very same text with another seed would be
        # served the first's video whole, chorus_sched.exact), another seed, a paraphrase
        prompts = [prompt, prompt.capitalize(), prompt.replace(" on ", " across ")]
        lines += [
            {"request_id": f"batch-{family}-{i}", "prompt": p, "seed": i, "tenant": tenant}
            for i, p in enumerate(prompts)
        ]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
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
            str(WAIT_S),
        ],
        env=stack.client_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S + 60,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    doc = json.loads(done.stdout)
    ids = [line["request_id"] for line in lines]
    assert (doc["sent"], doc["missing"], doc["invalid"]) == (ids, [], [])
    results = {r["request_id"]: GenerationResult.model_validate(r) for r in doc["results"]}
    assert sorted(results) == sorted(ids)

    used: Counter[str] = Counter()  # donor id → results that reused it
    for family in FAMILIES:
        members = [results[rid] for rid in ids if rid.startswith(f"batch-{family}-")]
        assert all(r.status is ResultStatus.DONE for r in members), [r.error for r in members]
        # One member ran in full as the group leader; every other one reused a donor of its own family.
        leaders = [r for r in members if r.donor is None]
        assert len(leaders) == 1, [(r.request_id, r.donor) for r in members]
        assert leaders[0].steps_computed == leaders[0].steps_requested == STEPS
        for r in members:
            if r is leaders[0]:
                continue
            assert r.donor is not None and r.donor.request_id.startswith(f"batch-{family}-"), r.donor
            assert r.fallback is None, r.fallback
            assert r.steps_computed < r.steps_requested and r.tokens_computed_fraction < 1.0
            used[r.donor.request_id] += 1
        roles = Counter(
            e["role"]
            for e in events(stack.schedulers, "request dispatched")
            if e["request_id"].startswith(f"batch-{family}-")
        )
        assert roles[str(Role.LEADER)] == 1, roles

    for r in results.values():
        check_stored(stack, r)

    # Once the scheduler has read every result, the index holds every request as a ready donor, with its hits.
    stack.wait_idle(timeout_s=WAIT_S)
    with donor_index(stack) as index:
        for rid, r in results.items():
            entry = index.get(r.job_id)
            assert isinstance(entry, DonorEntry), rid
            assert (entry.status, entry.tenant, entry.trajectory_uri, entry.video_uri, entry.bytes) == (
                "ready",
                tenant,
                r.trajectory_uri,
                r.video_uri,
                r.trajectory_bytes,
            )
            assert entry.hits == used[rid], rid
    check_ran_once(stack, ids)


@pytest.mark.skipif(KCAT is None, reason="kcat is not installed (Debian: kcat; scripts/test.sh installs it)")
def test_a_request_published_by_kcat_completes_and_boto3_downloads_its_video(
    stack: EmbeddedStack, tmp_path: Path
) -> None:
    assert KCAT is not None
    settings = stack.producer_settings
    rid = "kcat-1"
    message = {
        "request_id": rid,
        "tenant": "kcat",
        "prompt": "a blue star spinning",
        "model": MODEL,
        "seed": 5,
    }
    with ResultWatcher(settings) as watcher:
        subprocess.run(
            [KCAT, "-b", stack.kafka_address, "-P", "-t", settings.kafka_requests_topic, "-K", "|"],
            input=f"{rid}|{json.dumps(message)}\n",
            text=True,
            timeout=60,
            check=True,
        )
        result = wait_results(watcher, [rid])[rid]
    assert result.status is ResultStatus.DONE, result.error
    check_stored(stack, result)

    # kcat reads the same result from the results topic, keyed by the request id.
    consume = ["-C", "-t", settings.kafka_results_topic, "-o", "beginning", "-e", "-q", "-f", "%k\t%s\n"]
    out = subprocess.run(
        [KCAT, "-b", stack.kafka_address, *consume],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    mine = [line.split("\t", 1)[1] for line in out.splitlines() if line.startswith(f"{rid}\t")]
    assert [GenerationResult.model_validate_json(v) for v in mine] == [result]

    # boto3, another S3 client, downloads the video by its URI; it decodes to the request's frames.
    assert result.video_uri is not None
    bucket, key = result.video_uri.removeprefix("s3://").split("/", 1)
    s3 = boto3.client(
        "s3",
        endpoint_url=f"http://{stack.s3_endpoint}",
        aws_access_key_id=stack.env["CHORUS_S3_ACCESS_KEY"],
        aws_secret_access_key=stack.env["CHORUS_S3_SECRET_KEY"],
        region_name="us-east-1",
    )
    obj = s3.get_object(Bucket=bucket, Key=key)
    assert obj["ContentType"] == "video/mp4"
    path = tmp_path / "kcat-1.mp4"
    path.write_bytes(obj["Body"].read())
    frames = imageio_ffmpeg.read_frames(str(path))
    meta = next(frames)
    spec = build_request(**{k: v for k, v in message.items() if k != "request_id"})
    assert tuple(meta["size"]) == (spec.width, spec.height)
    assert sum(1 for _ in frames) == spec.num_frames


def test_the_same_request_id_published_three_times_runs_once_and_each_sender_is_answered(
    stack: EmbeddedStack,
) -> None:
    copy = request("again-1", "a white moon rising over dark hills", "redelivery", seed=1)
    with ChorusClient(stack.producer_settings) as client, client.watch_results() as watcher:
        client.submit(copy)
        client.submit(copy)  # sent again at once: same partition, same or next poll
        result = wait_results(watcher, [copy.request_id])[copy.request_id]
    with ChorusClient(stack.producer_settings) as client, client.watch_results() as later:
        client.submit(copy)  # and again after it finished, by a sender that missed the first answer
        [replay] = later.wait([copy], timeout_s=WAIT_S)
    assert result.status is ResultStatus.DONE, result.error
    assert replay.answers_resend and replay.video_uri == result.video_uri and not result.answers_resend
    stack.wait_idle(timeout_s=WAIT_S)  # the scheduler has read all three copies
    answered = events(stack.schedulers, "request id sent again; answered with its earlier result")
    assert [e["request_id"] for e in answered] == [copy.request_id] * 2
    check_ran_once(stack, [copy.request_id])


def test_a_request_id_sent_again_for_another_request_is_rejected_and_each_waiter_gets_its_own_answer(
    stack: EmbeddedStack,
) -> None:
    mine = request("reused-1", "a red kite over a green field", "reuse-id", seed=1)
    theirs = request("reused-1", "a grey whale under a dark sea", "reuse-id", seed=1)
    with ChorusClient(stack.producer_settings) as client, client.watch_results() as watcher:
        client.submit(mine)
        client.submit(theirs)
        got = {r.request_key: r for r in watcher.wait([mine, theirs], timeout_s=WAIT_S)}
    assert got[mine.answer_key].status is ResultStatus.DONE, got[mine.answer_key].error
    rejected = got[theirs.answer_key]
    assert rejected.status is ResultStatus.REJECTED and rejected.error is not None
    assert rejected.error.code == "request_id_reused"
    stack.wait_idle(timeout_s=WAIT_S)
    dispatched = events(stack.schedulers, "request dispatched", request_id=mine.request_id)
    assert [e["tenant"] for e in dispatched] == [mine.tenant]  # the first ran once; the second not at all


def test_malformed_messages_are_dead_lettered_with_their_reason_and_later_requests_complete(
    stack: EmbeddedStack,
) -> None:
    settings = stack.producer_settings
    not_json = b"{not json"
    bad_shape = json.dumps(
        {"request_id": "dlq-bad", "tenant": "dlq", "prompt": "a grey cube", "model": MODEL, "num_frames": 99}
    ).encode()
    later = request("dlq-after", "a grey cube falling", "dlq", seed=1)
    with ChorusClient(settings) as client, client.watch_results() as watcher:
        bus.publish(client.producer, settings.kafka_requests_topic, "junk", not_json)
        bus.publish(client.producer, settings.kafka_requests_topic, "dlq-bad", bad_shape)
        client.submit(later)
        got = wait_results(watcher, ["dlq-bad", later.request_id])

    # The one that names its id is answered `rejected` with the field and the rule; the next request completes.
    rejected = got["dlq-bad"]
    assert rejected.status is ResultStatus.REJECTED and rejected.error is not None
    assert rejected.error.code == "invalid_request" and "num_frames" in rejected.error.message
    assert got[later.request_id].status is ResultStatus.DONE, got[later.request_id].error

    stack.wait_idle(timeout_s=WAIT_S)
    letters = [
        (key, DeadLetter.model_validate_json(value))
        for key, value in read_topic(stack, settings.kafka_dead_letter_topic)
    ]
    by_raw = {letter.raw(): (key, letter) for key, letter in letters}
    assert len(letters) == len(by_raw) == 2  # each once
    key, letter = by_raw[not_json]
    assert letter.error.code == "invalid_request" and "not JSON" in letter.error.message
    assert [(i.field, i.rule) for i in letter.issues] == [("<message>", "json")]
    assert letter.topic == settings.kafka_requests_topic
    key, letter = by_raw[bad_shape]
    assert key == "dlq-bad"
    assert [(i.field, i.rule) for i in letter.issues] == [("num_frames", "model_shape")]
    assert "must be between 1 and 33" in letter.error.message


def test_a_donor_deleted_between_planning_and_fetch_runs_in_full_and_says_why(stack: EmbeddedStack) -> None:
    tenant, prompt = "vanish", "a purple kite drifting over a green field"
    donor = request("vanish-donor", prompt, tenant, seed=1)
    first = submit_and_wait(stack, donor)[donor.request_id]
    assert first.status is ResultStatus.DONE and first.donor is None, first.error
    stack.wait_idle(timeout_s=WAIT_S)  # indexed as a ready donor
    stored_objects(
        stack.object_store(), trajectory_prefix(donor.job_id), first.trajectory_bytes
    )  # all uploaded
    with donor_index(stack) as index:
        entry = index.get(donor.job_id)
        assert entry is not None and entry.ready

    target = request("vanish-target", prompt.capitalize(), tenant, seed=2)  # the same words: a donor
    store = stack.object_store()
    (worker,) = stack.workers
    with ChorusClient(stack.producer_settings) as client, client.watch_results() as watcher:
        with paused(worker):
            client.submit(target)
            planned = wait_for(
                stack,
                "the scheduler dispatched the request with the donor",
                lambda: events(stack.schedulers, "request dispatched", request_id=target.request_id),
            )
            assert planned[0]["donor"] == donor.job_id and planned[0]["role"] == str(Role.SOLO)
            # The order is on the broker; before any worker can fetch the donor, its trajectory goes.
            assert store.delete_prefix(trajectory_prefix(donor.job_id)) == STEPS + 1
        result = wait_results(watcher, [target.request_id])[target.request_id]

    assert result.status is ResultStatus.DONE, result.error
    assert result.donor is not None and result.donor.request_id == donor.request_id
    assert (result.steps_computed, result.steps_requested, result.tokens_computed_fraction) == (
        STEPS,
        STEPS,
        1.0,
    )
    assert result.fallback is not None
    assert f"donor {donor.job_id} unusable" in result.fallback and "not in the store" in result.fallback
    check_stored(stack, result)


def test_a_follower_whose_leader_never_runs_completes_in_full_after_its_deadline(
    stack: EmbeddedStack,
) -> None:
    tenant, prompt = "orphan", "a silver train crossing a long bridge"
    leader = request("orphan-leader", prompt, tenant, seed=1)
    follower = request("orphan-follower", prompt.capitalize(), tenant, seed=2)  # the same words: a follower
    (worker,) = stack.workers
    queue_name = queue_for(MODEL)
    with ChorusClient(stack.producer_settings) as client, client.watch_results() as watcher:
        with paused(worker):
            client.submit(leader)
            dispatched = wait_for(
                stack,
                "the leader was dispatched",
                lambda: events(stack.schedulers, "request dispatched", request_id=leader.request_id),
            )
            assert dispatched[0]["role"] == str(Role.LEADER)
            # The leader's order never reaches a worker: the test takes it off the queue (its worker hung).
            app = app_for_broker("", state_dir=stack.state_dir)
            with app.connection_for_read() as conn:
                simple = conn.SimpleQueue(Queue(queue_name, EXCHANGE, routing_key=queue_name, durable=True))
                message = simple.get_nowait()
                order = WorkOrder.model_validate_json(message.payload[0][0])
                message.ack()
                simple.close()
            app.close()
            assert order.request.request_id == leader.request_id and order.role is Role.LEADER

            client.submit(follower)
            planned = wait_for(
                stack,
                "the follower was dispatched",
                lambda: events(stack.schedulers, "request dispatched", request_id=follower.request_id),
            )
            assert planned[0]["role"] == str(Role.FOLLOWER) and planned[0]["donor"] == leader.job_id
        result = wait_results(watcher, [follower.request_id])[follower.request_id]

    assert result.status is ResultStatus.DONE, result.error
    assert result.donor is not None and result.donor.request_id == leader.request_id
    assert (result.steps_computed, result.tokens_computed_fraction) == (STEPS, 1.0)
    assert result.fallback is not None and f"not uploaded within {FOLLOWER_WAIT_S} s" in result.fallback
    check_stored(stack, result)
    # The leader produced nothing: no object under its prefix but the marker the follower left when it gave up on
    # it (so its other followers do not wait too), no result, and its index entry never became ready.
    prefix = trajectory_prefix(leader.job_id)
    assert [o.key for o in stack.object_store().list(prefix)] == [abandoned_key(prefix)]
    assert all(r.request_id != leader.request_id for r in results_on_topic(stack))
    with donor_index(stack) as index:
        entry = index.get(leader.job_id)
        assert entry is not None and not entry.ready


def test_a_donor_found_missing_at_fetch_is_not_planned_again(stack: EmbeddedStack) -> None:
    tenant, prompt = "gone", "a brown horse running on a sandy beach"
    donor = request("gone-donor", prompt, tenant, seed=1)
    stored = submit_and_wait(stack, donor)[donor.request_id]
    assert stored.status is ResultStatus.DONE
    stack.wait_idle(timeout_s=WAIT_S)
    stored_objects(stack.object_store(), trajectory_prefix(donor.job_id), stored.trajectory_bytes)  # uploaded
    stack.object_store().delete_prefix(trajectory_prefix(donor.job_id))  # lost outside Chorus' control
    # A paraphrase is planned with the donor, finds it missing and runs in full; it becomes a donor itself.
    first = request("gone-first", prompt.replace(" on ", " across "), tenant, seed=2)
    missed = submit_and_wait(stack, first)[first.request_id]
    assert missed.donor is not None and missed.donor.request_id == donor.request_id
    assert missed.fallback is not None and "not in the store" in missed.fallback
    assert missed.donor_gone
    stack.wait_idle(timeout_s=WAIT_S)
    # The same prompt again: the planner should no longer offer the donor whose objects are known to be gone.
    again = request(
        "gone-again", prompt.capitalize(), tenant, seed=3
    )  # planned, not served the donor's video
    result = submit_and_wait(stack, again)[again.request_id]
    assert result.status is ResultStatus.DONE, result.error
    assert result.donor is not None and result.donor.request_id != donor.request_id, result.donor
    assert result.fallback is None, result.fallback
