"""In-memory fakes of every port the scheduler takes (ledger, index, embedder, dispatcher, publisher), and the
requests and results the scheduler's unit tests build."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

from chorus_sched.dispatch import Dispatcher
from chorus_sched.index import DonorEntry, DonorHit, DonorIndex
from chorus_sched.ledger import RETRYABLE_STATES, Claim, Ledger, RequestRecord, RequestState
from chorus_sched.planner import Planner, load_calibration
from chorus_sched.service import Scheduler
from chorus_sched.settings import SchedulerSettings
from producer.contract import (
    GenerationRequest,
    GenerationResult,
    ResultStatus,
    build_request,
)
from producer.orders import EvictOrder, WorkOrder

PROMPT = "a red circle moving left on a white background"
REQUESTS = "chorus.requests"


# --- fakes of the ports ------------------------------------------------------------------------------------


class FakeLedger:
    """Claims, states, records, marks and hit counters in dicts; a mutex that is always free. Claims follow
    ``Ledger.begin``: new, retry (a request that ended failed from another message), resumed, busy, duplicate."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}
        self.owners: dict[str, str] = {}
        self.origins: dict[str, str] = {}
        self.records: dict[str, RequestRecord] = {}
        self.marks: set[str] = set()
        self.hits: dict[str, tuple[int, float]] = {}
        self.pending: dict[str, str] = {}
        self.values: dict[str, str] = {}
        self.waiters: dict[str, list[str]] = {}

    def put_value(self, key: str, value: str, *, ttl_s: float | None = None) -> None:
        self.values[key] = value

    def get_value(self, key: str) -> str | None:
        return self.values.get(key)

    def delete_value(self, key: str) -> None:
        self.values.pop(key, None)

    def add_waiter(self, key: str, value: str) -> None:
        self.waiters.setdefault(key, []).append(value)

    def take_waiters(self, key: str) -> list[str]:
        return self.waiters.pop(key, [])

    def begin(
        self,
        request_id: str,
        *,
        owner: str,
        lease_s: float,
        state: RequestState = RequestState.ACCEPTED,
        origin: str = "",
    ) -> Claim:
        current = self.states.get(request_id)
        if current is None or (
            current in RETRYABLE_STATES and origin and origin != self.origins.get(request_id, "")
        ):
            self.states[request_id], self.owners[request_id] = state, owner
            self.origins[request_id] = origin
            return Claim("new", state, owner) if current is None else Claim("retry", current, owner)
        holder = self.owners.get(request_id)
        if current == RequestState.ACCEPTED:
            return Claim("resumed" if holder == owner else "busy", current, holder)
        return Claim("duplicate", current, holder, self.origins.get(request_id, ""))

    def state(self, request_id: str) -> RequestState | None:
        return self.states.get(request_id)

    def set_state(self, request_id: str, state: RequestState, *, origin: str | None = None) -> None:
        self.states[request_id] = state
        if origin is not None:
            self.origins[request_id] = origin

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def record_dispatch(self, record: RequestRecord) -> None:
        self.states[record.request_id] = RequestState.DISPATCHED
        self.records[record.request_id] = record

    def record(self, request_id: str) -> RequestRecord | None:
        return self.records.get(request_id)

    def dispatched_records(self, limit: int = 1000) -> list[RequestRecord]:
        return [r for rid, r in self.records.items() if self.states.get(rid) == RequestState.DISPATCHED][
            :limit
        ]

    def mark_once(self, key: str) -> bool:
        fresh = key not in self.marks
        self.marks.add(key)
        return fresh

    def is_marked(self, key: str) -> bool:
        return key in self.marks

    def add_hit(self, donor_id: str, steps_saved: float) -> tuple[int, float]:
        hits, total = self.hits.get(donor_id, (0, 0.0))
        self.hits[donor_id] = (hits + 1, total + steps_saved)
        return self.hits[donor_id]

    def add_pending_evictions(self, request_ids: Sequence[str], reason: str) -> None:
        self.pending.update(dict.fromkeys(request_ids, reason))

    def pending_evictions(self) -> dict[str, str]:
        return dict(self.pending)

    def remove_pending_evictions(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.pending.pop(rid, None)

    @contextmanager
    def mutex(self, name: str, **_: Any) -> Iterator[None]:
        yield

    def purge_expired(self) -> int:
        return 0


class FakeIndex:
    """Donor entries and their vectors in a dict; search is exact cosine similarity over the matching entries."""

    def __init__(self) -> None:
        self.points: dict[str, tuple[DonorEntry, list[float]]] = {}

    @contextmanager
    def hold(self) -> Iterator[None]:
        yield

    def upsert(self, entry: DonorEntry, vector: Sequence[float]) -> None:
        self.points[entry.request_id] = (entry, list(vector))

    def search(
        self,
        vector: Sequence[float],
        *,
        compat_key: str,
        tenant: str | None,
        limit: int = 5,
        status: str | None = None,
    ) -> list[DonorHit]:
        hits = [
            DonorHit(entry=entry, similarity=cosine(vector, v))
            for entry, v in self.points.values()
            if entry.compat_key == compat_key
            and (tenant is None or entry.tenant == tenant)
            and (status is None or entry.status == status)
        ]
        return sorted(hits, key=lambda h: -h.similarity)[:limit]

    def get(self, request_id: str) -> DonorEntry | None:
        point = self.points.get(request_id)
        return None if point is None else point[0]

    def set_fields(self, request_id: str, fields: Mapping[str, Any]) -> DonorEntry | None:
        point = self.points.get(request_id)
        if point is None:
            return None
        updated = DonorEntry.model_validate({**point[0].model_dump(), **fields})
        self.points[request_id] = (updated, point[1])
        return updated

    def delete(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.points.pop(rid, None)

    def entries(self) -> list[DonorEntry]:
        return [entry for entry, _ in self.points.values()]


class FakeEmbedder:
    """Bag-of-words vectors over a growing vocabulary: the same prompt, the same vector."""

    name = "fake"
    dim = 64
    similarity_tolerance = 0.0

    def __init__(self) -> None:
        self.vocabulary: dict[str, int] = {}
        self.calls: list[list[str]] = []

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        out = []
        for text in texts:
            vector = [0.0] * self.dim
            for word in text.lower().split():
                vector[self.vocabulary.setdefault(word, len(self.vocabulary) % self.dim)] += 1.0
            out.append(vector)
        return out


class FakeDispatcher:
    def __init__(self) -> None:
        self.orders: list[WorkOrder] = []
        self.evictions: list[EvictOrder] = []
        self.forgotten: list[str] = []

    def generate(self, order: WorkOrder) -> None:
        self.orders.append(order)

    def forget(self, task_id: str) -> None:
        self.forgotten.append(task_id)

    def evict(self, order: EvictOrder) -> None:
        self.evictions.append(order)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0


@dataclass
class Msg:
    """A record as the scheduler reads it from the requests (or results) topic."""

    value: bytes
    offset: int
    key: bytes | None = None
    topic: str = REQUESTS
    partition: int = 0


@dataclass
class Ports:
    scheduler: Scheduler
    ledger: FakeLedger
    index: FakeIndex
    embedder: FakeEmbedder
    dispatcher: FakeDispatcher
    published: list[tuple[str, str, bytes]]

    def on(self, topic: str) -> list[bytes]:
        return [value for t, _, value in self.published if t == topic]

    def results(self) -> list[GenerationResult]:
        """The results the scheduler published itself (exact hits, rejections, answers to resent ids)."""
        return [
            GenerationResult.model_validate_json(v)
            for v in self.on(self.scheduler.settings.kafka_results_topic)
        ]


def make_ports(tmp_path: Any, planner: Planner | None = None, embedder: FakeEmbedder | None = None) -> Ports:
    """A Scheduler wired to fresh fakes (and the packaged calibration unless ``planner``), and the fakes."""
    settings = SchedulerSettings(state_dir=tmp_path, instance_id="unit", kafka_requests_topic=REQUESTS)
    ledger, index, dispatcher = FakeLedger(), FakeIndex(), FakeDispatcher()
    embedder = embedder or FakeEmbedder()
    published: list[tuple[str, str, bytes]] = []
    scheduler = Scheduler(
        settings,
        embedder=embedder,
        index=cast(DonorIndex, index),
        ledger=cast(Ledger, ledger),
        dispatcher=cast(Dispatcher, dispatcher),
        publish=lambda topic, key, value: published.append((topic, key, value)),
        planner=planner or Planner(load_calibration()),
        clock=lambda: 1000.0,
    )
    return Ports(scheduler, ledger, index, embedder, dispatcher, published)


def recased(prompt: str, variant: int = 1) -> str:
    """``prompt`` with the words that ``variant``'s bits pick upper-cased (0: unchanged; each variant another
    text): the same words to the embedders and the word diff. A request of the very same text with another seed
    is served its twin's video (``chorus_sched.exact``); a recased one is planned like it, with a donor, which is
    what tests of donor reuse want."""
    words = prompt.split(" ")
    return " ".join(w.upper() if variant >> j & 1 else w for j, w in enumerate(words))


def request(prompt: str = PROMPT, **fields: Any) -> GenerationRequest:
    # The default tenant, whose job ids are its request ids; tenancy has its own tests below.
    return build_request(prompt=prompt, model="toy", tenant=fields.pop("tenant", "default"), **fields)


def done(rid: str, *, nbytes: int = 1000, **fields: Any) -> GenerationResult:
    return GenerationResult(
        request_id=rid,
        tenant=fields.pop("tenant", "default"),
        status=ResultStatus.DONE,
        video_uri=f"s3://chorus/videos/{rid}.mp4",
        trajectory_uri=f"s3://chorus/trajectories/{rid}/",
        trajectory_bytes=nbytes,
        steps_requested=4,
        steps_computed=fields.pop("steps_computed", 4),
        tokens_computed_fraction=fields.pop("tokens_computed_fraction", 1.0),  # in full unless said otherwise
        **fields,
    )
