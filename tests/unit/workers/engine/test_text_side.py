"""The transformer's prompt-only work kept across requests: per text row, bounded by entries and bytes, and a
row's values the same whether the cache held it or not."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from producer.contract import ReusePlan
from workers.engine import Engine
from workers.engine.text_side import TextRows, TextSideCache


def _parts(n: int) -> tuple[torch.Tensor, ...]:
    return (torch.zeros(n, dtype=torch.float32),)  # 4 bytes per element


def test_lru_by_entries_then_by_bytes() -> None:
    cache = TextSideCache(max_entries=2, max_bytes=100)
    cache.store(("w", "a"), "text", _parts(5))
    cache.store(("w", "b"), "text", _parts(5))
    assert cache.lookup(("w", "a"), "text") is not None  # a is now the most recent: b goes first
    cache.store(("w", "c"), "text", _parts(5))
    assert len(cache) == 2 and cache.lookup(("w", "b"), "text") is None
    assert cache.nbytes == 40
    cache.store(("w", "c"), "kv0", _parts(20))  # 120 bytes in all: the oldest key (a) goes
    assert cache.lookup(("w", "a"), "text") is None and cache.nbytes == 100
    assert cache.lookup(("w", "c"), "kv0") is not None and cache.lookup(("w", "c"), "kv1") is None
    cache.store(("w", "d"), "text", _parts(30))  # larger than the budget alone: kept by nothing
    assert len(cache) == 0 and cache.nbytes == 0
    assert (cache.stats.hits, cache.stats.misses) == (2, 3)


def test_zero_bounds_keep_nothing_and_negative_ones_are_refused() -> None:
    for cache in (TextSideCache(0), TextSideCache(4, max_bytes=0)):
        cache.store(("w", "a"), "text", _parts(1))
        assert len(cache) == 0 and cache.lookup(("w", "a"), "text") is None
    with pytest.raises(ValueError, match="≥ 0"):
        TextSideCache(-1)


def test_rows_are_computed_one_at_a_time_once_per_key_and_only_for_named_tensors() -> None:
    cache, rows = TextSideCache(8), TextRows()
    seen: list[int] = []

    def double(row: torch.Tensor) -> tuple[torch.Tensor, ...]:
        seen.append(row.shape[0])
        return (row * 2,)

    text = torch.arange(6.0).reshape(2, 3)
    assert rows.project(text, "text", double) is None  # nothing named yet
    rows.begin(cache, text, [("w", "p"), ("w", "")])
    out = rows.project(text, "text", double)
    assert out is not None and torch.equal(out[0], text * 2) and seen == [1, 1]
    assert rows.project(text.clone(), "text", double) is None  # another tensor: not the request's
    rows.end()
    other = torch.tensor([[9.0, 9.0, 9.0], [3.0, 4.0, 5.0]])  # a new prompt beside the same negative prompt
    rows.begin(cache, other, [("w", "q"), ("w", "")])
    again = rows.project(other, "text", double)
    assert again is not None and torch.equal(again[0], other * 2) and seen == [1, 1, 1]
    with pytest.raises(ValueError, match="row keys"):
        rows.begin(cache, other, [("w", "q")])


def _count_batches(module: torch.nn.Module, counts: Counter[str], name: str) -> Any:
    def hook(_module: Any, args: Any, _out: Any) -> None:
        counts[name] += args[0].shape[0]

    return module.register_forward_hook(hook)


def test_a_prompt_seen_before_skips_the_text_projection_and_cross_attention_kv(
    tiny_bundle, make_request
) -> None:
    engine = Engine(tiny_bundle)
    transformer: Any = tiny_bundle.transformer
    counts: Counter[str] = Counter()
    handles = [
        _count_batches(transformer.condition_embedder.text_embedder.linear_1, counts, "text"),
        _count_batches(transformer.blocks[0].attn2.to_k, counts, "k"),
    ]
    try:
        request = make_request(guidance_scale=3.0, num_steps=3)
        engine.generate(request, ReusePlan.full(3))
        assert counts == {"text": 2, "k": 2}  # the prompt and the negative prompt, once each, for all 3 steps
        engine.generate(request.model_copy(update={"seed": 11}), ReusePlan.full(3))
        assert counts == {"text": 2, "k": 2}  # the same prompt: nothing prompt-only computed again
        engine.generate(make_request("a blue square", guidance_scale=3.0, num_steps=3), ReusePlan.full(3))
        assert counts == {"text": 3, "k": 3}  # a new prompt beside the same negative prompt
    finally:
        for h in handles:
            h.remove()
    assert engine.text_cache is not None and len(engine.text_cache) == 3


def test_cached_rows_give_the_same_video_as_a_cold_cache_and_as_the_plain_model(
    tiny_bundle, plain_bundle, make_request
) -> None:
    request = make_request(guidance_scale=3.0, num_steps=3)
    warm = Engine(tiny_bundle)
    warm.generate(request.model_copy(update={"seed": 1}), ReusePlan.full(3))  # fills the prompt's rows
    from_cache = warm.generate(request, ReusePlan.full(3))
    cold = Engine(tiny_bundle, text_cache_bytes=0).generate(request, ReusePlan.full(3))
    assert torch.equal(from_cache.trajectory.latent_after(2), cold.trajectory.latent_after(2))
    plain = Engine(plain_bundle, cache_text=False).generate(request, ReusePlan.full(3))
    assert plain.trajectory is not None
    torch.testing.assert_close(from_cache.trajectory.latent_after(2), plain.trajectory.latent_after(2))


def test_the_rows_of_the_request_in_progress_are_not_evicted_for_each_other() -> None:
    cache = TextSideCache(max_entries=4, max_bytes=100)
    cache.store(("w", "old"), "text", _parts(5))
    pinned = [("w", "prompt"), ("w", "")]
    cache.store(("w", "prompt"), "text", _parts(10), pinned=pinned)
    cache.store(("w", ""), "text", _parts(11), pinned=pinned)  # 104 bytes: the unpinned key goes
    assert cache.lookup(("w", "old"), "text") is None and cache.nbytes == 84
    cache.store(("w", ""), "kv0", _parts(10), pinned=pinned)  # does not fit beside the pinned rows: not kept
    assert cache.lookup(("w", ""), "kv0") is None and cache.nbytes == 84
    assert cache.lookup(("w", "prompt"), "text") is not None and cache.lookup(("w", ""), "text") is not None
