from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chorus_sched.cache import CachePolicy, Eviction, last_used, plan_evictions, value
from chorus_sched.index import DonorEntry

NOW = 1_000_000.0
DAY = 24 * 3600.0
POLICY = CachePolicy(
    budget_bytes=1000, ttl_s=7 * DAY, half_life_s=DAY, new_entry_credit=0.25, leader_stale_s=600
)


def entry(
    rid: str,
    *,
    size: int = 100,
    hits: int = 0,
    saved: float = 0.0,
    age: float = 0.0,
    idle: float | None = None,
    steps: int = 4,
    status: str = "ready",
) -> DonorEntry:
    created = NOW - age
    return DonorEntry(
        request_id=rid,
        tenant="t",
        compat_key="k",
        prompt="p",
        trajectory_prefix=f"trajectories/{rid}/",
        status=status,
        bytes=size,
        num_steps=steps,
        created_at=created,
        last_hit_at=None if idle is None else NOW - idle,
        hits=hits,
        steps_saved=saved,
    )


def test_within_budget_and_fresh_nothing_is_evicted() -> None:
    assert plan_evictions([entry("a"), entry("b")], NOW, POLICY) == []


def test_value_is_steps_saved_per_byte_halved_per_half_life_of_idleness() -> None:
    fresh = entry("a", size=100, saved=9.0)  # 9 saved + 0.25·4 credit = 10 steps over 100 bytes
    assert value(fresh, NOW, POLICY) == pytest.approx(0.1)
    assert value(entry("b", size=100, saved=9.0, age=DAY), NOW, POLICY) == pytest.approx(0.05)
    assert value(entry("c", size=200, saved=9.0), NOW, POLICY) == pytest.approx(0.05)
    # a recent hit makes an old entry young again
    assert value(entry("d", size=100, saved=9.0, age=5 * DAY, idle=0.0), NOW, POLICY) == pytest.approx(0.1)
    assert last_used(entry("e", age=10.0, idle=3.0)) == NOW - 3.0


def test_over_budget_the_least_valuable_go_first_until_within_budget() -> None:
    entries = [
        entry("useful", size=400, hits=3, saved=6.0),
        entry("unused-big", size=400),
        entry("unused-small", size=300),
    ]
    evicted = plan_evictions(entries, NOW, POLICY)
    # 1100 bytes over a 1000 budget: the lowest value per byte is the big unused one
    assert [(e.request_id, e.reason) for e in evicted] == [("unused-big", "budget")]
    assert evicted[0].score == pytest.approx(1.0 / 400)


def test_many_hits_outweigh_recency_but_enough_idleness_loses() -> None:
    popular_but_idle = entry("popular", size=500, hits=10, saved=20.0, age=6 * DAY, idle=6 * DAY)
    new = entry("new", size=500)
    kept = plan_evictions([popular_but_idle, new, entry("x", size=100)], NOW, POLICY)
    # popular: 21/500 · 2^-6 ≈ 6.6e-4 < new: 1/500 = 2e-3 → popular goes
    assert [e.request_id for e in kept] == ["popular"]
    popular_recent = entry("popular", size=500, hits=10, saved=20.0, age=6 * DAY, idle=0.0)
    assert [
        e.request_id for e in plan_evictions([popular_recent, new, entry("x", size=100)], NOW, POLICY)
    ] == ["new"]


def test_ttl_evicts_donors_unused_for_too_long_whatever_their_value() -> None:
    old = entry("old", size=1, hits=100, saved=400.0, age=8 * DAY)
    old_but_hit = entry("hit", size=1, age=8 * DAY, idle=DAY)
    assert plan_evictions([old, old_but_hit], NOW, POLICY) == [Eviction("old", "ttl", 1)]


def test_running_leaders_are_never_budget_victims_but_stale_ones_are_dropped() -> None:
    running = entry("running", size=0, age=60, status="running")
    stale = entry("stale", size=0, age=601, status="running")
    big = entry("big", size=5000)
    evicted = plan_evictions([running, stale, big], NOW, POLICY)
    assert [(e.request_id, e.reason) for e in evicted] == [("stale", "stale-leader"), ("big", "budget")]


def test_ties_are_broken_by_least_recent_use_then_request_id() -> None:
    a = entry("a", size=600, age=10)
    b = entry("b", size=600, age=20)
    c = entry("c", size=600, age=20)
    # equal bytes and credit; b and c are older (lower value, aged) — b first by id
    assert [e.request_id for e in plan_evictions([a, b, c], NOW, POLICY)] == ["b", "c"]


def test_zero_budget_evicts_every_finished_donor_with_bytes() -> None:
    policy = CachePolicy(budget_bytes=0, ttl_s=DAY, half_life_s=DAY)
    evicted = plan_evictions([entry("a"), entry("b", size=0), entry("c")], NOW, policy)
    assert sorted(e.request_id for e in evicted) == ["a", "c"]


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError):
        CachePolicy(budget_bytes=-1, ttl_s=1, half_life_s=1)
    with pytest.raises(ValueError):
        CachePolicy(budget_bytes=1, ttl_s=0, half_life_s=1)
    with pytest.raises(ValueError):
        CachePolicy(budget_bytes=1, ttl_s=1, half_life_s=1, new_entry_credit=2)


entries_strategy = st.lists(
    st.builds(
        entry,
        st.uuids().map(str),
        size=st.integers(0, 2000),
        hits=st.integers(0, 50),
        saved=st.floats(0, 500),
        age=st.floats(0, 10 * DAY),
        idle=st.none() | st.floats(0, DAY),
        status=st.sampled_from(["ready", "ready", "running"]),
    ),
    max_size=25,
    unique_by=lambda e: e.request_id,
)


@given(entries_strategy, st.integers(0, 10_000))
def test_policy_invariants(entries: list[DonorEntry], budget: int) -> None:
    policy = CachePolicy(budget_bytes=budget, ttl_s=7 * DAY, half_life_s=DAY, leader_stale_s=3600)
    evicted = plan_evictions(entries, NOW, policy)
    ids = [e.request_id for e in evicted]
    assert len(ids) == len(set(ids))
    by_id = {e.request_id: e for e in entries}
    kept = [e for e in entries if e.request_id not in set(ids)]
    # within budget afterwards
    assert sum(e.bytes for e in kept if e.ready) <= budget
    for ev in evicted:
        source = by_id[ev.request_id]
        if ev.reason == "budget":
            assert source.ready and source.bytes > 0
            # nothing kept that competed for the budget was worth less than an evicted one
            for other in kept:
                if other.ready and other.bytes > 0 and NOW - last_used(other) <= policy.ttl_s:
                    assert value(other, NOW, policy) >= value(source, NOW, policy)
        elif ev.reason == "ttl":
            assert source.ready and NOW - last_used(source) > policy.ttl_s
        else:
            assert not source.ready and NOW - source.created_at > policy.leader_stale_s
    # running leaders that are not stale always stay
    for e in entries:
        if not e.ready and NOW - e.created_at <= policy.leader_stale_s:
            assert e.request_id not in ids
