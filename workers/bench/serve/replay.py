"""Replaying a trace against a running stack: publish each request at its arrival time, collect every result.

Times are taken in this process: ``sent`` when the broker acknowledged the request (``ChorusClient.submit``
returns then), ``received`` when its result was read from the results topic. Both are ``time.monotonic()``; the
wall-clock ``received_wall`` is kept to compare with the result's own ``completed_at`` (same machine, same
clock), which tells how long publishing and delivering the result took.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from producer.contract import GenerationRequest, GenerationResult, build_request
from producer.sdk import ChorusClient, ResultWatcher
from workers.bench.serve.trace import TraceItem

POLL_S = 0.05


class ReplayTimeout(RuntimeError):
    """Results did not all arrive in time."""


@dataclass(frozen=True)
class Shape:
    """The request fields a model's trace requests share (``None``: the catalog's default)."""

    model: str
    num_steps: int
    num_frames: int | None = None
    height: int | None = None
    width: int | None = None
    guidance_scale: float | None = None

    def fields(self) -> dict[str, object]:
        given = {
            "num_frames": self.num_frames,
            "height": self.height,
            "width": self.width,
            "guidance_scale": self.guidance_scale,
        }
        return {"model": self.model, "num_steps": self.num_steps} | {
            k: v for k, v in given.items() if v is not None
        }


@dataclass(frozen=True)
class Observation:
    item: TraceItem
    request: GenerationRequest
    sent: float
    received: float
    received_wall: datetime
    result: GenerationResult

    @property
    def latency_s(self) -> float:
        return self.received - self.sent

    @property
    def delivery_s(self) -> float:
        """From the worker assembling the result (``completed_at``) to this process reading it."""
        return max(0.0, (self.received_wall - self.result.completed_at).total_seconds())


def requests_for(
    items: Sequence[TraceItem], shape: Shape, *, prefix: str, reuse: str
) -> list[GenerationRequest]:
    return [
        build_request(
            request_id=f"{prefix}{item.index}",
            prompt=item.prompt,
            seed=item.seed,
            reuse=reuse,
            **shape.fields(),
        )
        for item in items
    ]


def replay(
    client: ChorusClient,
    watcher: ResultWatcher,
    items: Sequence[TraceItem],
    requests: Sequence[GenerationRequest],
    *,
    timeout_s: float,
    on_sent: Callable[[], None] | None = None,
    on_result: Callable[[Observation], None] | None = None,
    check: Callable[[], None] | None = None,
) -> tuple[list[Observation], float]:
    """Publish ``requests`` at their items' arrival offsets, collect one result each; (observations in trace
    order, the monotonic time the first request was sent). Raises ``ReplayTimeout`` when results are missing
    ``timeout_s`` after the last was sent."""
    by_id = {r.request_id: (item, r) for item, r in zip(items, requests, strict=True)}
    sent: dict[str, float] = {}
    seen: dict[str, Observation] = {}
    start = time.monotonic()
    next_i = 0
    deadline: float | None = None
    while len(seen) < len(requests):
        now = time.monotonic()
        while next_i < len(requests) and items[next_i].at_s <= now - start:
            request = requests[next_i]
            client.submit(request)
            sent[request.request_id] = time.monotonic()
            next_i += 1
            if on_sent is not None:
                on_sent()
        if next_i == len(requests) and deadline is None:
            deadline = time.monotonic() + timeout_s
        if deadline is not None and time.monotonic() > deadline:
            missing = sorted(set(by_id) - set(seen))
            raise ReplayTimeout(f"{len(missing)} results missing after {timeout_s:.0f} s: {missing[:5]}")
        if check is not None:
            check()
        wait = POLL_S
        if next_i < len(requests):
            wait = max(0.0, min(POLL_S, items[next_i].at_s - (time.monotonic() - start)))
        pending = [r for r in requests if r.request_id in sent and r.request_id not in seen]
        if not pending:
            time.sleep(wait)
            continue
        for result in watcher.wait(pending, timeout_s=wait):
            item, request = by_id[result.request_id]
            obs = Observation(
                item, request, sent[result.request_id], time.monotonic(), datetime.now(UTC), result
            )
            seen[result.request_id] = obs
            if on_result is not None:
                on_result(obs)
    return [seen[r.request_id] for r in requests], start
