"""Prompt embeddings (pluggable) and the word-level difference between two prompts.

Cosine similarity of sentence embeddings says how close two prompts are *overall*; it cannot say whether the
words that differ matter ("a red circle …" vs "a blue circle …" scores 0.84 with MiniLM, yet a donor of the
other color commits the wrong color early in the trajectory). So the planner looks at both: the similarity
and ``word_diff``, which names the words of each prompt that the other does not have.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import re
import threading
import unicodedata
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Protocol, runtime_checkable

from chorus_sched.minilm import MiniLMEmbedder, Precision

__all__ = [
    "CachedEmbedder", "Embedder", "HashingEmbedder", "MiniLMEmbedder", "WordDiff", "cosine", "make_embedder",
    "word_diff", "words",
]  # fmt: skip

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")


@runtime_checkable
class Embedder(Protocol):
    """Maps prompts to unit-length vectors; cosine similarity is then a dot product."""

    @property
    def name(self) -> str: ...

    @property
    def dim(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> list[list[float]]: ...

    @property
    def similarity_tolerance(self) -> float:
        """How far its similarities may be from the reference numbers the calibration was measured with (0: they
        are those numbers); the planner widens its thresholds by it."""
        ...


class HashingEmbedder:
    """Signed feature hashing of words and word pairs: no model, no dependencies, deterministic.

    Much cruder than MiniLM (it knows no synonyms); meant for constrained machines and tests. Its similarity
    scale differs from MiniLM's, so a calibration table made for one does not transfer to the other.
    """

    def __init__(self, dim: int = 384) -> None:
        if dim < 8:
            raise ValueError("dim must be at least 8")
        self.dim = dim
        self.name = f"hashing-{dim}"
        self.similarity_tolerance = 0.0

    def _features(self, text: str) -> list[str]:
        tokens = words(text)
        return tokens + [f"{a} {b}" for a, b in itertools.pairwise(tokens)]

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        out = []
        for text in texts:
            vector = [0.0] * self.dim
            for feature in self._features(text):
                digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
                value = int.from_bytes(digest, "big")
                vector[value % self.dim] += 1.0 if (value >> 63) & 1 else -1.0
            norm = math.sqrt(sum(v * v for v in vector))
            out.append([v / norm for v in vector] if norm > 0 else vector)
        return out


class CachedEmbedder:
    """Another embedder behind a bounded cache of prompt → vector (least recently used goes first).

    Each request's prompt was embedded twice: by intake to search for donors, and again by feedback to index the
    finished request as a donor — the largest share of the scheduler's time per request (``chorus bench sched``:
    MiniLM's forward passes). Traffic also repeats prompts (the same prompt with another seed, resubmissions), so
    one cache serves both. Shared by the intake and feedback threads, hence the lock; embedding runs outside it.
    """

    def __init__(self, inner: Embedder, max_entries: int = 4096) -> None:
        self.inner = inner
        self.max_entries = max_entries
        self._cache: OrderedDict[str, list[float]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def dim(self) -> int:
        return self.inner.dim

    @property
    def similarity_tolerance(self) -> float:
        return self.inner.similarity_tolerance

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        found: dict[str, list[float]] = {}
        with self._lock:
            for text in texts:
                vector = self._cache.get(text)
                if vector is not None:
                    self._cache.move_to_end(text)
                    found[text] = vector
        missing = list(dict.fromkeys(t for t in texts if t not in found))
        fresh = dict(zip(missing, self.inner.embed(missing), strict=True)) if missing else {}
        with self._lock:
            self.hits += len(texts) - len(missing)
            self.misses += len(missing)
            for text, vector in fresh.items():
                self._cache[text] = vector
                self._cache.move_to_end(text)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return [list(found.get(t) or fresh[t]) for t in texts]


def make_embedder(
    kind: str, *, device: str = "cpu", threads: int | None = None, precision: Precision = "float32"
) -> Embedder:
    if kind == "minilm":
        return CachedEmbedder(MiniLMEmbedder(device=device, threads=threads, precision=precision))
    if kind == "hashing":
        return CachedEmbedder(HashingEmbedder())
    raise ValueError(f"unknown embedder {kind!r} (known: minilm, hashing)")


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na > 0 and nb > 0 else 0.0


def words(text: str) -> list[str]:
    """The prompt's words, case- and compatibility-normalized (NFKC), punctuation dropped."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


@dataclass(frozen=True)
class WordDiff:
    """Words of each prompt that the other does not have, aligned in order (a longest common subsequence).

    Order matters on purpose: "red circle on a blue background" and "blue circle on a red background" have the
    same words but differ, and the alignment reports it.
    """

    donor_words: tuple[str, ...]
    target_words: tuple[str, ...]
    # indices into donor_words / target_words of the words left unmatched (replaced, deleted or inserted)
    donor_positions: tuple[int, ...]
    target_positions: tuple[int, ...]

    @property
    def donor_only(self) -> tuple[str, ...]:
        return tuple(self.donor_words[i] for i in self.donor_positions)

    @property
    def target_only(self) -> tuple[str, ...]:
        return tuple(self.target_words[i] for i in self.target_positions)

    @property
    def identical(self) -> bool:
        return not self.donor_positions and not self.target_positions

    @property
    def matched(self) -> int:
        return len(self.target_words) - len(self.target_positions)

    @property
    def changed_fraction(self) -> float:
        """Share of words on both sides left unmatched (0: same words in the same order, 1: nothing in common)."""
        total = len(self.donor_words) + len(self.target_words)
        return 1.0 if total == 0 else 1.0 - 2 * self.matched / total

    def content_changes(self, ignorable: frozenset[str] = frozenset()) -> int:
        """How many word slots differ, not counting ignorable (function) words: max of both sides."""
        donor = sum(1 for w in self.donor_only if w not in ignorable)
        target = sum(1 for w in self.target_only if w not in ignorable)
        return max(donor, target)

    def describe(self) -> str:
        if self.identical:
            return "same words"
        return f"-{list(self.donor_only)} +{list(self.target_only)}"


_LCS_MAX_CELLS = 250_000  # beyond this (prompts of ~500 words each) fall back to difflib's heuristic


def _aligned_pairs(a: Sequence[str], b: Sequence[str]) -> list[tuple[int, int]]:
    """Positions of a longest common subsequence of ``a`` and ``b`` (the fewest words left unmatched).

    difflib's longest-matching-block heuristic is not minimal with repeated words ("a … a"), which would
    report unchanged words as differences; a plain LCS table is, and prompts are short.
    """
    # A common head and tail belong to a longest common subsequence: only the middle needs the table, and the
    # prompts of similar requests mostly share both (the scheduler aligns each request with ~8 candidates).
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    middle = _middle_pairs(a[head : len(a) - tail], b[head : len(b) - tail])
    return (
        [(k, k) for k in range(head)]
        + [(i + head, j + head) for i, j in middle]
        + [(len(a) - tail + k, len(b) - tail + k) for k in range(tail)]
    )


def _middle_pairs(a: Sequence[str], b: Sequence[str]) -> list[tuple[int, int]]:
    n, m = len(a), len(b)
    if n * m > _LCS_MAX_CELLS:
        pairs: list[tuple[int, int]] = []
        for block in SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks():
            pairs.extend((block.a + k, block.b + k) for k in range(block.size))
        return pairs
    table = [[0] * (m + 1) for _ in range(n + 1)]  # table[i][j]: LCS length of a[i:], b[j:]
    for i in range(n - 1, -1, -1):
        row, below, ai = table[i], table[i + 1], a[i]
        for j in range(m - 1, -1, -1):
            if ai == b[j]:
                row[j] = below[j + 1] + 1
            else:
                down, right = below[j], row[j + 1]
                row[j] = down if down >= right else right
    pairs = []
    i = j = 0
    while i < n and j < m:
        if a[i] == b[j]:
            pairs.append((i, j))
            i += 1
            j += 1
        elif table[i + 1][j] >= table[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


@functools.lru_cache(maxsize=8192)
def word_diff(donor_prompt: str, target_prompt: str) -> WordDiff:
    """Cached: the scheduler compares one request with the same candidates several times (own tenant and
    everyone, ready and running), and traffic repeats prompts; a ``WordDiff`` is immutable."""
    donor = words(donor_prompt)
    target = words(target_prompt)
    pairs = _aligned_pairs(donor, target)
    donor_matched = {i for i, _ in pairs}
    target_matched = {j for _, j in pairs}
    return WordDiff(
        donor_words=tuple(donor),
        target_words=tuple(target),
        donor_positions=tuple(i for i in range(len(donor)) if i not in donor_matched),
        target_positions=tuple(i for i in range(len(target)) if i not in target_matched),
    )
