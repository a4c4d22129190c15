"""What the scheduler would see of each donor/target pair (MiniLM similarity, content-word changes), and the
per-class summary of it that the quality report prints (``pair_classes``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from chorus_sched.embedding import MiniLMEmbedder, word_diff
from chorus_sched.planner import Planner
from workers.bench.pairs import Pair


@dataclass(frozen=True)
class PairFacts:
    """What the planner sees of a pair."""

    pair: Pair
    similarity: float
    content_changes: int


def pair_facts(pairs: Sequence[Pair], ignorable: Sequence[str]) -> list[PairFacts]:
    """MiniLM similarity and content-word changes of every pair — what the scheduler computes."""
    embedder = MiniLMEmbedder()
    texts = sorted({p.donor_prompt for p in pairs} | {p.target.prompt for p in pairs})
    vectors = dict(zip(texts, np.asarray(embedder.embed(texts), dtype=np.float64), strict=True))
    ign = frozenset(w.casefold() for w in ignorable)
    out = []
    for p in pairs:
        sim = float(np.clip(vectors[p.donor_prompt] @ vectors[p.target.prompt], -1.0, 1.0))
        out.append(PairFacts(p, sim, word_diff(p.donor_prompt, p.target.prompt).content_changes(ign)))
    return out


def class_report(infos: Sequence[PairFacts], planner: Planner | None, steps: Sequence[int]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for cls in dict.fromkeys(i.pair.pair_class for i in infos):
        group = [i for i in infos if i.pair.pair_class == cls]
        sims = [i.similarity for i in group]
        changes = [i.content_changes for i in group]
        entry: dict[str, Any] = {
            "n": len(group),
            "similarity": {
                "mean": round(float(np.mean(sims)), 4),
                "min": round(min(sims), 4),
                "max": round(max(sims), 4),
            },
            "content_changes": {
                "mean": round(float(np.mean(changes)), 3),
                "min": min(changes),
                "max": max(changes),
            },
        }
        if planner is not None:
            for n in steps:
                chosen = Counter(
                    planner.plan(i.similarity, word_diff(i.pair.donor_prompt, i.pair.target.prompt), n).row
                    or "none"
                    for i in group
                )
                entry[f"planner_rows_{n}"] = dict(sorted(chosen.items()))
        report[cls] = entry
    return report
