"""``chorus produce`` and the SDK against the real Kafka-protocol broker, checked with ``kcat`` (librdkafka).

``kcat`` is an independent client: what it publishes the SDK must read and validate, and what ``chorus produce``
publishes it must read keyed by request id.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from producer import bus
from producer.contract import ErrorInfo, GenerationResult, ResultStatus, build_request
from producer.parsing import parse_request
from producer.sdk import read_requests
from producer.settings import KafkaSettings

pytestmark = pytest.mark.integration

CHORUS = str(Path(sys.executable).with_name("chorus"))
KCAT = shutil.which("kcat")
needs_kcat = pytest.mark.skipif(KCAT is None, reason="kcat is not installed (scripts/test.sh installs it)")


def env_for(settings: KafkaSettings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        CHORUS_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
        CHORUS_KAFKA_API_VERSION=settings.kafka_api_version,
        CHORUS_KAFKA_REQUESTS_TOPIC=settings.kafka_requests_topic,
        CHORUS_KAFKA_RESULTS_TOPIC=settings.kafka_results_topic,
    )
    return env


def produce(settings: KafkaSettings, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CHORUS, "produce", *args], env=env_for(settings), capture_output=True, text=True, timeout=timeout
    )


def kcat_consume(settings: KafkaSettings, topic: str, count: int) -> list[tuple[str, int, str]]:
    """(key, partition, value) of the first ``count`` messages of ``topic``, read by kcat."""
    assert KCAT is not None
    out = subprocess.run(
        [
            KCAT,
            "-b",
            settings.kafka_bootstrap,
            "-C",
            "-t",
            topic,
            "-o",
            "beginning",
            "-c",
            str(count),
            "-q",
            "-f",
            "%k\t%p\t%s\n",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows = []
    for line in out.stdout.splitlines():
        key, partition, value = line.split("\t", 2)
        rows.append((key, int(partition), value))
    return rows


@needs_kcat
def test_a_request_published_by_kcat_is_read_and_validated_by_the_sdk(kafka_settings: KafkaSettings) -> None:
    assert KCAT is not None
    valid = {"request_id": "kcat-1", "prompt": "a red circle moving left", "model": "toy", "seed": 7}
    lines = f"kcat-1|{json.dumps(valid)}\nbroken|{{not json\n"
    subprocess.run(
        [
            KCAT,
            "-b",
            kafka_settings.kafka_bootstrap,
            "-P",
            "-t",
            kafka_settings.kafka_requests_topic,
            "-K",
            "|",
        ],
        input=lines,
        text=True,
        timeout=60,
        check=True,
    )
    received = sorted(
        read_requests(kafka_settings, group_id="sdk-reader", timeout_s=60, limit=2),
        key=lambda r: r.key or b"",
    )
    assert [r.key for r in received] == [b"broken", b"kcat-1"]
    bad, good = received
    assert good.request is not None and good.error is None
    assert (good.request.request_id, good.request.prompt, good.request.seed) == ("kcat-1", valid["prompt"], 7)
    assert good.request.num_frames == 8  # the model's default filled in
    assert bad.request is None and bad.error is not None
    assert [(i.field, i.rule) for i in bad.error.issues] == [("<message>", "json")]


@needs_kcat
def test_produce_publishes_requests_keyed_by_id_that_kcat_reads(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text(
        "\n".join(json.dumps({"request_id": f"p-{i}", "prompt": f"shape {i}", "seed": i}) for i in range(3))
        + "\n"
    )
    sent = produce(
        kafka_settings, "--file", str(batch), "--model", "toy", "--tenant", "acme", "--keep-seed", "--json"
    )
    assert sent.returncode == 0, sent.stderr
    assert json.loads(sent.stdout)["sent"] == ["p-0", "p-1", "p-2"]
    # The same id published again (another invocation) lands in the same partition.
    again = produce(
        kafka_settings,
        "--prompt",
        "shape 1 again",
        "--request-id",
        "p-1",
        "--model",
        "toy",
        "--tenant",
        "acme",
    )
    assert again.returncode == 0, again.stderr
    assert "sent p-1" in again.stdout

    rows = kcat_consume(kafka_settings, kafka_settings.kafka_requests_topic, 4)
    assert sorted(key for key, _, _ in rows) == ["p-0", "p-1", "p-1", "p-2"]
    for key, _, value in rows:
        request = parse_request(value)
        assert request.request_id == key and request.tenant == "acme" and request.model == "toy"
    assert len({partition for key, partition, _ in rows if key == "p-1"}) == 1
    # --keep-seed filled every line of the file; the request sent on its own did not ask for it
    kept = sorted((key, parse_request(value).keep_seed) for key, _, value in rows)
    assert kept == [("p-0", True), ("p-1", False), ("p-1", True), ("p-2", True)]


def respond(settings: KafkaSettings, answers: dict[str, ResultStatus]) -> None:
    """Answer the given requests on the results topic (a stand-in for the scheduler and workers)."""
    producer = bus.make_producer(settings)
    try:
        for received in read_requests(settings, group_id="responder", timeout_s=120, limit=len(answers)):
            assert received.request is not None
            request_id, tenant = received.request.request_id, received.request.tenant
            status = answers.get(received.request.job_id) or answers[request_id]  # keyed by job id, or by id
            result = GenerationResult(
                request_id=request_id,
                tenant=tenant,
                status=status,
                video_uri=f"s3://b/videos/{request_id}.mp4" if status is ResultStatus.DONE else None,
                error=ErrorInfo(code="engine_error", message="boom")
                if status is ResultStatus.FAILED
                else None,
                steps_computed=4,
                steps_requested=4,
            )
            bus.publish(producer, settings.kafka_results_topic, request_id, result.to_bytes())
    finally:
        producer.close()


def test_produce_wait_prints_each_result_and_fails_on_a_failed_one(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    answers = {"w-done": ResultStatus.DONE, "w-failed": ResultStatus.FAILED}
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"request_id": rid, "prompt": "x"}) + "\n" for rid in answers))
    responder = threading.Thread(target=respond, args=(kafka_settings, answers), daemon=True)
    responder.start()
    done = produce(kafka_settings, "--file", str(batch), "--wait", "--timeout", "120", "--json")
    responder.join(timeout=60)
    assert done.returncode == 1, done.stderr  # one result failed
    doc = json.loads(done.stdout)
    assert doc["missing"] == []
    assert {r["request_id"]: r["status"] for r in doc["results"]} == {"w-done": "done", "w-failed": "failed"}
    assert next(r for r in doc["results"] if r["status"] == "failed")["error"]["code"] == "engine_error"


def test_produce_sends_one_id_for_two_tenants_and_shows_each_its_own_result(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    ours, theirs = (
        build_request(prompt="x", request_id="t-1"),
        build_request(prompt="x", request_id="t-1", tenant="acme"),
    )
    answers = {ours.job_id: ResultStatus.DONE, theirs.job_id: ResultStatus.FAILED}
    batch = tmp_path / "tenants.jsonl"
    lines = [{"request_id": "t-1", "prompt": "x"}, {"request_id": "t-1", "prompt": "x", "tenant": "acme"}]
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    responder = threading.Thread(target=respond, args=(kafka_settings, answers), daemon=True)
    responder.start()
    done = produce(kafka_settings, "--file", str(batch), "--wait", "--timeout", "120", "--json")
    responder.join(timeout=60)
    assert done.returncode == 1, done.stderr  # acme's failed
    doc = json.loads(done.stdout)
    assert doc["missing"] == [] and doc["sent"] == ["t-1", "t-1"]
    assert {(r["tenant"], r["status"]) for r in doc["results"]} == {("default", "done"), ("acme", "failed")}


def test_produce_wait_gives_up_after_its_timeout_and_names_what_is_missing(
    kafka_settings: KafkaSettings,
) -> None:
    waited = produce(
        kafka_settings, "--prompt", "nobody answers", "--request-id", "lonely-1", "--wait", "--timeout", "2"
    )
    assert waited.returncode == 1
    assert "sent lonely-1" in waited.stdout
    assert "no result" in waited.stdout  # the table row
    assert "no result within the timeout for 1 request(s)" in waited.stderr and "lonely-1" in waited.stderr


def test_the_watcher_never_hands_a_tenant_another_tenants_result_for_the_same_id(
    kafka_settings: KafkaSettings,
) -> None:
    from producer.contract import build_request
    from producer.sdk import ResultWatcher

    mine = build_request(prompt="a blue square", request_id="shared-id", tenant="tenant-b")
    producer = bus.make_producer(kafka_settings)
    with ResultWatcher(kafka_settings) as watcher:
        theirs = GenerationResult(
            request_id="shared-id", tenant="tenant-a", status=ResultStatus.DONE, video_uri="s3://x/a.mp4"
        )
        ours = GenerationResult(
            request_id="shared-id", tenant="tenant-b", status=ResultStatus.DONE, video_uri="s3://x/b.mp4"
        )
        for result in (theirs, ours):
            bus.publish(producer, kafka_settings.kafka_results_topic, result.request_id, result.to_bytes())
        got = list(watcher.wait([mine], timeout_s=60))
        assert [(r.tenant, r.video_uri) for r in got] == [("tenant-b", "s3://x/b.mp4")]
        # A bare id still matches (either tenant's, whichever arrived first).
        again = list(watcher.wait(["shared-id"], timeout_s=5))
        assert len(again) == 1 and again[0].request_id == "shared-id"
    producer.close(timeout=10)


def test_the_watcher_tells_apart_two_requests_sent_under_one_id_by_their_content(
    kafka_settings: KafkaSettings,
) -> None:
    from producer.contract import ErrorInfo, build_request
    from producer.sdk import ResultWatcher

    first = build_request(prompt="a blue square", request_id="one-id", tenant="t")
    second = build_request(prompt="a red circle", request_id="one-id", tenant="t")
    rejected = GenerationResult(
        request_id="one-id",
        tenant="t",
        status=ResultStatus.REJECTED,
        error=ErrorInfo(code="request_id_reused", message="send it with a new id"),
        request_key=second.answer_key,
    )
    video = GenerationResult(
        request_id="one-id",
        tenant="t",
        status=ResultStatus.DONE,
        video_uri="s3://x/first.mp4",
        request_key=first.answer_key,
    )
    producer = bus.make_producer(kafka_settings)
    with ResultWatcher(kafka_settings) as watcher:
        for result in (rejected, video, video.model_copy(update={"answers_resend": True})):
            bus.publish(producer, kafka_settings.kafka_results_topic, result.request_id, result.to_bytes())
        assert [r.video_uri for r in watcher.wait([first], timeout_s=60)] == ["s3://x/first.mp4"]
        # the other request's answer was seen meanwhile and is its own; the copy answering a resend is not kept twice
        [answer] = watcher.wait([second], timeout_s=5)
        assert answer.error is not None and answer.error.code == "request_id_reused"
        assert list(watcher.wait(["not-sent"], timeout_s=2)) == []  # reads the rest of the topic
        assert len(watcher.received["one-id"]) == 2
        # a bare id knows no request: it never takes the rejection of another request sent under it
        assert [r.video_uri for r in watcher.wait(["one-id"], timeout_s=5)] == ["s3://x/first.mp4"]
        # the same prompt asking for its own seed is another request: it is not answered with the first's video
        strict = build_request(prompt="a blue square", request_id="one-id", tenant="t", keep_seed=True)
        assert strict.fingerprint == first.fingerprint and strict.answer_key != first.answer_key
        assert list(watcher.wait([strict], timeout_s=2)) == []
    producer.close(timeout=10)


def test_a_watcher_told_to_forget_a_request_waits_for_its_retrys_answer(
    kafka_settings: KafkaSettings,
) -> None:
    from producer.contract import build_request
    from producer.sdk import ResultWatcher

    mine = build_request(prompt="a green kite", request_id="retried", tenant="t")
    failed = GenerationResult(
        request_id="retried", tenant="t", status=ResultStatus.FAILED, request_key=mine.answer_key
    )
    done = failed.model_copy(update={"status": ResultStatus.DONE, "video_uri": "s3://x/retried.mp4"})
    producer = bus.make_producer(kafka_settings)
    with ResultWatcher(kafka_settings) as watcher:
        bus.publish(producer, kafka_settings.kafka_results_topic, "retried", failed.to_bytes())
        assert [r.status for r in watcher.wait([mine], timeout_s=60)] == [ResultStatus.FAILED]
        watcher.forget([mine])  # the request is sent again: its earlier answer is not its answer any more
        bus.publish(producer, kafka_settings.kafka_results_topic, "retried", done.to_bytes())
        assert [r.video_uri for r in watcher.wait([mine], timeout_s=60)] == ["s3://x/retried.mp4"]
    producer.close(timeout=10)
