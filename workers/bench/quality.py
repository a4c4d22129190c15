"""``chorus bench quality``: attribute accuracy of the toy model with and without reuse, beside cache-dit.

Every clip is generated through ``Engine.generate`` and read back by the pixel checker (``workers.toy.checker``);
the evaluation set uses the held-out caption templates (``world.EVAL_TEMPLATES``) over all attribute
combinations, with noise seeds of its own. What runs, in order, is described in ``workers.bench.suite``; the pair
classes in ``workers.bench.pairs``; cache-dit's wiring and how its skipping is verified in
``workers.bench.cachedit``; the calibration in ``workers.bench.calibrate``.

JSON report (stdout with ``--json``, and ``--out``)::

    format            "chorus-bench-quality/1"
    command           the command line
    started_at, wall_s
    model             name, weights_dir, weights_id (sha256), guidance_scale, guidance_source
    settings          prompts, seeds, steps, rows, classes, ablation_alphas, cachedit settings, quick, threads, ...
    calibration       null, or (with --calibrate) the calibration set, the negative set, the derived rows with
                      the pairs and negatives routed to each (negatives_max_similarity: what bounded the row),
                      dropped_rows, per-class similarity of the pairs (pair_classes) and negatives
                      (negative_classes), and per regime and row every candidate tried (k1/k2/k3, α, threshold,
                      evaluated, wrong, lost, gained, loss_bound, passed, stopped_early, compute means) and the chosen one
    calibration_table path, provisional, source of the table the chorus rows used
    pair_classes      per class: n, similarity {mean,min,max} (MiniLM cosine), content_changes {mean,min,max},
                      planner_rows_<N> {row name or "none": count}
    rows              one object per measured row:
                        id ("<method>[/<class>]@<N>"), method (no-reuse | cachedit | chorus | chorus-alpha1 | probe |
                        chorus+cachedit), steps, pair_class (null, a class, or "all" for the pooled reuse-heavy set),
                        description, n, accuracy {color, shape, direction, background, all} ("all": every
                        judged attribute right, see settings.judge — all four unless --judge), all_correct_ci95,
                        steps_computed_mean, tokens_computed_fraction_mean, block_compute_fraction_mean,
                        reused_fraction, fallbacks, seconds_mean, stage2_steps, stage2_active_fraction_mean
                        (what Stage 2 recomputed per step); chorus class rows: by_changed {changed attributes:
                        {n, all_correct, no_reuse_all, stage2_steps, stage2_active_fraction_mean,
                        tokens_computed_fraction_mean}}; against the no-reuse clips of the same targets:
                        no_reuse_all, delta_all_vs_no_reuse, lost, gained; cache-dit rows: cachedit {cache_passes_mean,
                        cached_steps_mean, computed_steps_mean, uncached_subset_passes_mean, block_calls_total,
                        expected_block_calls_total, skips_verified} and cachedit_settings; chorus rows: plans
                        {label: count}; probe rows: plan
    targets           judged_on [attributes], no_reuse_all_correct_<N> {value, target, met}, chorus_within_1pt_<N> {value, no_reuse, delta,
                      reused_fraction, met}, tgaa_probe_all_correct_<N> {class: {alpha<α>: accuracy}}
    contact_sheets    [{steps, path, size}]
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from workers.cli_options import aliased, split_list

if TYPE_CHECKING:
    from workers.bench.cachedit import CacheDiTSettings
    from workers.bench.suite import BenchConfig

DEFAULT_STEPS = "4,50"
_LIST_HELP = "Repeatable, or comma-separated."
# --quick: 2 prompts × 1 seed, 2 steps, 2 calibration prompts, probe α 1 and 2, 2 prompts on the contact sheet
QUICK_PROMPTS, QUICK_STEPS, QUICK_CALIBRATION_PROMPTS, QUICK_ALPHAS, QUICK_SHEET_PROMPTS = 2, "2", 2, "1,2", 2
QUICK_NEGATIVE_PROMPTS, QUICK_MIN_ROW_PAIRS = 8, 1


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"{what}: expected comma-separated numbers, got {text!r}") from None


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter(f"{what}: need at least one positive integer")
    return values


def _names(text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [v for v in values if v not in known]
    if unknown:
        raise typer.BadParameter(f"{what}: unknown {unknown} (known: {', '.join(known)})")
    return values


def resolve_guidance(explicit: float | None) -> tuple[float, str]:
    """The guidance scale: explicit, else the toy catalog default, i.e. what a served toy request gets."""
    from producer.catalog import CATALOG

    if explicit is not None:
        return explicit, "--guidance-scale"
    return CATALOG["toy"].default_guidance_scale, "toy catalog default"


def _command(ctx: typer.Context) -> str:
    """The command line that reproduces this run: every option not left at its default, as given."""
    parts = ["chorus", "bench", "quality"]
    for param in ctx.command.params:
        name = param.name
        opts = getattr(param, "opts", None)
        if name is None or not opts:
            continue
        source = ctx.get_parameter_source(name)
        if source is None or source.name == "DEFAULT":
            continue
        value = ctx.params[name]
        if getattr(param, "is_flag", False):
            secondary = getattr(param, "secondary_opts", None)
            if value:
                parts.append(opts[0])
            elif secondary:
                parts.append(secondary[0])
            continue
        for item in value if isinstance(value, list) else [value]:
            parts += [opts[0], str(item)]
    return shlex.join(parts)


def bench_quality(
    ctx: typer.Context,
    as_json: bool = typer.Option(
        False, "--json", help="Print the JSON report on stdout (otherwise a table)."
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="Also write the JSON report here."),
    weights_dir: Path | None = typer.Option(
        None, help="Toy weights directory (default: $CHORUS_TOY_WEIGHTS_DIR or workers/toy/weights)."
    ),
    prompts: int = typer.Option(64, min=1, help="Evaluation prompts (held-out templates)."),
    seeds: int = typer.Option(1, min=1, help="Noise seeds per prompt."),
    num_steps: list[str] | None = typer.Option(
        None, "--num-steps", help=f"Step counts (regimes) [default: {DEFAULT_STEPS}]. " + _LIST_HELP
    ),
    steps: list[str] | None = typer.Option(None, "--steps", hidden=True),
    rows: list[str] = typer.Option(
        ["no-reuse", "chorus", "tgaa", "cachedit", "chorus-cachedit", "sheet"],
        help="Which rows: no-reuse, chorus, tgaa, cachedit, chorus-cachedit, sheet ('' for none, e.g. calibration "
        "only). " + _LIST_HELP,
    ),
    classes: list[str] = typer.Option(
        ["same-prompt", "one-attribute", "two-attributes", "paraphrase", "reworded-one-attribute"],
        help="Donor pair classes. " + _LIST_HELP,
    ),
    guidance_scale: float | None = typer.Option(
        None,
        "--guidance-scale",
        help="Guidance scale (default: the toy catalog's, what served requests get).",
    ),
    guidance: float | None = typer.Option(None, "--guidance", hidden=True),
    ablation_alphas: list[str] = typer.Option(
        ["1", "2", "4"], help="TGAA α values of the fixed probe plan (k1=N/4, k2=N/2). " + _LIST_HELP
    ),
    cachedit_thresholds: list[str] = typer.Option(
        ["0.08", "0.16", "0.5"],
        help="DBCache residual-diff thresholds, one cache-dit row each; the first is combined with Chorus. "
        + _LIST_HELP,
    ),
    cachedit_fn: int = typer.Option(1, min=1, help="DBCache Fn_compute_blocks."),
    cachedit_bn: int = typer.Option(0, min=0, help="DBCache Bn_compute_blocks."),
    cachedit_warmup: int | None = typer.Option(
        None, min=0, help="DBCache max_warmup_steps (default: max(1, min(8, N//4)))."
    ),
    calibration: Path | None = typer.Option(
        None,
        help="Calibration table the chorus rows plan with (default: the packaged chorus_sched/calibration.json).",
    ),
    calibrate: bool = typer.Option(
        False,
        "--calibrate",
        help="First sweep the plans and derive the planner's table (used by this run's rows).",
    ),
    calibration_out: Path | None = typer.Option(
        None,
        help="Where --calibrate writes the table (default: not written; the report holds it). To replace the "
        "packaged table, name it: chorus_sched/calibration.json.",
    ),
    calibration_prompts: int = typer.Option(
        64, min=1, help="Calibration-set prompts (apart from the evaluation set)."
    ),
    calibration_seeds: int = typer.Option(1, min=1, help="Calibration-set noise seeds per prompt."),
    negative_prompts: int = typer.Option(
        256,
        min=0,
        help="Captions whose unmeasured changes (3-4 attributes, or 2-4 reworded) bound the calibrated rows' "
        "similarity (embedded only); a verified row is measured on those it admits instead (--verified-negatives).",
    ),
    verified_negatives: int = typer.Option(
        64,
        min=0,
        help="Negatives admitted by a verified row (paraphrase) that --calibrate generates and counts in the "
        "row's paired test: the model's donor check, not similarity, must turn them away.",
    ),
    eval_negative_prompts: int = typer.Option(
        32,
        min=0,
        help="Captions of the benchmark's own negatives (apart from the calibration's), generated wherever the "
        "planner would reuse: the chorus/negatives row counts what the donor check let through (0: none).",
    ),
    min_row_pairs: int = typer.Option(
        8, min=1, help="Fewest measured calibration pairs a reusing row must admit to be kept."
    ),
    tolerance: float = typer.Option(
        0.01, min=0.0, max=1.0, help="Accepted all-attribute accuracy loss (0.01 = 1 point)."
    ),
    out_dir: Path = typer.Option(Path("out/bench-quality"), help="Where contact sheets are written."),
    sheet_prompts: int = typer.Option(4, min=0, help="Prompts on each contact sheet."),
    judge: list[str] = typer.Option(
        ["color", "shape", "direction", "background"],
        help="Attributes that must all be right for a clip to count as correct ('all' in the report, the "
        "calibration's acceptance). Narrow it only for a model that has not learned the others. "
        + _LIST_HELP,
    ),
    threads: int = typer.Option(1, min=1, help="torch CPU threads."),
    quick: bool = typer.Option(False, "--quick", help="Tiny smoke setting (2 prompts, 2 steps) for tests."),
) -> None:
    """Attribute accuracy with and without Chorus reuse (TGAA ablation) and cache-dit; optionally calibrate."""
    # Every option by name: at this point the function's locals are exactly its parameters.
    args = QualityArgs(**_as_given(**{name: value for name, value in locals().items() if name != "ctx"}))
    _run(args.with_quick() if args.quick else args, _command(ctx))


def _as_given(**options: Any) -> dict[str, Any]:
    """The options as ``QualityArgs`` takes them: older names folded into the current ones, list options
    (repeated or comma-separated) joined with commas."""
    num_steps, steps = options.pop("num_steps"), options.pop("steps")
    guidance_scale, guidance = options.pop("guidance_scale"), options.pop("guidance")
    step_values = aliased(num_steps, steps, "--num-steps", "--steps")
    options["steps"] = ",".join(split_list(step_values)) if step_values is not None else DEFAULT_STEPS
    options["guidance"] = aliased(guidance_scale, guidance, "--guidance-scale", "--guidance")
    for name in ("rows", "classes", "ablation_alphas", "cachedit_thresholds", "judge"):
        options[name] = ",".join(split_list(options[name]))
    return options


@dataclass(frozen=True)
class QualityArgs:
    """``chorus bench quality``'s options as given (``with_quick`` applies ``--quick``)."""

    as_json: bool
    out: Path | None
    weights_dir: Path | None
    prompts: int
    seeds: int
    steps: str
    rows: str
    classes: str
    guidance: float | None
    ablation_alphas: str
    cachedit_thresholds: str
    cachedit_fn: int
    cachedit_bn: int
    cachedit_warmup: int | None
    calibration: Path | None
    calibrate: bool
    calibration_out: Path | None
    calibration_prompts: int
    calibration_seeds: int
    negative_prompts: int
    verified_negatives: int
    eval_negative_prompts: int
    min_row_pairs: int
    tolerance: float
    out_dir: Path
    sheet_prompts: int
    judge: str
    threads: int
    quick: bool

    def with_quick(self) -> QualityArgs:
        return replace(
            self,
            prompts=QUICK_PROMPTS,
            seeds=1,
            steps=QUICK_STEPS,
            calibration_prompts=QUICK_CALIBRATION_PROMPTS,
            ablation_alphas=QUICK_ALPHAS,
            sheet_prompts=min(self.sheet_prompts, QUICK_SHEET_PROMPTS),
            negative_prompts=min(self.negative_prompts, QUICK_NEGATIVE_PROMPTS),
            verified_negatives=min(self.verified_negatives, QUICK_NEGATIVE_PROMPTS),
            eval_negative_prompts=min(self.eval_negative_prompts, QUICK_PROMPTS),
            min_row_pairs=QUICK_MIN_ROW_PAIRS,
        )


@dataclass(frozen=True)
class _Parsed:
    """The list-valued options parsed and checked, the cache-dit settings and the weights directory."""

    steps: tuple[int, ...]
    rows: tuple[str, ...]
    classes: tuple[str, ...]
    judge: tuple[str, ...]
    alphas: tuple[float, ...]
    cachedit: tuple[CacheDiTSettings, ...]
    weights_dir: Path


def _run(args: QualityArgs, command: str) -> None:
    import torch

    from workers.bench import suite

    torch.set_num_threads(args.threads)
    parsed = _parse(args)
    config = _bench_config(args, parsed, command)
    report = suite.run(config, suite.Progress(enabled=True))
    text = suite.dumps(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.as_json:
        typer.echo(text)
        return
    _print_table(report)


def _parse(args: QualityArgs) -> _Parsed:
    """Parse and check the options (``typer.BadParameter`` on the first problem)."""
    from producer.catalog import CATALOG
    from workers.bench import suite
    from workers.bench.cachedit import CacheDiTSettings
    from workers.bench.pairs import PAIR_CLASSES
    from workers.toy.model import WEIGHTS_DIR, WEIGHTS_FILE
    from workers.toy.world import ATTRIBUTE_NAMES

    step_list = _ints(args.steps, "--num-steps")
    row_list = _names(args.rows, suite.ROW_KINDS, "--rows")
    cached = [r for r in row_list if "cachedit" in r]
    if cached and importlib.util.find_spec("cache_dit") is None:
        raise typer.BadParameter(
            f"--rows {','.join(cached)} needs cache-dit, which the bench extra installs (`./scripts/setup.sh dev`, "
            f"or `pip install -e '.[bench]'`); or leave it out: --rows "
            + ",".join(r for r in row_list if r not in cached)
        )
    class_list = _names(args.classes, PAIR_CLASSES, "--classes")
    judged = _names(args.judge, ATTRIBUTE_NAMES, "--judge")
    if not judged:
        raise typer.BadParameter("--judge: name at least one attribute")
    alphas = _floats(args.ablation_alphas, "--ablation-alphas")
    if any(not 1.0 <= a <= 20.0 for a in alphas):
        raise typer.BadParameter("--ablation-alphas: each α must be within [1, 20]")
    thresholds = _floats(args.cachedit_thresholds, "--cachedit-thresholds") or (0.08,)
    wdir = args.weights_dir or Path(os.environ.get("CHORUS_TOY_WEIGHTS_DIR") or WEIGHTS_DIR)
    if not (wdir / WEIGHTS_FILE).exists():
        raise typer.BadParameter(f"no toy weights in {wdir} (train them with `chorus train-toy`)")
    for n in step_list:
        why = CATALOG["toy"].num_steps.check(n)
        if why is not None:
            raise typer.BadParameter(f"--num-steps {n}: {why}")
    cache_settings = tuple(
        CacheDiTSettings(
            fn_compute_blocks=args.cachedit_fn,
            bn_compute_blocks=args.cachedit_bn,
            residual_diff_threshold=t,
            max_warmup_steps=args.cachedit_warmup,
        )
        for t in thresholds
    )
    return _Parsed(step_list, row_list, class_list, judged, alphas, cache_settings, wdir)


def _settings_report(args: QualityArgs, parsed: _Parsed) -> dict[str, Any]:
    """The report's ``settings``: what this run measured, as the options resolved."""
    from workers.bench import suite
    from workers.bench.calibrate import default_grid

    settings: dict[str, Any] = {
        "prompts": args.prompts,
        "seeds": args.seeds,
        "targets": args.prompts * args.seeds,
        "steps": list(parsed.steps),
        "rows": list(parsed.rows),
        "classes": list(parsed.classes),
        "ablation_alphas": list(parsed.alphas),
        "probe_plan": {"k1_fraction": suite.PROBE_K1, "k2_fraction": suite.PROBE_K2},
        "cachedit": [
            {k: v for k, v in s.describe(0).items() if k != "max_warmup_steps"}
            | {
                "max_warmup_steps": s.max_warmup_steps
                if s.max_warmup_steps is not None
                else "max(1, min(8, N//4))"
            }
            for s in parsed.cachedit
        ],
        "calibrate": args.calibrate,
        "calibration_prompts": args.calibration_prompts,
        "calibration_seeds": args.calibration_seeds,
        "negative_prompts": args.negative_prompts,
        "verified_negatives": args.verified_negatives,
        "eval_negative_prompts": args.eval_negative_prompts,
        "min_row_pairs": args.min_row_pairs,
        "tolerance": args.tolerance,
        "quick": args.quick,
        "threads": args.threads,
        "judge": list(parsed.judge),
        "eval_set": "workers.bench.pairs.eval_targets(prompts, seeds) (EVAL_TEMPLATES, seed base 2000000)",
    }
    if args.calibrate:
        settings["calibration_grid"] = {str(n): default_grid(n) for n in parsed.steps}
    return settings


def _bench_config(args: QualityArgs, parsed: _Parsed, command: str) -> BenchConfig:
    from workers.bench import suite
    from workers.engine.registry import load_bundle
    from workers.toy.model import WEIGHTS_FILE, sha256_file

    g, g_source = resolve_guidance(args.guidance)
    wdir = parsed.weights_dir

    def load() -> Any:
        from producer.logs import quiet_transformers

        with quiet_transformers():  # the benchmark's own progress, not a "Loading weights" bar per engine
            return load_bundle("toy", toy_weights_dir=wdir)

    return suite.BenchConfig(
        load_bundle=load,
        weights={"weights_dir": str(wdir), "weights_id": sha256_file(wdir / WEIGHTS_FILE)},
        guidance=g,
        guidance_source=g_source,
        prompts=args.prompts,
        seeds=args.seeds,
        steps=parsed.steps,
        rows=parsed.rows,
        classes=parsed.classes,
        ablation_alphas=parsed.alphas,
        cachedit=parsed.cachedit,
        calibration_path=args.calibration,
        calibrate=args.calibrate,
        calibration_out=args.calibration_out,
        calibration_prompts=args.calibration_prompts,
        calibration_seeds=args.calibration_seeds,
        negative_prompts=args.negative_prompts,
        verified_negatives=args.verified_negatives,
        eval_negative_prompts=args.eval_negative_prompts,
        min_row_pairs=args.min_row_pairs,
        tolerance=args.tolerance,
        out_dir=args.out_dir,
        sheet_prompts=args.sheet_prompts,
        command=command,
        quick=args.quick,
        settings_report=_settings_report(args, parsed),
        judge=parsed.judge,
    )


def _print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"chorus bench quality ({report['model'].get('weights_id', '')[:12]})")
    for col in (
        "row",
        "n",
        "all",
        "Δ vs none",
        "color",
        "shape",
        "dir",
        "bg",
        "steps",
        "tokens",
        "compute",
        "reused",
    ):
        table.add_column(col)
    for r in report.get("rows", []):
        acc = r["accuracy"]
        delta = r.get("delta_all_vs_no_reuse")
        table.add_row(
            r["id"],
            str(r["n"]),
            f"{acc['all']:.3f}",
            "" if delta is None else f"{delta:+.3f}",
            f"{acc['color']:.2f}",
            f"{acc['shape']:.2f}",
            f"{acc['direction']:.2f}",
            f"{acc['background']:.2f}",
            f"{r['steps_computed_mean']:.2f}",
            f"{r['tokens_computed_fraction_mean']:.3f}",
            f"{r['block_compute_fraction_mean']:.3f}",
            f"{r['reused_fraction']:.2f}",
        )
    Console().print(table)
    for name, t in report.get("targets", {}).items():
        Console().print(f"{name}: {t}")
