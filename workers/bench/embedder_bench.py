"""``chorus bench embedder``: what MiniLM in bfloat16 changes against float32, in CPU time and in the planner's
decisions.

The scheduler embeds in bfloat16 where the CPU has bfloat16 instructions and it is timed faster at load
(``chorus_sched.minilm``; the report's ``machine.auto`` says what it picked here and why), and its planner then
raises the similarity floor of every unverified row by the embedder's tolerance. This benchmark measures both
sides of that trade on the quality benchmark's own pair generators (``workers.bench.pairs``: the evaluation and
calibration captions and two more sets, every pair class and the negatives): the CPU milliseconds per prompt in
batches of 32 and alone, the largest and mean move of a pair's similarity, and every planner decision (at 4 and
50 steps, the shipped table) that differs — split into decisions that reuse more and less than float32's, by
pair class and row. A reuse-more decision can only come from a verified row (its floor has no margin: the
worker's model check is its safety); an unverified one would be a defect.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import typer

from workers.bench.report_file import stamped, write_report

TARGET_SETS = ((0, 2_000_000), (1, 3_000_000), (3, 7_000_000), (4, 8_000_000))  # (set seed, seed base)
STEPS = (4, 50)


def _cpu_ms_per_prompt(embed: Callable[[Sequence[str]], Any], texts: Sequence[str], batch: int) -> float:
    """Best of three passes, process CPU time per prompt, ``batch`` prompts per call."""
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for i in range(0, len(texts), batch):
            embed(texts[i : i + batch])
        best = min(best, time.process_time() - start)
    return round(best / len(texts) * 1000, 3)


def run_embedder_bench(captions: int, say: Callable[[str], None]) -> dict[str, Any]:
    import numpy as np

    from chorus_sched.embedding import word_diff
    from chorus_sched.minilm import BF16_TOLERANCE, MiniLMEmbedder, bf16_hardware
    from chorus_sched.planner import Planner, load_calibration
    from workers.bench import pairs as P

    reference, fast = (
        MiniLMEmbedder(precision="float32", threads=1),
        MiniLMEmbedder(precision="bfloat16", threads=1),
    )
    plain = Planner(load_calibration())
    widened = plain.widened(fast.similarity_tolerance)
    pairs: list[P.Pair] = []
    for set_seed, base in TARGET_SETS:
        targets = P.eval_targets(captions, set_seed=set_seed, seed_base=base)
        pairs += P.make_pairs(targets) + P.make_negative_pairs(targets)
    texts = sorted({p.target.prompt for p in pairs} | {p.donor_prompt for p in pairs})
    say(f"{len(pairs)} pairs, {len(texts)} distinct prompts: embedding both ways")
    index = {t: i for i, t in enumerate(texts)}
    v32, v16 = np.asarray(reference.embed(texts)), np.asarray(fast.embed(texts))
    timed = texts[:256]
    cpu = {
        name: {f"batch_{b}": _cpu_ms_per_prompt(e.embed, timed, b) for b in (32, 1)}
        for name, e in (("float32", reference), ("bfloat16", fast))
    }
    shifts: list[float] = []
    more: Counter[str] = Counter()
    less: Counter[str] = Counter()
    for p in pairs:
        a, b = index[p.target.prompt], index[p.donor_prompt]
        s32, s16 = min(1.0, float(v32[a] @ v32[b])), min(1.0, float(v16[a] @ v16[b]))
        shifts.append(abs(s32 - s16))
        diff = word_diff(p.donor_prompt, p.target.prompt)
        for n in STEPS:
            c32, c16 = plain.plan(s32, diff, n), widened.plan(s16, diff, n)
            if c32.row == c16.row:
                continue
            key = f"{p.pair_class}@{n}: {c32.row} -> {c16.row}"
            gained = c16.plan.stage1_steps + 0.5 * c16.plan.stage2_steps
            (more if gained > c32.plan.stage1_steps + 0.5 * c32.plan.stage2_steps else less)[key] += 1
    unverified_more = sum(
        count for key, count in more.items() if not _verified(widened, key.rsplit("-> ", 1)[1])
    )
    return {
        "format": "chorus-bench-embedder/1",
        "machine": {"bf16_hardware": bf16_hardware(), "auto": _auto_choice()},
        "captions_per_set": captions,
        "pairs": len(pairs),
        "decisions": len(pairs) * len(STEPS),
        "tolerance": BF16_TOLERANCE,
        "margin_applied": widened.similarity_margin,
        "cpu_ms_per_prompt": cpu,
        "similarity_shift": {"max": round(max(shifts), 5), "mean": round(statistics.fmean(shifts), 6)},
        "reuses_more": {"total": sum(more.values()), "into_unverified_rows": unverified_more, **dict(more)},
        "reuses_less": {"total": sum(less.values()), **dict(less)},
    }


def _auto_choice() -> dict[str, Any]:
    """What ``auto`` picks on this machine, and its timing of both graphs at load (one thread, like the
    scheduler's default)."""
    from chorus_sched.minilm import MiniLMEmbedder

    auto = MiniLMEmbedder(precision="auto", threads=1)
    auto.embed(["a"])  # loads, and with it chooses
    return {"numbers": auto.numbers, "probe_timings": auto.probe_timings}


def _verified(planner: Any, row: str) -> bool:
    return any(r.name == row and r.verified for regime in planner.table.regimes for r in regime.rows)


def bench_embedder(
    captions: int = typer.Option(256, "--captions", min=1, help="Captions per target set (four sets)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Also write the JSON report here."),
) -> None:
    """MiniLM in bfloat16 against float32: CPU per prompt, similarity moves, and the planner decisions that
    differ on the quality benchmark's pairs (JSON on stdout)."""
    from rich.console import Console

    err = Console(stderr=True)
    report = run_embedder_bench(captions, say=err.print)
    sys.stdout.write(write_report(stamped("embedder", report), out) + "\n")
