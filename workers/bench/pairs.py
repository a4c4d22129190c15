"""The quality benchmark's evaluation set and its donor/target pairs.

Targets are held-out captions (``world.EVAL_TEMPLATES``) whose attribute values are balanced, each with one or
more noise seeds. Every target gets one donor per *pair class*:

- ``same-prompt``: the very same caption, another noise seed;
- ``one-attribute``: the same template and word choices with one attribute (cycling color, shape, direction,
  background over the targets) set to another value;
- ``two-attributes``: the same with two attributes changed;
- ``paraphrase``: the same attributes in another held-out template with re-drawn synonyms (a different caption);
- ``reworded-one-attribute``: another template *and* one attribute changed — the case a loose paraphrase rule
  must not admit; it is measured so that the planner's paraphrase row is calibrated on what it would really see.

*Negative* pairs (``make_negative_pairs``, ``NEGATIVE_CLASSES``) are the changes no class measures: three or four
attributes in the same words, or two to four in another template. They are only embedded, never generated: the
calibration keeps every reusing row's admission rule above them (``calibrate.bound_rows``), except a verified
row's, which is measured on them instead; the benchmark generates its own set of them wherever the planner
would reuse, and counts what the model's donor check let through.

Donors always use another noise seed than their target (``DONOR_SEED_OFFSET``), as another user's request would.
Captions keep their filled-in template fields, so a donor differs from its target in exactly the words intended.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from workers.toy import world
from workers.toy.world import Attributes

PAIR_CLASSES: tuple[str, ...] = (
    "same-prompt",
    "one-attribute",
    "two-attributes",
    "paraphrase",
    "reworded-one-attribute",
)
DONOR_SEED_OFFSET = 500_000
# Target noise seeds: the benchmark's evaluation set and the calibration set never share one.
EVAL_SEED_BASE = 2_000_000
CALIBRATION_SEED_BASE = 3_000_000
# Which random streams draw the sets' captions.
EVAL_SET_SEED = 0
CALIBRATION_SET_SEED = 1
NEGATIVE_SET_SEED = 2
NEGATIVE_SEED_BASE = 4_000_000
# The benchmark's own negatives (generated where the planner would reuse): apart from the calibration's.
EVAL_NEGATIVE_SET_SEED = 6
EVAL_NEGATIVE_SEED_BASE = 6_000_000
# (class, attributes changed, reworded): what no measured class covers.
_NEGATIVES: tuple[tuple[str, int, bool], ...] = (
    ("three-attributes", 3, False),
    ("four-attributes", 4, False),
    ("reworded-two-attributes", 2, True),
    ("reworded-three-attributes", 3, True),
    ("reworded-four-attributes", 4, True),
)
NEGATIVE_CLASSES: tuple[str, ...] = tuple(name for name, _, _ in _NEGATIVES)

_ATTR_VALUES: dict[str, tuple[str, ...]] = {
    "color": tuple(world.FG_COLORS),
    "shape": world.SHAPES,
    "direction": world.DIRECTIONS,
    "background": tuple(world.BG_COLORS),
}
_FIELD_OF = {"color": "color", "shape": "shape", "direction": "dir", "background": "bg"}


@dataclass(frozen=True)
class Caption:
    """A caption with the template and the words that filled it in."""

    template: str
    fields: tuple[tuple[str, str], ...]  # (field, word) pairs, as ``str.format`` takes them
    attributes: Attributes

    @property
    def text(self) -> str:
        return self.template.format(**dict(self.fields))

    def field(self, name: str) -> str:
        return dict(self.fields)[name]


@dataclass(frozen=True)
class Target:
    index: int
    caption: Caption
    seed: int

    @property
    def prompt(self) -> str:
        return self.caption.text

    @property
    def attributes(self) -> Attributes:
        return self.caption.attributes


@dataclass(frozen=True)
class Pair:
    pair_class: str
    target: Target
    donor: Caption
    donor_seed: int
    changed: tuple[str, ...]  # attribute names whose value differs between donor and target

    @property
    def donor_prompt(self) -> str:
        return self.donor.text


def _word(rng: np.random.Generator, options: Sequence[str]) -> str:
    return str(rng.choice(list(options)))


def _draw_fields(attributes: Attributes, rng: np.random.Generator) -> dict[str, str]:
    return {
        "color": _word(rng, world.COLOR_WORDS[attributes.color]),
        "shape": _word(rng, world.SHAPE_WORDS[attributes.shape]),
        "dir": _word(rng, world.DIRECTION_WORDS[attributes.direction]),
        "bg": _word(rng, world.COLOR_WORDS[attributes.background]),
        "ving": _word(rng, world.VERBS_ING),
        "v3": _word(rng, world.VERBS_3RD),
        "backdrop": _word(rng, world.BACKDROP_WORDS),
    }


def _attribute_word(attribute: str, value: str, rng: np.random.Generator) -> str:
    if attribute in ("color", "background"):
        return _word(rng, world.COLOR_WORDS[value])
    if attribute == "shape":
        return _word(rng, world.SHAPE_WORDS[value])
    return _word(rng, world.DIRECTION_WORDS[value])


def make_caption(template: str, attributes: Attributes, rng: np.random.Generator) -> Caption:
    fields = _draw_fields(attributes, rng)
    return Caption(template, tuple(sorted(fields.items())), attributes)


def change_attributes(
    caption: Caption, attributes: Sequence[str], rng: np.random.Generator
) -> tuple[Caption, tuple[str, ...]]:
    """The caption with each named attribute set to another value (and its word replaced, nothing else)."""
    values = caption.attributes.as_dict()
    fields = dict(caption.fields)
    for name in attributes:
        new = _word(rng, [v for v in _ATTR_VALUES[name] if v != values[name]])
        values[name] = new
        fields[_FIELD_OF[name]] = _attribute_word(name, new, rng)
    changed = Attributes(**values)
    return Caption(caption.template, tuple(sorted(fields.items())), changed), tuple(attributes)


def reword(caption: Caption, rng: np.random.Generator, attributes: Attributes | None = None) -> Caption:
    """Another held-out template with freshly drawn words (for ``attributes``, default the caption's own);
    guaranteed to differ from the caption's text."""
    attrs = attributes or caption.attributes
    others = [t for t in world.EVAL_TEMPLATES if t != caption.template]
    for _ in range(100):
        out = make_caption(_word(rng, others), attrs, rng)
        if out.text != caption.text:
            return out
    raise RuntimeError("could not reword the caption")  # pragma: no cover - 4 other templates always differ


def _balanced(values: Sequence[str], n: int, rng: np.random.Generator) -> list[str]:
    """``n`` values as consecutive random permutations of ``values``: in every prefix, counts differ by ≤ 1."""
    out: list[str] = []
    while len(out) < n:
        out.extend(str(values[int(i)]) for i in rng.permutation(len(values)))
    return out[:n]


def eval_targets(
    n_prompts: int, n_seeds: int = 1, *, set_seed: int = EVAL_SET_SEED, seed_base: int = EVAL_SEED_BASE
) -> list[Target]:
    """``n_prompts`` held-out captions, each with ``n_seeds`` noise seeds: ``n_prompts * n_seeds`` targets.

    Each attribute's values are balanced (any two counts differ by at most one) and drawn independently of the
    other attributes; the template and words are drawn at random."""
    if n_prompts < 1 or n_seeds < 1:
        raise ValueError("need at least one prompt and one seed")
    rng = np.random.default_rng(set_seed)
    columns = {name: _balanced(values, n_prompts, rng) for name, values in _ATTR_VALUES.items()}
    targets: list[Target] = []
    for p in range(n_prompts):
        attributes = Attributes(**{name: col[p] for name, col in columns.items()})
        caption = make_caption(_word(rng, world.EVAL_TEMPLATES), attributes, rng)
        for s in range(n_seeds):
            index = p * n_seeds + s
            targets.append(Target(index, caption, seed_base + index))
    return targets


def make_pairs(
    targets: Sequence[Target], classes: Sequence[str] = PAIR_CLASSES, *, seed: int = 0
) -> list[Pair]:
    """One donor per target and class. Deterministic in (targets, classes, seed)."""
    unknown = [c for c in classes if c not in PAIR_CLASSES]
    if unknown:
        raise ValueError(f"unknown pair class(es) {unknown} (known: {', '.join(PAIR_CLASSES)})")
    names = list(_ATTR_VALUES)
    pairs: list[Pair] = []
    for cls in classes:
        rng = np.random.default_rng([seed, PAIR_CLASSES.index(cls)])
        for t in targets:
            first = names[t.index % len(names)]
            second = names[(t.index + 1 + t.index // len(names)) % len(names)]
            if second == first:
                second = names[(names.index(first) + 1) % len(names)]
            donor_seed = t.seed + DONOR_SEED_OFFSET
            if cls == "same-prompt":
                pairs.append(Pair(cls, t, t.caption, donor_seed, ()))
            elif cls == "one-attribute":
                donor, changed = change_attributes(t.caption, [first], rng)
                pairs.append(Pair(cls, t, donor, donor_seed, changed))
            elif cls == "two-attributes":
                donor, changed = change_attributes(t.caption, [first, second], rng)
                pairs.append(Pair(cls, t, donor, donor_seed, changed))
            elif cls == "paraphrase":
                pairs.append(Pair(cls, t, reword(t.caption, rng), donor_seed, ()))
            else:
                moved, changed = change_attributes(t.caption, [first], rng)
                pairs.append(Pair(cls, t, reword(t.caption, rng, moved.attributes), donor_seed, changed))
    return pairs


def make_negative_pairs(targets: Sequence[Target], *, seed: int = 0) -> list[Pair]:
    """One donor per target and negative class (the attributes changed rotate over the targets).
    Deterministic in (targets, seed)."""
    names = list(_ATTR_VALUES)
    pairs: list[Pair] = []
    for number, (cls, count, reworded) in enumerate(_NEGATIVES):
        rng = np.random.default_rng([seed, len(PAIR_CLASSES) + number])
        for t in targets:
            chosen = [names[(t.index + j) % len(names)] for j in range(count)]
            moved, changed = change_attributes(t.caption, chosen, rng)
            donor = reword(t.caption, rng, moved.attributes) if reworded else moved
            pairs.append(Pair(cls, t, donor, t.seed + DONOR_SEED_OFFSET, changed))
    return pairs
