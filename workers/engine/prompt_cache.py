"""A bounded LRU cache of prompt encodings, so that a prompt the engine has seen is not encoded again.

Serving traffic repeats prompts: the unconditional (negative) prompt of every CFG request, exact and near
repeats, a family's base prompt. Encoding one costs a text-encoder forward (the toy's MiniLM: milliseconds on a
CPU, of the order of a small model's denoising step; Wan2.1's UMT5-XXL far more), while the encoding is a pure
function of the text encoder's weights and the prompt. Entries are keyed by ``(weights_id, prompt)``: a bundle's
``weights_id`` names the weights, so an engine whose model changes never serves another model's encoding.

Cached ``TextEncoding`` objects are shared between requests: callers must treat them as read-only (the engine
only reads them and concatenates their embeddings into a new tensor).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from workers.engine.bundle import TextEncoding

# Encodings kept by default. A toy encoding is 32 × 384 floats (48 KiB); a Wan2.1 one 512 × 4096 in the model's
# dtype (4–8 MiB), so a worker serving Wan2.1 may want fewer (``Engine(prompt_cache_size=…)``).
DEFAULT_PROMPT_CACHE_SIZE = 64


@dataclass
class PromptCacheStats:
    hits: int = 0
    misses: int = 0


class PromptCache:
    """``get(weights_id, prompt, encode)`` returns the cached encoding or calls ``encode(prompt)`` and keeps it,
    evicting the least recently used entry beyond ``capacity`` (0 keeps nothing: every call encodes)."""

    def __init__(self, capacity: int = DEFAULT_PROMPT_CACHE_SIZE) -> None:
        if capacity < 0:
            raise ValueError(f"prompt cache capacity must be ≥ 0, got {capacity}")
        self.capacity = capacity
        self.stats = PromptCacheStats()
        self._entries: OrderedDict[tuple[str, str], TextEncoding] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, weights_id: str, prompt: str, encode: Callable[[str], TextEncoding]) -> TextEncoding:
        key = (weights_id, prompt)
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return found
        self.stats.misses += 1
        encoding = encode(prompt)
        if self.capacity > 0:
            self._entries[key] = encoding
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return encoding

    def clear(self) -> None:
        self._entries.clear()
