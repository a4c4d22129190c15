"""``chorus bench engine``: time full and SRD steps of the engine (``engine_bench.run_bench``) and print the
report as JSON or a table. Heavy imports (torch, the engine) happen inside the command."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

_err = Console(stderr=True)


def bench_engine(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (otherwise a table)."),
    configs: str = typer.Option("tiny,mid", help="Comma-separated configs: tiny, mid."),
    steps: int = typer.Option(4, min=3, help="Denoising steps per measured request."),
    repeats: int = typer.Option(
        3, min=1, help="Rounds (a full request + one SRD request per fraction) per config."
    ),
    threads: int | None = typer.Option(None, help="torch intra-op threads (default: torch's)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Also write the JSON here."),
) -> None:
    """Time full and SRD steps of the engine (tiny and a Wan2.1-1.3B-width config); print trajectory sizes."""
    import torch

    from workers.bench.engine_bench import run_bench

    if threads is not None:
        torch.set_num_threads(threads)
    names = [c.strip() for c in configs.split(",") if c.strip()]
    try:
        report = run_bench(
            names, steps=steps, repeats=repeats, log=lambda m: _err.print(f"[dim]{escape(m)}[/]")
        )
    except ValueError as exc:
        _err.print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(code=2) from None
    text = json.dumps(report, indent=2)
    if output is not None:
        output.write_text(text + "\n")
    if as_json:
        typer.echo(text)
        return
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
    ):
        table.add_column(col)
    for cfg in report["configs"]:
        tb = cfg["trajectory_bytes_per_request"]
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
            )
    Console().print(table)
