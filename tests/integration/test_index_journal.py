"""The donor index's local-mode file in write-ahead-log mode (``chorus_sched.index_journal``): switched when the
index connects, on a new folder and on one Qdrant made in its default mode, with every point kept and readable by
a plain Qdrant client. Real Qdrant local mode throughout."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from qdrant_client import QdrantClient
from qdrant_client.http import models as qm

from chorus_sched.index import DonorEntry, DonorIndex, point_id
from chorus_sched.index_journal import journal_mode, storage_file, use_write_ahead_log

pytestmark = pytest.mark.integration


def _entry(rid: str) -> DonorEntry:
    return DonorEntry(
        request_id=rid, tenant="t", compat_key="k", prompt=f"prompt {rid}", trajectory_prefix=f"t/{rid}/"
    )


def test_a_new_folder_is_written_through_the_log_and_reads_back_everywhere(qdrant_path: Path) -> None:
    index = DonorIndex.connect(path=qdrant_path, collection="donors", dim=2, keep_open_s=5.0)
    assert journal_mode(storage_file(qdrant_path, "donors")) == "wal"
    for n in range(5):
        index.upsert(_entry(f"r{n}"), [1.0, float(n)])
    index.close()
    plain = QdrantClient(path=str(qdrant_path))  # Qdrant's own reader sees every committed point
    try:
        assert plain.count("donors").count == 5
    finally:
        plain.close()
    again = DonorIndex.connect(path=qdrant_path, collection="donors", dim=2)
    assert again.get("r4") is not None and again.get("r0") is not None
    again.close()


def test_a_folder_qdrant_made_in_its_default_mode_is_switched_with_its_points(qdrant_path: Path) -> None:
    plain = QdrantClient(path=str(qdrant_path))
    plain.create_collection("donors", vectors_config=qm.VectorParams(size=2, distance=qm.Distance.COSINE))
    plain.upsert(
        "donors",
        points=[
            qm.PointStruct(
                id=point_id("old"), vector=[1.0, 0.0], payload=_entry("old").model_dump(mode="json")
            )
        ],
    )
    plain.close()
    assert journal_mode(storage_file(qdrant_path, "donors")) != "wal"  # else this test shows nothing
    index = DonorIndex.connect(path=qdrant_path, collection="donors", dim=2, keep_open_s=5.0)
    assert journal_mode(storage_file(qdrant_path, "donors")) == "wal"
    index.upsert(_entry("new"), [0.0, 1.0])  # through the connection Qdrant opened before the switch
    assert index.get("old") is not None and index.get("new") is not None
    index.close()
    again = DonorIndex.connect(path=qdrant_path, collection="donors", dim=2)
    assert again.get("new") is not None
    again.close()


def test_a_layout_it_does_not_know_leaves_the_file_alone_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="chorus_sched.index_journal"):
        assert not use_write_ahead_log(tmp_path, "donors")
    assert "not where Qdrant local mode kept it" in caplog.text
