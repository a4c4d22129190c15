"""Prometheus for dashboard pictures: a small HTTP API client (``PromClient``), every target of a panel evaluated
over a time window (``fetch_panel``), and a throwaway local Prometheus that scrapes given targets
(``local_prometheus``, the Debian ``prometheus`` binary with a temporary config, as
``tests/integration/test_observability.py`` starts one).
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from chorus_dashboards.picture_model import Panel, Window, legend, substitute

# Panels that show one value per series: their queries are evaluated once, at the end of the window.
INSTANT_PANELS = frozenset({"stat", "gauge", "bargauge", "table", "piechart"})


class PromError(RuntimeError):
    """Prometheus answered with an error, or could not be reached or started."""


@dataclass(frozen=True)
class Series:
    """One series of a panel: its legend name, labels and points (Unix seconds; NaN where Prometheus said so)."""

    name: str
    labels: dict[str, str]
    times: list[float]
    values: list[float]


@dataclass
class PanelData:
    """What a panel's queries returned over a window, and the error of each query that failed."""

    panel: Panel
    series: list[Series] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return str(self.panel.get("type", "timeseries"))

    @property
    def has_values(self) -> bool:
        """Whether any point is a number (a quantile or ratio of nothing is NaN at every point)."""
        return any(not math.isnan(v) for s in self.series for v in s.values)


class Queries(Protocol):
    """What drawing needs of Prometheus (``PromClient``, or a stand-in in tests)."""

    def query(self, expr: str, at: float) -> list[dict[str, Any]]: ...

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class PromClient:
    url: str
    timeout_s: float = 30.0

    def api(self, path: str, **params: Any) -> Any:
        encoded = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        # Queries go as POST forms (expressions can be long).
        post = path in ("query", "query_range")
        url = f"{self.url.rstrip('/')}/api/v1/{path}" + ("" if post or not encoded else f"?{encoded}")
        try:
            data = encoded.encode() if post else None
            with urllib.request.urlopen(url, data=data, timeout=self.timeout_s) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        except (urllib.error.URLError, OSError) as exc:
            raise PromError(f"Prometheus at {self.url} cannot be reached: {exc}") from None
        if body.get("status") != "success":
            raise PromError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr, time=at)["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return list(self.api("query_range", query=expr, start=start, end=end, step=step)["result"])

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _series(result: dict[str, Any], fmt: str, expr: str) -> Series:
    labels = {str(k): str(v) for k, v in result.get("metric", {}).items()}
    points = result["values"] if "values" in result else [result["value"]]
    return Series(
        name=legend(fmt, labels, expr),
        labels=labels,
        times=[float(t) for t, _ in points],
        values=[_number(v) for _, v in points],
    )


def fetch_panel(prom: Queries, panel: Panel, window: Window, variables: Mapping[str, str]) -> PanelData:
    """Every visible target of ``panel`` evaluated over ``window`` (instant at its end for stat-like panels and
    instant targets), with Grafana's variables replaced; a failing query is kept as an error, not raised."""
    values = {**variables, **window.builtins()}
    data = PanelData(panel)
    instant_panel = data.kind in INSTANT_PANELS
    for target in panel.get("targets", []):
        if target.get("hide") or not target.get("expr"):
            continue
        expr = substitute(str(target["expr"]), values)
        try:
            if instant_panel or (target.get("instant") and not target.get("range")):
                results = prom.query(expr, at=window.end)
            else:
                results = prom.query_range(expr, window.start, window.end, window.step)
        except PromError as exc:
            data.errors.append(f"[{target.get('refId', '?')}] {exc}")
            continue
        fmt = str(target.get("legendFormat", ""))
        data.series.extend(_series(r, fmt, expr) for r in results)
    return data


@contextmanager
def local_prometheus(
    workdir: Path,
    jobs: Mapping[str, list[str]],
    *,
    scrape_interval: str = "1s",
    ready_timeout_s: float = 60.0,
) -> Iterator[PromClient]:
    """A Prometheus on a free loopback port scraping ``jobs`` (job name → ``host:port`` targets) every
    ``scrape_interval``, its data in ``workdir``; stopped on exit."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise PromError(
            "prometheus is not installed (Debian: apt-get install prometheus; scripts/test.sh does)"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(targets)}]} for job, targets in jobs.items()
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    log_path = workdir / "prometheus.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    prom = PromClient(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not prom.ready():
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise PromError(f"Prometheus did not start (see {log_path}):\n{tail}")
            time.sleep(0.2)
        yield prom
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def wait_for_series(prom: PromClient, exprs: list[str], timeout_s: float = 60.0) -> None:
    """Return once every expression returns a series (Prometheus has scraped what it names)."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [e for e in exprs if not prom.query(e, at=time.time())]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise PromError(f"Prometheus has no series for {missing} after {timeout_s:.0f} s")
        time.sleep(0.5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
