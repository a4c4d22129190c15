"""The intake's donor candidates on a real index (Qdrant local mode, the SQLite ledger): a tenant's own nearest
entries and everyone's, with one search per status when everyone's nearest are the tenant's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from chorus_sched.dispatch import Dispatcher
from chorus_sched.embedding import HashingEmbedder
from chorus_sched.index import DonorEntry
from chorus_sched.service import build_scheduler
from chorus_sched.settings import SchedulerSettings

pytestmark = pytest.mark.integration

COMPAT = "toy|8x32x32|4|euler"


class _NoWorkers(Dispatcher):
    def __init__(self) -> None:
        self.broker_url = "none://"

    def generate(self, order: object) -> None:
        raise AssertionError("nothing is dispatched here")


def _entry(request_id: str, tenant: str, prompt: str) -> DonorEntry:
    return DonorEntry(
        request_id=request_id,
        tenant=tenant,
        compat_key=COMPAT,
        prompt=prompt,
        trajectory_prefix=f"t/{request_id}/",
    )


def test_a_tenant_finds_its_own_donor_behind_nearer_ones_of_others_with_one_search_when_all_are_its_own(
    tmp_path: Path,
) -> None:
    settings = SchedulerSettings(
        state_dir=tmp_path, instance_id="candidates", kafka_bootstrap="127.0.0.1:9", search_limit=3
    )
    embedder = HashingEmbedder()
    scheduler, close = build_scheduler(
        settings, embedder=embedder, dispatcher=_NoWorkers(), publish=lambda *_: None
    )
    intake, index = scheduler.intake, scheduler.intake.index
    try:
        near = "a red circle moving left on a white background"
        entries = [_entry(f"g{i}", "globex", near + " " + "x" * i) for i in range(4)]
        entries.append(_entry("a0", "acme", "a blue square spinning slowly over green grass at dusk"))
        for entry in entries:
            index.upsert(entry, embedder.embed([entry.prompt])[0])
        vector = embedder.embed([near])[0]
        searches: list[str | None] = []
        search = index.search

        def counted(*args: object, **kwargs: object) -> object:
            searches.append(kwargs.get("tenant"))  # type: ignore[arg-type]
            return search(*args, **kwargs)  # type: ignore[arg-type]

        index.search = counted  # type: ignore[method-assign,assignment]

        own, everyone = intake._candidate_sets(vector, COMPAT, "acme")
        assert [c.request_id for c in own] == ["a0"]  # behind three nearer entries of globex
        assert {c.tenant for c in everyone} == {"globex"} and len(everyone) == 3
        assert searches == [None, "acme", None]  # ready: everyone's then acme's; running: nothing to narrow

        searches.clear()
        own, everyone = intake._candidate_sets(vector, COMPAT, "globex")
        assert own == everyone and len(own) == 3
        assert searches == [None, None]  # everyone's nearest are globex's own: one search per status

        searches.clear()
        own, everyone = intake._candidate_sets(vector, COMPAT, None)  # cross-tenant reuse on
        assert own == everyone and searches == [None, None]
    finally:
        close()
