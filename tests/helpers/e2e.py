"""What the end-to-end modules (``tests/integration/test_e2e*.py``) share: an embedded stack's options with the
tiny model, the hashing embedder and a calibration of their own, requests, waiting for events and results, reading
topics and the donor index, pausing a worker, and checks of what a request left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from chorus_sched.index import DonorIndex
from chorus_sched.planner import parse_calibration
from chorus_sched.settings import SchedulerSettings
from producer.contract import GenerationRequest, GenerationResult, build_request
from producer.local.config import StackOptions
from producer.local.processes import ServiceProcess
from producer.local.stack import EmbeddedStack
from producer.orders import (
    header_key,
    step_key,
    trajectory_prefix,
    video_key,
)
from producer.sdk import ChorusClient, ResultWatcher
from tests.helpers import topics
from tests.helpers.stored import stored_objects
from workers.donors import S3DonorSource

MODEL = "tiny-random-wan"
STEPS = 4  # the model's default; the test calibration reuses 1 step (Stage 1) + 1 step (Stage 2) of 4
WAIT_S = 300.0
FOLLOWER_WAIT_S = 15  # how long a follower waits for a step its leader has not uploaded
CHORUS = str(Path(sys.executable).with_name("chorus"))
KCAT = shutil.which("kcat")

T = TypeVar("T")

# The calibration the stacks of these tests plan with. The shipped table is data that the quality benchmark
# rewrites (and made for MiniLM); the serving path is what is under test, so the tests bring a table of their own
# on the hashing embedder's scale: prompts with the same content words (function words may differ) reuse 1 step of
# 4 outright and recompute only divergent tokens for 1 more; any differing content word means a full run.
IGNORABLE = ["a", "an", "the", "on", "in", "over", "across", "with", "and", "of", "to", "at"]
SAME_WORDS = {
    "name": "same-content-words",
    "min_similarity": 0.6,
    "max_content_changes": 0,
    "k1": 0.25,
    "k2": 0.25,
    "alpha": 2.0,
}
CALIBRATION = {
    "format": "chorus-calibration/1",
    "provisional": True,
    "note": "tests/helpers/e2e.py: reuse between prompts with the same content words",
    "source": "hand-written for the end-to-end tests",
    "embedder": "hashing-384",
    "ignorable_words": IGNORABLE,
    "regimes": [
        {"name": "few-step", "max_steps": 8, "rows": [SAME_WORDS]},
        {"name": "many-step", "max_steps": 1000, "rows": [SAME_WORDS]},
    ],
}


def write_calibration(folder: Path) -> Path:
    path = folder / "calibration.json"
    path.write_text(json.dumps(CALIBRATION, indent=2))
    parse_calibration(path.read_text(), source=str(path))  # a table the scheduler accepts
    return path


def stack_options(state_dir: Path, **fields: Any) -> StackOptions:
    """Options of an end-to-end stack: the tiny model, the hashing embedder, the test calibration."""
    extra_env = {
        "CHORUS_CALIBRATION_PATH": str(write_calibration(state_dir.parent)),
        "CHORUS_FOLLOWER_WAIT_S": str(FOLLOWER_WAIT_S),
        "CHORUS_POLL_TIMEOUT_MS": "100",
        **fields.pop("extra_env", {}),
    }
    fields.setdefault("ready_timeout_s", WAIT_S)
    return StackOptions(
        state_dir=state_dir,
        models=[MODEL],
        embedder="hashing",
        persist_s3=False,
        extra_env=extra_env,
        **fields,
    )


def request(rid: str, prompt: str, tenant: str, seed: int = 0, **fields: Any) -> GenerationRequest:
    return build_request(request_id=rid, prompt=prompt, tenant=tenant, model=MODEL, seed=seed, **fields)


def wait_for(stack: EmbeddedStack, what: str, check: Callable[[], T | None], timeout_s: float = WAIT_S) -> T:
    """Poll ``check`` until it returns a truthy value; fails if a process of the stack exits meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        stack.check()
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


def events(processes: Sequence[ServiceProcess], name: str, **fields: Any) -> list[dict[str, Any]]:
    """Log events called ``name`` whose fields equal ``fields``, from all ``processes``."""
    return [
        e
        for p in processes
        for e in list(p.read_events())
        if e.get("event") == name and all(e.get(k) == v for k, v in fields.items())
    ]


def submit_and_wait(stack: EmbeddedStack, *requests: GenerationRequest) -> dict[str, GenerationResult]:
    with ChorusClient(stack.producer_settings) as client, client.watch_results() as watcher:
        for r in requests:
            client.submit(r)
        return wait_results(watcher, [r.request_id for r in requests])


def wait_results(watcher: ResultWatcher, ids: Sequence[str]) -> dict[str, GenerationResult]:
    got = {r.request_id: r for r in watcher.wait(ids, timeout_s=WAIT_S)}
    assert sorted(got) == sorted(ids), f"no result for {sorted(set(ids) - set(got))}"
    return got


def read_topic(stack: EmbeddedStack, topic: str) -> list[tuple[str | None, bytes]]:
    """(key, value) of every message on ``topic``, from the beginning (outside any consumer group)."""
    return topics.read_topic(stack.producer_settings, topic)


def results_on_topic(stack: EmbeddedStack) -> list[GenerationResult]:
    topic = stack.producer_settings.kafka_results_topic
    return [GenerationResult.model_validate_json(value) for _, value in read_topic(stack, topic)]


@contextmanager
def donor_index(stack: EmbeddedStack) -> Iterator[DonorIndex]:
    """The scheduler's donor index (Qdrant local mode, shared with the running scheduler under its file lock)."""
    settings: SchedulerSettings = stack.scheduler_settings
    index = DonorIndex.connect(
        path=settings.resolved_qdrant_path, collection=settings.qdrant_collection, dim=384
    )
    try:
        yield index
    finally:
        index.close()


def _group_states(pgid: int) -> list[str]:
    states = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                states.append(fields[0])
    return states


@contextmanager
def paused(process: ServiceProcess) -> Iterator[None]:
    """Stop a service and its pool processes (SIGSTOP to its process group) for the block, then continue them."""
    os.killpg(process.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while not all(s == "T" for s in _group_states(process.pid)):
            assert time.monotonic() < deadline, f"{process.name} did not stop"
            time.sleep(0.05)
        yield
    finally:
        os.killpg(process.pid, signal.SIGCONT)


def check_stored(stack: EmbeddedStack, result: GenerationResult) -> None:
    """The result's video and its whole trajectory are in S3 (packed in one object, or a group leader's header
    and one object per step), and it reads back whole."""
    store = stack.object_store()
    rid = result.job_id  # object keys are per tenant
    assert result.video_uri == store.uri(video_key(rid, "mp4"))
    assert store.exists(video_key(rid, "mp4"))
    prefix = trajectory_prefix(rid)
    assert result.trajectory_uri == store.uri(prefix)
    sizes = stored_objects(store, prefix, result.trajectory_bytes)
    streamed = {header_key(prefix)} | {step_key(prefix, i) for i in range(result.steps_requested)}
    assert set(sizes) in ({header_key(prefix)}, streamed)
    assert result.trajectory_bytes == sum(sizes.values())
    S3DonorSource(store, prefix).prefetch(range(result.steps_requested))


def check_ran_once(stack: EmbeddedStack, ids: Sequence[str]) -> None:
    """Each id was dispatched once by the schedulers, started once by the workers and has one result (besides
    the answers to messages that sent the id again: ``answers_resend``)."""
    dispatched = Counter(e["request_id"] for e in events(stack.schedulers, "request dispatched"))
    started = Counter(e["request_id"] for e in events(stack.workers, "order started"))
    published = Counter(r.request_id for r in results_on_topic(stack) if not r.answers_resend)
    for rid in ids:
        assert (dispatched[rid], started[rid], published[rid]) == (1, 1, 1), rid


# --- the module's stack ----------------------------------------------------------------------------------------
