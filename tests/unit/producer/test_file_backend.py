"""The embedded result backend writes atomically: a reader never sees a torn value (a reader of Celery's plain
file backend can, which rejected a valid request as no_worker in chorus bench faults' burst)."""

from __future__ import annotations

import threading
from pathlib import Path

from producer.broker import announce_models, app_for_broker, model_last_seen
from producer.file_backend import AtomicFilesystemBackend, atomic_file_url


def test_the_embedded_app_uses_the_atomic_backend_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    app = app_for_broker("", state_dir=tmp_path)
    assert isinstance(app.backend, AtomicFilesystemBackend)
    announce_models(app, ["toy"], now=123.5)
    assert model_last_seen(app, "toy") == 123.5
    app.backend.store_result("job-1", {"step": 1}, "PROGRESS")
    assert app.AsyncResult("job-1").state == "PROGRESS"
    results = Path(app.backend.path.decode())
    assert not [p.name for p in results.iterdir() if p.name.endswith(".tmp")]


def test_a_reader_racing_a_writer_only_ever_sees_whole_values(tmp_path: Path) -> None:
    app = app_for_broker("", state_dir=tmp_path)
    announce_models(app, ["toy"], now=1.0)
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            announce_models(app, ["toy"], now=float(n))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        seen = [model_last_seen(app, "toy") for _ in range(3000)]
    finally:
        stop.set()
        writer.join()
    assert None not in seen


def test_only_file_urls_get_the_atomic_class() -> None:
    assert atomic_file_url("file:///x/results").endswith("+file:///x/results")
    assert atomic_file_url("redis://127.0.0.1:6379/3") == "redis://127.0.0.1:6379/3"
