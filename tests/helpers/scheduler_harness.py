"""The scheduler on real services, as its integration tests drive it: the consume loop in a thread (``Harness``),
Celery queues drained with kombu, requests, results and dead letters read back from the topics."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery
from kafka import KafkaProducer
from kombu import Queue

from chorus_sched.dispatch import Dispatcher
from chorus_sched.embedding import HashingEmbedder
from chorus_sched.service import Scheduler, build_scheduler, run
from chorus_sched.settings import SchedulerSettings
from producer import bus
from producer.broker import EXCHANGE, app_for_broker
from producer.contract import (
    DeadLetter,
    DonorInfo,
    GenerationRequest,
    GenerationResult,
    ResultStatus,
    build_request,
)
from producer.orders import (
    GENERATE_TASK,
    EvictOrder,
    WorkOrder,
    queue_for,
)
from producer.settings import KafkaSettings

PROMPT = "a red circle moving left on a white background"
OTHER = "a green triangle moving up on a black background"
WAIT_S = 90.0


def celery_client(broker_url: str, state_dir: Path, key_prefix: str) -> Celery:
    app = app_for_broker(broker_url, state_dir=state_dir)
    if broker_url.startswith("redis://"):
        options = dict(app.conf.broker_transport_options or {})
        options["global_keyprefix"] = key_prefix
        app.conf.broker_transport_options = options
    return app


@dataclass
class Task:
    name: str
    args: list[Any]
    properties: dict[str, Any]
    headers: dict[str, Any] = field(default_factory=dict)

    @property
    def order(self) -> WorkOrder:
        return WorkOrder.model_validate_json(self.args[0])

    @property
    def evict_order(self) -> EvictOrder:
        return EvictOrder.model_validate_json(self.args[0])


def drain(app: Celery, queue: str) -> list[Task]:
    """Every message now on ``queue`` (a consumer of the queue, like a worker, that takes them all).

    Called once the scheduler has committed everything published, i.e. once every order it will send is on the
    broker, so "until empty" is all of them.
    """
    tasks = []
    with app.connection_for_read() as conn:
        simple = conn.SimpleQueue(Queue(queue, EXCHANGE, routing_key=queue, durable=True))
        while True:
            try:
                message = simple.get_nowait()
            except simple.Empty:
                break
            args, _kwargs, _embed = message.payload
            tasks.append(Task(message.headers["task"], args, dict(message.properties), dict(message.headers)))
            message.ack()
        simple.close()
    return tasks


class Harness:
    def __init__(self, settings: SchedulerSettings, app: Celery) -> None:
        self.settings = settings
        self.app = app
        self.scheduler: Scheduler
        self.scheduler, self._close = build_scheduler(
            settings, embedder=HashingEmbedder(), dispatcher=Dispatcher(app)
        )
        self.producer: KafkaProducer = bus.make_producer(settings)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=run, args=(settings, self.stop), kwargs={"scheduler": self.scheduler}, daemon=True
        )
        self.thread.start()

    def publish(self, *messages: GenerationRequest | bytes, key: str = "raw") -> None:
        for m in messages:
            if isinstance(m, bytes):
                bus.publish(self.producer, self.settings.kafka_requests_topic, key, m)
            else:
                bus.publish(self.producer, self.settings.kafka_requests_topic, m.request_id, m.to_bytes())

    def publish_result(self, result: GenerationResult) -> None:
        bus.publish(self.producer, self.settings.kafka_results_topic, result.request_id, result.to_bytes())

    def wait_handled(self) -> None:
        """Until both consumer groups have committed every message published so far."""
        for group, topic in (
            (self.settings.kafka_group_id, self.settings.kafka_requests_topic),
            (self.settings.kafka_results_group_id, self.settings.kafka_results_topic),
        ):
            deadline = time.monotonic() + WAIT_S
            while True:
                progress = bus.group_progress(self.settings, group, topic)
                if all(committed >= end for committed, end in progress.values()):
                    break
                assert self.thread.is_alive(), "the scheduler loop died"
                assert time.monotonic() < deadline, f"{group} did not handle {topic}: {progress}"
                time.sleep(0.2)

    def generate_tasks(self, model: str = "toy") -> dict[str, Task]:
        tasks = drain(self.app, queue_for(model))
        assert all(t.name == GENERATE_TASK for t in tasks)
        ids = [t.order.request.request_id for t in tasks]
        assert len(ids) == len(set(ids)), f"duplicate work orders: {ids}"
        return dict(zip(ids, tasks, strict=True))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()
        self.producer.close(timeout=10)


def request(prompt: str = PROMPT, **fields: Any) -> GenerationRequest:
    # The default tenant, whose job ids are its request ids (index and ledger keys); tenants have their own tests.
    return build_request(prompt=prompt, model="toy", tenant=fields.pop("tenant", "default"), **fields)


def done(
    rid: str, *, tenant: str = "default", nbytes: int = 1000, donor: str | None = None, **fields: Any
) -> GenerationResult:
    return GenerationResult(
        request_id=rid,
        tenant=tenant,
        status=ResultStatus.DONE,
        video_uri=f"s3://chorus/videos/{rid}.mp4",
        trajectory_uri=f"s3://chorus/trajectories/{rid}/",
        trajectory_bytes=nbytes,
        donor=DonorInfo(request_id=donor, similarity=1.0) if donor else None,
        steps_requested=4,
        steps_computed=fields.pop("steps_computed", 4),
        tokens_computed_fraction=fields.pop("tokens_computed_fraction", 1.0),  # in full unless said otherwise
        **fields,
    )


# A consumer subscribed before its topic exists sees it only at its next metadata refresh (kafka-python's default:
# 5 minutes, longer than any wait here). A CI run once read no result in 90 s although the scheduler had logged
# sending it; this is one way that happens (not reproduced here), so the helpers refresh every second.
METADATA_AGE_MS = 1000


def dead_letters(settings: KafkaSettings, n: int) -> list[DeadLetter]:
    consumer = bus.make_consumer(
        settings, [settings.kafka_dead_letter_topic], group_id=None, metadata_max_age_ms=METADATA_AGE_MS
    )
    letters = []
    for record in bus.poll_records(consumer, timeout_s=WAIT_S):
        letters.append(DeadLetter.model_validate_json(record.value))
        if len(letters) == n:
            break
    consumer.close()
    return letters


def results_of(settings: KafkaSettings, n: int) -> list[GenerationResult]:
    consumer = bus.make_consumer(
        settings, [settings.kafka_results_topic], group_id=None, metadata_max_age_ms=METADATA_AGE_MS
    )
    out = []
    for record in bus.poll_records(consumer, timeout_s=WAIT_S):
        out.append(GenerationResult.model_validate_json(record.value))
        if len(out) == n:
            break
    consumer.close()
    return out


@dataclass(frozen=True)
class Record:
    """A consumed message as the scheduler core sees it (what kafka-python's ConsumerRecord carries)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
