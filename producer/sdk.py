"""The producer SDK: validate requests, publish them, follow their results.

    from producer.sdk import ChorusClient, parse_jsonl
    from producer.contract import build_request

    with ChorusClient() as client:                       # ProducerSettings from CHORUS_* environment
        watcher = client.watch_results()                 # listen first, so no result can be missed
        request = build_request(prompt="a red circle moving left", model="toy")
        client.submit(request)
        for result in watcher.wait([request], timeout_s=120):
            print(result.status, result.video_uri)

Requests are keyed by ``request_id`` (so a request and its result land in the same partition of their topics).
A request's ``submitted_at`` is stamped when it is sent (unless its builder set one), so the end-to-end latency
the workers measure starts at publication, not at whenever the request object was built.
Everything is validated against the contract before it is sent; ``parse_jsonl`` reports every bad line with its
number, the field and the rule, and ``ChorusClient.submit_many`` sends a batch only once it has no bad line.
All Kafka access goes through ``producer.bus``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import KafkaError
from pydantic import ValidationError

from producer import bus
from producer.contract import (
    REQUEST_ID_REUSED,
    ContractError,
    FieldIssue,
    GenerationRequest,
    GenerationResult,
    build_request,
)
from producer.parsing import parse_request
from producer.settings import KafkaSettings, ProducerSettings

log = logging.getLogger(__name__)

# Poll the results topic for partitions created after we started listening this often.
_PARTITION_REFRESH_S = 2.0


class PublishError(RuntimeError):
    """The broker did not take a request."""


# --- validation ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LineError:
    """A line of a JSONL batch that is not a valid request."""

    line: int
    issues: list[FieldIssue]

    def __str__(self) -> str:
        return f"line {self.line}: " + "; ".join(str(i) for i in self.issues)


@dataclass
class Batch:
    """A parsed JSONL batch: the valid requests (with their line numbers) and the bad lines."""

    requests: list[tuple[int, GenerationRequest]] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


class BatchInvalid(ValueError):
    """A batch has bad lines; nothing of it was sent."""

    def __init__(self, errors: list[LineError]) -> None:
        self.errors = errors
        shown = "\n".join(str(e) for e in errors[:20])
        more = f"\n… and {len(errors) - 20} more" if len(errors) > 20 else ""
        super().__init__(f"{len(errors)} invalid line(s); nothing was sent:\n{shown}{more}")


def parse_jsonl(lines: Iterable[str | bytes], *, defaults: dict[str, Any] | None = None) -> Batch:
    """Validate each non-blank line as a request; never raises for bad input.

    Lines may be bytes (a file read as it is): one that is not UTF-8 is an error of its own line, not the file's.

    ``defaults`` fill fields a line does not set (a line's own values win). A ``request_id`` repeated within
    the batch for one tenant is an error on the later line (rule ``duplicate``): one id must name one request
    (ids are per tenant: two tenants may each use it).
    """
    batch = Batch()
    seen: dict[str, int] = {}  # job id (tenant and request id) -> line
    for number, line in enumerate(lines, start=1):
        text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
        if not text.strip():  # Unicode whitespace too, as for a text line
            continue
        try:
            request = _parse_line(line, defaults)
        except ContractError as exc:
            batch.errors.append(LineError(number, exc.issues))
            continue
        first = seen.get(request.job_id)
        if first is not None:
            tenant = "" if request.tenant == "default" else f" for tenant {request.tenant!r}"
            issue = FieldIssue(
                field="request_id",
                rule="duplicate",
                message=f"request_id {request.request_id!r} already used{tenant} on line {first}",
            )
            batch.errors.append(LineError(number, [issue]))
            continue
        seen[request.job_id] = number
        batch.requests.append((number, request))
    return batch


def _parse_line(line: str | bytes, defaults: dict[str, Any] | None) -> GenerationRequest:
    if not defaults:
        return parse_request(line)
    try:  # decoded here, not by json.loads, which would also take UTF-16 and UTF-32 bytes
        data = json.loads(line.decode("utf-8") if isinstance(line, bytes) else line)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return parse_request(line)  # raises ContractError naming the UTF-8 or JSON error
    if not isinstance(data, dict):
        return parse_request(line)  # raises ContractError: not an object
    return parse_request(json.dumps({**defaults, **data}))


def stamped(request: GenerationRequest) -> GenerationRequest:
    """``request`` with ``submitted_at`` now, unless whoever built it set one (a replay keeps its time)."""
    if "submitted_at" in request.model_fields_set:
        return request
    return request.model_copy(update={"submitted_at": datetime.now(UTC)})


def request_from_options(**fields: Any) -> GenerationRequest:
    """A request from keyword options; ``None`` means "not given" (the contract's default applies)."""
    return build_request(**{k: v for k, v in fields.items() if v is not None})


# --- the client -----------------------------------------------------------------------------------------------


class ChorusClient:
    """Publishes requests and follows results. Not thread-safe; close it (or use ``with``)."""

    def __init__(self, settings: ProducerSettings | None = None, *, send_timeout_s: float = 30.0) -> None:
        self.settings = settings or ProducerSettings()
        self.send_timeout_s = send_timeout_s
        self._producer: KafkaProducer | None = None

    def __enter__(self) -> ChorusClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def producer(self) -> KafkaProducer:
        if self._producer is None:
            self._producer = bus.make_producer(self.settings)
        return self._producer

    def submit(self, request: GenerationRequest) -> str:
        """Publish one (already validated) request, stamped now (``stamped``); returns its id once the broker has
        it."""
        try:
            bus.publish(
                self.producer,
                self.settings.kafka_requests_topic,
                request.request_id,
                stamped(request).to_bytes(),
                timeout_s=self.send_timeout_s,
            )
        except KafkaError as exc:
            raise PublishError(f"request {request.request_id} not published: {exc!r}") from exc
        log.info(
            "request published",
            extra={"request_id": request.request_id, "topic": self.settings.kafka_requests_topic},
        )
        return request.request_id

    def submit_many(
        self, requests: Iterable[GenerationRequest], *, on_sent: Callable[[str], None] | None = None
    ) -> list[str]:
        """Publish validated requests (ids must be unique per tenant), each stamped as it is sent (``stamped``);
        returns their ids once the broker has all of them."""
        items = list(requests)
        ids = [r.request_id for r in items]
        if len({r.job_id for r in items}) != len(items):
            raise ValueError("request ids in one batch must be unique per tenant")
        try:
            bus.publish_many(
                self.producer,
                self.settings.kafka_requests_topic,
                ((r.request_id, stamped(r).to_bytes()) for r in items),
                timeout_s=self.send_timeout_s,
                on_sent=on_sent,
            )
        except KafkaError as exc:
            raise PublishError(f"batch not fully published: {exc!r}") from exc
        return ids

    def submit_batch(self, batch: Batch, *, on_sent: Callable[[str], None] | None = None) -> list[str]:
        """Publish a parsed batch; refuses (``BatchInvalid``, nothing sent) if any line was bad."""
        if not batch.ok:
            raise BatchInvalid(batch.errors)
        return self.submit_many((r for _, r in batch.requests), on_sent=on_sent)

    def watch_results(self) -> ResultWatcher:
        """Start listening to the results topic *now* (call before submitting)."""
        return ResultWatcher(self.settings)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush(timeout=self.send_timeout_s)
            self._producer.close(timeout=5)
            self._producer = None


# What a wait asks for: (tenant or None for any, request id, the request's answer_key or None for any request).
_Want = tuple[str | None, str, str | None]


def _want(request: str | GenerationRequest) -> _Want:
    if isinstance(request, GenerationRequest):
        return (request.tenant, request.request_id, request.answer_key)
    return (None, request, None)


def _answers(result: GenerationResult, want: _Want) -> bool:
    """Whether ``result`` answers ``want``: same id, same tenant if given, and — where both name one — the same
    request (a request id sent again for another request is answered separately). A bare id never takes the
    rejection of another request sent under it."""
    tenant, request_id, key = want
    if result.request_id != request_id or (tenant is not None and result.tenant != tenant):
        return False
    if key is None:
        return not (result.error is not None and result.error.code == REQUEST_ID_REUSED)
    return result.request_key in (None, key)


class ResultWatcher:
    """Follows the results topic from the moment it was created; ``wait`` yields the results asked for."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        self.topic = settings.kafka_results_topic
        self.consumer: KafkaConsumer = bus.tail_consumer(settings, self.topic)
        self.skipped = 0  # messages on the topic that were not valid results
        # Every distinct answer (tenant, request_key) per request id seen so far, the first of each, so that
        # sequential waits lose nothing.
        self.received: dict[str, list[GenerationResult]] = {}

    def wait(
        self,
        requests: Iterable[str | GenerationRequest],
        *,
        timeout_s: float,
        on_result: Callable[[GenerationResult], None] | None = None,
    ) -> Iterator[GenerationResult]:
        """Yield the first result of each request as it arrives, until all arrived or ``timeout_s`` passed.

        Give the requests themselves: a result then matches on tenant, id and content (its
        ``request_key``), so neither another tenant's request that used the same id nor another request
        sent under your id is taken for yours. A bare id matches that id in any tenant. Results that arrived
        earlier (while waiting for other requests) are yielded first.
        """
        pending: dict[str, list[_Want]] = {}
        for want in sorted({_want(r) for r in requests}, key=str):
            result = next((r for r in self.received.get(want[1], []) if _answers(r, want)), None)
            if result is None:
                pending.setdefault(want[1], []).append(want)
                continue
            if on_result is not None:
                on_result(result)
            yield result
        deadline = time.monotonic() + timeout_s
        next_refresh = 0.0
        while pending and time.monotonic() < deadline:
            now = time.monotonic()
            if now >= next_refresh:
                bus.follow_new_partitions(self.consumer, self.topic)
                next_refresh = now + _PARTITION_REFRESH_S
            if not self.consumer.assignment():
                time.sleep(min(0.5, max(0.0, deadline - now)))
                continue
            remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            batches = self.consumer.poll(timeout_ms=min(500, max(1, remaining_ms)))
            for records in batches.values():
                for record in records:
                    result = self._parse(record.value)
                    if result is None or not self._first_of_its_kind(result):
                        continue
                    wants = pending.get(result.request_id, [])
                    # The most specific want first: a tenant's own request before a bare id.
                    matched = sorted(
                        (w for w in wants if _answers(result, w)), key=lambda w: (w[0] is None, str(w))
                    )
                    if not matched:
                        continue
                    wants.remove(matched[0])
                    if not wants:
                        del pending[result.request_id]
                    if on_result is not None:
                        on_result(result)
                    yield result

    def forget(self, requests: Iterable[str | GenerationRequest]) -> None:
        """Drop the answers seen so far for ``requests``, before waiting on them again after sending them again
        (a retry after a failure): otherwise ``wait`` hands back the earlier answer, and the retry's own answer,
        which names the same request, is taken for a copy of it."""
        for want in {_want(r) for r in requests}:
            seen = self.received.get(want[1], [])
            seen[:] = [r for r in seen if not _answers(r, want)]

    def _first_of_its_kind(self, result: GenerationResult) -> bool:
        """Record ``result`` unless an answer to the same request was seen before (a replay, a redelivery)."""
        seen = self.received.setdefault(result.request_id, [])
        if any(r.tenant == result.tenant and r.request_key == result.request_key for r in seen):
            return False
        seen.append(result)
        return True

    def _parse(self, raw: bytes | None) -> GenerationResult | None:
        try:
            return GenerationResult.model_validate_json(raw or b"")
        except ValidationError as exc:
            self.skipped += 1
            log.warning(
                "not a result; skipped", extra={"topic": self.topic, "error": str(exc).splitlines()[0]}
            )
            return None

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> ResultWatcher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass(frozen=True)
class ReceivedRequest:
    """One message of the requests topic as a consumer sees it: the request, or why it is not one."""

    key: bytes | None
    partition: int
    offset: int
    request: GenerationRequest | None
    error: ContractError | None


def read_requests(
    settings: KafkaSettings, *, group_id: str, timeout_s: float, limit: int | None = None
) -> Iterator[ReceivedRequest]:
    """Consume the requests topic in consumer group ``group_id``, validating every message (for tools and
    tests; the scheduler has its own consumer). Offsets are committed after each yielded message."""
    consumer = bus.make_consumer(settings, [settings.kafka_requests_topic], group_id=group_id)
    seen = 0
    try:
        for record in bus.poll_records(consumer, timeout_s=timeout_s):
            try:
                received = ReceivedRequest(
                    record.key, record.partition, record.offset, parse_request(record.value), None
                )
            except ContractError as exc:
                received = ReceivedRequest(record.key, record.partition, record.offset, None, exc)
            yield received
            consumer.commit()
            seen += 1
            if limit is not None and seen >= limit:
                return
    finally:
        consumer.close()
