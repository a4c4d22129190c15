"""The ``chorus`` command line. Each command lives with the package that implements it; this module only
assembles them, and every command module defers heavy imports (torch, diffusers) to call time so that
``chorus --help`` stays instant."""

from __future__ import annotations

import typer

from chorus_sched import cli as sched_cli
from producer import cli_produce, cli_root
from producer.local import demo_command
from workers import cli as worker_cli
from workers import generate as generate_cli
from workers.bench import embedder_bench
from workers.bench import engine_cli as engine_bench
from workers.bench import quality as quality_bench
from workers.bench.faults import cli as faults_bench
from workers.bench.serve import cli as serve_bench
from workers.toy import cli as toy_cli

app = typer.Typer(
    name="chorus",
    help="Chorus: serve text-to-video diffusion requests cheaper by reusing work from similar requests.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    callback=cli_root.root,
    cls=cli_root.ChorusGroup,
)
bench_app = typer.Typer(help="Benchmarks that print JSON (speed, quality, faults).", no_args_is_help=True)

app.command("demo")(demo_command.demo)
app.command("produce")(cli_produce.produce)
app.command("scheduler")(sched_cli.scheduler)
app.command("worker")(worker_cli.worker)
app.command("generate")(generate_cli.generate)
app.command("train-toy")(toy_cli.train_toy)
bench_app.command("engine")(engine_bench.bench_engine)
bench_app.command("quality")(quality_bench.bench_quality)
bench_app.command("faults")(faults_bench.bench_faults)
bench_app.command("serve")(serve_bench.bench_serve)
bench_app.command("sched")(serve_bench.bench_sched)
bench_app.command("embedder")(embedder_bench.bench_embedder)
app.add_typer(bench_app, name="bench")


def main() -> None:
    app()
