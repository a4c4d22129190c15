"""``chorus worker``: a Celery worker (prefork) for the queues of the models it serves, plus maintenance."""

from __future__ import annotations

import logging
import re
import socket
from typing import TYPE_CHECKING, Any, Literal

import typer
from rich.console import Console
from rich.markup import escape

from producer.catalog import ModelName
from producer.readiness import ReadinessEvent

if TYPE_CHECKING:
    from workers.settings import WorkerSettings

log = logging.getLogger(__name__)


def worker(
    model: list[ModelName] | None = typer.Option(
        None,
        "--model",
        "-m",
        help="Model to serve (repeatable). Default: CHORUS_WORKER_MODELS, else every model that can load here.",
    ),
    concurrency: int | None = typer.Option(
        None, "--concurrency", "-c", min=1, help="Worker processes (default CHORUS_WORKER_CONCURRENCY)."
    ),
    autoscale: bool = typer.Option(
        False,
        "--autoscale",
        help="Grow and shrink the pool between the autoscale bounds (CHORUS_WORKER_AUTOSCALE_MIN/MAX).",
    ),
    min_processes: int | None = typer.Option(
        None, min=1, help="Lower autoscale bound (default from settings)."
    ),
    max_processes: int | None = typer.Option(
        None, min=1, help="Upper autoscale bound (default from settings)."
    ),
    pool: Literal["prefork", "solo", "threads"] = typer.Option(
        "prefork", help="Celery pool: prefork, solo (one process, debugging) or threads."
    ),
    hostname: str | None = typer.Option(
        None, "--hostname", "-n", help="Worker name (default chorus@<host>)."
    ),
    maintenance: bool = typer.Option(True, help="Also consume the maintenance queue (evictions)."),
    preload: bool = typer.Option(
        False, help="Load the served models when each worker process starts instead of on its first order."
    ),
) -> None:
    """Run a Celery worker that executes generation orders for the given models."""
    err = Console(stderr=True)
    conflict = flag_conflict(pool, concurrency, autoscale, min_processes, max_processes)
    if conflict is not None:
        err.print(f"[bold red]error:[/] {escape(conflict)}", soft_wrap=True)
        raise typer.Exit(code=2)
    overrides: dict[str, Any] = {
        name: value
        for name, value in (
            ("worker_models", model or None),
            ("worker_concurrency", concurrency),
            ("worker_autoscale_min", min_processes),
            ("worker_autoscale_max", max_processes),
        )
        if value is not None
    }
    settings = _settings(overrides, err)
    _serve(
        settings, pool=pool, autoscale=autoscale, hostname=hostname, maintenance=maintenance, preload=preload
    )


def _settings(overrides: dict[str, Any], err: Console) -> WorkerSettings:
    """The worker's settings (the environment's, the flags over them), with only the models it can load."""
    from pydantic import ValidationError

    from producer.logs import configure_logging
    from producer.settings import settings_error_line
    from workers.settings import WorkerSettings

    try:
        settings = WorkerSettings(**overrides)
    except ValidationError as exc:
        err.print(f"[bold red]error:[/] {escape(settings_error_line(exc))}", soft_wrap=True)
        raise typer.Exit(code=2) from None
    configure_logging(settings.log_level, settings.log_format)
    return _servable(settings, err)


def _serve(
    settings: WorkerSettings,
    *,
    pool: str,
    autoscale: bool,
    hostname: str | None,
    maintenance: bool,
    preload: bool,
) -> None:
    """Start the Celery worker and run it until it stops."""
    from celery.signals import worker_process_init, worker_process_shutdown

    from workers.app import create_app
    from workers.presence import announcing

    app = create_app(settings)
    # before anything else starts (the metrics endpoint, the engine's imports): a broker that is not there is
    # said at once
    _reach_broker(app, settings.broker_connect_timeout_s, Console(stderr=True))

    # Metrics: multiprocess mode and the endpoint start here, in the main process, before any metric exists
    # and before the pool forks (workers/metrics.py).
    from workers import metrics as worker_metrics

    in_main = 0 if pool == "prefork" else (1 if pool == "solo" else settings.worker_concurrency)
    exposition = worker_metrics.serve(settings, slots_in_main=in_main)
    worker_process_init.connect(worker_metrics.on_process_init, weak=False)
    worker_process_shutdown.connect(worker_metrics.on_process_exit, weak=False)

    # Import the engine's modules (torch, diffusers) once here, before the pool forks, so each process does
    # not import them on its first order. Models are still loaded in each process (CUDA must start after fork).
    from workers.runner import close_runners

    models = settings.served_models
    name = hostname or f"chorus@{socket.gethostname()}"
    argv, queues, sizing = worker_argv(
        settings, pool=pool, autoscale=autoscale, hostname=name, maintenance=maintenance
    )
    worker_process_shutdown.connect(lambda **_: close_runners(), weak=False)
    if preload:
        _preload_in_each_process(app, settings, models)

    Console().print(
        f"[bold]chorus worker[/] {escape(name)}: models [bold]{escape(', '.join(models))}[/] on "
        f"[bold]{escape(settings.device)}[/] ({settings.dtype}); queues {escape(', '.join(queues))}; "
        f"{pool} pool, {sizing}; broker {escape(_redact(app.conf.broker_url))}"
        + (f"; metrics on :{exposition.port}" if exposition is not None else "")
    )
    try:
        with announcing(app, models, settings.worker_presence_s):
            app.worker_main(argv)
    finally:
        # Celery sends worker_process_shutdown from prefork's children only: under the solo and threads pools
        # the orders ran here, and their trajectory uploads (daemon threads) would die with the process.
        close_runners()
        if exposition is not None:
            exposition.close()


def _servable(settings: WorkerSettings, err: Console) -> WorkerSettings:
    """The settings with only the models this worker can load, checked before it announces any (the scheduler
    sends a model's orders to whoever announces it). A model named (``--model``, ``CHORUS_WORKER_MODELS``) that
    cannot load stops the worker; of the default, every catalog model, those that cannot are left out."""
    from workers.engine.errors import ModelUnavailable
    from workers.engine.registry import check_available

    servable: list[str] = []
    refused: dict[str, str] = {}
    for m in settings.served_models:
        try:
            # count_gpus=False: this process forks the pool, whose processes start CUDA themselves
            check_available(
                m,
                device=settings.device,
                wan21_dir=settings.wan21_dir,
                toy_weights_dir=settings.toy_weights_dir,
                count_gpus=False,
            )
        except ModelUnavailable as exc:
            refused[m] = str(exc)
        else:
            servable.append(m)
    if refused and (settings.worker_models or not servable):
        name, reason = next(iter(refused.items()))
        err.print(f"[bold red]error:[/] cannot serve {escape(name)}: {escape(reason)}", soft_wrap=True)
        raise typer.Exit(code=2)
    for name, reason in refused.items():
        log.warning("model left out: it cannot load here", extra={"model": name, "reason": reason})
    return settings.model_copy(update={"worker_models": servable}) if refused else settings


def _preload_in_each_process(app: Any, settings: Any, models: list[str]) -> None:
    """Load the served models when each pool process starts, not on its first order."""
    from celery.signals import worker_process_init

    # Loading can take minutes (Wan2.1); give each new process that long to report that it is up.
    app.conf.worker_proc_alive_timeout = max(60.0, settings.task_soft_time_limit_s)

    @worker_process_init.connect(weak=False)
    def _load_models(**_: Any) -> None:
        from workers.runner import engine_for

        for m in models:
            try:
                engine_for(m, settings)
            except Exception as exc:  # the process stays up; orders for m then fail with the reason
                log.error(ReadinessEvent.MODEL_NOT_PRELOADED, extra={"model": m, "error": str(exc)})


def flag_conflict(
    pool: str, concurrency: int | None, autoscale: bool, min_processes: int | None, max_processes: int | None
) -> str | None:
    """Pool-size flags that cannot all hold (one would be ignored without a word), or None."""
    if concurrency is not None and autoscale:
        return "give --concurrency (a fixed pool) or --autoscale (a pool that grows and shrinks), not both"
    if pool == "solo" and concurrency not in (None, 1):
        return f"--pool solo runs one order at a time: --concurrency {concurrency} needs --pool prefork or threads"
    if autoscale and pool != "prefork":
        return f"--autoscale needs --pool prefork (the {pool} pool has a fixed size)"
    if (min_processes is not None or max_processes is not None) and not autoscale:
        return "--min-processes and --max-processes bound --autoscale: add it, or give --concurrency"
    if min_processes is not None and max_processes is not None and min_processes > max_processes:
        return f"--min-processes {min_processes} exceeds --max-processes {max_processes}"
    return None


def worker_argv(
    settings: WorkerSettings, *, pool: str, autoscale: bool, hostname: str, maintenance: bool
) -> tuple[list[str], list[str], str]:
    """Celery ``worker`` arguments for the served models: (argv, queues, a description of the pool size)."""
    from producer.orders import MAINTENANCE_QUEUE, queue_for

    queues = [queue_for(m) for m in settings.served_models] + ([MAINTENANCE_QUEUE] if maintenance else [])
    argv = ["worker", "-Q", ",".join(queues), "-P", pool, "-n", hostname, "--loglevel", settings.log_level]
    if autoscale and pool == "prefork":
        argv += ["--autoscale", f"{settings.worker_autoscale_max},{settings.worker_autoscale_min}"]
        sizing = f"autoscale {settings.worker_autoscale_min}..{settings.worker_autoscale_max}"
    else:
        size = settings.worker_concurrency if pool != "solo" else 1
        argv += ["--concurrency", str(size)]
        sizing = f"concurrency {size}"
    return argv, queues, sizing


def _reach_broker(app: Any, timeout_s: float, err: Console) -> None:
    """Stop with one line when the broker cannot be reached within ``timeout_s``."""
    from kombu.exceptions import OperationalError

    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(
                interval_start=0.5, interval_step=0.5, interval_max=2.0, timeout=timeout_s
            )
    except (OperationalError, OSError) as exc:
        err.print(
            f"[bold red]error:[/] cannot reach the broker {escape(_redact(app.conf.broker_url))} within "
            f"{timeout_s:g} s ({escape(str(exc))}): start it, or point CHORUS_BROKER_URL at it",
            soft_wrap=True,
        )
        raise typer.Exit(code=2) from None


def _redact(url: str) -> str:
    return re.sub(r"//([^:/@]*):[^@]*@", r"//\1:***@", url)
