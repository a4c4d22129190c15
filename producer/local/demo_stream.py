"""The stream ``chorus demo`` publishes: families of similar toy-world prompts (``build_stream``), published to a
running local stack while its results are followed with live progress (``publish_and_follow``)."""

from __future__ import annotations

import itertools
import random
import time
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from producer.contract import GenerationRequest, GenerationResult
    from producer.local.stack import EmbeddedStack

Kind = Literal["base", "baseline", "new-seed", "paraphrase", "terse", "attribute"]
# The members of a family, in the order the stream publishes them (all bases first, then all baselines, …), so
# every family's first request is dispatched before anything that may reuse it.
KINDS: tuple[Kind, ...] = ("base", "baseline", "new-seed", "paraphrase", "terse", "attribute")
KIND_HELP = {
    "base": "the family's first prompt",
    "baseline": "the base prompt with reuse off: full computation, measured in this run",
    "new-seed": "the base prompt with another seed",
    "paraphrase": "the base prompt with other function words",
    "terse": "the base prompt without function words",
    "attribute": "one attribute changed (direction or background)",
}

# Used when the toy world's vocabulary cannot be imported.
_FALLBACK_VOCABULARY: dict[str, tuple[str, ...]] = {
    "color": ("red", "green", "blue", "yellow", "purple", "cyan"),
    "shape": ("circle", "square", "triangle"),
    "direction": ("left", "right", "up", "down"),
    "background": ("black", "white", "gray", "brown"),
}


class DemoItem(BaseModel):
    """One request of the stream and what it is meant to show."""

    model_config = ConfigDict(frozen=True)

    family: int
    kind: Kind
    request_id: str
    prompt: str
    seed: int
    reuse: Literal["auto", "off"]


def vocabulary() -> dict[str, tuple[str, ...]]:
    """Attribute values of the toy world (``workers.toy.world``), or a fixed copy if it cannot be imported."""
    try:
        from workers.toy import world
    except Exception:
        return dict(_FALLBACK_VOCABULARY)
    try:
        return {
            "color": tuple(world.FG_COLORS),
            "shape": tuple(world.SHAPES),
            "direction": tuple(world.DIRECTIONS),
            "background": tuple(world.BG_COLORS),
        }
    except AttributeError:
        return dict(_FALLBACK_VOCABULARY)


def _prompt(kind: Kind, a: dict[str, str]) -> str:
    if kind == "paraphrase":
        return f"the {a['color']} {a['shape']} moving {a['direction']} over a {a['background']} background"
    if kind == "terse":
        return f"{a['color']} {a['shape']} moving {a['direction']}, {a['background']} background"
    return f"a {a['color']} {a['shape']} moving {a['direction']} on a {a['background']} background"


def build_stream(families: int, per_family: int, *, seed: int, run_id: str) -> list[DemoItem]:
    """``families`` families of ``per_family`` members (the first ``per_family`` of ``KINDS``).

    The families' attributes come from ``seed`` alone, so every run with the same seed publishes the same prompts
    (a later run then finds donors from an earlier one); two families differ in at least two attributes. Request
    ids carry ``run_id``.
    """
    vocab = vocabulary()
    names = list(vocab)
    rng = random.Random(seed)
    combos = [dict(zip(names, values, strict=True)) for values in itertools.product(*vocab.values())]
    rng.shuffle(combos)
    chosen: list[dict[str, str]] = []
    for combo in combos:
        if all(sum(combo[n] != c[n] for n in names) >= 2 for c in chosen):
            chosen.append(combo)
        if len(chosen) == families:
            break
    if len(chosen) < families:
        raise ValueError(f"the toy world has room for {len(chosen)} distinct families, not {families}")
    items: list[DemoItem] = []
    for kind in KINDS[:per_family]:
        for f, attrs in enumerate(chosen):
            base_seed = seed * 1000 + f * 10
            prompt_attrs = dict(attrs)
            if kind == "attribute":
                # Alternate between a new direction and a new background across families.
                changed = "direction" if f % 2 == 0 else "background"
                options = [v for v in vocab[changed] if v != attrs[changed]]
                prompt_attrs[changed] = options[(seed + f) % len(options)]
            items.append(
                DemoItem(
                    family=f + 1,
                    kind=kind,
                    request_id=f"demo-{run_id}-f{f + 1}-{kind}",
                    prompt=_prompt(kind, prompt_attrs),
                    seed=base_seed + (1 if kind == "new-seed" else 0),
                    reuse="off" if kind == "baseline" else "auto",
                )
            )
    return items


def publish_and_follow(
    console: Console,
    stack: EmbeddedStack,
    items: list[DemoItem],
    requests: list[GenerationRequest],
    interval: float,
    timeout: float,
    warmups: list[GenerationRequest],
) -> tuple[dict[str, GenerationResult], dict[str, float]]:
    """Publish the uncounted ``warmups`` and wait for them, then publish ``requests`` every ``interval`` seconds
    while printing each result as it arrives; returns the results and latencies (published → received) by id."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from producer.sdk import ChorusClient

    by_id = {i.request_id: i for i in items}
    sent_at: dict[str, float] = {}
    latencies: dict[str, float] = {}
    results: dict[str, GenerationResult] = {}
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    with ChorusClient(stack.producer_settings) as client, client.watch_results() as watcher, progress:
        if warmups:
            # Not counted: the first pass through a freshly loaded model is slower than the rest, and would
            # inflate whichever request happens to come first.
            warm_task = progress.add_task("warm-up  ", total=len(warmups))
            client.submit_many(warmups)
            for _ in watcher.wait([w.request_id for w in warmups], timeout_s=timeout):
                progress.advance(warm_task)
        sent_task = progress.add_task("published", total=len(requests))
        done_task = progress.add_task("results  ", total=len(requests))
        pending = [r.request_id for r in requests]

        def collect(wait_s: float) -> None:
            for result in watcher.wait(list(pending), timeout_s=wait_s):
                rid = result.request_id
                pending.remove(rid)
                results[rid] = result
                latencies[rid] = time.monotonic() - sent_at.get(rid, time.monotonic())
                progress.advance(done_task)
                console.print(live_line(by_id[rid], result, latencies[rid]))

        for request in requests:
            # From the moment it is published, as the worker's end-to-end histogram counts (the SDK stamps
            # submitted_at at send, not when the stream was built before the stack started).
            sent_at[request.request_id] = time.monotonic()
            client.submit(request)
            progress.advance(sent_task)
            collect(interval)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            stack.check()
            collect(1.0)
    return results, latencies


def live_line(item: DemoItem, result: GenerationResult, latency: float) -> str:
    if result.status.value != "done":
        why = f"{result.error.code}: {result.error.message}" if result.error else result.status.value
        return f"[red]✗[/] {escape(item.request_id)} {item.kind}: {escape(why[:160])}"
    if result.saved_compute and result.donor is not None:
        what = (
            f"[green]{result.reuse}[/] from {escape(result.donor.request_id)} (sim {result.donor.similarity:.2f}, "
            f"computed {result.tokens_computed_fraction:.0%} of the token-steps)"
        )
    elif result.donor is not None and not result.fallback:
        what = f"[yellow]full[/] (donor {escape(result.donor.request_id)} planned; nothing saved)"
    elif result.fallback:
        what = f"[yellow]full[/] ({escape(result.fallback[:80])})"
    else:
        what = "full"
    return (
        f"[green]✓[/] {escape(item.request_id)} [dim]{item.kind}[/] {what}: "
        f"{result.steps_computed}/{result.steps_requested} steps, {result.timings.denoise_s:.2f} s denoise, "
        f"{latency:.1f} s end to end"
    )
