"""Exact hits: identical requests answered from a served one's result, or coalesced onto the one running (with the
in-memory fakes of tests/helpers/scheduler_fakes.py)."""

from __future__ import annotations

from typing import Any

import pytest
from kafka.structs import TopicPartition

from chorus_sched.ledger import RequestState
from producer.contract import (
    GenerationResult,
    ResultStatus,
    ReuseKind,
    ReusePlan,
)
from producer.orders import WorkOrder
from tests.helpers.scheduler_fakes import PROMPT, REQUESTS, Msg, Ports, done, make_ports, request


@pytest.fixture
def ports(tmp_path: Any) -> Ports:
    return make_ports(tmp_path)


# --- exact hits ------------------------------------------------------------------------------------------------


def test_an_identical_request_is_answered_from_the_stored_result_with_no_worker(ports: Ports) -> None:
    first = request(request_id="orig", seed=7)
    ports.scheduler.handle_requests([Msg(first.to_bytes(), 0)])
    ports.scheduler.handle_results([Msg(done("orig").to_bytes(), 0, topic="results")])
    again = request(request_id="again", seed=7)  # same fingerprint, another id
    ports.scheduler.handle_requests([Msg(again.to_bytes(), 1)])

    assert [o.request.request_id for o in ports.dispatcher.orders] == ["orig"]  # no second order
    [answer] = ports.results()
    assert answer.request_id == "again" and answer.status is ResultStatus.DONE
    assert answer.reuse is ReuseKind.EXACT and answer.served_from == "orig"
    assert answer.plan is None  # nothing was planned or run for it
    assert (answer.steps_computed, answer.tokens_computed_fraction) == (0, 0.0) and answer.saved_compute
    assert answer.video_uri == "s3://chorus/videos/orig.mp4"
    assert ports.scheduler.stats.exact_hits == 1 and ports.ledger.state("again") == "done"
    # its redelivery is a duplicate, not a second answer
    ports.scheduler.handle_requests([Msg(again.to_bytes(), 1)])
    assert len(ports.results()) == 1


@pytest.mark.parametrize(
    "other",
    [
        {"seed": 8, "keep_seed": True},
        {"tenant": "someone-else"},
        {"tenant": "someone-else", "seed": 8},
        {"guidance_scale": 3.0, "seed": 8},
        {"reuse": "off"},
        {"prompt": "a red circle moving left on a black background"},
    ],
)
def test_a_request_that_differs_in_what_shapes_the_video_or_in_tenant_is_not_an_exact_hit(
    ports: Ports, other: dict[str, Any]
) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="orig", seed=7).to_bytes(), 0)])
    ports.scheduler.handle_results([Msg(done("orig").to_bytes(), 0, topic="results")])
    fields = {"request_id": "other", "seed": 7, **other}
    ports.scheduler.handle_requests([Msg(request(fields.pop("prompt", PROMPT), **fields).to_bytes(), 1)])
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["orig", "other"]
    assert ports.scheduler.stats.exact_hits == 0 and ports.results() == []


def test_identical_requests_in_flight_are_coalesced_onto_the_one_running(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="runner", seed=3).to_bytes(), 0)])
    twins = [request(request_id=f"twin-{i}", seed=3) for i in range(2)]
    ports.scheduler.handle_requests([Msg(t.to_bytes(), 1 + i) for i, t in enumerate(twins)])
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["runner"]  # run once
    assert ports.results() == []
    ports.scheduler.handle_results([Msg(done("runner").to_bytes(), 0, topic="results")])
    answers = ports.results()
    assert sorted(a.request_id for a in answers) == ["twin-0", "twin-1"]
    assert all(a.reuse is ReuseKind.EXACT and a.served_from == "runner" for a in answers)


def test_identical_requests_in_one_poll_run_once_and_the_others_wait_for_its_result(ports: Ports) -> None:
    twins = [request(request_id=f"twin-{i}", seed=3) for i in range(3)]
    ports.scheduler.handle_requests([Msg(t.to_bytes(), i) for i, t in enumerate(twins)])
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["twin-0"]  # run once, not led
    assert ports.scheduler.stats.exact_hits == 2 and ports.results() == []
    ports.scheduler.handle_results([Msg(done("twin-0").to_bytes(), 0, topic="results")])
    answers = ports.results()
    assert sorted(a.request_id for a in answers) == ["twin-1", "twin-2"]
    assert all(a.reuse is ReuseKind.EXACT and a.served_from == "twin-0" for a in answers)


def test_a_twin_whose_first_could_not_be_dispatched_is_scheduled_itself(ports: Ports) -> None:
    send = ports.dispatcher.generate
    refused: list[str] = []

    def broker_refuses_the_first(order: WorkOrder) -> None:
        if not refused:
            refused.append(order.request.request_id)
            raise OSError("broker unreachable")  # left for a retry
        send(order)

    ports.dispatcher.generate = broker_refuses_the_first  # type: ignore[method-assign]
    twins = [request(request_id=f"twin-{i}", seed=3) for i in range(2)]
    outcome = ports.scheduler.handle_requests([Msg(t.to_bytes(), i) for i, t in enumerate(twins)])
    assert refused == ["twin-0"] and [o.request.request_id for o in ports.dispatcher.orders] == ["twin-1"]
    assert outcome.retry == {
        TopicPartition(REQUESTS, 0): 0
    }  # twin-0 is read again (and then waits for twin-1)


def test_requests_waiting_for_a_run_that_failed_are_run_in_full(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="runner", seed=3).to_bytes(), 0)])
    ports.scheduler.handle_requests([Msg(request(request_id="twin", seed=3).to_bytes(), 1)])
    failed = GenerationResult(request_id="runner", tenant="default", status=ResultStatus.FAILED)
    ports.scheduler.handle_results([Msg(failed.to_bytes(), 0, topic="results")])
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["runner", "twin"]
    assert ports.dispatcher.orders[-1].plan == ReusePlan.full(4) and ports.results() == []
    assert ports.ledger.state("twin") == "dispatched"


def test_a_request_that_keeps_its_seed_takes_no_donor_of_another_seed(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="donor", seed=1).to_bytes(), 0)])
    ports.scheduler.handle_results([Msg(done("donor").to_bytes(), 0, topic="results")])
    ports.scheduler.handle_requests([Msg(request(request_id="mine", seed=2, keep_seed=True).to_bytes(), 1)])
    [mine] = ports.dispatcher.orders[1:]
    assert mine.donor is None and mine.plan == ReusePlan.full(4) and ports.results() == []
    # a reworded prompt (not the same text) still gets a Stage-1 donor of another seed
    ports.scheduler.handle_requests([Msg(request(PROMPT + ".", request_id="any", seed=3).to_bytes(), 2)])
    anyone = ports.dispatcher.orders[-1]
    assert anyone.request.request_id == "any" and anyone.donor is not None and anyone.plan.reuses


# --- the same prompt and settings, another seed ------------------------------------------------------------------


def test_the_same_prompt_with_another_seed_is_served_the_stored_video_saying_the_seed_was_not_honoured(
    ports: Ports,
) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="orig", seed=7).to_bytes(), 0)])
    ports.scheduler.handle_results([Msg(done("orig").to_bytes(), 0, topic="results")])
    ports.scheduler.handle_requests([Msg(request(request_id="reseed", seed=8).to_bytes(), 1)])
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["orig"]  # no worker for it
    [answer] = ports.results()
    assert answer.request_id == "reseed" and answer.reuse is ReuseKind.EXACT and answer.served_from == "orig"
    assert answer.video_uri == "s3://chorus/videos/orig.mp4" and answer.steps_computed == 0
    assert answer.seed_honoured is False  # another seed's video: said so
    # the same seed as the stored one is an exact hit and keeps what the source says of its seed
    ports.scheduler.handle_requests([Msg(request(request_id="again", seed=7).to_bytes(), 2)])
    assert ports.results()[-1].seed_honoured is True


def test_requests_of_other_seeds_wait_for_the_same_prompt_running_and_exact_twins_keep_their_seed(
    ports: Ports,
) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="runner", seed=3).to_bytes(), 0)])
    batch = [request(request_id="reseed-a", seed=4), request(request_id="twin", seed=3)]
    batch.append(request(request_id="reseed-b", seed=5))
    ports.scheduler.handle_requests([Msg(r.to_bytes(), 1 + i) for i, r in enumerate(batch)])
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["runner"]  # run once
    assert ports.ledger.state("reseed-a") == "coalesced" and ports.scheduler.stats.exact_hits == 3
    ports.scheduler.handle_results([Msg(done("runner").to_bytes(), 0, topic="results")])
    answers = {a.request_id: a for a in ports.results()}
    assert sorted(answers) == ["reseed-a", "reseed-b", "twin"]
    assert all(a.served_from == "runner" and a.steps_computed == 0 for a in answers.values())
    assert {rid: a.seed_honoured for rid, a in answers.items()} == {
        "reseed-a": False,
        "reseed-b": False,
        "twin": True,
    }


def test_same_prompt_requests_of_several_seeds_in_one_poll_run_once(ports: Ports) -> None:
    batch = [request(request_id=f"s{seed}", seed=seed) for seed in (1, 2, 3)]
    ports.scheduler.handle_requests([Msg(r.to_bytes(), i) for i, r in enumerate(batch)])
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["s1"]
    ports.scheduler.handle_results([Msg(done("s1").to_bytes(), 0, topic="results")])
    assert sorted(a.request_id for a in ports.results()) == ["s2", "s3"]


def test_a_request_that_keeps_its_seed_neither_waits_for_nor_is_served_another_seeds_video(
    ports: Ports,
) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="runner", seed=3).to_bytes(), 0)])
    ports.scheduler.handle_requests([Msg(request(request_id="mine", seed=4, keep_seed=True).to_bytes(), 1)])
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["runner", "mine"]
    ports.scheduler.handle_results([Msg(done("runner").to_bytes(), 0, topic="results")])
    assert ports.results() == []
    # its own result stands for later requests of any seed that do not keep theirs
    ports.scheduler.handle_results([Msg(done("mine").to_bytes(), 0, topic="results")])
    ports.scheduler.handle_requests([Msg(request(request_id="later", seed=4).to_bytes(), 2)])
    [answer] = ports.results()
    assert answer.served_from == "mine" and answer.seed_honoured is True


def test_a_request_that_starts_waiting_as_another_run_takes_the_key_waits_for_a_video_not_a_full_run(
    ports: Ports,
) -> None:
    # Between the newcomer's check (the runner holds the any-seed key) and its push onto the waiting list, a run
    # of another seed is dispatched and takes the key: the list still gets a video, from whichever run ends.
    ports.scheduler.handle_requests([Msg(request(request_id="runner", seed=3).to_bytes(), 0)])
    exact, ledger = ports.scheduler.exact, ports.ledger
    push = ledger.add_waiter

    def another_run_takes_the_key(key: str, value: str) -> None:
        ledger.set_state("mine", RequestState.DISPATCHED)
        exact.running(request(request_id="mine", seed=4, keep_seed=True))
        push(key, value)

    ledger.add_waiter = another_run_takes_the_key  # type: ignore[method-assign]
    ports.scheduler.handle_requests([Msg(request(request_id="reseed", seed=5).to_bytes(), 1)])
    ledger.add_waiter = push  # type: ignore[method-assign]
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["runner"]  # not sent to run in full
    ports.scheduler.handle_results([Msg(done("runner").to_bytes(), 0, topic="results")])
    [answer] = ports.results()
    assert answer.request_id == "reseed" and answer.served_from == "runner" and not answer.seed_honoured


def test_requests_of_another_seed_waiting_for_a_run_that_failed_are_run_in_full(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="runner", seed=3).to_bytes(), 0)])
    ports.scheduler.handle_requests([Msg(request(request_id="reseed", seed=9).to_bytes(), 1)])
    failed = GenerationResult(request_id="runner", tenant="default", status=ResultStatus.FAILED)
    ports.scheduler.handle_results([Msg(failed.to_bytes(), 0, topic="results")])
    assert [o.request.request_id for o in ports.dispatcher.orders] == ["runner", "reseed"]
    assert ports.dispatcher.orders[-1].plan == ReusePlan.full(4) and ports.results() == []


def test_a_run_that_ends_while_an_identical_request_starts_waiting_still_answers_it(ports: Ports) -> None:
    # The result of the running request is handled between the newcomer's check and its push onto the waiting
    # list (another thread or instance): the newcomer must be answered, not left waiting forever.
    ports.scheduler.handle_requests([Msg(request(request_id="runner", seed=3).to_bytes(), 0)])
    exact, ledger = ports.scheduler.exact, ports.ledger
    push = ledger.add_waiter

    def push_after_the_result(key: str, value: str) -> None:
        record = ledger.record("runner")
        assert record is not None
        exact.on_result(record, done("runner"))  # takes an empty list, stores the result
        push(key, value)

    ledger.add_waiter = push_after_the_result  # type: ignore[method-assign]
    ports.scheduler.handle_requests([Msg(request(request_id="late-twin", seed=3).to_bytes(), 1)])
    [answer] = ports.results()
    assert answer.request_id == "late-twin" and answer.reuse is ReuseKind.EXACT
    assert ledger.waiters == {} or all(not v for v in ledger.waiters.values())


def test_waiters_not_yet_answered_when_publishing_fails_wait_again(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="runner", seed=3).to_bytes(), 0)])
    twins = [request(request_id=f"twin-{i}", seed=3) for i in range(2)]
    ports.scheduler.handle_requests([Msg(t.to_bytes(), 1 + i) for i, t in enumerate(twins)])
    record = ports.ledger.record("runner")
    assert record is not None

    def kafka_down(topic: str, key: str, value: bytes) -> None:
        raise OSError("results topic unreachable")

    exact = ports.scheduler.exact
    publish, exact.publish = exact.publish, kafka_down
    with pytest.raises(OSError):
        exact.on_result(record, done("runner"))
    exact.publish = publish
    exact.on_result(record, done("runner"))  # the result is handled again (the message was not committed)
    assert sorted(a.request_id for a in ports.results()) == ["twin-0", "twin-1"]


def test_an_exact_hit_carries_what_its_source_says_of_seed_and_prompt(ports: Ports) -> None:
    ports.scheduler.handle_requests([Msg(request(request_id="orig", seed=7).to_bytes(), 0)])
    source = done("orig", seed_honoured=False, prompt_tokens_used=32, prompt_truncated=True)
    ports.scheduler.handle_results([Msg(source.to_bytes(), 0, topic="results")])
    ports.scheduler.handle_requests([Msg(request(request_id="again", seed=7).to_bytes(), 1)])
    [answer] = ports.results()
    assert (answer.seed_honoured, answer.prompt_tokens_used, answer.prompt_truncated) == (False, 32, True)
    # a request that keeps its seed is not served a video that did not honour it
    ports.scheduler.handle_requests([Msg(request(request_id="mine", seed=7, keep_seed=True).to_bytes(), 2)])
    assert ports.dispatcher.orders[-1].request.request_id == "mine"
