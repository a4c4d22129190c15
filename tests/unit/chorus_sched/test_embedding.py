from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chorus_sched.embedding import (
    CachedEmbedder,
    Embedder,
    HashingEmbedder,
    MiniLMEmbedder,
    cosine,
    make_embedder,
    word_diff,
    words,
)
from chorus_sched.minilm import _frozen_pipeline

word = st.text(alphabet="abcdefghij", min_size=1, max_size=4)
prompts = st.lists(word, min_size=0, max_size=12)


def test_words_are_case_folded_and_punctuation_free() -> None:
    assert words("A Red circle, moving LEFT — on a white background!") == [
        "a", "red", "circle", "moving", "left", "on", "a", "white", "background",
    ]  # fmt: skip
    assert words("the shape's path") == ["the", "shape's", "path"]
    assert words("ＲＥＤ") == ["red"]  # compatibility forms normalize


def test_a_color_swap_is_one_word_each_side() -> None:
    diff = word_diff(
        "a red circle moving left on a white background", "a blue circle moving left on a white background"
    )
    assert diff.donor_only == ("red",)
    assert diff.target_only == ("blue",)
    assert diff.target_positions == (1,)
    assert diff.content_changes() == 1
    assert not diff.identical
    assert diff.describe() == "-['red'] +['blue']"


def test_same_words_in_a_new_order_are_a_difference() -> None:
    diff = word_diff("red circle on a blue background", "blue circle on a red background")
    assert not diff.identical
    assert diff.content_changes() >= 1


def test_ignorable_words_do_not_count_as_content_changes() -> None:
    diff = word_diff("a red circle on the white background", "red circle over white background")
    assert set(diff.donor_only) == {"a", "on", "the"}
    assert diff.target_only == ("over",)
    assert diff.content_changes(frozenset({"a", "on", "the", "over"})) == 0
    assert diff.content_changes() == 3


@given(prompts)
def test_a_prompt_does_not_differ_from_itself(ws: list[str]) -> None:
    text = " ".join(ws)
    diff = word_diff(text, text)
    assert diff.identical
    assert diff.changed_fraction == (0.0 if ws else 1.0)
    assert diff.content_changes() == 0


@given(prompts, prompts)
def test_diff_accounts_for_every_word(a: list[str], b: list[str]) -> None:
    diff = word_diff(" ".join(a), " ".join(b))
    assert diff.donor_words == tuple(a) and diff.target_words == tuple(b)
    # the matched words are the same sequence on both sides
    kept_a = [w for i, w in enumerate(a) if i not in diff.donor_positions]
    kept_b = [w for i, w in enumerate(b) if i not in diff.target_positions]
    assert kept_a == kept_b
    assert diff.matched == len(kept_b)
    assert 0.0 <= diff.changed_fraction <= 1.0
    assert diff.identical == (a == b)


def _lcs_length(a: list[str], b: list[str]) -> int:
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


@given(prompts, prompts, prompts, prompts)
def test_the_alignment_is_a_longest_common_subsequence_around_a_shared_head_and_tail(
    head: list[str], a: list[str], b: list[str], tail: list[str]
) -> None:
    # the alignment tables only the middle between a common head and tail; it must stay as long as a full table's
    donor, target = head + a + tail, head + b + tail
    diff = word_diff(" ".join(donor), " ".join(target))
    assert diff.matched == _lcs_length(donor, target)


@given(prompts, st.data())
def test_inserting_a_new_word_is_exactly_one_target_only_word(ws: list[str], data: st.DataObject) -> None:
    position = data.draw(st.integers(0, len(ws)))
    new = "zzz"  # outside the alphabet of the other words
    target = [*ws[:position], new, *ws[position:]]
    diff = word_diff(" ".join(ws), " ".join(target))
    assert diff.target_only == (new,)
    assert diff.target_positions == (position,)
    assert diff.donor_only == ()


@given(st.lists(word, min_size=1, max_size=12), st.data())
def test_replacing_one_word_with_a_new_one_is_one_content_change(ws: list[str], data: st.DataObject) -> None:
    position = data.draw(st.integers(0, len(ws) - 1))
    target = list(ws)
    target[position] = "zzz"
    diff = word_diff(" ".join(ws), " ".join(target))
    assert diff.content_changes() == 1
    assert diff.target_only == ("zzz",)


def test_hashing_embedder_gives_unit_vectors_and_same_text_same_vector() -> None:
    embedder = make_embedder("hashing")
    assert isinstance(embedder, Embedder)
    a, b, c = embedder.embed(["a red circle", "a red circle", "a blue square moving up"])
    assert len(a) == embedder.dim == 384
    assert math.isclose(sum(x * x for x in a), 1.0, rel_tol=1e-9)
    assert a == b
    assert cosine(a, b) == pytest.approx(1.0)
    assert cosine(a, c) < 0.9
    assert embedder.embed([]) == []
    assert HashingEmbedder(dim=16).embed([""])[0] == [0.0] * 16


def test_unknown_embedder_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown embedder 'clip'"):
        make_embedder("clip")


@pytest.mark.slow
def test_minilm_embeds_in_one_batch_and_a_color_swap_still_scores_high() -> None:
    """The FINDINGS case: cosine alone calls a color swap a close donor (which the planner must refuse)."""
    embedder = MiniLMEmbedder()
    assert isinstance(embedder, Embedder)
    red, blue, same = embedder.embed(
        [
            "a red circle moving left on a white background",
            "a blue circle moving left on a white background",
            "a red circle moving left on a white background",
        ]
    )
    assert len(red) == 384
    assert math.isclose(sum(x * x for x in red), 1.0, rel_tol=1e-4)
    assert cosine(red, same) == pytest.approx(1.0, abs=1e-5)
    assert 0.75 < cosine(red, blue) < 0.92


@pytest.mark.slow
def test_minilm_direct_pipeline_gives_the_packages_vectors() -> None:
    """The embedder runs BERT, mean pooling and normalization as its own graph; the vectors are
    sentence-transformers'."""
    import numpy as np

    prompts = [
        "a red circle",
        "a blue square moving slowly to the right across a grey background, then stopping",
        "ein rotes Quadrat",
        "",
    ] * 3
    embedder = MiniLMEmbedder(batch_size=5)  # batches of unequal padding, split across graph calls
    direct = np.asarray(embedder.embed(prompts))
    assert embedder._graph is not None
    reference = embedder._load().encode(prompts, normalize_embeddings=True, convert_to_numpy=True)
    assert np.abs(direct - reference).max() < 1e-5


def test_a_pipeline_other_than_mean_pooling_is_left_to_encode() -> None:
    # Stages are recognised by their class names, so stand-ins named like sentence-transformers' modules do.
    class Transformer:
        """The encoder stage."""

    class Pooling:
        """A pooling stage of another mode than mean."""

        pooling_mode = "cls"

    class Normalize:
        """The normalization stage."""

    assert _frozen_pipeline([Transformer(), Pooling(), Normalize()]) is None
    assert _frozen_pipeline([Transformer()]) is None


@pytest.mark.slow
def test_a_graph_that_disagrees_with_encode_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def wrong(graph: Any, *args: Any, **kwargs: Any) -> Any:
        return lambda input_ids, attention_mask: torch.zeros(input_ids.shape[0], 384)

    monkeypatch.setattr(torch.jit, "optimize_for_inference", wrong)
    embedder = MiniLMEmbedder()
    vector = embedder.embed(["a red circle"])[0]
    assert embedder._graph is None  # fell back to encode
    assert math.isclose(sum(x * x for x in vector), 1.0, rel_tol=1e-4)


@pytest.mark.slow
def test_minilm_runs_on_the_threads_it_is_given() -> None:
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        vectors = make_embedder("minilm", threads=1).embed(["a red circle moving left on a white background"])
        assert len(vectors[0]) == 384 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_repeated_words_are_not_reported_as_differences() -> None:
    diff = word_diff("a red circle on a white background", "a big red circle on a white background")
    assert diff.target_only == ("big",)
    assert diff.donor_only == ()


def test_very_long_prompts_fall_back_to_the_block_heuristic() -> None:
    long = " ".join(f"w{i % 50}" for i in range(600))
    diff = word_diff(long, long + " extra")
    assert diff.target_only == ("extra",)


class _Counting:
    name, dim, similarity_tolerance = "counting", 8, 0.0

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.inner = HashingEmbedder(dim=8)

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.seen += texts
        return self.inner.embed(texts)


def test_cached_embedder_embeds_each_prompt_once_and_forgets_the_oldest() -> None:
    inner = _Counting()
    cached = CachedEmbedder(inner, max_entries=2)
    first = cached.embed(["a red circle", "a blue square", "a red circle"])
    assert inner.seen == ["a red circle", "a blue square"]
    assert first[0] == first[2] == inner.inner.embed(["a red circle"])[0]
    assert cached.embed(["a blue square"]) == [first[1]] and inner.seen == ["a red circle", "a blue square"]
    cached.embed(["a green triangle"])  # evicts the least recently used: the red circle
    cached.embed(["a red circle"])
    assert inner.seen[-1] == "a red circle" and cached.hits == 2 and cached.misses == 4
    assert cached.name == "counting" and cached.dim == 8


# Other prompts than the embedder's own probe set: the tolerance must hold beyond what it was checked on.
_HELD_OUT = [
    "a yellow triangle moving right on a black background",
    "a yellow square moving right on a black background",
    "the triangle, yellow, heads right against black",
    "a red circle moving left on a white background",
    "a red circle beside a blue square",
    "a blue circle beside a red square",
    "a person walking a dog through a snowy park at night",
    "no circle at all, only a white background",
]


def _similarities(vectors: list[list[float]]) -> list[float]:
    return [cosine(a, b) for i, a in enumerate(vectors) for b in vectors[i + 1 :]]


@pytest.mark.slow
def test_minilm_in_bfloat16_keeps_similarities_within_its_tolerance() -> None:
    from chorus_sched.minilm import BF16_TOLERANCE

    reference = MiniLMEmbedder(precision="float32")
    fast = MiniLMEmbedder(precision="bfloat16")
    assert (reference.similarity_tolerance, fast.similarity_tolerance) == (0.0, BF16_TOLERANCE)
    ref, got = _similarities(reference.embed(_HELD_OUT)), _similarities(fast.embed(_HELD_OUT))
    shifts = [abs(a - b) for a, b in zip(ref, got, strict=True)]
    assert max(shifts) <= BF16_TOLERANCE
    assert max(shifts) > 0  # bfloat16 numbers indeed: float32's would be equal to ~1e-7
    assert (reference.numbers, fast.numbers) == ("float32", "bfloat16")
    alone = _similarities([fast.embed([p])[0] for p in _HELD_OUT])  # other padding, other kernels
    assert max(abs(a - b) for a, b in zip(ref, alone, strict=True)) <= BF16_TOLERANCE
    assert all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4) for v in fast.embed(_HELD_OUT))


@pytest.mark.slow
def test_auto_precision_follows_the_cpu_and_keeps_its_margin_either_way(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import chorus_sched.minilm as minilm

    reference = MiniLMEmbedder(precision="float32").embed(_HELD_OUT)
    monkeypatch.setattr(minilm, "bf16_hardware", lambda: False)
    without = MiniLMEmbedder(precision="auto")
    assert without.embed(_HELD_OUT) == reference and without.numbers == "float32"  # float32's very numbers
    assert without.probe_timings is None  # nothing to time without the instructions
    # the vectors it writes share an index with bfloat16 ones elsewhere: the margin stays
    assert without.similarity_tolerance == minilm.BF16_TOLERANCE
    monkeypatch.setattr(minilm, "bf16_hardware", lambda: True)
    # With the instructions, the timing at load decides: bfloat16 only where it is faster.
    slower = {"alone_ms": {}, "batch_ms": {}, "bfloat16_pays": False}
    monkeypatch.setattr(minilm, "_probe_timings", lambda *args: slower)
    not_faster = MiniLMEmbedder(precision="auto")
    with caplog.at_level("INFO", logger="chorus_sched.minilm"):
        assert not_faster.embed(_HELD_OUT) == reference
    assert not_faster.numbers == "float32" and "bfloat16 is not faster" in caplog.text
    assert not_faster.similarity_tolerance == minilm.BF16_TOLERANCE

    def broken(*args: object) -> None:
        raise RuntimeError("no timer here")

    monkeypatch.setattr(minilm, "_probe_timings", broken)
    unchecked = MiniLMEmbedder(precision="auto")
    with caplog.at_level("WARNING", logger="chorus_sched.minilm"):
        assert unchecked.embed(_HELD_OUT) == reference  # loads (the scheduler starts) in float32
    assert unchecked.numbers == "float32" and "bfloat16 graph not checked" in caplog.text
    monkeypatch.setattr(minilm, "_probe_timings", lambda *args: {**slower, "bfloat16_pays": True})
    faster = MiniLMEmbedder(precision="auto")
    with_bf16 = faster.embed(_HELD_OUT)
    assert with_bf16 != reference and faster.numbers == "bfloat16" and faster.probe_timings is not None
    shifts = [abs(a - b) for a, b in zip(_similarities(reference), _similarities(with_bf16), strict=True)]
    assert max(shifts) <= minilm.BF16_TOLERANCE


class _Batch(dict[str, Any]):
    def to(self, device: str) -> _Batch:
        return self


class _FakeMiniLM:
    """What ``_probe_timings`` uses of the model: a tokenizer of fixed-length ids, and the device."""

    device = "cpu"

    @staticmethod
    def tokenizer(texts: list[str], **_: object) -> _Batch:
        import torch

        ids = torch.ones((len(texts), 4), dtype=torch.long)
        return _Batch(input_ids=ids, attention_mask=ids)


def _timings(monkeypatch: pytest.MonkeyPatch, ms32: tuple[float, float], ms16: tuple[float, float]) -> Any:
    """``_probe_timings`` on fake graphs that take (alone, per prompt batched) ms on a fake clock, except in their
    warm-up rounds (a graph not yet specialized runs otherwise), which the timing must leave out."""
    import torch

    import chorus_sched.minilm as minilm

    now = [0.0]
    monkeypatch.setattr(minilm, "_clock", lambda: now[0])

    def graph(ms: tuple[float, float]) -> Any:
        calls = [0]

        def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            n = len(input_ids)
            if (calls[0] - 1) % 10 >= 5:  # the warm-up rounds take no time: counted, they would win
                now[0] += (ms[0] if n == 1 else ms[1] * n) / 1000
            return torch.zeros((n, 3))

        return run

    return minilm._probe_timings(_FakeMiniLM(), graph(ms32), graph(ms16))


def test_the_timing_at_load_picks_bfloat16_only_when_it_is_faster_alone_and_clearly_in_total(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    faster = _timings(monkeypatch, ms32=(8.0, 4.5), ms16=(6.0, 2.5))
    assert faster["bfloat16_pays"] is True
    assert faster["alone_ms"] == {"float32": 8.0, "bfloat16": 6.0}  # the warm-up rounds left out
    assert faster["batch_ms"] == {"float32": 45.0, "bfloat16": 25.0}  # the ten probe prompts at once
    assert _timings(monkeypatch, ms32=(6.0, 2.5), ms16=(8.0, 4.5))["bfloat16_pays"] is False
    # as fast as float32 is not enough: bfloat16 costs the planner a margin, so it has to buy something
    assert _timings(monkeypatch, ms32=(8.0, 4.5), ms16=(8.0, 4.2))["bfloat16_pays"] is False
    # much faster in a backlog, slower alone: light traffic would pay for it
    assert _timings(monkeypatch, ms32=(6.0, 4.5), ms16=(6.5, 2.0))["bfloat16_pays"] is False


def test_the_probe_check_keeps_a_share_of_the_tolerance_for_the_pairs_it_does_not_see() -> None:
    from chorus_sched.minilm import BF16_TOLERANCE, PROBE_PROMPTS, PROBE_SHARE, probe_agrees

    assert probe_agrees(0.0030)  # the AMD EPYC's probe, whose 10,240 benchmark pairs moved 0.0045 at most
    assert not probe_agrees(0.0036)  # a CPU moving the probe this far could move other pairs past the margin
    assert not probe_agrees(BF16_TOLERANCE)
    assert 0 < PROBE_SHARE < 1 and len(set(PROBE_PROMPTS)) == len(PROBE_PROMPTS) >= 32


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "cap", "usable"),
    [
        (False, False, None, False),  # emulated bfloat16 never pays
        (True, False, None, True),  # AMD EPYC (Zen 4): AVX512-BF16, no AMX
        (True, True, None, True),
        (True, True, "ALL", True),
        (True, True, "avx512_core_bf16", True),
        (True, True, "AVX512_CORE_FP16", True),  # above AVX512_CORE_BF16 in oneDNN's order
        (True, True, "AVX10_1_512", True),
        (True, True, "AVX512_CORE_AMX", True),
        (True, True, "AVX512_CORE_VNNI", False),  # below: oneDNN may not use the bfloat16 instructions
        (True, True, "AVX2", False),
    ],
)
def test_bfloat16_hardware_is_avx512_bf16_or_amx_that_onednn_may_use(
    monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool, cap: str | None, usable: bool
) -> None:
    import torch

    from chorus_sched.minilm import bf16_hardware

    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    if cap is not None:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert bf16_hardware() is usable
    if cap is not None:  # oneDNN's older name for the same cap
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
        monkeypatch.setenv("DNNL_MAX_CPU_ISA", cap)
        assert bf16_hardware() is usable


@pytest.mark.slow
def test_a_bfloat16_graph_that_moves_the_probe_too_far_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import chorus_sched.minilm as minilm

    monkeypatch.setattr(minilm, "_similarity_shift", lambda *args: 0.05)
    embedder = MiniLMEmbedder(precision="bfloat16")
    with caplog.at_level("WARNING", logger="chorus_sched.minilm"):
        vectors = embedder.embed(_HELD_OUT[:3])
    assert "bfloat16 graph unusable" in caplog.text and embedder.numbers == "float32"
    reference = MiniLMEmbedder(precision="float32").embed(_HELD_OUT[:3])
    assert (
        max(abs(a - b) for v, w in zip(vectors, reference, strict=True) for a, b in zip(v, w, strict=True))
        < 1e-6
    )
    assert embedder.similarity_tolerance > 0  # the margin stays: wider than needed, never narrower


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        MiniLMEmbedder(precision="fp8")  # type: ignore[arg-type]
