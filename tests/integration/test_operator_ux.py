"""What an operator meets first (issue 19), against real services: ``chorus produce`` with the stack's env file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from producer.local.standins import EmbeddedService
from producer.settings import KafkaSettings

pytestmark = pytest.mark.integration

CHORUS = str(Path(sys.executable).with_name("chorus"))


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CHORUS_")}


def test_produce_reads_an_env_file_and_logs_no_api_version_warning(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    # The fixture's version is spelled 2.1.0, as stack.env used to: kafka-python warned about it on every client.
    assert kafka_settings.kafka_api_version == "2.1.0"
    env_file = tmp_path / "stack.env"
    env_file.write_text(
        f"CHORUS_KAFKA_BOOTSTRAP={json.dumps(kafka_settings.kafka_bootstrap)}\n"
        f"CHORUS_KAFKA_API_VERSION={json.dumps(kafka_settings.kafka_api_version)}\n"
        f"CHORUS_KAFKA_REQUESTS_TOPIC={json.dumps(kafka_settings.kafka_requests_topic)}\n"
    )
    sent = subprocess.run(
        [CHORUS, "produce", "--env-file", str(env_file), "--prompt", "a red circle", "--request-id", "env-1"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sent.returncode == 0, sent.stderr
    assert "sent env-1" in sent.stdout
    assert "not supported" not in sent.stderr and "ambiguous" not in sent.stderr, sent.stderr


def test_a_url_s3_endpoint_serves_the_store_and_boto3_alike(s3_server: EmbeddedService) -> None:
    import boto3

    from workers.settings import WorkerSettings
    from workers.store import ObjectStore

    settings = WorkerSettings(
        s3_endpoint=f"http://{s3_server.address}",
        s3_bucket="url-endpoint",
        s3_access_key="t",
        s3_secret_key="t",
    )
    store = ObjectStore.from_settings(settings)
    store.ensure_bucket()
    store.put("greeting", b"hello", content_type="text/plain")
    s3 = boto3.client(
        "s3",
        endpoint_url=settings.s3_url,  # as written in stack.env: no URL to build
        aws_access_key_id="t",
        aws_secret_access_key="t",
        region_name="us-east-1",
    )
    assert s3.get_object(Bucket="url-endpoint", Key="greeting")["Body"].read() == b"hello"


def _histogram(url: str, name: str, status: str) -> tuple[float, float]:
    """(sum, count) of one status' series of a histogram on a /metrics page."""
    import urllib.request

    values: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            for part in ("sum", "count"):
                prefix = f'{name}_{part}{{status="{status}"}} '
                if line.startswith(prefix):
                    values[part] = float(line[len(prefix) :])
    return values["sum"], values["count"]


@pytest.mark.slow
def test_latency_counts_from_publication_as_the_client_sees_it_and_long_prompts_say_so(
    tmp_path: Path,
) -> None:
    import time

    from producer.contract import ResultStatus, build_request
    from producer.local.config import StackOptions
    from producer.local.stack import EmbeddedStack
    from producer.sdk import ChorusClient

    # Built before the stack starts, as the demo builds its stream: the ~20 s start must not count as latency.
    long_prompt = " ".join(f"word{i}" for i in range(40))  # tiny-random-wan reads 16 tokens
    request = build_request(request_id="latency-1", prompt=long_prompt, model="tiny-random-wan", num_steps=4)
    options = StackOptions(state_dir=tmp_path / "state", models=["tiny-random-wan"], embedder="hashing")
    with EmbeddedStack(options) as stack:
        assert stack.env["CHORUS_S3_ENDPOINT"].startswith("http://")
        assert stack.env["CHORUS_METRICS_BIND_ADDRESS"] == "127.0.0.1"
        with ChorusClient(stack.producer_settings) as client, client.watch_results() as watcher:
            published = time.monotonic()
            client.submit(request)
            [result] = list(watcher.wait([request], timeout_s=180))
            seen_s = time.monotonic() - published
        assert result.status is ResultStatus.DONE, result.error
        assert result.prompt_truncated and result.prompt_tokens_used == 16
        total, count = _histogram(stack.metrics_urls["worker-0"], "chorus_request_duration_seconds", "done")
        assert count == 1
        # The worker's end-to-end time is the client's, less the result's trip back (well under a second here).
        assert total <= seen_s + 0.5 and seen_s - total < 3.0, (total, seen_s)
