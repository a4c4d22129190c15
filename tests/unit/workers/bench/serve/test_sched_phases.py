"""The scheduler benchmark's phase table: each phase's time counted once, in our modules only."""

from __future__ import annotations

import cProfile
import threading
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from chorus_sched.batch import BatchOutcome, Message
from workers.bench.serve.sched import PHASE_FUNCTIONS, _Harness, _profile_summary, _wait_settled
from workers.bench.serve.sched_direct import PHASES, phase_ms


def _entry(cumulative_s: float) -> tuple[int, int, float, float, dict[object, object]]:
    return (1, 1, 0.0, cumulative_s, {})


def test_a_wrapper_of_the_same_name_is_not_counted_again() -> None:
    raw = {
        ("/src/chorus_sched/service.py", 135, "handle_results"): _entry(0.5),  # wraps feedback's
        ("/src/chorus_sched/feedback.py", 59, "handle_results"): _entry(0.5),
        ("/src/chorus_sched/planner.py", 278, "plan"): _entry(0.2),
        ("/src/workers/bench/calibrate.py", 187, "plan"): _entry(9.0),  # another module's plan
        ("/venv/site-packages/chorus_sched/feedback.py", 59, "handle_results"): _entry(9.0),
    }
    phases = phase_ms(raw, 100, PHASES)
    assert phases["results"] == 5.0
    assert phases["plan"] == 2.0
    assert phases["validate"] == 0.0


def test_the_backlog_report_keeps_its_phase_names() -> None:
    assert set(PHASE_FUNCTIONS) == {
        "validate",
        "claim",
        "exact",
        "embed",
        "search",
        "plan",
        "dispatch",
        "feedback",
    }


def test_a_thread_that_ran_nothing_while_profiled_is_left_out_of_the_summary() -> None:
    busy, idle = cProfile.Profile(), cProfile.Profile()
    busy.enable()
    sum(range(1000))
    busy.disable()
    idle.enable()
    idle.disable()  # e.g. the feedback thread in a drain no result came back during
    phases, top = _profile_summary({"intake": busy, "feedback": idle}, handled=10)
    assert phases["all_handlers"] >= 0 and any("ncalls" in line for line in top)
    assert _profile_summary({"feedback": cProfile.Profile()}, handled=10) == ({}, [])


class _Stats:
    requests = 0
    results = 0


class _NoWorkers:
    def __init__(self) -> None:
        self.dispatched: dict[str, object] = {}

    def idle(self) -> bool:
        return True


def test_a_drain_settles_only_when_the_handler_that_admitted_its_requests_returned() -> None:
    """The scheduler counts a request at admission, before it embeds and schedules the poll: a drain that waited
    on that count alone stopped its clock and its profile mid-poll (the profiled phases after embed read 0)."""
    scheduler = SimpleNamespace(stats=_Stats())
    harness = _Harness(None, scheduler, _NoWorkers(), {}, threading.Event())  # type: ignore[arg-type]
    harness.mark()
    admitted, release = threading.Event(), threading.Event()

    def handle(messages: Sequence[Message]) -> BatchOutcome:
        scheduler.stats.requests += len(messages)  # admitted and counted…
        admitted.set()
        release.wait(10)  # …then embedded and scheduled
        return BatchOutcome()

    wrapped = harness.profiled("requests", handle)
    request = SimpleNamespace(request_id="r1")
    poll = threading.Thread(target=wrapped, args=([SimpleNamespace(key=b"r1")],), daemon=True)
    poll.start()
    assert admitted.wait(10)
    with pytest.raises(RuntimeError):
        _wait_settled(harness, [request], timeout_s=0.3)  # type: ignore[list-item]
    release.set()
    poll.join(10)
    _wait_settled(harness, [request], timeout_s=5)  # type: ignore[list-item]  # raises if it does not settle
