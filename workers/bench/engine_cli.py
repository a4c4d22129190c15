"""``chorus bench engine``: time full and SRD steps of the engine (``engine_bench.run_bench``) and print the
report as JSON or a table. Heavy imports (torch, the engine) happen inside the command.

Exit codes: 0 every SRD row met its target; 1 a row missed it (``--no-fail``: 0 anyway); 2 bad options."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from workers.cli_options import aliased, split_list

_err = Console(stderr=True)


def bench_engine(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (otherwise a table)."),
    configs: list[str] = typer.Option(
        ["tiny", "toy2", "mid"],
        "--configs",
        help="Configs to run: tiny, toy2, mid (repeatable, or comma-separated).",
    ),
    num_steps: int | None = typer.Option(
        None, "--num-steps", min=3, help="Denoising steps per measured request (default: 4)."
    ),
    steps: int | None = typer.Option(None, "--steps", min=3, hidden=True),
    repeats: int = typer.Option(
        3, min=1, help="Rounds (a full request + one SRD request per fraction) per config."
    ),
    threads: int | None = typer.Option(None, help="torch intra-op threads (default: torch's)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Also write the JSON here."),
    no_fail: bool = typer.Option(
        False, "--no-fail", help="Exit 0 even when an SRD row misses its target (the report says which)."
    ),
) -> None:
    """Time full and SRD steps of the engine (tiny, the toy-world-v2 shape, a Wan2.1-1.3B-width config); print
    trajectory sizes and the prompt encoding's cost with and without the engine's prompt cache."""
    import torch

    from workers.bench.engine_bench import run_bench

    if threads is not None:
        torch.set_num_threads(threads)
    names = split_list(configs)
    steps_per_request = aliased(num_steps, steps, "--num-steps", "--steps") or 4
    try:
        with _progress(len(names), repeats, enabled=_err.is_terminal) as log:
            report = run_bench(names, steps=steps_per_request, repeats=repeats, log=log)
    except ValueError as exc:
        _err.print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(code=2) from None
    report["command"] = _command(names, steps_per_request, repeats, threads, as_json, output, no_fail)
    text = json.dumps(report, indent=2)
    if output is not None:
        output.write_text(text + "\n")
    if as_json:
        typer.echo(text)
    else:
        _print_table(report)
    missed = [
        f"{cfg['config']} at f={row['active_fraction']} (ratio {row['ratio_wall']:.3f} > {row['target_ratio']:.2f})"
        for cfg in report["configs"]
        for row in cfg["srd"]
        if not row["meets_target"]
    ]
    if missed:
        _err.print(f"[yellow]missed the target[/]: {escape('; '.join(missed))}", soft_wrap=True)
        if not no_fail:
            raise typer.Exit(code=1)


def _command(
    names: list[str],
    steps: int,
    repeats: int,
    threads: int | None,
    as_json: bool,
    output: Path | None,
    no_fail: bool,
) -> str:
    """The command line that reproduces this report (recorded in it, so a committed result names its command)."""
    parts = ["chorus", "bench", "engine", *(["--json"] if as_json else []), "--configs", ",".join(names)]
    parts += ["--num-steps", str(steps), "--repeats", str(repeats)]
    if threads is not None:
        parts += ["--threads", str(threads)]
    if output is not None:
        parts += ["--output", str(output)]
    if no_fail:
        parts.append("--no-fail")
    return shlex.join(parts)


def phase_count(configs: int, repeats: int) -> int:
    """How many phases ``run_bench`` logs: per config a warm-up, per round a full request and one SRD request
    per fraction, donor verification, and the interleaved transformer passes."""
    from workers.bench.engine_bench import FRACTIONS

    return configs * (3 + repeats * (1 + len(FRACTIONS)))


@contextmanager
def _progress(configs: int, repeats: int, *, enabled: bool) -> Iterator[Callable[[str], None]]:
    """A progress bar over the bench's phases (per config: warm-up, each round's full and SRD requests, the
    interleaved passes), advanced by ``run_bench``'s log messages; not on a terminal, the messages as lines."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not enabled:
        yield lambda m: _err.print(f"[dim]{escape(m)}[/]")
        return
    total = phase_count(configs, repeats)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_err,
        transient=True,
    ) as bar:
        task = bar.add_task("starting", total=total)
        started: list[Any] = []

        def log(message: str) -> None:
            if started:  # a message starts the next phase: the one before is done
                bar.advance(task)
            started.append(message)
            bar.update(task, description=escape(message))

        yield log
        bar.update(task, completed=total)


def _print_table(report: dict[str, Any]) -> None:
    table = Table(title="chorus bench engine (medians)")
    for col in (
        "config",
        "tokens",
        "full step s",
        "f",
        "SRD step s",
        "ratio wall/cpu",
        "target",
        "ok",
        "pass ratio",
        "traj fp32/fp16 B",
        "encode ms (cache off/on)",
    ):
        table.add_column(col)
    for cfg in report["configs"]:
        tb = cfg["trajectory_bytes_per_request"]
        enc = cfg.get("prompt_encoding")  # absent from reports written before the prompt cache
        encode = (
            f"{enc['uncached']['wall_s'] * 1e3:.2f} / {enc['cached']['wall_s'] * 1e3:.3f}" if enc else "-"
        )
        for row in cfg["srd"]:
            p = cfg["transformer_pass"][str(row["active_fraction"])]
            table.add_row(
                cfg["config"],
                str(cfg["request"]["tokens"]),
                f"{cfg['full_step']['wall_s']:.4f}",
                str(row["active_fraction"]),
                f"{row['step']['wall_s']:.4f}",
                f"{row['ratio_wall']:.3f} / {row['ratio_cpu']:.3f}",
                f"≤ {row['target_ratio']:.2f}",
                "yes" if row["meets_target"] else "NO",
                f"{p['ratio_wall']:.3f}",
                f"{tb['float32']:,} / {tb['float16']:,}",
                encode,
            )
    Console().print(table)
