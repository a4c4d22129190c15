"""``workers.bench.faults.accounting``: what a fault scenario sent against what came back.

- Each valid request counts once by its first result (done, failed, rejected) or as lost if none came.
- A second result for one (tenant, request_id) is a duplicate; a result for a (tenant, request_id) never sent whose
  request id another tenant sent is a wrong-tenant delivery; two requests answered with one video share it.
- Results of other scenarios' requests do not count.
- Hostile messages are matched to dead letters by partition and offset; one answered ``done`` was executed.
- Recovery is measured from the end of the fault to the first result at or after it.
- ``judge`` applies the issue's done criteria and names each one that failed.
"""

from __future__ import annotations

import pytest

from workers.bench.faults.accounting import Letter, Received, Sent, account, judge
from workers.bench.faults.traffic import HOSTILE_KINDS, hostile_stream

A, B = "acme", "globex"


def valid(tenant: str, rid: str, offset: int = 0) -> Sent:
    return Sent(tenant, rid, True, partition=0, offset=offset)


def hostile(rid: str | None, offset: int, kind: str = "tombstone") -> Sent:
    return Sent("default", rid, False, kind, partition=1, offset=offset)


def got(tenant: str, rid: str, status: str = "done", at: float = 1.0, video: str | None = None) -> Received:
    return Received(
        tenant, rid, status, arrived_at=at, video_uri=video, error_code=None if status == "done" else "x"
    )


def test_each_valid_request_counts_once_by_its_first_result() -> None:
    sent = [valid(A, "r1"), valid(A, "r2"), valid(A, "r3"), valid(A, "r4")]
    results = [
        got(A, "r1"),
        got(A, "r2", "failed", at=1.0),
        got(A, "r2", "done", at=2.0),  # a late second result: the first is what the client saw
        got(A, "r3", "rejected"),
    ]
    tally = account(sent, results, [])
    assert (tally.sent, tally.valid, tally.done, tally.failed, tally.rejected, tally.lost) == (
        4,
        4,
        1,
        1,
        1,
        1,
    )
    assert tally.lost_ids == ["acme/r4"]
    assert tally.duplicated == 1
    assert [f["request"] for f in tally.failures] == ["acme/r2", "acme/r3"]


def test_an_answer_to_a_message_that_sent_the_id_again_is_not_a_second_result() -> None:
    copy = Received(tenant=A, request_id="r1", status="done", arrived_at=2.0, answers_resend=True)
    tally = account([valid(A, "r1")], [got(A, "r1", "done", at=1.0), copy], [])
    assert (tally.done, tally.duplicated) == (1, 0)


def test_results_arriving_out_of_order_are_sorted_by_arrival() -> None:
    tally = account([valid(A, "r1")], [got(A, "r1", "done", at=5.0), got(A, "r1", "failed", at=2.0)], [])
    assert (tally.done, tally.failed, tally.duplicated) == (0, 1, 1)


def test_a_result_under_the_other_tenant_is_a_wrong_tenant_delivery() -> None:
    # Both tenants used id r1; the system answered B's request under A's identity (and A's twice).
    sent = [valid(A, "r1"), valid(B, "r1")]
    tally = account(sent, [got(A, "r1"), got(A, "r1")], [])
    assert tally.lost == 1 and tally.lost_ids == ["globex/r1"]
    assert tally.duplicated == 1 and tally.wrong_tenant == 0
    stray = account([valid(A, "r1")], [got(A, "r1"), got(B, "r1")], [])
    assert stray.wrong_tenant == 1 and stray.duplicated == 0 and stray.done == 1


def test_two_requests_answered_with_one_video_share_it() -> None:
    sent = [valid(A, "r1"), valid(B, "r1"), valid(A, "r2")]
    results = [
        got(A, "r1", video="s3://b/v/r1.mp4"),
        got(B, "r1", video="s3://b/v/r1.mp4"),
        got(A, "r2", video="s3://b/v/r2.mp4"),
    ]
    tally = account(sent, results, [])
    assert tally.done == 3 and tally.shared_video == 1 and tally.wrong_tenant == 0


def test_results_of_other_requests_are_ignored() -> None:
    tally = account([valid(A, "mine")], [got(A, "mine"), got(A, "someone-else"), got(B, "other")], [])
    assert (tally.done, tally.duplicated, tally.wrong_tenant, tally.unexpected) == (1, 0, 0, 0)


def test_hostile_messages_are_matched_to_dead_letters_by_position() -> None:
    sent = [
        hostile("h1", 10),
        hostile(None, 11, "missing-id-no-key"),
        hostile("h3", 12, "unknown-model"),
        hostile("h4", 13),
    ]
    letters = [
        Letter(partition=1, offset=10, code="invalid_request", issues=(("<message>", "tombstone"),)),
        Letter(partition=1, offset=11, code="invalid_request", issues=(("request_id", "missing"),)),
        Letter(partition=1, offset=11, code="invalid_request", issues=(("request_id", "missing"),)),
        Letter(partition=1, offset=12, code="scheduling_failed"),  # no field and rule
        Letter(partition=0, offset=13, code="invalid_request", issues=(("x", "y"),)),  # another partition
    ]
    results = [got("default", "h3", "rejected"), got("default", "h1", "done")]
    tally = account(sent, results, letters)
    h = tally.hostile
    assert (h.sent, h.dead_lettered, h.with_field_and_rule, h.letters_duplicated) == (4, 3, 2, 1)
    assert h.unanswered == 1 and h.unanswered_by_kind == {"tombstone": 1}
    assert (h.rejected_results, h.executed) == (1, 1)
    assert h.rules == {"missing-id-no-key: request_id [missing]": 1, "tombstone: <message> [tombstone]": 1}
    assert tally.valid == 0 and tally.lost == 0


def test_recovery_is_the_first_result_at_or_after_the_fault_end() -> None:
    sent = [valid(A, "r1"), valid(A, "r2"), valid(A, "r3")]
    results = [got(A, "r1", at=3.0), got(A, "r2", at=12.5), got(A, "r3", at=11.0)]
    assert account(sent, results, [], fault_end=10.0).recover_s == pytest.approx(1.0)
    assert account(sent, results, [], fault_end=20.0).recover_s is None
    assert account(sent, results, []).recover_s is None


def test_judge_passes_a_clean_tally_and_names_every_broken_criterion() -> None:
    clean = account([valid(A, "r1")], [got(A, "r1")], [])
    assert judge(clean).ok and judge(clean).reasons == ()

    sent = [valid(A, "r1"), valid(A, "r2"), valid(A, "r3"), valid(B, "r3"), hostile("h", 5)]
    results = [got(A, "r1"), got(A, "r1"), got(A, "r2", "failed"), got(A, "r3"), got(A, "r3")]
    verdict = judge(
        account(sent, results, []),
        scheduler_crashes=2,
        scheduler_alive=False,
        checks={"donor not planned again": False, "fine": True},
    )
    assert not verdict.ok
    text = "\n".join(verdict.reasons)
    for expected in (
        "lost: 1",
        "duplicated: 2",
        "scheduler_crashes: 2",
        "hostile not dead-lettered: 1",
        "valid requests not done: 1 (allowed 0)",
        "the scheduler is not running at the end",
        "check failed: donor not planned again",
    ):
        assert expected in text
    assert "fine" not in text


def test_judge_allows_failures_only_where_the_fault_makes_success_impossible() -> None:
    tally = account([valid(A, "r1"), valid(A, "r2")], [got(A, "r1"), got(A, "r2", "failed")], [])
    assert not judge(tally).ok
    assert judge(tally, allowed_failures=1).ok


def test_the_hostile_stream_covers_every_kind_and_interleaves_valid_requests() -> None:
    stream = list(hostile_stream("p-", 60, valid_every=10, big=2))
    hostile_kinds = {m.kind for m in stream if not m.valid}
    assert hostile_kinds == set(HOSTILE_KINDS) | {"big-prompt"}
    assert sum(m.valid for m in stream) == 6 and sum(not m.valid for m in stream) == 60
    big = [m for m in stream if m.kind == "big-prompt"]
    assert len(big) == 2 and all(len(m.value or b"") > 1_000_000 for m in big)
    assert any(m.value is None and m.key is not None for m in stream)  # a tombstone has a key
    assert all(m.request_id is None and m.key is None for m in stream if m.kind == "missing-id-no-key")
    ids = [m.request_id for m in stream if m.request_id is not None]
    assert len(ids) == len(set(ids))  # every message names a request of its own


def test_the_table_counts_hostile_messages_beside_the_valid_requests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 320 sent, 20 of them valid: the other 300 must show somewhere (they were dead-lettered)
    from workers.bench.faults.cli import _table

    entry = {"name": "hostile-input", "ok": True, "sent": 320, "valid": 20, "done": 20, "failed": 0, "rejected": 0,
             "lost": 0, "duplicated": 0, "wrong_tenant": 0, "scheduler_restarts": 0, "recover_s": None,
             "hostile": {"sent": 300, "dead_lettered": 300, "unanswered": 0}}  # fmt: skip
    _table({"quick": True, "scenarios": [entry], "state_dir": None})
    out = capsys.readouterr().out
    assert "dead lettered" in out and "hostile unanswered" in out and " 300 " in out
