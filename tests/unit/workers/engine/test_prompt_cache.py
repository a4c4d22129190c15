"""The engine's prompt-encoding cache: bounded, least recently used out first, keyed by weights id and prompt."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from producer.contract import ReusePlan
from workers.engine import Engine, TextEncoding
from workers.engine.prompt_cache import PromptCache


def _encoding(prompt: str) -> TextEncoding:
    return TextEncoding(torch.zeros(1, 2, 3), [len(prompt), 0], [prompt, "<pad>"], [True, False])


def test_lru_keeps_the_most_recent_entries_per_weights_id() -> None:
    calls: Counter[str] = Counter()

    def encode(prompt: str) -> TextEncoding:
        calls[prompt] += 1
        return _encoding(prompt)

    cache = PromptCache(2)
    first = cache.get("w1", "a", encode)
    assert cache.get("w1", "a", encode) is first
    cache.get("w1", "b", encode)
    cache.get("w1", "a", encode)  # a is now the most recent: b goes first
    cache.get("w1", "c", encode)
    assert len(cache) == 2
    cache.get("w1", "a", encode)
    cache.get("w1", "b", encode)
    assert calls == {"a": 1, "b": 2, "c": 1}
    cache.get("w2", "a", encode)  # other weights: encoded again
    assert calls["a"] == 2 and (cache.stats.hits, cache.stats.misses) == (3, 5)


def test_capacity_zero_encodes_every_time_and_negative_is_refused() -> None:
    calls: list[str] = []

    def encode(prompt: str) -> TextEncoding:
        calls.append(prompt)
        return _encoding(prompt)

    cache = PromptCache(0)
    for _ in range(2):
        cache.get("w", "a", encode)
    assert calls == ["a", "a"] and len(cache) == 0
    with pytest.raises(ValueError, match="≥ 0"):
        PromptCache(-1)


def test_the_engine_encodes_each_prompt_once_across_requests(tiny_bundle, make_request) -> None:
    calls: Counter[str] = Counter()

    def encode(prompt: str) -> TextEncoding:
        calls[prompt] += 1
        return tiny_bundle.encode_prompt(prompt)

    engine = Engine(replace(tiny_bundle, encode_prompt=encode))
    uncached = Engine(replace(tiny_bundle, encode_prompt=encode), prompt_cache_size=0)
    request = make_request(guidance_scale=2.0, num_steps=2)
    out = engine.generate(request, ReusePlan.full(2))
    engine.generate(request.model_copy(update={"seed": 8}), ReusePlan.full(2))
    assert calls == {request.prompt: 1, "": 1}  # the prompt and the (empty) negative prompt, once each
    assert engine.prompt_cache.stats.hits == 2
    plain = uncached.generate(request, ReusePlan.full(2))
    assert calls == {request.prompt: 2, "": 2}
    assert torch.equal(out.trajectory.latent_after(1), plain.trajectory.latent_after(1))
