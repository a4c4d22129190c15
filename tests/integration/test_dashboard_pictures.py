"""The workers dashboard drawn from a real Prometheus (``infra/grafana/render_dashboards.py``'s path with
``--prometheus``, and that command itself): a stub exporter serves a few of the worker's metrics, changing every half second; a Prometheus
scrapes it every second; then every panel is evaluated over those seconds and drawn into a PNG. Panels whose
metrics the stub serves have data, the others say "no data", and no query fails (the ``$instance`` variable and
Grafana's intervals are replaced). About 20 s."""

from __future__ import annotations

import json
import random
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from producer.local.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "infra" / "grafana"
if str(GRAFANA) not in sys.path:
    sys.path.insert(0, str(GRAFANA))

import render_dashboards  # noqa: E402
from chorus_dashboards.picture_draw import render_dashboard  # noqa: E402
from chorus_dashboards.picture_model import Window  # noqa: E402
from chorus_dashboards.picture_prom import local_prometheus, wait_for_series  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_S = 12.0


@pytest.fixture
def exporter() -> Iterator[str]:
    """A stub worker exporter on a free port; yields its ``host:port``."""
    registry = CollectorRegistry()
    busy = Gauge("chorus_worker_busy_slots", "busy", registry=registry)
    Gauge("chorus_worker_pool_slots", "slots", registry=registry).set(2)
    loaded = Gauge("chorus_worker_models_loaded", "loaded", ["model"], registry=registry)
    loaded.labels(model="toy").set(2)
    results = Counter(
        "chorus_worker_requests", "results", ["model", "role", "status", "reuse"], registry=registry
    )
    phases = Histogram("chorus_worker_phase_duration_seconds", "phases", ["phase"], registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    stop = threading.Event()

    def work() -> None:
        rng = random.Random(1)
        while not stop.wait(0.5):
            busy.set(rng.choice([0, 1, 2]))
            results.labels(model="toy", role="solo", status="done", reuse=rng.choice(["donor", "none"])).inc()
            for phase in ("queue", "denoise", "upload"):
                phases.labels(phase=phase).observe(rng.uniform(0.01, 2.0))

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop.set()
        worker.join(timeout=5)
        server.shutdown()
        thread.join(timeout=5)


@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus is not installed (Debian: prometheus)"
)
def test_the_workers_dashboard_drawn_from_a_real_prometheus(
    exporter: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with local_prometheus(tmp_path / "prometheus", {"chorus-worker": [exporter]}) as prom:
        wait_for_series(prom, ['chorus_worker_pool_slots{job="chorus-worker"}'])
        start = time.time()
        time.sleep(RUN_S)
        window = Window.over(start, time.time(), points=60, rate_window="5s")
        dashboard = json.loads((GRAFANA / "dashboards" / "chorus-workers.json").read_text())
        rendered = render_dashboard(prom, dashboard, window, tmp_path / "chorus-workers.png", note="stub")
        # the command's own path: --prometheus draws from a running Prometheus
        argv = [
            "--prometheus",
            prom.url,
            "--last",
            "20s",
            "--rate-window",
            "5s",
            "--dashboard",
            "chorus-workers",
        ]
        assert render_dashboards.main([*argv, "--out", str(tmp_path / "cli")]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {tmp_path / 'cli' / 'chorus-workers.png'}: " in printed and "query error" not in printed
    assert (tmp_path / "cli" / "chorus-workers.png").read_bytes()[:4] == b"\x89PNG"
    assert rendered.path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not rendered.errors
    assert {
        "Busy slots",
        "Utilisation",
        "Pool slots",
        "Results per worker",
        "Worker phases (p95)",
        "Processes holding each model",
    } <= set(rendered.with_data)
    assert {"Kafka consumer lag", "Fallbacks by cause", "Celery queue depth"} <= set(rendered.no_data)
