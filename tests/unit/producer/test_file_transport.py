"""The embedded broker writes each message file atomically: a consumer never takes an empty or partial message
(kombu's filesystem transport creates the file before writing it, and a consumer that listed the folder in
between read an empty message and stopped the worker: chorus bench serve --trace fresh --rate 3)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from queue import Empty
from typing import Any

import pytest

from producer.broker import app_for_broker
from producer.file_transport import AtomicChannel, AtomicFilesystemTransport


def _channel(tmp_path: Path) -> Any:
    app = app_for_broker("", state_dir=tmp_path)
    conn = app.connection_for_write()
    assert isinstance(conn.transport, AtomicFilesystemTransport)
    channel = conn.default_channel
    assert isinstance(channel, AtomicChannel)
    return conn, channel


def test_messages_arrive_whole_in_order_and_leave_no_temporary_files(tmp_path: Path) -> None:
    conn, channel = _channel(tmp_path)
    with conn:
        for n in range(5):
            channel._put("q", {"n": n})
        folder = Path(channel.data_folder_out)
        assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
        assert [channel._get("q")["n"] for _ in range(5)] == [0, 1, 2, 3, 4]
        with pytest.raises(Empty):
            channel._get("q")


def test_a_consumer_racing_producers_only_ever_reads_whole_messages(tmp_path: Path) -> None:
    conn, channel = _channel(tmp_path)
    body = {"order": "x" * 20_000}  # large enough that a write is not one instant
    stop = threading.Event()
    sent = 0

    def produce() -> None:
        nonlocal sent
        while not stop.is_set() and sent < 400:
            channel._put("q", body)
            sent += 1

    producer = threading.Thread(target=produce)
    producer.start()
    received = 0
    try:
        while producer.is_alive() or received < sent:
            try:
                assert channel._get("q") == body
                received += 1
            except Empty:
                continue
    finally:
        stop.set()
        producer.join()
        conn.close()
    assert received == sent


def test_an_unreadable_message_file_is_skipped_not_fatal(tmp_path: Path, caplog: Any) -> None:
    conn, channel = _channel(tmp_path)
    with conn:
        Path(channel.data_folder_in, "0_broken.q.msg").write_bytes(b"")
        with caplog.at_level(logging.ERROR, logger="producer.file_transport"), pytest.raises(Empty):
            channel._get("q")  # skipped (and logged), not raised to the worker
        assert not os.listdir(channel.data_folder_in)
        channel._put("q", {"n": 1})
        assert channel._get("q") == {"n": 1}


def test_other_brokers_keep_their_own_transport() -> None:
    app = app_for_broker("redis://127.0.0.1:6379/15", state_dir=Path("/nonexistent"))
    assert app.conf.broker_transport is None
