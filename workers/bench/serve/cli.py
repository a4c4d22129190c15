"""``chorus bench serve``: a trace through the embedded stack, with reuse and with ``reuse: off``, in one run.

The report (stdout with ``--json``, and ``--out``; the PNG beside ``--out`` or at ``--png``)::

    format            "chorus-bench-serve/1"
    command, started_at, wall_s, stack_start_s, quick, ok (every request of every pass done)
    machine           cores, load averages before and after (other work on the machine shows here)
    stack             workers, concurrency, schedulers, video format
    models            per model: model, catalog_model, shape, ok, trace (kind, requests, seed, rate, loop,
                      zipf_s, shares, variants), reuse / no_reuse (see workers.bench.serve.report: requests,
                      status, reuse kinds, hits, fallbacks, steps and token-steps, makespan_s, throughput_rps,
                      latency_s p50/p95/p99, worker_phase_s, outside_engine_s and _ratio, scheduler
                      ms_per_request, quality for the toy model), compare (throughput_ratio, latency_ratio,
                      token_steps_ratio), latencies_s (every request's, both passes), by_variant (reuse pass)

Progress goes to stderr. The exit status is 1 when a request failed or went missing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from workers.bench.report_file import stamped, write_report
from workers.bench.serve.trace import TraceKind

QUICK_HELP = "Smaller traces (toy 32, mid 16 requests): about 5 minutes on 2 cores."


@contextmanager
def _bars() -> Iterator[Callable[[str, int], Callable[[], None]]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )

    def add(label: str, total: int) -> Callable[[], None]:
        task = progress.add_task(label, total=total)
        return lambda: progress.advance(task)

    with progress:
        yield add


def bench_serve(
    as_json: bool = typer.Option(
        False, "--json", help="Print the JSON report on stdout (otherwise a table)."
    ),
    quick: bool = typer.Option(False, "--quick", help=QUICK_HELP),
    model: list[str] = typer.Option(
        ["toy", "mid"],
        "--model",
        help="toy (the toy model) or mid (Wan2.1-1.3B-width random weights); repeatable.",
    ),
    kind: TraceKind = typer.Option(TraceKind.MIXED, "--trace", help="mixed, fresh or duplicates."),
    requests: int | None = typer.Option(None, "--requests", min=1, help="Trace length (default: per model)."),
    rate: float | None = typer.Option(
        None, "--rate", min=0.001, help="Open-loop arrivals at this many requests/s (default: all at once)."
    ),
    num_steps: int | None = typer.Option(
        None, "--num-steps", min=1, max=200, help="Denoising steps (default 4)."
    ),
    seed: int = typer.Option(0, "--seed", help="The trace generator's seed."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Also write the JSON report here."),
    png: Path | None = typer.Option(
        None, "--png", help="Where to draw the figure (default: --out with .png)."
    ),
    state_dir: Path | None = typer.Option(
        None, help="The stack's state and logs (default: a temporary folder)."
    ),
) -> None:
    """Throughput and latency through the whole stack, with reuse against without, on a seeded trace."""
    from rich.console import Console

    from workers.bench.serve.harness import MODELS, ServeOptions, run_serve
    from workers.bench.serve.plot import write_png

    unknown = [m for m in model if m not in MODELS]
    if unknown:
        raise typer.BadParameter(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    err = Console(stderr=True)
    options = ServeOptions(
        models=tuple(dict.fromkeys(model)),
        kind=kind,
        requests=requests,
        seed=seed,
        rate=rate,
        num_steps=num_steps,
        quick=quick,
        state_dir=state_dir,
    )
    with _bars() as progress:
        report = run_serve(options, say=err.print, progress=progress)
    report = stamped("serve", report)
    figure = png or (out.with_suffix(".png") if out is not None else None)
    if figure is not None:
        report["figure"] = str(write_png(report, figure))
    text = write_report(report, out)
    if as_json:
        sys.stdout.write(text + "\n")
    else:
        _table(report)
    if not report["ok"]:
        raise typer.Exit(1)


def _table(report: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"chorus bench serve ({'quick' if report['quick'] else 'full'})")
    for name in ("model", "pass", "req/s", "p50 s", "p95 s", "p99 s", "hits", "steps", "outside/engine"):
        table.add_column(name, justify="left" if name in ("model", "pass") else "right")
    models = report["models"]
    assert isinstance(models, list)
    for entry in models:
        for key in ("reuse", "no_reuse"):
            s = entry[key]
            lat = s["latency_s"]
            table.add_row(
                entry["model"],
                key,
                str(s["throughput_rps"]),
                f"{lat['p50']:.2f}",
                f"{lat['p95']:.2f}",
                f"{lat['p99']:.2f}",
                str(s["hits"]),
                f"{s['steps_computed']}/{s['steps_requested']}",
                str(s["outside_engine_ratio"]),
            )
        table.add_row(
            entry["model"], "ratio", str(entry["compare"]["throughput_ratio"]), "", "", "", "", "", ""
        )
    Console().print(table)


def bench_sched(
    as_json: bool = typer.Option(
        False, "--json", help="Print the JSON report on stdout (otherwise a summary)."
    ),
    quick: bool = typer.Option(False, "--quick", help="60 direct, 200 at the rate, a backlog of 300."),
    rate: float = typer.Option(
        100.0, "--rate", min=1.0, help="Open-loop rate of the latency run (requests/s)."
    ),
    core: int | None = typer.Option(
        None, "--core", min=0, help="Pin the process to this core (default: not pinned)."
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="Also write the JSON report here."),
) -> None:
    """The scheduler's own cost per request, with workers that answer at once: added latency at a rate, the
    highest sustained rate on one core, and a profile of where the time goes."""
    from rich.console import Console

    from workers.bench.serve.sched import SchedOptions, run_sched

    err = Console(stderr=True)
    options = SchedOptions(rate=rate, core=core)
    if quick:
        options = SchedOptions(rate=rate, core=core, latency_requests=200, backlog=300, direct_requests=60)
    report = run_sched(options, say=err.print)
    report = stamped("sched", {"quick": quick, **report})
    text = write_report(report, out)
    if as_json:
        sys.stdout.write(text + "\n")
        return
    lat, sus = report["latency"], report["sustained"]
    err.print(
        f"added latency at {lat['rate']:g}/s: p50 {lat['added_ms']['p50']} ms, p99 {lat['added_ms']['p99']} ms "
        f"(in the scheduler p99 {lat['in_scheduler_ms']['p99']} ms; the broker alone p99 "
        f"{report['broker']['delivery_ms']['p99']} ms); "
        f"sustained {sus['rate']} requests/s ({sus['one_core_capacity']} on one core by CPU time); "
        f"direct: {report['direct']['cpu_ms_per_request']} CPU ms per request, by phase (wall ms): "
        f"{report['direct']['profile_wall_ms_per_request']}"
    )
