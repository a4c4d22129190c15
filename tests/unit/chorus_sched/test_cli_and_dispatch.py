from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chorus_sched.dispatch import broker_priority
from chorus_sched.settings import SchedulerSettings

CHORUS = str(Path(sys.executable).parent / "chorus")


def run_scheduler(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CHORUS_")}
    clean.update({"CHORUS_STATE_DIR": str(tmp_path), **env})
    return subprocess.run([CHORUS, "scheduler"], env=clean, capture_output=True, text=True, timeout=120)


def test_bad_settings_stop_the_scheduler_with_the_field_named(tmp_path: Path) -> None:
    result = run_scheduler(tmp_path, CHORUS_CROSS_TENANT_REUSE="maybe")
    assert result.returncode == 2
    # One line naming the variable and its value (the operator-facing form of the field's name).
    assert "invalid setting CHORUS_CROSS_TENANT_REUSE='maybe'" in result.stderr


@pytest.mark.parametrize(
    ("env", "code", "says"),
    [
        (
            {"CHORUS_QDRANT_URL": "http://127.0.0.1:1"},
            1,
            "cannot reach the donor index at http://127.0.0.1:1",
        ),
        ({"CHORUS_REDIS_URL": "redis://127.0.0.1:1"}, 1, "cannot reach the ledger at redis://127.0.0.1:1"),
        # a URL no adapter speaks, exit 2. The broker's took every request, then failed each order five times
        # (KeyError: No such transport); the ledger's was a traceback. The password is never echoed.
        ({"CHORUS_BROKER_URL": "garbage://x"}, 2, "CHORUS_BROKER_URL: no Celery transport for 'garbage://'"),
        (
            {"CHORUS_REDIS_URL": "mysql://u:s3cret@h/db"},
            2,
            "CHORUS_REDIS_URL: no ledger store for 'mysql://'",
        ),
    ],
)
def test_a_backing_service_it_cannot_use_stops_the_scheduler_with_one_line(
    tmp_path: Path, env: dict[str, str], code: int, says: str
) -> None:
    result = run_scheduler(tmp_path, CHORUS_EMBEDDER="hashing", CHORUS_METRICS_PORT="0", **env)
    assert result.returncode == code, result.stderr
    assert f"scheduler stopped: {says}" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout and "s3cret" not in result.stderr


def test_a_bad_calibration_file_stops_the_scheduler_before_it_consumes(tmp_path: Path) -> None:
    bad = tmp_path / "calibration.json"
    bad.write_text('{"format": "chorus-calibration/1"}')
    result = run_scheduler(tmp_path, CHORUS_CALIBRATION_PATH=str(bad), CHORUS_EMBEDDER="hashing")
    assert result.returncode == 2
    assert "calibration table rejected" in result.stderr and str(bad) in result.stderr
    assert "regimes" in result.stderr


def test_settings_defaults_point_at_the_embedded_setup(tmp_path: Path) -> None:
    settings = SchedulerSettings(state_dir=tmp_path, instance_id="")
    assert settings.resolved_qdrant_path == str(tmp_path / "qdrant")
    assert settings.ledger_path == tmp_path / "ledger.sqlite3"
    assert settings.broker_url == "" and settings.redis_url == ""
    assert str(os.getpid()) in settings.resolved_instance_id
    with pytest.raises(ValueError, match="CHORUS_CLAIM_LEASE_S"):
        SchedulerSettings(claim_lease_s=0.1, poll_timeout_ms=500)


@pytest.mark.parametrize(
    ("priority", "url", "expected"),
    [
        (0, "redis://r:6379/0", 9),  # kombu's Redis transport serves low numbers first
        (9, "rediss://r:6379/0", 0),
        (5, "amqp://guest@r//", 5),
        (3, "filesystem://", None),
    ],
)
def test_request_priority_maps_to_what_the_broker_honours(
    priority: int, url: str, expected: int | None
) -> None:
    assert broker_priority(priority, url) == expected
