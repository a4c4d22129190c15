"""Draws the Grafana dashboards as pictures (one PNG each), for where Grafana cannot run.

Each dashboard of ``dashboards/*.json`` becomes one PNG: every panel's queries evaluated by a real Prometheus and
drawn with matplotlib.

    python infra/grafana/render_dashboards.py           # a live run (about 3 minutes), PNGs into docs/dashboards/
    python infra/grafana/render_dashboards.py --quick   # a shorter stream (about 1½ minutes)
    python infra/grafana/render_dashboards.py --prometheus http://localhost:9090 --last 1h   # an existing one

A live run starts a Prometheus (the ``prometheus`` binary; scripts/test.sh installs it) scraping an embedded
stack every second, publishes a short, varied stream of requests (``chorus_dashboards/picture_run.py``), then
evaluates each panel over the run with ``/api/v1/query_range`` (Grafana's ``$__rate_interval`` becomes
``--rate-window``, ``$__range`` the run's length, "All" for template variables) and draws it
(``chorus_dashboards/picture_draw.py``). With ``--prometheus`` nothing is started: the pictures show the last
``--last`` of that Prometheus (the compose stack's, say).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DASHBOARD_DIR = HERE / "dashboards"

# infra/ is not an installed package (as in build_dashboards.py).
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from chorus_dashboards.picture_draw import Rendered, render_dashboard  # noqa: E402
from chorus_dashboards.picture_model import Window  # noqa: E402
from chorus_dashboards.picture_prom import PromClient, PromError  # noqa: E402

COMMAND = "python infra/grafana/render_dashboards.py"


def seconds(text: str) -> float:
    """A duration such as ``90s``, ``30m`` or ``1h`` in seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration like 90s, 30m or 1h: {text!r}")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboards", help="where the PNGs go")
    parser.add_argument(
        "--quick", action="store_true", help="a shorter stream (2 prompt families, 1.5 s apart)"
    )
    parser.add_argument("--model", default="toy", choices=["toy", "tiny-random-wan"], help="the model served")
    parser.add_argument(
        "--embedder", default="minilm", choices=["minilm", "hashing"], help="the prompt embedder"
    )
    parser.add_argument(
        "--dashboard",
        action="append",
        default=[],
        help="only this dashboard (file name without .json); repeats",
    )
    parser.add_argument("--rate-window", default="30s", help="what $__rate_interval becomes (default 30s)")
    parser.add_argument("--prometheus", metavar="URL", help="draw from this Prometheus instead of a live run")
    parser.add_argument("--last", type=seconds, default=3600.0, help="with --prometheus: the time range (1h)")
    args = parser.parse_args(argv)
    try:
        seconds(args.rate_window)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--rate-window: {exc}")
    return args


def dashboards(names: list[str]) -> list[Path]:
    paths = sorted(DASHBOARD_DIR.glob("*.json"))
    unknown = set(names) - {p.stem for p in paths}
    if unknown:
        raise SystemExit(f"unknown dashboard(s) {sorted(unknown)}; known: {[p.stem for p in paths]}")
    return [p for p in paths if not names or p.stem in names]


def render_all(
    prom: PromClient, window: Window, paths: list[Path], out_dir: Path, note: str
) -> list[Rendered]:
    rendered = []
    for path in paths:
        dashboard = json.loads(path.read_text())
        rendered.append(render_dashboard(prom, dashboard, window, out_dir / f"{path.stem}.png", note))
    return rendered


def report(rendered: list[Rendered]) -> None:
    for r in rendered:
        total = r.panels
        where = r.path.relative_to(ROOT) if r.path.is_relative_to(ROOT) else r.path
        print(f"wrote {where}: {len(r.with_data)} of {total} panels with data")
        if r.no_data:
            print(f"  no data: {', '.join(r.no_data)}")
        for error in r.errors:
            print(f"  query error: {error}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    paths = dashboards(args.dashboard)
    stamp = time.strftime("%Y-%m-%d %H:%M %Z")
    try:
        if args.prometheus:
            end = time.time()
            window = Window.over(end - args.last, end, rate_window=args.rate_window)
            note = f"{args.prometheus}, the last {args.last / 60:g} min, {stamp}; $__rate_interval = {args.rate_window}"
            prom = PromClient(args.prometheus)
            prom.api("status/buildinfo")  # reachable, and a Prometheus
            rendered = render_all(prom, window, paths, args.out, note)
        else:
            from chorus_dashboards.picture_run import RunPlan, live_run

            plan = RunPlan.quick(args.model) if args.quick else RunPlan(model=args.model)
            plan = dataclasses.replace(plan, embedder=args.embedder)
            with live_run(plan) as run:
                window = Window.over(run.start, run.end, rate_window=args.rate_window)
                sent = sum(n for what, n in run.outcomes.items() if what != "no result in time")
                note = (
                    f"A live run of the embedded stack ({plan.model} model), {stamp}: {sent} results of a stream "
                    f"with donor reuse, exact hits and invalid requests; Prometheus scraping every 1 s; "
                    f"$__rate_interval = {args.rate_window}; x axis: minutes:seconds into the run. "
                    f"Regenerate: {COMMAND}{' --quick' if args.quick else ''}"
                )
                rendered = render_all(run.prom, window, paths, args.out, note)
    except PromError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
