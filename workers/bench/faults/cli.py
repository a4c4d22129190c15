"""``chorus bench faults``: run the fault scenarios on the embedded stack and print one JSON object.

The report (stdout with ``--json``, and ``--out``)::

    format            "chorus-bench-faults/1"
    command, started_at, wall_s, quick, ok (every scenario ok), stacks_started
    state_dir         where the stacks' state and logs are (null: removed, every scenario was ok)
    sizes             the counts and durations used
    scenarios         one object per scenario:
                        name, ok, sent (messages published), valid (valid requests among them), done, failed,
                        rejected (valid requests by their first result), lost (valid, no result of any kind
                        within the deadline), duplicated (results beyond the first per (tenant, request_id)),
                        wrong_tenant (results for a (tenant, request_id) never sent whose request id another
                        tenant sent), shared_video (requests answered with another request's video),
                        scheduler_restarts (all, planned ones included), scheduler_crashes (exits nobody
                        asked for), scheduler_alive, worker_restarts, worker_crashes, recover_s (from the end
                        of the fault to the first result after it), peak_scheduler_rss_mb, wall_s,
                        hostile (null, or sent, dead_lettered, with_field_and_rule, rejected_results, executed,
                        letters_duplicated, unanswered, unanswered_by_kind, rules), checks (scenario-specific,
                        each must hold), figures, lost_ids, failures, why_not_ok, error, notes, logs

Progress goes to stderr. The exit status is 1 when a scenario is not ok.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from workers.bench.faults import NAMES
from workers.bench.report_file import stamped, write_report

QUICK_HELP = "A smaller version of every scenario (under 10 minutes on 2 cores)."


def _env(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.startswith("CHORUS_"):
            raise typer.BadParameter(f"--stack-env wants CHORUS_NAME=value, got {pair!r}")
        out[name] = value
    return out


def bench_faults(
    as_json: bool = typer.Option(
        False, "--json", help="Print the JSON report on stdout (otherwise a table)."
    ),
    quick: bool = typer.Option(False, "--quick", help=QUICK_HELP),
    only: list[str] = typer.Option(
        [], "--only", help=f"Run only this scenario (repeatable): {', '.join(NAMES)}."
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="Also write the JSON report here."),
    state_dir: Path | None = typer.Option(
        None,
        help="Where the stacks keep state and logs (default: a temporary folder, kept if a scenario fails).",
    ),
    stack_env: list[str] = typer.Option(
        [], "--stack-env", help="CHORUS_NAME=value added to every service's environment (repeatable)."
    ),
) -> None:
    """Fault scenarios on the embedded stack: kills, S3 down or hung, index unavailable, corrupt donors, hostile
    input, tenants sharing request ids, a burst. Counts lost, duplicated and misdelivered results per scenario."""
    from rich.console import Console

    from workers.bench.faults.harness import run_faults

    unknown = [n for n in only if n not in NAMES]
    if unknown:
        raise typer.BadParameter(f"unknown scenario(s) {unknown}; known: {', '.join(NAMES)}")
    err = Console(stderr=True)
    report = run_faults(only or None, quick=quick, state_root=state_dir, env=_env(stack_env), say=err.print)
    report = stamped("faults", report)
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

    columns = ("done", "failed", "rejected", "lost", "duplicated", "wrong_tenant", "scheduler_restarts")
    table = Table(title=f"chorus bench faults ({'quick' if report['quick'] else 'full'})")
    # sent = valid requests (done/failed/rejected/lost count them) + hostile messages (dead-lettered, or not)
    heads = ("scenario", "ok", "sent", "valid", *columns, "dead_lettered", "hostile_unanswered", "recover_s")
    for name in heads:  # headers wrap at their words on a narrow terminal
        table.add_column(
            name.replace("_", " "), justify="left" if name == "scenario" else "right", no_wrap=False
        )
    scenarios = report["scenarios"]
    assert isinstance(scenarios, list)
    for e in scenarios:
        hostile = e.get("hostile") or {}
        table.add_row(
            e["name"],
            "[green]yes[/]" if e["ok"] else "[red]no[/]",
            str(e["sent"]),
            str(e.get("valid", "")),
            *(str(e.get(c, "")) for c in columns),
            str(hostile.get("dead_lettered", "")),
            str(hostile.get("unanswered", "")),
            "" if e.get("recover_s") is None else f"{e['recover_s']:.1f}",
        )
    # Not a terminal (a pipe, a log): wide lines instead of a table squeezed to 80 columns.
    (Console() if sys.stdout.isatty() else Console(width=200)).print(table)
    if report.get("state_dir"):
        Console().print(f"state and logs: {report['state_dir']}")
