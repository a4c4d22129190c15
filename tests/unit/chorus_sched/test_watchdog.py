"""The order watchdog: a lost order is sent again, a bounded number of times, then answered failed.

The ledger is the real embedded one (SQLite); the Celery side is a fake that reports each task's state.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from chorus_sched.ledger import RequestRecord, RequestState
from chorus_sched.ledger_sqlite import SqliteLedger
from chorus_sched.settings import SchedulerSettings
from chorus_sched.watchdog import OrderWatchdog
from producer.contract import DeadLetter, GenerationResult, ResultStatus, ReusePlan, build_request
from producer.orders import WorkOrder


class FakeCelery:
    def __init__(self) -> None:
        self.states: dict[str, tuple[str, float | None]] = {}
        self.sent: list[WorkOrder] = []
        self.seen: dict[str, float] = {}  # model -> when a worker last announced it
        self.answered: list[str] = []

    def generate(self, order: WorkOrder) -> None:
        self.sent.append(order)

    def task_state(self, task_id: str) -> tuple[str, float | None]:
        return self.states.get(task_id, ("PENDING", None))

    def failure_of(self, task_id: str) -> str:
        return "ResultNotPublished('results topic unreachable')"

    def model_last_seen(self, model: str) -> float | None:
        return self.seen.get(model)

    def mark_answered(self, task_id: str) -> None:
        self.answered.append(task_id)


class Clock:
    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[SqliteLedger]:
    store = SqliteLedger(tmp_path / "ledger.sqlite3")
    yield store
    store.close()


def setup(ledger: SqliteLedger, tmp_path: Path) -> tuple[OrderWatchdog, FakeCelery, Clock, list[bytes]]:
    settings = SchedulerSettings(
        state_dir=tmp_path,
        order_check_after_s=30,
        worker_lost_after_s=60,
        order_pending_lost_after_s=600,
        max_redispatches=2,
    )
    celery, clock, published = FakeCelery(), Clock(), []
    watchdog = OrderWatchdog(
        settings, ledger=ledger, dispatcher=celery, publish=lambda t, k, v: published.append(v), clock=clock
    )
    return watchdog, celery, clock, published


def dispatch(ledger: SqliteLedger, at: float, tenant: str = "default") -> WorkOrder:
    request = build_request(prompt="a red circle", request_id="r-1", tenant=tenant)
    order = WorkOrder(request=request, plan=ReusePlan.full(4))
    ledger.record_dispatch(
        RequestRecord(
            request_id=request.job_id,
            tenant=tenant,
            prompt=request.prompt,
            model="toy",
            compat_key="k",
            num_steps=4,
            reuse="auto",
            role="solo",
            order=order.model_dump_json(),
            dispatched_at=at,
        )
    )
    return order


def test_an_order_whose_worker_stopped_beating_is_sent_again_then_answered_failed(
    ledger: SqliteLedger, tmp_path: Path
) -> None:
    watchdog, celery, clock, published = setup(ledger, tmp_path)
    order = dispatch(ledger, clock.now, tenant="acme")
    job = order.request.job_id
    celery.states[job] = ("PROGRESS", clock.now + 5)  # started, beating
    clock.now += 50
    assert watchdog.check() == [] and celery.sent == []  # beat 45 s ago: alive
    clock.now += 30
    assert watchdog.check() == [job] and celery.sent == [order]  # 75 s without a beat: lost
    record = ledger.record(job)
    assert record is not None and record.redispatches == 1 and record.dispatched_at == clock.now
    assert watchdog.check() == []  # just sent again: not checked before order_check_after_s
    for _ in range(2):  # the second and third time it is lost
        clock.now += 100
        watchdog.check()
    assert len(celery.sent) == 2
    [raw] = published
    failed = GenerationResult.model_validate_json(raw)
    assert (failed.request_id, failed.tenant, failed.status) == ("r-1", "acme", ResultStatus.FAILED)
    assert failed.error is not None and failed.error.code == "worker_lost"
    assert ledger.state(job) == "failed" and ledger.dispatched_records() == []


def test_an_order_still_queued_is_left_alone_until_the_pending_bound(
    ledger: SqliteLedger, tmp_path: Path
) -> None:
    watchdog, celery, clock, _ = setup(ledger, tmp_path)
    order = dispatch(ledger, clock.now)
    clock.now += 500
    assert watchdog.check() == []
    clock.now += 200
    assert watchdog.check() == [order.request.job_id] and celery.sent == [order]


def test_an_order_celery_finished_is_never_sent_again(ledger: SqliteLedger, tmp_path: Path) -> None:
    watchdog, celery, clock, published = setup(ledger, tmp_path)
    order = dispatch(ledger, clock.now)
    celery.states[order.request.job_id] = ("SUCCESS", None)  # its result was published: it comes
    clock.now += 10_000
    assert watchdog.check() == [] and celery.sent == [] and published == []


def test_an_order_that_failed_in_its_worker_without_an_answer_is_answered_failed(
    ledger: SqliteLedger, tmp_path: Path
) -> None:
    # The task's own retries ran out (its result could not be published), or the hard time limit killed it:
    # nothing else will ever answer the request.
    watchdog, celery, clock, published = setup(ledger, tmp_path)
    order = dispatch(ledger, clock.now)
    job = order.request.job_id
    celery.states[job] = ("FAILURE", None)
    clock.now += 10  # before order_check_after_s: a result may still be on its way
    assert watchdog.check() == [] and published == []
    clock.now += 30
    assert watchdog.check() == [job]
    assert celery.sent == [] and celery.answered == [job]  # not sent again; a copy still queued skips it
    [raw] = published
    failed = GenerationResult.model_validate_json(raw)
    assert failed.status is ResultStatus.FAILED and failed.error is not None
    assert failed.error.code == "worker_failed" and "ResultNotPublished" in failed.error.message
    assert failed.request_key == order.request.answer_key
    assert ledger.state(job) == RequestState.FAILED
    assert watchdog.check() == []  # answered once


def test_an_answered_request_is_no_longer_watched(ledger: SqliteLedger, tmp_path: Path) -> None:
    watchdog, celery, clock, _ = setup(ledger, tmp_path)
    order = dispatch(ledger, clock.now)
    ledger.set_state(order.request.job_id, RequestState.DONE)
    clock.now += 10_000
    assert ledger.dispatched_records() == [] and watchdog.check() == [] and celery.sent == []


def test_an_order_for_a_model_no_live_worker_serves_is_rejected_with_a_dead_letter(
    ledger: SqliteLedger, tmp_path: Path
) -> None:
    watchdog, celery, clock, published = setup(ledger, tmp_path)
    order = dispatch(ledger, clock.now, tenant="acme")
    job = order.request.job_id
    clock.now += 11  # past no_worker_after_s (10 s by default)
    assert watchdog.check() == []  # no worker at all yet: it waits for one
    celery.seen = {"*": clock.now, "tiny-random-wan": clock.now}  # workers run, for another model
    assert watchdog.check() == [job]
    letter_raw, result_raw = published
    letter = DeadLetter.model_validate_json(letter_raw)
    assert letter.error.code == "no_worker" and [(i.field, i.rule) for i in letter.issues] == [
        ("model", "no_worker")
    ]
    assert "chorus worker --model toy" in letter.error.message
    rejected = GenerationResult.model_validate_json(result_raw)
    assert (rejected.request_id, rejected.tenant, rejected.status) == ("r-1", "acme", ResultStatus.REJECTED)
    assert celery.answered == [job] and celery.sent == []  # a worker that comes later skips it
    assert ledger.state(job) == "failed"  # and it may be sent again


def test_an_order_for_a_model_a_live_worker_serves_waits_its_turn(
    ledger: SqliteLedger, tmp_path: Path
) -> None:
    watchdog, celery, clock, published = setup(ledger, tmp_path)
    dispatch(ledger, clock.now)
    clock.now += 25
    celery.seen = {"*": clock.now - 3, "toy": clock.now - 3}
    assert watchdog.check() == [] and published == [] and celery.answered == []


def test_a_re_sent_order_is_given_its_own_time_before_it_counts_as_lost_again(
    ledger: SqliteLedger, tmp_path: Path
) -> None:
    watchdog, celery, clock, published = setup(ledger, tmp_path)
    order = dispatch(ledger, clock.now)
    job = order.request.job_id
    celery.states[job] = ("PROGRESS", clock.now)  # the dead worker's last beat stays in the backend
    clock.now += 70
    assert watchdog.check() == [job] and len(celery.sent) == 1
    clock.now += 40  # past order_check_after_s, but the re-sent copy has had only 40 s of worker_lost_after_s
    assert watchdog.check() == [] and len(celery.sent) == 1
    clock.now += 30
    assert watchdog.check() == [job] and len(celery.sent) == 2
    clock.now += 70
    watchdog.check()  # lost a third time: answered failed, and marked so a queued copy is skipped
    assert celery.answered == [job] and len(published) == 1


def test_one_instance_at_a_time_checks_the_orders(ledger: SqliteLedger, tmp_path: Path) -> None:
    watchdog, celery, clock, _ = setup(ledger, tmp_path)
    order = dispatch(ledger, clock.now)
    celery.states[order.request.job_id] = ("PROGRESS", clock.now)
    clock.now += 100
    assert ledger.try_lock("watchdog", "another-scheduler:x", ttl_s=60)
    assert watchdog.check() == [] and celery.sent == []  # the other instance is checking them
    ledger.unlock("watchdog", "another-scheduler:x")
    assert watchdog.check() == [order.request.job_id]
