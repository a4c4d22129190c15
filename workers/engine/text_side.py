"""The transformer's prompt-only work, kept across requests: per text row, bounded by entries and bytes (LRU).

A Wan-style DiT sees the prompt through projections that depend on nothing else: the condition embedder's text
projection (``condition_embedder.text_embedder``) and every block's cross-attention keys and values. Within one
request the SRD text hook and the ``attn2`` processor compute them once; this cache keeps them *across* requests,
per row of the text batch: the negative prompt is the same in every CFG request, and serving traffic repeats
prompts (exact repeats, new seeds, a donor's family). How much that is depends on the shape: on the serving
benchmark's mid model (Wan2.1-1.3B width, 512 text tokens against 64 latent tokens) a request's first step cost
2.3× each later one, all of it this work, so a Stage-1 hit computing one step paid for two.

Each row (CFG: row 0 the prompt, row 1 the negative prompt) is projected on its own, batch 1, so a row's values
depend neither on the row beside it nor on whether the cache held it. The engine names its text tensor's rows
(``TextRows.begin``) before a request's first pass and forgets them after (``end``); a tensor it did not name is
projected as before, whole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

RowKey = tuple[str, str]  # (weights id, prompt): the same key as the prompt-encoding cache's
Parts = tuple[torch.Tensor, ...]

# A Wan2.1-1.3B prompt row holds 6 MiB per block in float32 (K and V, 512 × 1536) plus its projection: 30 blocks
# ~183 MiB (half in bfloat16); the default holds the negative prompt and a few prompts.
DEFAULT_TEXT_CACHE_BYTES = 1024 * 1024 * 1024


@dataclass
class TextCacheStats:
    hits: int = 0
    misses: int = 0


def _nbytes(parts: Parts) -> int:
    return sum(t.numel() * t.element_size() for t in parts)


class TextSideCache:
    """Per row key, named parts (``"text"``, ``"kv0"``, …), each a tuple of batch-1 tensors. At most
    ``max_entries`` keys and ``max_bytes`` in all; the least recently used key goes first (0 keeps nothing)."""

    def __init__(self, max_entries: int, max_bytes: int = DEFAULT_TEXT_CACHE_BYTES) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("text cache bounds must be ≥ 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.stats = TextCacheStats()
        self._rows: OrderedDict[RowKey, dict[str, Parts]] = OrderedDict()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._rows)

    def lookup(self, key: RowKey, part: str) -> Parts | None:
        row = self._rows.get(key)
        found = row.get(part) if row is not None else None
        if found is None:
            self.stats.misses += 1
            return None
        self._rows.move_to_end(key)
        self.stats.hits += 1
        return found

    def store(self, key: RowKey, part: str, tensors: Parts, *, pinned: Sequence[RowKey] = ()) -> None:
        """Keep ``tensors`` as ``key``'s ``part``, evicting the least recently used keys but ``pinned`` (the
        request in progress' rows: evicting one mid-pass would only make the next request compute it again);
        what does not fit beside the pinned keys is not kept."""
        if self.max_entries == 0 or self.max_bytes == 0:
            return
        row = self._rows.setdefault(key, {})
        self._rows.move_to_end(key)
        old = row.get(part)
        self._bytes += _nbytes(tensors) - (_nbytes(old) if old is not None else 0)
        row[part] = tensors
        keep = {key, *pinned}
        for victim in [k for k in self._rows if k not in keep]:
            if len(self._rows) <= self.max_entries and self._bytes <= self.max_bytes:
                return
            self._bytes -= sum(_nbytes(p) for p in self._rows.pop(victim).values())
        if self._bytes > self.max_bytes or len(self._rows) > self.max_entries:
            self._bytes -= _nbytes(row.pop(part))  # the pinned rows alone are over the budget
            if not row:
                del self._rows[key]


@dataclass
class TextRows:
    """The request in progress: which cache its text rows are kept in, their keys, and the tensors known to hold
    those rows in order (the text handed to the transformer, then its projection). Shared by the text hook and
    the cross-attention processors of one transformer."""

    cache: TextSideCache | None = None
    keys: tuple[RowKey, ...] = ()
    _known: list[torch.Tensor] = field(default_factory=list, repr=False)

    def begin(self, cache: TextSideCache | None, text: torch.Tensor, keys: Sequence[RowKey]) -> None:
        if text.shape[0] != len(keys):
            raise ValueError(f"{len(keys)} row keys for a text batch of {text.shape[0]}")
        self.cache, self.keys, self._known = cache, tuple(keys), [text]

    def end(self) -> None:
        self.cache, self.keys, self._known = None, (), []

    def project(
        self, tensor: torch.Tensor, part: str, compute: Callable[[torch.Tensor], Parts]
    ) -> Parts | None:
        """``compute`` of each row of ``tensor`` (given the batch-1 row), from the cache where it holds it, the
        rows concatenated back; None when ``tensor`` is not one of the request's named tensors."""
        cache = self.cache
        if cache is None or not any(t is tensor for t in self._known):
            return None
        per_row: list[Parts] = []
        for r, key in enumerate(self.keys):
            got = cache.lookup(key, part)
            if got is None:
                got = compute(tensor[r : r + 1])
                cache.store(key, part, got, pinned=self.keys)
            per_row.append(got)
        if len(per_row) == 1:
            return per_row[0]
        return tuple(torch.cat(pieces) for pieces in zip(*per_row, strict=True))

    def derived(self, tensor: torch.Tensor) -> None:
        """``tensor`` holds the request's rows too (a row-wise function of a named tensor)."""
        if self.cache is not None:
            self._known.append(tensor)
