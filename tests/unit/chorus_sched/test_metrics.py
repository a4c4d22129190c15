"""Scheduler metrics: definitions, and what the real scheduling core counts on embedded stores.

The scheduler here is ``build_scheduler`` on the embedded stores (SQLite ledger, Qdrant local mode, filesystem
Celery broker), fed messages directly instead of through Kafka; what it publishes is kept in a list.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from kafka.structs import TopicPartition
from prometheus_client import REGISTRY, CollectorRegistry

from chorus_sched import metrics as sm
from chorus_sched.embedding import HashingEmbedder
from chorus_sched.service import Scheduler, build_scheduler
from chorus_sched.settings import SchedulerSettings
from producer.broker import app_for_broker
from producer.contract import (
    DonorInfo,
    ErrorInfo,
    GenerationRequest,
    GenerationResult,
    ResultStatus,
    ReusePlan,
    build_request,
)
from producer.orders import MAINTENANCE_QUEUE, queue_for
from tests.helpers.scheduler_fakes import recased

PROMPT = "a red circle moving left on a white background"
OTHER = "a green triangle moving up on a black background"


def test_names_follow_prometheus_conventions_and_every_label_is_bounded() -> None:
    registry = CollectorRegistry()
    sm.SchedulerMetrics(registry)
    for family in registry.collect():
        assert family.name.startswith("chorus_"), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds") or family.name == "chorus_donor_similarity"
        if family.type == "gauge":
            assert family.name.endswith(("_bytes", "_messages", "_entries", "_length")), family.name
        for s in family.samples:
            assert not {"request_id", "prompt", "tenant", "donor"} & set(s.labels), s
    assert registry.get_sample_value("chorus_donor_lookups_total", {"outcome": "cross_tenant_blocked"}) == 0
    assert registry.get_sample_value("chorus_cache_evictions_total", {"reason": "budget"}) == 0


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("stale-leader", "stale_leader"),
        ("ttl", "ttl"),
        ("budget", "budget"),
        ("leader failed", "leader_failed"),
        ("leader rejected", "leader_failed"),
        ("leader finished without a stored trajectory", "leader_no_trajectory"),
        ("donor-gone", "donor_gone"),
        ("something else", "other"),
    ],
)
def test_eviction_reasons_map_to_a_fixed_set(reason: str, label: str) -> None:
    assert sm.eviction_reason(reason) == label


class FakeConsumer:
    def __init__(self) -> None:
        self.ends = {TopicPartition("r", 0): 10, TopicPartition("r", 1): 7}
        self.positions = {TopicPartition("r", 0): 4, TopicPartition("r", 1): 7}
        self.fail = False
        self.calls = 0

    def assignment(self) -> set[TopicPartition]:
        return set(self.ends)

    def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        self.calls += 1
        if self.fail:
            raise RuntimeError("broker gone")
        return {tp: self.ends[tp] for tp in tps}

    def position(self, tp: TopicPartition) -> int:
        return self.positions[tp]


def test_lag_probe_sums_partitions_throttles_and_keeps_the_last_value_on_failure() -> None:
    registry = CollectorRegistry()
    m = sm.SchedulerMetrics(registry)
    probe = m.lag_probe("requests", interval_s=3600)
    consumer: Any = FakeConsumer()
    probe(consumer)
    assert registry.get_sample_value("chorus_consumer_lag_messages", {"consumer": "requests"}) == 6
    probe(consumer)  # within the interval: not measured again
    assert consumer.calls == 1
    probe.interval_s, probe._next = 0.0, 0.0
    consumer.fail = True
    probe(consumer)
    assert registry.get_sample_value("chorus_consumer_lag_messages", {"consumer": "requests"}) == 6


# --- the scheduling core ----------------------------------------------------------------------------------


@dataclass
class Msg:
    value: bytes
    offset: int
    key: bytes | None = None
    topic: str = "requests"
    partition: int = 0


class Counts:
    """Deltas of the process-wide scheduler metrics since construction."""

    def __init__(self) -> None:
        self.before: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.before = self._all()

    @staticmethod
    def _all() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in REGISTRY.collect()
            if family.name.startswith("chorus_")
            for s in family.samples
        }

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return self._all().get(key, 0.0) - self.before.get(key, 0.0)


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[tuple[Scheduler, list[tuple[str, str, bytes]]]]:
    settings = SchedulerSettings(
        state_dir=tmp_path,
        broker_url="",
        redis_url="",
        embedder="hashing",
        instance_id="metrics-test",
        qdrant_collection="metrics_test",
    )
    published: list[tuple[str, str, bytes]] = []
    sched, close = build_scheduler(
        settings, embedder=HashingEmbedder(), publish=lambda t, k, v: published.append((t, k, v))
    )
    yield sched, published
    close()


def req(prompt: str = PROMPT, **fields: Any) -> GenerationRequest:
    return build_request(prompt=prompt, model="toy", tenant=fields.pop("tenant", "acme"), **fields)


def test_the_scheduler_counts_requests_lookups_results_hits_and_cache(
    scheduler: tuple[Scheduler, list[tuple[str, str, bytes]]], tmp_path: Path
) -> None:
    sched, _published = scheduler
    c = Counts()
    lead = req(request_id="lead", seed=1)
    sched.handle_requests(
        [
            Msg(lead.to_bytes(), 0),
            Msg(b'{"request_id": "bad1", "prompt": ""}', 1),
            Msg(lead.to_bytes(), 2),  # a second copy in the same poll
        ]
    )
    assert c("chorus_requests_received_total") == 3
    assert c("chorus_requests_accepted_total", role="leader") == 1
    assert c("chorus_donor_lookups_total", outcome="miss") == 1
    assert c("chorus_requests_dead_lettered_total", reason="invalid_request") == 1
    assert c("chorus_requests_rejected_total", reason="invalid_request") == 1
    # the copy is a new message with a taken id: not a skipped duplicate, counted once answered
    assert c("chorus_requests_duplicate_total") == 0
    assert c("chorus_requests_resent_total", outcome="replayed") == 0
    assert c("chorus_scheduler_phase_duration_seconds_count", phase="embed") == 1
    assert c("chorus_scheduler_phase_duration_seconds_count", phase="search") == 1
    assert c("chorus_scheduler_phase_duration_seconds_count", phase="dispatch") == 1

    follow = req(recased(PROMPT), request_id="follow", seed=2)  # the same words: a follower, no exact hit
    other = req(OTHER, request_id="other")
    stranger = req(request_id="stranger", tenant="zeta")
    sched.handle_requests([Msg(r.to_bytes(), 3 + i) for i, r in enumerate((follow, other, stranger))])
    assert c("chorus_donor_lookups_total", outcome="hit") == 1
    assert c("chorus_donor_lookups_total", outcome="incompatible") == 1
    assert c("chorus_donor_lookups_total", outcome="cross_tenant_blocked") == 1
    assert c("chorus_requests_accepted_total", role="follower") == 1
    assert c("chorus_requests_accepted_total", role="leader") == 3
    assert c("chorus_donor_similarity_count", role="follower") == 1
    assert c("chorus_donor_similarity_sum", role="follower") == pytest.approx(1.0)

    plan = ReusePlan(stage1_steps=1, stage2_steps=2, stage3_steps=1)
    results = [
        GenerationResult(
            request_id="lead",
            tenant="acme",
            status=ResultStatus.DONE,
            video_uri="s3://chorus/videos/lead.mp4",
            trajectory_uri="s3://chorus/trajectories/lead/",
            trajectory_bytes=1000,
            steps_requested=4,
            steps_computed=4,
            tokens_computed_fraction=1.0,
        ),
        GenerationResult(
            request_id="follow",
            tenant="acme",
            status=ResultStatus.DONE,
            video_uri="s3://chorus/videos/follow.mp4",
            donor=DonorInfo(request_id="lead", similarity=1.0),
            plan=plan,
            steps_requested=4,
            steps_computed=3,
            tokens_computed_fraction=0.25,
        ),
        GenerationResult(
            request_id="other",
            tenant="acme",
            status=ResultStatus.FAILED,
            error=ErrorInfo(code="engine_error", message="boom"),
        ),
    ]
    sched.handle_results([Msg(r.to_bytes(), i, topic="results") for i, r in enumerate(results)])
    assert c("chorus_scheduler_results_total", status="done") == 2
    assert c("chorus_scheduler_results_total", status="failed") == 1
    assert c("chorus_requests_resent_total", outcome="replayed") == 1  # the copy of "lead", now answered
    assert c("chorus_donors_indexed_total") == 1
    assert c("chorus_donor_hits_total") == 1
    assert c("chorus_donor_steps_saved_total") == pytest.approx(4 * (1 - 0.25))
    assert c("chorus_cache_evictions_total", reason="leader_failed") == 1
    assert c("chorus_cache_evict_orders_total") == 1

    sched.maintain()
    assert REGISTRY.get_sample_value("chorus_cache_entries", {"status": "ready"}) == 1
    assert REGISTRY.get_sample_value("chorus_cache_entries", {"status": "running"}) == 1  # "stranger"
    assert REGISTRY.get_sample_value("chorus_cache_size_bytes") == 1000

    app = app_for_broker("", state_dir=tmp_path)
    lengths = sm.queue_lengths(app, [queue_for("toy"), queue_for("tiny-random-wan"), MAINTENANCE_QUEUE])
    assert lengths == {queue_for("toy"): 4, queue_for("tiny-random-wan"): 0, MAINTENANCE_QUEUE: 1}
    sampler = sm.QueueSampler(lambda: lengths)
    sampler.sample_once()
    assert REGISTRY.get_sample_value("chorus_celery_queue_length", {"queue": queue_for("toy")}) == 4


def test_a_poll_is_scheduled_in_submission_order_not_partition_order(
    scheduler: tuple[Scheduler, list[tuple[str, str, bytes]]],
) -> None:
    sched, _published = scheduler
    first = req(request_id="first", seed=1)
    later = req(
        recased(PROMPT), request_id="later", seed=2, submitted_at=first.submitted_at + timedelta(seconds=1)
    )
    # the later request's partition is read first
    sched.handle_requests([Msg(later.to_bytes(), 0), Msg(first.to_bytes(), 1)])
    leader = sched.index.get(first.job_id)
    assert leader is not None and leader.status == "running"
    assert sched.index.get(later.job_id) is None  # a follower of "first", not a leader
