"""What the fault bench watches from outside the services: the results and dead-letter topics (read in full, from
their beginning, by a consumer of its own outside any group) and the processes (``/proc``: pool children, RSS).

Every record is stamped with the (monotonic) time this process read it, which is what recovery times use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer

from producer import bus
from producer.settings import KafkaSettings
from workers.bench.faults.accounting import Letter, Received

log = logging.getLogger(__name__)


class Collector:
    """Reads the results and dead-letter topics from their beginning in a thread until ``close``."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.results_topic = settings.kafka_results_topic
        self.letters_topic = settings.kafka_dead_letter_topic
        self.requests_topic = settings.kafka_requests_topic
        self._consumer = KafkaConsumer(
            **bus.client_config(settings),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        self._lock = threading.Lock()
        self._results: list[Received] = []
        self._letters: list[Letter] = []
        self.unreadable = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faults-collector", daemon=True)
        self._thread.start()

    def results(self) -> list[Received]:
        with self._lock:
            return list(self._results)

    def letters(self) -> list[Letter]:
        with self._lock:
            return list(self._letters)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        with contextlib.suppress(Exception):
            self._consumer.close(autocommit=False)

    def _run(self) -> None:
        last_follow = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() - last_follow > 2.0:
                    for topic in (self.results_topic, self.letters_topic):
                        bus.follow_new_partitions(self._consumer, topic)
                    last_follow = time.monotonic()
                if not self._consumer.assignment():
                    time.sleep(0.2)
                    continue
                batches = self._consumer.poll(timeout_ms=200)
            except Exception as exc:  # a broker restart or shutdown: try again until closed
                log.debug("collector poll failed", extra={"error": repr(exc)})
                time.sleep(0.5)
                continue
            now = time.monotonic()
            for tp, records in batches.items():
                for record in records:
                    self._take(tp.topic, record.value, now)

    def _take(self, topic: str, value: bytes | None, now: float) -> None:
        try:
            data = json.loads(value or b"")
        except ValueError:
            self.unreadable += 1
            return
        if not isinstance(data, dict):
            self.unreadable += 1
            return
        with self._lock:
            if topic == self.results_topic:
                result = _received(data, now)
                if result is None:
                    self.unreadable += 1
                else:
                    self._results.append(result)
            elif data.get("topic") == self.requests_topic:
                self._letters.append(_letter(data, now))


def _received(data: dict[str, Any], now: float) -> Received | None:
    rid, status = data.get("request_id"), data.get("status")
    if not isinstance(rid, str) or not isinstance(status, str):
        return None
    error = data.get("error") if isinstance(data.get("error"), dict) else {}
    donor = data.get("donor")
    return Received(
        tenant=str(data.get("tenant") or "default"),
        request_id=rid,
        status=status,
        arrived_at=now,
        video_uri=data.get("video_uri") if isinstance(data.get("video_uri"), str) else None,
        error_code=str(error.get("code")) if error and error.get("code") else None,
        donor=str(donor.get("request_id")) if isinstance(donor, dict) else None,
        fallback=data.get("fallback") if isinstance(data.get("fallback"), str) else None,
        trajectory_uri=data.get("trajectory_uri") if isinstance(data.get("trajectory_uri"), str) else None,
        answers_resend=data.get("answers_resend") is True,
    )


def _letter(data: dict[str, Any], now: float) -> Letter:
    issues = tuple(
        (str(i.get("field") or ""), str(i.get("rule") or ""))
        for i in data.get("issues") or []
        if isinstance(i, dict)
    )
    error = data.get("error") if isinstance(data.get("error"), dict) else {}
    return Letter(
        partition=int(data.get("partition", -1)),
        offset=int(data.get("offset", -1)),
        code=str((error or {}).get("code") or ""),
        issues=issues,
        arrived_at=now,
    )


# --- processes ------------------------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, …), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def children(pid: int) -> list[int]:
    """Live (not zombie) child processes of ``pid``."""
    out = []
    for child in _pids():
        fields = _stat_fields(child)
        if fields is not None and fields[0] != "Z" and int(fields[1]) == pid:
            out.append(child)
    return sorted(out)


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in _pids():
        fields = _stat_fields(pid)
        if fields is None or int(fields[2]) != pgid:
            continue
        with contextlib.suppress(ValueError, IndexError):
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def group_rss_bytes(pgid: int) -> int:
    """Resident memory of every process in process group ``pgid`` (a service and what it started)."""
    total = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for pid in _pids():
        fields = _stat_fields(pid)
        if fields is None or int(fields[2]) != pgid or fields[0] == "Z":
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
    return total
