"""CLI commands of this package."""

from __future__ import annotations

import logging

import typer

log = logging.getLogger(__name__)


def scheduler() -> None:
    """Run the scheduler: requests topic → donor search and planning → Celery work orders; results → donor index.

    Configured by environment (CHORUS_*, see chorus_sched/settings.py). Stops cleanly on SIGTERM or SIGINT:
    the batch in hand is finished and committed, then the consumers leave their groups.
    """
    import os
    import signal
    import threading

    from pydantic import ValidationError

    # The scheduler is one process and keeps its metrics in memory; a PROMETHEUS_MULTIPROC_DIR inherited from an
    # environment shared with the workers would send them to the workers' files instead (workers/metrics.py).
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    from chorus_sched.metrics import serve as serve_metrics
    from chorus_sched.planner import CalibrationError
    from chorus_sched.service import ServiceUnreachable, run
    from chorus_sched.settings import SchedulerSettings
    from producer.bus import BrokerUnreachable, is_bootstrap_failure
    from producer.logs import configure_logging
    from producer.settings import UnusableSetting, settings_error_line

    try:
        settings = SchedulerSettings()
    except ValidationError as exc:
        typer.echo(settings_error_line(exc), err=True)
        raise typer.Exit(code=2) from None
    configure_logging(settings.log_level, settings.log_format)
    stop = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    exposition = None
    try:
        exposition = serve_metrics(settings)
        run(settings, stop)
    except CalibrationError as exc:
        typer.echo(f"calibration table rejected: {exc}", err=True)
        raise typer.Exit(code=2) from None
    except UnusableSetting as exc:
        typer.echo(f"scheduler stopped: {exc}", err=True)
        raise typer.Exit(code=2) from None
    except ServiceUnreachable as exc:  # one line; the traceback only at CHORUS_LOG_LEVEL=DEBUG
        log.debug("a backing service is unreachable", exc_info=exc)
        typer.echo(f"scheduler stopped: {exc}", err=True)
        raise typer.Exit(code=1) from None
    except Exception as exc:
        if is_bootstrap_failure(exc):  # one line: nothing in a traceback would help
            typer.echo(
                f"scheduler stopped: {BrokerUnreachable(settings.kafka_bootstrap, [str(exc)])}", err=True
            )
            raise typer.Exit(code=1) from None
        log.critical("scheduler stopped on an error", exc_info=exc)
        typer.echo(f"scheduler stopped on an error: {exc!r}", err=True)
        raise typer.Exit(code=1) from None
    finally:
        if exposition is not None:
            exposition.close()
