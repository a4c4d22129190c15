"""Two ``chorus scheduler`` instances (one consumer group) and three ``chorus worker`` processes over one stream.

Four families of four similar requests, plus a second copy of four of them, go out at once. Requests are keyed by
id, so they spread over the requests topic's partitions and therefore over both schedulers; the ledger, the donor
index and the broker are shared (the embedded setup shares them through the state directory). Then:

- no loss: every request has a result, and it is ``done``;
- no duplicate: every request id was dispatched once (over both schedulers' logs), started once (over the three
  workers' logs) and has exactly one result on the results topic besides the copies sent for the extra messages;
  each extra copy (a new message with a taken id) was answered once with its request's result, never run;
- both schedulers dispatched part of the stream;
- grouping holds across instances: each family has one leader, and every other member reused a donor of its own
  family (a running leader or a finished member), without falling back;
- the donor index holds every request once, as a ready donor.

``test_scheduler_instances.py`` checks the schedulers alone (no workers) down to the broker queue, including one
instance leaving mid-stream.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from producer.contract import ResultStatus, job_id
from producer.local.stack import EmbeddedStack
from producer.orders import Role
from producer.sdk import ChorusClient
from tests.helpers.e2e import (
    WAIT_S,
    check_ran_once,
    donor_index,
    events,
    request,
    stack_options,
    wait_results,
)
from tests.helpers.scheduler_fakes import recased

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAMILIES = {
    "red": "a red circle moving left on a white background",
    "blue": "a blue square moving up on a black background",
    "green": "a green triangle moving right on a gray background",
    "pink": "a pink star moving down on a brown background",
}
MEMBERS = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    root = tmp_path_factory.mktemp("e2e-scale")
    options = stack_options(
        root / "state",
        schedulers=2,
        workers=3,
        worker_concurrency=1,
        # Followers on one worker wait for leaders on another; be generous on a loaded machine.
        extra_env={"CHORUS_FOLLOWER_WAIT_S": "60"},
    )
    with EmbeddedStack(options) as running:
        yield running


def test_two_schedulers_and_three_workers_lose_nothing_duplicate_nothing_and_keep_grouping(
    stack: EmbeddedStack,
) -> None:
    tenant = "scale"
    requests = [
        # each member the same words in another text (the very same text would wait for the first's video)
        request(f"scale-{family}-{i}", recased(prompt, i), tenant, seed=i)
        for i in range(MEMBERS)
        for family, prompt in FAMILIES.items()
    ]
    ids = [r.request_id for r in requests]
    copies = requests[1::4]  # one member of each family published twice
    with ChorusClient(stack.producer_settings) as client, client.watch_results() as watcher:
        for message in requests[:8] + copies[:2] + requests[8:] + copies[2:]:
            client.submit(message)
        results = wait_results(watcher, ids)
    stack.wait_idle(timeout_s=WAIT_S)  # every copy read, every result indexed

    assert all(r.status is ResultStatus.DONE for r in results.values()), [
        (r.request_id, r.error) for r in results.values() if r.status is not ResultStatus.DONE
    ]
    check_ran_once(stack, ids)
    # each copy is a new message with a taken id: run never, answered once with its request's result
    answered = events(stack.schedulers, "request id sent again; answered with its earlier result")
    assert Counter(e["request_id"] for e in answered) == Counter(c.request_id for c in copies)

    dispatched = events(stack.schedulers, "request dispatched")
    per_scheduler = {p.name: len(events([p], "request dispatched")) for p in stack.schedulers}
    assert all(n > 0 for n in per_scheduler.values()), per_scheduler
    assert sum(per_scheduler.values()) == len(ids)

    for family in FAMILIES:
        members = [r for r in results.values() if r.request_id.startswith(f"scale-{family}-")]
        roles = Counter(e["role"] for e in dispatched if e["request_id"].startswith(f"scale-{family}-"))
        assert roles[str(Role.LEADER)] == 1, roles
        leaders = [r for r in members if r.donor is None]
        assert len(leaders) == 1, [(r.request_id, r.donor) for r in members]
        for r in members:
            if r is leaders[0]:
                assert r.steps_computed == r.steps_requested
                continue
            assert r.donor is not None and r.donor.request_id.startswith(f"scale-{family}-"), r.donor
            assert r.fallback is None, r.fallback
            assert r.steps_computed < r.steps_requested

    with donor_index(stack) as index:
        entries = [e for e in index.entries() if e.tenant == tenant]
    assert sorted(e.request_id for e in entries) == sorted(
        job_id(tenant, rid) for rid in ids
    )  # index: job ids
    assert all(e.ready for e in entries)
