"""Request ids sent again (chorus_sched.resend), with the in-memory fakes of tests/helpers/scheduler_fakes.py:
a redelivery stays silent, a new message with the id is answered — with a copy of its request's answer, at once or
when the request finishes, or rejected when that answer does not fit what it asks — and the request itself is never
touched by it."""

from __future__ import annotations

from typing import Any

import pytest

from chorus_sched.ledger import RequestState
from chorus_sched.resend import RESULT_NOT_KEPT
from producer.contract import REQUEST_ID_REUSED, ErrorInfo, GenerationResult, ResultStatus, ReuseKind
from tests.helpers.scheduler_fakes import Msg, Ports, done, make_ports, request


@pytest.fixture
def ports(tmp_path: Any) -> Ports:
    return make_ports(tmp_path)


def finished(ports: Ports, rid: str, **fields: Any) -> GenerationResult:
    """Feed the worker's result of ``rid`` (it names the fingerprint of the request dispatched)."""
    [order] = [o for o in ports.dispatcher.orders if o.request.request_id == rid]
    result = done(rid, request_key=order.request.answer_key, **fields)
    ports.scheduler.handle_results([Msg(result.to_bytes(), 0, topic="results")])
    return result


def test_an_id_sent_again_after_it_finished_gets_its_result_again_and_a_redelivery_gets_nothing(
    ports: Ports,
) -> None:
    first = request(request_id="again", seed=3)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    result = finished(ports, "again")

    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])  # the claimed message read again
    assert ports.results() == []
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 5)])  # the sender asking again
    [replay] = ports.results()
    assert replay.answers_resend and replay.model_copy(update={"answers_resend": False}) == result
    assert len(ports.dispatcher.orders) == 1  # nothing computed again
    assert ports.ledger.state("again") == "done"

    # the scheduler's own feedback takes the copy in as nothing new
    counted = ports.scheduler.stats.results
    ports.scheduler.handle_results([Msg(replay.to_bytes(), 1, topic="results")])
    assert ports.scheduler.stats.results == counted


def test_an_id_sent_again_while_its_request_runs_is_answered_when_it_finishes(ports: Ports) -> None:
    first = request(request_id="running", seed=3)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 1)])
    assert ports.results() == [] and len(ports.dispatcher.orders) == 1

    result = finished(ports, "running")
    [replay] = ports.results()  # the worker's own result went out on its own; this is the resent message's
    assert replay.answers_resend and replay.video_uri == result.video_uri


def test_a_failure_answers_the_waiting_message_too_and_a_new_attempt_does_not_replay_it(ports: Ports) -> None:
    first = request(request_id="flaky", seed=3)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 1)])  # waits
    [order] = ports.dispatcher.orders
    failed = GenerationResult(
        request_id="flaky",
        status=ResultStatus.FAILED,
        error=ErrorInfo(code="engine_error", message="boom"),
        request_key=order.request.answer_key,
    )
    ports.scheduler.handle_results([Msg(failed.to_bytes(), 0, topic="results")])
    [told] = ports.results()
    assert told.answers_resend and told.status is ResultStatus.FAILED

    ports.scheduler.handle_requests([Msg(first.to_bytes(), 2)])  # asked again: a new attempt runs
    assert len(ports.dispatcher.orders) == 2 and ports.ledger.state("flaky") == "dispatched"
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 3)])  # and a copy of that waits, not told "failed"
    assert len(ports.results()) == 1


def test_an_answer_kept_just_before_the_message_waits_still_answers_it(
    ports: Ports, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = request(request_id="race", seed=3)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    add_waiter = ports.ledger.add_waiter

    def result_lands_first(key: str, value: str) -> None:
        # another instance's feedback keeps the answer and takes the (still empty) waiting list
        failed = GenerationResult(request_id="race", status=ResultStatus.FAILED, request_key=first.answer_key)
        ports.scheduler.handle_results([Msg(failed.to_bytes(), 0, topic="results")])
        add_waiter(key, value)

    monkeypatch.setattr(ports.ledger, "add_waiter", result_lands_first)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 1)])
    [told] = ports.results()
    assert told.status is ResultStatus.FAILED and told.answers_resend
    assert ports.ledger.waiters.get("resent:race", []) == []


def test_two_copies_in_one_poll_run_once_and_the_second_is_answered_too(ports: Ports) -> None:
    twice = request(request_id="twice").to_bytes()
    ports.scheduler.handle_requests([Msg(twice, 10), Msg(twice, 11)])
    assert len(ports.dispatcher.orders) == 1 and ports.scheduler.stats.resent == 1
    finished(ports, "twice")
    assert [(r.request_id, r.answers_resend) for r in ports.results()] == [("twice", True)]


@pytest.mark.parametrize("first_finished", [True, False], ids=["finished", "running"])
def test_an_id_sent_again_for_another_request_is_rejected_and_the_first_keeps_its_result(
    ports: Ports, first_finished: bool
) -> None:
    first = request(request_id="mine", seed=3)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    if first_finished:
        finished(ports, "mine")
    other = request("a blue square moving up on a white background", request_id="mine", seed=3)
    ports.scheduler.handle_requests([Msg(other.to_bytes(), 1)])

    [rejected] = ports.results()
    assert rejected.status is ResultStatus.REJECTED and rejected.error is not None
    assert rejected.error.code == REQUEST_ID_REUSED and "new request id" in rejected.error.message
    # it names the request it answers, so the first request's waiter does not take it for its own, and the
    # scheduler's own feedback, reading it on the results topic, leaves the first request alone
    assert rejected.request_key == other.answer_key != first.answer_key and rejected.answers_resend
    ports.scheduler.handle_results([Msg(rejected.to_bytes(), 5, topic="results")])
    assert ports.ledger.state("mine") == ("done" if first_finished else "dispatched")
    assert ports.scheduler.stats.results == (1 if first_finished else 0)
    assert len(ports.dispatcher.orders) == 1
    if not first_finished:
        finished(ports, "mine")  # and the first's result, when it comes, answers only the first
        assert len(ports.results()) == 1
    assert ports.ledger.state("mine") == "done"


def test_an_id_sent_again_asking_for_its_own_seed_is_not_answered_with_a_donors_sample(
    ports: Ports,
) -> None:
    first = request(request_id="donor-seed", seed=3)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    finished(ports, "donor-seed", reuse=ReuseKind.STAGE1, seed_honoured=False)
    strict = request(request_id="donor-seed", seed=3, keep_seed=True)
    ports.scheduler.handle_requests([Msg(strict.to_bytes(), 1)])
    [rejected] = ports.results()
    assert rejected.error is not None and rejected.error.code == REQUEST_ID_REUSED
    assert "keep_seed" in rejected.error.message


def test_an_id_sent_again_with_reuse_off_is_not_answered_with_a_reused_video(ports: Ports) -> None:
    first = request(request_id="reused", seed=3)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    finished(ports, "reused", reuse=ReuseKind.STAGE2, tokens_computed_fraction=0.5)
    ports.scheduler.handle_requests([Msg(request(request_id="reused", seed=3, reuse="off").to_bytes(), 1)])
    [rejected] = ports.results()
    assert rejected.error is not None and rejected.error.code == REQUEST_ID_REUSED


def test_an_answer_from_a_worker_that_names_no_fingerprint_is_checked_against_the_order(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="legacy", seed=3).to_bytes(), 0)])
    ports.scheduler.handle_results([Msg(done("legacy").to_bytes(), 0, topic="results")])  # no fingerprint
    other = request("a blue square moving up on a white background", request_id="legacy", seed=3)
    ports.scheduler.handle_requests([Msg(other.to_bytes(), 1)])
    [rejected] = ports.results()
    assert rejected.error is not None and rejected.error.code == REQUEST_ID_REUSED


def test_an_exact_hit_sent_again_gets_its_answer_again(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="orig", seed=7).to_bytes(), 0)])
    finished(ports, "orig")
    copy = request(request_id="copy", seed=7)
    ports.scheduler.handle_requests([Msg(copy.to_bytes(), 1)])
    ports.scheduler.handle_requests([Msg(copy.to_bytes(), 2)])
    served, replay = ports.results()
    assert served.reuse is ReuseKind.EXACT and not served.answers_resend
    assert replay.answers_resend and replay.served_from == "orig" and replay.request_key == copy.answer_key


def test_a_finished_request_whose_result_is_not_kept_is_answered_with_the_reason(ports: Ports) -> None:
    first = request(request_id="old", seed=1)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    finished(ports, "old")
    ports.ledger.values.pop("result:old")  # answered before results were kept, or expired before its claim
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 4)])
    [rejected] = ports.results()
    assert rejected.error is not None and rejected.error.code == RESULT_NOT_KEPT


def test_copies_of_one_poll_read_again_after_a_failure_are_answered_once_each(
    ports: Ports, monkeypatch: pytest.MonkeyPatch
) -> None:
    twice = request(request_id="again-poll").to_bytes()
    generate = ports.dispatcher.generate

    def broker_down(order: Any) -> None:
        raise ConnectionError("broker down")

    monkeypatch.setattr(ports.dispatcher, "generate", broker_down)
    assert ports.scheduler.handle_requests([Msg(twice, 10), Msg(twice, 11)]).retry  # both read again
    monkeypatch.setattr(ports.dispatcher, "generate", generate)
    ports.scheduler.handle_requests([Msg(twice, 10), Msg(twice, 11)])
    finished(ports, "again-poll")
    assert [r.answers_resend for r in ports.results()] == [True]  # offset 11, once


def test_a_resend_that_keeps_failing_is_dead_lettered_without_touching_its_request(
    ports: Ports, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = request(request_id="poison", seed=3)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])

    def broken(key: str, value: str) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(ports.ledger, "add_waiter", broken)
    for _ in range(ports.scheduler.settings.max_attempts):
        ports.scheduler.handle_requests([Msg(first.to_bytes(), 1)])
    [told] = ports.results()
    assert told.status is ResultStatus.REJECTED and told.answers_resend
    assert told.request_key == first.answer_key
    ports.scheduler.handle_results([Msg(told.to_bytes(), 0, topic="results")])
    assert ports.ledger.state("poison") == "dispatched" and ports.ledger.record("poison") is not None


def test_a_claim_that_fails_never_releases_the_claim_of_an_earlier_message(
    ports: Ports, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = request(request_id="held", seed=3)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])

    def lost_reply(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("the ledger's reply was lost")

    monkeypatch.setattr(ports.ledger, "begin", lost_reply)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 1)])
    assert ports.ledger.state("held") == "dispatched"


def test_a_ledger_failure_while_answering_retries_the_message_and_keeps_the_first_claim(
    ports: Ports, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = request(request_id="kept", seed=1)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    finished(ports, "kept")

    def down(key: str) -> str | None:
        raise ConnectionError("ledger down")

    monkeypatch.setattr(ports.ledger, "get_value", down)
    outcome = ports.scheduler.handle_requests([Msg(first.to_bytes(), 3)])
    assert outcome.retry and not outcome.commit
    assert ports.ledger.state("kept") == "done"  # the first message's claim is not released
    monkeypatch.undo()
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 3)])
    assert [r.answers_resend for r in ports.results()] == [True]


def test_a_resent_message_read_again_is_not_answered_again(ports: Ports) -> None:
    from prometheus_client import REGISTRY

    def replayed() -> float:
        return REGISTRY.get_sample_value("chorus_requests_resent_total", {"outcome": "replayed"}) or 0.0

    first = request(request_id="once", seed=3)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    finished(ports, "once")
    before = replayed()
    for _ in range(3):  # the resend, then the same message read again (a rewind, a redelivery)
        ports.scheduler.handle_requests([Msg(first.to_bytes(), 7)])
    assert len(ports.results()) == 1 and replayed() == before + 1


def test_a_claim_that_keeps_failing_is_dead_lettered_as_that_messages_answer_alone(
    ports: Ports, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = request(request_id="readonly", seed=3)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("READONLY You can't write against a read only replica")

    monkeypatch.setattr(ports.ledger, "begin", read_only)
    for _ in range(ports.scheduler.settings.max_attempts):
        ports.scheduler.handle_requests([Msg(first.to_bytes(), 1)])
    [told] = ports.results()
    assert (
        told.status is ResultStatus.REJECTED and told.answers_resend and told.request_key == first.answer_key
    )
    ports.scheduler.handle_results([Msg(told.to_bytes(), 0, topic="results")])
    assert ports.ledger.state("readonly") == "dispatched"


def test_copies_waiting_on_a_request_that_is_dead_lettered_are_told_why(
    ports: Ports, monkeypatch: pytest.MonkeyPatch
) -> None:
    twice = request(request_id="doomed").to_bytes()

    def broken(order: Any) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(ports.dispatcher, "generate", broken)
    for _ in range(ports.scheduler.settings.max_attempts):
        ports.scheduler.handle_requests([Msg(twice, 10), Msg(twice, 11)])
    own, copy = ports.results()
    assert own.status is copy.status is ResultStatus.REJECTED
    assert not own.answers_resend and copy.answers_resend and own.error == copy.error
    assert ports.ledger.waiters.get("resent:doomed", []) == []


def test_a_finished_request_whose_entry_was_evicted_and_answer_expired_is_answered_with_the_reason(
    ports: Ports,
) -> None:
    first = request(request_id="evicted", seed=1)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    finished(ports, "evicted")
    ports.ledger.set_state("evicted", RequestState.EVICTED)  # the cache evicted its donor entry since
    ports.ledger.values.pop("result:evicted")  # and its answer expired before the claim the eviction renewed
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 4)])
    [told] = ports.results()
    assert told.error is not None and told.error.code == RESULT_NOT_KEPT
    assert ports.ledger.waiters.get("resent:evicted", []) == []


def test_an_old_answer_is_forgotten_even_when_the_retry_that_should_forget_it_failed(
    ports: Ports, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = request(request_id="stale", seed=3)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    failed = GenerationResult(request_id="stale", status=ResultStatus.FAILED, request_key=first.answer_key)
    ports.scheduler.handle_results([Msg(failed.to_bytes(), 0, topic="results")])
    forget = ports.dispatcher.forget
    calls = []

    def fails_once(task_id: str) -> None:
        calls.append(task_id)
        if len(calls) == 1:
            raise ValueError("a bug")
        forget(task_id)

    monkeypatch.setattr(ports.dispatcher, "forget", fails_once)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 1)])  # a retry whose forgetting fails: released
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 1)])  # read again: a new claim, run afresh
    assert ports.ledger.state("stale") == "dispatched"
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 2)])  # a copy waits for the new run's answer
    assert ports.results() == []


def test_copies_that_cannot_be_told_do_not_send_the_dead_letter_round_again(
    ports: Ports, monkeypatch: pytest.MonkeyPatch
) -> None:
    twice = request(request_id="untold").to_bytes()

    def broken(*args: Any) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(ports.dispatcher, "generate", broken)
    monkeypatch.setattr(ports.scheduler.intake.resends, "answer_waiting", broken)
    for _ in range(ports.scheduler.settings.max_attempts):
        outcome = ports.scheduler.handle_requests([Msg(twice, 10), Msg(twice, 11)])
    assert not outcome.retry and ports.ledger.state("untold") == "dead_lettered"


def test_copies_left_waiting_by_a_failure_to_tell_them_are_told_when_the_id_comes_again(
    ports: Ports, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = request(request_id="left", seed=3)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 1)])  # waits
    [order] = ports.dispatcher.orders
    ports.ledger.records.pop(
        "left"
    )  # the result then comes to nothing the feedback knows (say, a lost record)
    ports.ledger.states["left"] = RequestState.DONE
    ports.ledger.values["result:left"] = done("left", request_key=order.request.answer_key).model_dump_json()
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 2)])  # the id sent once more
    assert sorted(r.answers_resend for r in ports.results()) == [True, True]  # both copies told
