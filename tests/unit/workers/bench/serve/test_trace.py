from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.bench.serve import trace
from workers.bench.serve.trace import TraceKind, TraceSpec, Variant

kinds = st.sampled_from(list(TraceKind))
sizes = st.integers(min_value=1, max_value=60)
seeds = st.integers(min_value=0, max_value=10_000)
rates = st.one_of(st.none(), st.floats(min_value=0.1, max_value=100.0))


@settings(max_examples=40, deadline=None)
@given(kind=kinds, n=sizes, seed=seeds, rate=rates)
def test_same_spec_same_trace(kind: TraceKind, n: int, seed: int, rate: float | None) -> None:
    spec = TraceSpec(kind=kind, requests=n, seed=seed, rate=rate)
    assert trace.generate(spec) == trace.generate(spec)


@settings(max_examples=40, deadline=None)
@given(kind=kinds, n=sizes, seed=seeds, rate=rates)
def test_arrivals(kind: TraceKind, n: int, seed: int, rate: float | None) -> None:
    items = trace.generate(TraceSpec(kind=kind, requests=n, seed=seed, rate=rate))
    assert [i.index for i in items] == list(range(n))
    times = [i.at_s for i in items]
    assert times == sorted(times) and times[0] == 0.0
    if rate is None:  # closed loop: everything at once
        assert set(times) == {0.0}


@settings(max_examples=30, deadline=None)
@given(n=st.integers(min_value=2, max_value=200), seed=seeds)
def test_mixed_counts_follow_the_shares(n: int, seed: int) -> None:
    items = trace.generate(TraceSpec(requests=n, seed=seed))
    counts = trace.variant_counts(items)
    for variant, share in trace.MIXED_SHARES.items():
        expected = share * (n - 1) + (1 if variant is Variant.FRESH else 0)
        assert abs(counts[str(variant)] - expected) < 1.0 + 1e-9


@settings(max_examples=30, deadline=None)
@given(n=sizes, seed=seeds)
def test_variants_mean_what_they_say(n: int, seed: int) -> None:
    items = trace.generate(TraceSpec(requests=n, seed=seed))
    bases = {i.family: i for i in items if i.variant is Variant.FRESH}
    assert items[0].variant is Variant.FRESH
    for item in items:
        base = bases[item.family]
        assert base.index <= item.index  # a family is opened before it is revisited
        changed = {k for k in base.attributes if base.attributes[k] != item.attributes[k]}
        if item.variant is Variant.EXACT:
            assert (item.prompt, item.seed) == (base.prompt, base.seed)
        elif item.variant is Variant.RESEED:
            assert item.prompt == base.prompt and not changed
        elif item.variant is Variant.PARAPHRASE:
            assert not changed
        elif item.variant is Variant.ONE_ATTRIBUTE:
            assert len(changed) == 1 and item.prompt != base.prompt
        elif item.variant is Variant.TWO_ATTRIBUTES:
            assert len(changed) == 2


@settings(max_examples=20, deadline=None)
@given(n=sizes, seed=seeds)
def test_fresh_trace_has_no_two_alike(n: int, seed: int) -> None:
    items = trace.generate(TraceSpec(kind=TraceKind.FRESH, requests=n, seed=seed))
    assert all(i.variant is Variant.FRESH for i in items)
    assert len({(i.prompt, i.seed) for i in items}) == n


def test_duplicates_repeat_one_request() -> None:
    items = trace.generate(TraceSpec(kind=TraceKind.DUPLICATES, requests=10, seed=3))
    assert len({(i.prompt, i.seed) for i in items}) == 1


def test_prompts_name_the_attributes_the_checker_expects() -> None:
    values = trace.attribute_values()
    for item in trace.generate(TraceSpec(requests=30, seed=1)):
        assert set(item.attributes) == set(values)
        assert all(item.attributes[k] in values[k] for k in values)


def test_open_loop_rate_is_about_right() -> None:
    items = trace.generate(TraceSpec(requests=2000, seed=0, rate=10.0))
    assert items[-1].at_s / (len(items) - 1) == pytest.approx(0.1, rel=0.1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"requests": 0}, "at least one"),
        ({"rate": 0.0}, "positive"),
        ({"shares": {Variant.FRESH: 0.5}}, "sum to 1"),
        ({"shares": {Variant.FRESH: 0.0, Variant.EXACT: 1.0}}, "fresh share"),
    ],
)
def test_bad_specs_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TraceSpec(**fields)  # type: ignore[arg-type]
