"""An evicted donor, end to end: a stack whose donor cache has a budget of one byte evicts every finished donor at
its next maintenance (every second here). The test waits until the eviction has happened — the scheduler logged it,
the index entry is gone, the worker deleted the trajectory objects — and only then publishes a request with the same
prompt, which must run in full without a donor. The evicted request's video stays (it is the user's).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from producer.contract import ResultStatus
from producer.local.stack import EmbeddedStack
from producer.orders import Role, trajectory_prefix, video_key
from tests.helpers.e2e import (
    STEPS,
    donor_index,
    events,
    request,
    stack_options,
    submit_and_wait,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    root: Path = tmp_path_factory.mktemp("e2e-evict")
    options = stack_options(
        root / "state", extra_env={"CHORUS_CACHE_BUDGET_BYTES": "1", "CHORUS_EVICT_INTERVAL_S": "1"}
    )
    with EmbeddedStack(options) as running:
        yield running


def test_an_evicted_donor_is_gone_from_index_and_store_and_later_similar_requests_run_without_it(
    stack: EmbeddedStack,
) -> None:
    tenant, prompt = "evict", "an orange balloon floating over a quiet lake"
    first = request("evict-first", prompt, tenant, seed=1)
    done = submit_and_wait(stack, first)[first.request_id]
    assert done.status is ResultStatus.DONE and done.donor is None, done.error
    # Maintenance runs every second, so the donor can be gone before this line: that it was stored in full (so it
    # could serve as a donor) is read from what the worker deleted below, not raced against the eviction.

    store = stack.object_store()
    job = first.job_id  # the scheduler and the store know a request by its job id (ids are per tenant)
    prefix = trajectory_prefix(job)

    def evicted_by_budget() -> bool:
        return any(
            {"request_id": job, "reason": "budget"}.items() <= e.items()
            for event in events(stack.schedulers, "cache policy evicts donors")
            for e in event["evictions"]
        )

    wait_for(stack, "the scheduler evicts the donor", evicted_by_budget)

    def deletions() -> list[dict[str, object]]:
        return [e for e in events(stack.workers, "evicted donor objects") if job in e["request_ids"]]

    wait_for(stack, "the worker deletes the donor's objects", lambda: bool(deletions()))
    # Only this request was ever finished on this stack before, so its orders name it alone: header + every step.
    assert all(e["request_ids"] == [job] for e in deletions())
    assert sum(int(str(e["objects"])) for e in deletions()) == 1 + STEPS
    assert list(store.list(prefix)) == []
    assert store.exists(video_key(job, "mp4"))
    with donor_index(stack) as index:
        assert index.get(job) is None

    # the same words in another text: planned (the very same text would be served the kept video whole)
    again = request("evict-again", prompt.capitalize(), tenant, seed=2)
    result = submit_and_wait(stack, again)[again.request_id]
    assert result.status is ResultStatus.DONE, result.error
    assert result.donor is None and result.fallback is None
    assert (result.steps_computed, result.tokens_computed_fraction) == (STEPS, 1.0)
    (dispatched,) = events(stack.schedulers, "request dispatched", request_id=again.request_id)
    assert dispatched["donor"] is None and dispatched["role"] == str(Role.LEADER)
    assert dispatched["considered"] == []  # the index had nothing left to consider
