"""A live run for dashboard pictures: a local Prometheus scraping an ``EmbeddedStack`` every second while a short,
varied stream of requests goes through it (``live_run``).

The stream (``build_shots``) is ``chorus demo``'s families of similar toy-world prompts (base, reuse-off baseline,
new seed, paraphrase, terse, one changed attribute: donor hits and misses, group followers) with extras for the
other panels: an identical request after its original finished and two identical ones back to back (exact hits,
stored and coalesced), a request sent twice (its id in a new message: answered with a copy, not run), another
tenant's copy of a prompt (a cross-tenant lookup), and invalid messages for the error panels (a blank prompt, steps
out of range, bytes that are not JSON, a model no worker serves). One message is published every ``interval_s``.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from chorus_dashboards.picture_prom import PromClient, local_prometheus, wait_for_series
from producer import bus
from producer.contract import GenerationRequest, GenerationResult, build_request
from producer.local.config import StackOptions
from producer.local.demo_stream import build_stream
from producer.local.processes import free_port
from producer.local.stack import EmbeddedStack
from producer.sdk import ChorusClient

TENANT = "pictures"
UNSERVED_MODEL = "wan2.1-t2v-1.3b"  # in the catalog; the run's worker does not serve it


@dataclass(frozen=True)
class Shot:
    """One message of the stream: a request (``expect``: wait for its result) or raw bytes; the next one follows
    after ``gap_s`` (the plan's interval if None)."""

    label: str
    request: GenerationRequest | None = None
    raw: bytes = b""
    key: str = ""
    expect: bool = True
    gap_s: float | None = None


@dataclass(frozen=True)
class RunPlan:
    model: str = "toy"
    embedder: str = "minilm"
    families: int = 4
    interval_s: float = 4.0
    num_steps: int | None = None  # the model's default
    result_timeout_s: float = 300.0
    lead_s: float = 10.0  # the pictures start this long before the first message
    tail_s: float = 15.0  # and end this long after the last result

    @classmethod
    def quick(cls, model: str = "toy") -> RunPlan:
        return cls(model=model, families=2, interval_s=1.5, tail_s=8.0)


@dataclass(frozen=True)
class LiveRun:
    prom: PromClient
    start: float
    end: float
    outcomes: dict[str, int]  # results by status and reuse kind, messages without a result


def _request(plan: RunPlan, request_id: str, prompt: str, seed: int, **fields: object) -> GenerationRequest:
    steps = {"num_steps": plan.num_steps} if plan.num_steps is not None else {}
    fields.setdefault("model", plan.model)
    fields.setdefault("tenant", TENANT)
    return build_request(request_id=request_id, prompt=prompt, seed=seed, **steps, **fields)


def _raw(request_id: str, **fields: object) -> bytes:
    return json.dumps({"request_id": request_id, "tenant": TENANT, **fields}).encode()


def build_shots(plan: RunPlan, run_id: str) -> list[Shot]:
    """The messages of a run, in publishing order (see the module's docstring)."""
    items = build_stream(plan.families, 6, seed=7, run_id=run_id)
    shots = [
        Shot(f"{i.kind} f{i.family}", _request(plan, i.request_id, i.prompt, i.seed, reuse=i.reuse))
        for i in items
    ]
    base = next(s.request for s in shots if s.request is not None)
    assert base is not None
    twin = _request(plan, f"{run_id}-twin-a", base.prompt, base.seed + 500)
    raw = {
        "blank": _raw(f"{run_id}-blank", prompt=" ", model=plan.model),
        "steps": _raw(f"{run_id}-steps", prompt=base.prompt, model=plan.model, num_steps=10_000),
        "unserved": _raw(f"{run_id}-unserved", prompt=base.prompt, model=UNSERVED_MODEL),
    }
    n = plan.families
    extras = [
        # (positions count the demo's items): two identical at once (coalesced) after the bases, the first base
        # asked again once it has long finished (stored)
        (n + 1, Shot("twin", twin, gap_s=0.5)),  # the copy comes while it runs, in a later batch
        (n + 1, Shot("exact hit (coalesced)", twin.model_copy(update={"request_id": f"{run_id}-twin-b"}))),
        (3 * n + 2, Shot("exact hit (stored)", base.model_copy(update={"request_id": f"{run_id}-again"}))),
        (n + 3, Shot("invalid: blank prompt", raw=raw["blank"], key=f"{run_id}-blank")),
        (2 * n, Shot("duplicate", base, expect=False)),
        (
            2 * n + 1,
            Shot("other tenant", base.model_copy(update={"request_id": f"{run_id}-z", "tenant": "zeta"})),
        ),
        (3 * n, Shot("invalid: not JSON", raw=b"{not json", key=f"{run_id}-garbled")),
        (3 * n + 1, Shot(f"unserved model {UNSERVED_MODEL}", raw=raw["unserved"], key=f"{run_id}-unserved")),
        (4 * n, Shot("invalid: steps out of range", raw=raw["steps"], key=f"{run_id}-steps")),
    ]
    for offset, (position, shot) in enumerate(sorted(extras, key=lambda e: e[0])):
        shots.insert(min(position + offset, len(shots)), shot)
    return shots


def publish_stream(
    stack: EmbeddedStack, shots: list[Shot], plan: RunPlan, say: Callable[[str], None]
) -> dict[str, int]:
    """Publish ``shots`` one per ``plan.interval_s`` and wait for the results of those that expect one; returns
    how many results of each status and reuse kind came, and how many expected results did not."""
    settings = stack.producer_settings
    outcomes: Counter[str] = Counter()
    with ChorusClient(settings) as client, client.watch_results() as watcher:
        pending: list[GenerationRequest] = []

        def collect(until: float, *, drain: bool = False) -> None:
            while time.monotonic() < until and not (drain and not pending):
                if not pending:
                    time.sleep(max(0.0, min(0.5, until - time.monotonic())))
                    stack.check()
                    continue
                for result in watcher.wait(list(pending), timeout_s=max(0.1, until - time.monotonic())):
                    pending[:] = [
                        r for r in pending if (r.tenant, r.request_id) != (result.tenant, result.request_id)
                    ]
                    outcomes[_outcome(result)] += 1
                stack.check()

        for n, shot in enumerate(shots, 1):
            say(f"  [{n}/{len(shots)}] {shot.label}")
            if shot.request is None:
                bus.publish(client.producer, settings.kafka_requests_topic, shot.key, shot.raw)
            else:
                client.submit(shot.request)
                if shot.expect and shot.request not in pending:
                    pending.append(shot.request)
            collect(time.monotonic() + (plan.interval_s if shot.gap_s is None else shot.gap_s))
        collect(time.monotonic() + plan.result_timeout_s, drain=True)
        outcomes["no result in time"] = len(pending)
    return dict(outcomes)


def _outcome(result: GenerationResult) -> str:
    status = result.status.value
    return f"{status} (reuse: {result.reuse.value})" if status == "done" else status


@contextmanager
def live_run(plan: RunPlan, say: Callable[[str], None] = print) -> Iterator[LiveRun]:
    """Start Prometheus and the stack, publish the stream, and yield the run's time window while both still run
    (everything is stopped, and its temporary state removed, on exit)."""
    with tempfile.TemporaryDirectory(prefix="chorus-pictures-") as tmp_name:
        tmp = Path(tmp_name)
        sched_port = free_port()
        worker_port = free_port({sched_port})
        jobs = {
            "chorus-scheduler": [f"127.0.0.1:{sched_port}"],
            "chorus-worker": [f"127.0.0.1:{worker_port}"],
        }
        say(f"starting Prometheus (scraping every second) and the embedded stack ({plan.model})…")
        with local_prometheus(tmp / "prometheus", jobs) as prom:
            options = StackOptions(
                state_dir=tmp / "state",
                models=[plan.model],
                embedder="hashing" if plan.embedder == "hashing" else "minilm",
                worker_concurrency=2,
                persist_s3=False,
                scheduler_metrics_port=sched_port,
                worker_metrics_port=worker_port,
                extra_env={"CHORUS_EVICT_INTERVAL_S": "2", "CHORUS_POLL_TIMEOUT_MS": "100"},
            )
            with EmbeddedStack(options) as stack:
                wait_for_series(
                    prom,
                    [
                        'chorus_requests_received_total{job="chorus-scheduler"}',
                        'chorus_worker_pool_slots{job="chorus-worker"}',
                    ],
                )
                shots = build_shots(plan, run_id=f"pic{int(time.time()) % 100_000}")
                say(f"publishing {len(shots)} messages, one every {plan.interval_s:g} s…")
                start = time.time() - plan.lead_s
                outcomes = publish_stream(stack, shots, plan, say)
                say("results: " + ", ".join(f"{n} {what}" for what, n in sorted(outcomes.items()) if n))
                time.sleep(plan.tail_s)  # a few more scrapes after the last result
                yield LiveRun(prom, start, time.time(), outcomes)
