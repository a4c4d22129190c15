"""Seeded request traces for ``chorus bench serve``: what arrives, and when.

A trace is a list of ``TraceItem`` (arrival offset, prompt, seed, what it is relative to earlier requests and
the attributes its prompt asks for, so the toy checker can judge the video). The same ``TraceSpec`` always gives
the same trace: every random draw comes from ``random.Random(spec.seed)`` or from numpy generators seeded by
``(spec.seed, …)``.

Kinds (``TraceKind``):

- ``mixed`` (the default): prompts in *families* (a base prompt and its variants); each request either opens a
  new family (``fresh``) or revisits one, the family drawn Zipf-like (weight ``1 / rank ** zipf_s`` over the
  families opened so far, the first one the most popular), and the revisit is one of the variants below.
- ``fresh``: every request a new family: no two requests alike (reuse can only cost here).
- ``duplicates``: every request after the first repeats one prompt and seed exactly.

Variants (``Variant``) and their shares in ``mixed`` (``MIXED_SHARES``). The shares are a choice, not a
measurement, made to match what is published about text-to-image/video prompt streams: users re-run a prompt
they just saw with another seed far more often than anything else (DiffusionDB: most prompts come in runs of
the same text with new seeds), exact resubmissions happen (retries, shared links, popular prompts), and edits
are small (one or two words changed) more often than full rewrites; about a quarter of traffic is new.

=================  =====  ==============================================================================
variant            share  what it is
=================  =====  ==============================================================================
``fresh``          0.25   a new family: new attributes, new wording
``exact``          0.15   a family's base prompt and seed again (an exact hit: no worker needed)
``reseed``         0.25   the base prompt with a new seed (served the base's video: an other-seed exact hit)
``paraphrase``     0.10   the base attributes, other template and words
``one_attribute``  0.15   the base wording with one attribute changed
``two_attributes`` 0.10   the base wording with two attributes changed
=================  =====  ==============================================================================

In ``mixed`` the variant counts are the shares of the trace (after its first request) rounded by largest
remainders, in a seeded random order. A one- or two-attribute variant draws its caption with the base's caption
seed, so it keeps the base's template and (nearly always) its other words.

Arrivals: open loop at ``rate`` requests per second (exponential gaps: a Poisson process), or closed loop
(``rate`` None: everything at time 0, the system drains a backlog).

Prompts are the toy world's held-out (evaluation) captions (``workers.toy.world``), so the toy model reads them
and the checker knows what each should show; the mid-cost random model takes the same text.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from workers.toy import world


class TraceKind(StrEnum):
    MIXED = "mixed"
    FRESH = "fresh"
    DUPLICATES = "duplicates"


class Variant(StrEnum):
    FRESH = "fresh"
    EXACT = "exact"
    RESEED = "reseed"
    PARAPHRASE = "paraphrase"
    ONE_ATTRIBUTE = "one_attribute"
    TWO_ATTRIBUTES = "two_attributes"


MIXED_SHARES: Mapping[Variant, float] = {
    Variant.FRESH: 0.25,
    Variant.EXACT: 0.15,
    Variant.RESEED: 0.25,
    Variant.PARAPHRASE: 0.10,
    Variant.ONE_ATTRIBUTE: 0.15,
    Variant.TWO_ATTRIBUTES: 0.10,
}
ZIPF_S = 1.1
SEED_BASE = 7_000_000  # noise seeds of trace requests: apart from training and the quality benchmark's


@dataclass(frozen=True)
class TraceSpec:
    kind: TraceKind = TraceKind.MIXED
    requests: int = 40
    seed: int = 0
    rate: float | None = None  # requests per second (open loop); None: all at once (closed loop)
    zipf_s: float = ZIPF_S
    shares: Mapping[Variant, float] = field(default_factory=lambda: dict(MIXED_SHARES))

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError("a trace needs at least one request")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("the arrival rate must be positive")
        if abs(sum(self.shares.values()) - 1.0) > 1e-6 or min(self.shares.values()) < 0:
            raise ValueError("variant shares must be non-negative and sum to 1")
        if self.shares.get(Variant.FRESH, 0.0) <= 0:
            raise ValueError("the fresh share must be positive (the first request opens a family)")

    def describe(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "requests": self.requests,
            "seed": self.seed,
            "rate": self.rate,
            "loop": "closed" if self.rate is None else "open",
            "zipf_s": self.zipf_s,
            "shares": {str(k): v for k, v in self.shares.items()} if self.kind is TraceKind.MIXED else None,
        }


@dataclass(frozen=True)
class TraceItem:
    index: int
    at_s: float  # arrival offset from the trace's start
    variant: Variant
    family: int
    prompt: str
    seed: int
    attributes: Mapping[str, str]  # what the prompt asks for (the toy checker's expectation)


@dataclass
class _Family:
    number: int
    attributes: dict[str, str]
    caption_seed: int  # the numpy seed that drew the base caption's template and words
    seed: int  # the base request's noise seed
    prompt: str


def attribute_values() -> dict[str, tuple[str, ...]]:
    """Each attribute of the toy world and its values, in the world's order."""
    values = getattr(world, "ATTRIBUTE_VALUES", None)
    if isinstance(values, Mapping):
        return {str(k): tuple(v) for k, v in values.items()}
    # A world without the table (one element): build it from its palettes.
    return {
        "color": tuple(world.FG_COLORS),
        "shape": tuple(world.SHAPES),
        "direction": tuple(world.DIRECTIONS),
        "background": tuple(world.BG_COLORS),
    }


def caption(attributes: Mapping[str, str], caption_seed: int) -> str:
    """The held-out caption for ``attributes`` whose template and words ``caption_seed`` draws. The same seed
    with one attribute changed draws the same template and filler words: only that attribute's word differs."""
    attrs = world.Attributes(**dict(attributes))
    return str(world.make_caption(attrs, np.random.default_rng(caption_seed), "eval"))


def generate(spec: TraceSpec) -> list[TraceItem]:
    """The trace ``spec`` describes (deterministic in ``spec``)."""
    rng = random.Random(spec.seed)
    values = attribute_values()
    families: list[_Family] = []
    items: list[TraceItem] = []
    at = 0.0
    variants = _variants(spec, rng)
    for i, variant in enumerate(variants):
        if spec.rate is not None and i > 0:
            at += rng.expovariate(spec.rate)
        if variant is Variant.FRESH or not families:
            family = _open_family(spec, rng, values, len(families))
            families.append(family)
            items.append(_item(i, at, Variant.FRESH, family, family.prompt, family.seed, family.attributes))
            continue
        weights = [1.0 / (rank + 1) ** spec.zipf_s for rank in range(len(families))]
        family = rng.choices(families, weights=weights)[0]
        items.append(_revisit(spec, rng, values, i, at, variant, family))
    return items


def _variants(spec: TraceSpec, rng: random.Random) -> list[Variant]:
    """The variant of every request: the first opens a family; the others follow the kind. In ``mixed`` the
    counts are the shares of the other ``requests - 1`` (largest remainders), in shuffled order, so even a short
    trace has the mix it claims."""
    rest = spec.requests - 1
    if spec.kind is TraceKind.FRESH:
        return [Variant.FRESH] * spec.requests
    if spec.kind is TraceKind.DUPLICATES:
        return [Variant.FRESH] + [Variant.EXACT] * rest
    exact = {k: spec.shares[k] * rest for k in spec.shares}
    counts = {k: int(v) for k, v in exact.items()}
    by_remainder = sorted(spec.shares, key=lambda k: (counts[k] - exact[k], list(spec.shares).index(k)))
    for k in by_remainder[: rest - sum(counts.values())]:
        counts[k] += 1
    order = [k for k in spec.shares for _ in range(counts[k])]
    rng.shuffle(order)
    return [Variant.FRESH, *order]


def _open_family(
    spec: TraceSpec, rng: random.Random, values: Mapping[str, tuple[str, ...]], number: int
) -> _Family:
    attributes = {name: rng.choice(options) for name, options in values.items()}
    caption_seed = rng.randrange(2**32)
    return _Family(
        number=number,
        attributes=attributes,
        caption_seed=caption_seed,
        seed=SEED_BASE + spec.seed * 100_000 + rng.randrange(100_000),
        prompt=caption(attributes, caption_seed),
    )


def _revisit(
    spec: TraceSpec,
    rng: random.Random,
    values: Mapping[str, tuple[str, ...]],
    i: int,
    at: float,
    variant: Variant,
    family: _Family,
) -> TraceItem:
    new_seed = SEED_BASE + spec.seed * 100_000 + rng.randrange(100_000)
    if variant is Variant.EXACT:
        return _item(i, at, variant, family, family.prompt, family.seed, family.attributes)
    if variant is Variant.RESEED:
        return _item(i, at, variant, family, family.prompt, new_seed, family.attributes)
    if variant is Variant.PARAPHRASE:
        for _ in range(20):
            text = caption(family.attributes, rng.randrange(2**32))
            if text != family.prompt:
                break
        return _item(i, at, variant, family, text, new_seed, family.attributes)
    count = 1 if variant is Variant.ONE_ATTRIBUTE else 2
    changed = dict(family.attributes)
    for name in rng.sample(sorted(values), count):
        changed[name] = rng.choice([v for v in values[name] if v != family.attributes[name]])
    return _item(i, at, variant, family, caption(changed, family.caption_seed), new_seed, changed)


def _item(
    i: int,
    at: float,
    variant: Variant,
    family: _Family,
    prompt: str,
    seed: int,
    attributes: Mapping[str, str],
) -> TraceItem:
    return TraceItem(i, round(at, 6), variant, family.number, prompt, seed, dict(attributes))


def variant_counts(items: list[TraceItem]) -> dict[str, int]:
    counts = dict.fromkeys((str(v) for v in Variant), 0)
    for item in items:
        counts[str(item.variant)] += 1
    return counts
