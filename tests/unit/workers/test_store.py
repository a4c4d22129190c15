"""The S3 adapter against a real S3 server (moto) that is down when a write starts and comes back during it."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from moto.server import ThreadedMotoServer

from workers.store import ObjectStore, StoreError


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_write_to_a_store_that_is_down_is_retried_until_it_comes_back() -> None:
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        # The store comes back after the second failed attempt.
        pauses.append(seconds)
        if len(pauses) == 2:
            server.start()
            ObjectStore(f"127.0.0.1:{port}", "chorus-test", access_key="k", secret_key="s").ensure_bucket()
        time.sleep(min(seconds, 0.05))

    store = ObjectStore(
        f"127.0.0.1:{port}",
        "chorus-test",
        access_key="k",
        secret_key="s",
        timeout_s=2.0,
        write_retry_s=30.0,
        sleep=sleep,
    )
    try:
        with pytest.raises(StoreError):
            store.ensure_bucket()  # only writes retry; a read or a bucket check fails at once
        stored = store.put("videos/r.mp4", b"video")
        assert len(pauses) >= 2 and pauses[1] > pauses[0]  # backoff grows
        assert store.get("videos/r.mp4") == b"video" and stored.size == 5
    finally:
        if pauses[1:]:
            server.stop()


def _record_and_sleep(pauses: list[float], seconds: float) -> None:
    pauses.append(seconds)
    time.sleep(seconds)


def test_a_write_gives_up_when_its_retry_window_is_spent() -> None:
    pauses: list[float] = []
    store = ObjectStore(
        f"127.0.0.1:{_free_port()}",
        "chorus-test",
        access_key="k",
        secret_key="s",
        timeout_s=1.0,
        write_retry_s=2.0,
        sleep=lambda s: _record_and_sleep(pauses, s),
    )
    start = time.monotonic()
    with pytest.raises(StoreError, match="cannot write"):
        store.put("videos/r.mp4", b"video")
    assert pauses and 1.5 <= time.monotonic() - start <= 15.0


class _ProxyPage(BaseHTTPRequestHandler):
    """What a proxy or load balancer in front of the store answers when it throttles: not S3's XML."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        page = b"<html><body>Too Many Requests</body></html>"
        self.send_response(413 if self.command == "PUT" else 429)  # what urllib3 does not retry
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(page)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_an_answer_that_is_not_s3s_is_a_store_error() -> None:
    # minio raises InvalidResponseError / ServerError for these, which are not S3Error: every caller that expects
    # a StoreError (a donor fetch falls back, a failed upload is served without its trajectory) must get one.
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ProxyPage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    store = ObjectStore(
        f"127.0.0.1:{server.server_address[1]}",
        "chorus-test",
        access_key="k",
        secret_key="s",
        timeout_s=2.0,
        write_retry_s=0.0,
    )
    try:
        for call in (
            lambda: store.get("videos/r.mp4"),
            lambda: store.get_verified("videos/r.mp4"),
            lambda: store.put("videos/r.mp4", b"video"),
            lambda: store.exists("videos/r.mp4"),
            lambda: store.delete_prefix("trajectories/r/"),
        ):
            with pytest.raises(StoreError):
                call()
    finally:
        server.shutdown()
        server.server_close()


def test_one_store_per_process_and_settings_even_when_threads_ask_at_once(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from workers.settings import WorkerSettings
    from workers.store import store_for

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        base: dict[str, Any] = {
            "state_dir": tmp_path,
            "s3_endpoint": f"http://127.0.0.1:{port}",
            "s3_bucket": f"b-{port}",
        }
        settings = WorkerSettings(**base, s3_access_key="k", s3_secret_key="s")
        with ThreadPoolExecutor(8) as pool:  # a threads pool's first orders
            stores = list(pool.map(lambda _: store_for(settings), range(8)))
        assert len({id(s) for s in stores}) == 1
        other = WorkerSettings(**base, s3_access_key="k2", s3_secret_key="s2")  # other credentials: its own
        assert store_for(other) is not stores[0]
    finally:
        server.stop()


def test_settings_that_differ_only_in_credentials_get_runners_of_their_own(tmp_path: Path) -> None:
    # pydantic's dump masks secrets: keyed by it alone, the second would get the first's store and producer
    from workers.runner import runner_for
    from workers.settings import WorkerSettings

    base: dict[str, Any] = {"state_dir": tmp_path, "s3_access_key": "k"}
    first = runner_for(WorkerSettings(**base, s3_secret_key="one"))
    assert runner_for(WorkerSettings(**base, s3_secret_key="one")) is first
    assert runner_for(WorkerSettings(**base, s3_secret_key="two")) is not first
