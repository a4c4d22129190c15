"""Builds the Grafana dashboards that docker-compose provisions (``infra/grafana/dashboards/*.json``).

    python infra/grafana/build_dashboards.py           # rewrite the JSON files
    python infra/grafana/build_dashboards.py --check   # exit 1 if the committed files differ from this script

The JSON is what Grafana reads; this script and its package ``chorus_dashboards`` are where it is edited:
``panels`` (queries, layout, panel kinds, the data source every query names), ``chorus_overview`` and
``chorus_workers`` (one function per row of panels).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "dashboards"

# infra/ is not an installed package: put this directory on the path so that ``chorus_dashboards`` imports both
# when the builder runs as a script and when it is loaded from its file (tests/unit/infra/test_metrics_infra.py).
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from chorus_dashboards.chorus_overview import overview  # noqa: E402
from chorus_dashboards.chorus_workers import workers  # noqa: E402

DASHBOARDS = {"chorus-overview.json": overview, "chorus-workers.json": workers}


def render(build: Any) -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path = OUT_DIR / name
        text = render(build)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"out of date (run {Path(__file__).name}): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
