"""The local-mode index kept open between operations (``chorus_sched.index_lock``, ``DonorIndex.keep_open_s``): it
lets go when idle, counts only live waiters, survives a fork, and never searches a copy that disagrees with the
folder. Real Qdrant local mode throughout."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest
from qdrant_client import QdrantClient

from chorus_sched.index import DonorEntry, DonorIndex
from chorus_sched.index_lock import STALE_MARKER_S, WAITING_DIR, FolderLock

pytestmark = pytest.mark.integration
FORK = multiprocessing.get_context("fork")


def _entry(rid: str) -> DonorEntry:
    return DonorEntry(
        request_id=rid, tenant="t", compat_key="k", prompt=f"prompt {rid}", trajectory_prefix=f"t/{rid}/"
    )


def _foreign_client_opens(path: Path) -> bool:
    """Whether a client outside Chorus' protocol can open the folder now (Qdrant's own storage lock)."""
    try:
        client = QdrantClient(path=str(path))
    except RuntimeError:
        return False
    client.close()
    return True


def test_the_folder_is_kept_open_then_let_go_when_idle(qdrant_path: Path) -> None:
    index = DonorIndex.connect(path=qdrant_path, collection="donors", dim=2, keep_open_s=0.3)
    index.upsert(_entry("a"), [1.0, 0.0])
    assert index.search([1.0, 0.0], compat_key="k", tenant="t")[0].entry.request_id == "a"
    assert not _foreign_client_opens(qdrant_path)  # still open after the operations
    time.sleep(0.6)
    assert _foreign_client_opens(qdrant_path)  # idle past keep_open_s: let go
    assert index.get("a") is not None and index.opens == 2  # the next operation opened it again
    index.close()
    assert _foreign_client_opens(qdrant_path)


def test_only_live_waiters_count(qdrant_path: Path) -> None:
    lock = FolderLock(qdrant_path, wait_s=1.0)
    waiting = qdrant_path / WAITING_DIR
    waiting.mkdir(parents=True)
    dead = waiting / "999999999-gone"  # no such pid
    dead.touch()
    assert not lock.others_waiting() and not dead.exists()
    stopped = waiting / f"{os.getppid()}-stopped"  # a live pid that stopped touching its marker
    stopped.touch()
    past = time.time() - 2 * STALE_MARKER_S
    os.utime(stopped, (past, past))
    assert not lock.others_waiting() and not stopped.exists()
    live = waiting / f"{os.getppid()}-live"
    live.touch()
    assert lock.others_waiting() and live.exists()


def test_a_forked_child_leaves_the_parents_open_folder_locked(qdrant_path: Path) -> None:
    index = DonorIndex.connect(path=qdrant_path, collection="donors", dim=2, keep_open_s=600)
    index.upsert(_entry("a"), [1.0, 0.0])
    with index.hold():  # a fork from inside an operation keeps the folder (an idle one is let go first)
        child = FORK.Process(target=time.sleep, args=(0.1,))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        assert not _foreign_client_opens(qdrant_path)  # the child did not unlock Qdrant's storage lock
    assert index.get("a") is not None
    index.close()


def test_an_idle_folder_is_let_go_before_a_fork(qdrant_path: Path) -> None:
    index = DonorIndex.connect(path=qdrant_path, collection="donors", dim=2, keep_open_s=600)
    index.upsert(_entry("a"), [1.0, 0.0])
    child = FORK.Process(target=time.sleep, args=(0.1,))
    child.start()
    assert _foreign_client_opens(qdrant_path)  # closed in the parent before the fork
    child.join(timeout=60)
    assert child.exitcode == 0 and index.get("a") is not None and index.opens == 2
    index.close()


def test_a_write_that_fails_partway_is_not_searched_from_a_stale_copy(
    qdrant_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = DonorIndex.connect(path=qdrant_path, collection="donors", dim=2, keep_open_s=600)
    for rid in ("a", "b"):
        index.upsert(_entry(rid), [1.0, 0.0])
    real_delete = QdrantClient.delete

    def delete_one_then_fail(
        self: QdrantClient, collection_name: str, points_selector: Any, **kw: Any
    ) -> Any:
        first = type(points_selector)(points=points_selector.points[:1])
        real_delete(self, collection_name, points_selector=first, **kw)
        raise ConnectionError("storage failed after the first id")

    monkeypatch.setattr(QdrantClient, "delete", delete_one_then_fail)
    with pytest.raises(ConnectionError):
        index.delete(["a", "b"])
    monkeypatch.undo()
    assert index.get("a") is None and index.get("b") is not None  # what the folder holds
    assert [h.entry.request_id for h in index.search([1.0, 0.0], compat_key="k", tenant="t")] == ["b"]
    index.close()


def test_local_mode_commits_without_waiting_for_the_disk_and_keeps_its_points(qdrant_path: Path) -> None:
    """Qdrant's per-point commits in its default journal mode waited for fsyncs under the index's hold."""
    import sqlite3

    index = DonorIndex.connect(path=qdrant_path, collection="donors", dim=2, keep_open_s=600)
    index.upsert(_entry("a"), [1.0, 0.0])
    client: Any = index._client
    db = client._client.collections["donors"].storage.storage
    assert db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL: no fsync per commit in WAL
    index.close()
    (storage,) = qdrant_path.rglob("storage.sqlite")
    with sqlite3.connect(storage) as probe:
        assert probe.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    reopened = DonorIndex.connect(path=qdrant_path, collection="donors", dim=2)  # an existing collection
    assert reopened.get("a") is not None
    reopened.upsert(_entry("b"), [0.0, 1.0])
    reopened.close()
    foreign = QdrantClient(path=str(qdrant_path))
    try:
        assert foreign.count("donors").count == 2
    finally:
        foreign.close()


def _use_the_index(path: str, rounds: int, done: Any, go_on: Any) -> None:
    """A forked child that opens the index several times, the parent writing in between."""
    for n in range(rounds):
        index = DonorIndex.connect(path=path, collection="donors", dim=2, lock_wait_s=30)
        index.upsert(_entry(f"child-{n}"), [0.0, 1.0])
        assert index.get(f"parent-{n}") is not None and index.count() == 2 * n + 2
        index.close()
        done.set()
        assert go_on.wait(60)
        go_on.clear()


def test_a_forked_child_can_use_the_index_its_parent_kept_open(qdrant_path: Path) -> None:
    """Before a fork the parent lets go of its idle folder: in WAL mode a child that inherited the open SQLite
    connection got 'disk I/O error' (or missed a write) on its second open after the parent had written."""
    index = DonorIndex.connect(path=qdrant_path, collection="donors", dim=2, keep_open_s=600)
    index.upsert(_entry("parent-0"), [1.0, 0.0])
    done, go_on = FORK.Event(), FORK.Event()
    child = FORK.Process(target=_use_the_index, args=(str(qdrant_path), 3, done, go_on))
    child.start()
    for n in range(3):
        assert done.wait(60), f"the child's round {n} did not finish"
        done.clear()
        assert (
            index.get(f"child-{n}") is not None
        )  # the parent opens the folder again, the child's write in it
        index.upsert(_entry(f"parent-{n + 1}"), [1.0, 0.0])
        index.release()
        go_on.set()
    child.join(timeout=120)
    assert child.exitcode == 0
    assert index.count() == 7
    index.close()


def test_a_file_that_cannot_switch_modes_keeps_its_default_and_the_index_works(
    qdrant_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The mode is a speed-up: an outside reader in a transaction (SQLite cannot switch then) costs it, not the
    open, which once left a client behind after releasing the folder's lock."""
    import logging
    import sqlite3

    from qdrant_client.http import models as qm

    plain = QdrantClient(path=str(qdrant_path))  # made in Qdrant's default mode
    plain.create_collection("donors", vectors_config=qm.VectorParams(size=2, distance=qm.Distance.COSINE))
    plain.close()
    (storage,) = qdrant_path.rglob("storage.sqlite")
    reader = sqlite3.connect(storage, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM points").fetchone()
    try:
        with caplog.at_level(logging.WARNING, logger="chorus_sched.index"):
            index = DonorIndex.connect(path=qdrant_path, collection="donors", dim=2)
    finally:
        reader.execute("COMMIT")  # a reader in a transaction blocks writes in either mode
        reader.close()
    assert "not switched to write-ahead logging" in caplog.text
    assert _foreign_client_opens(qdrant_path)  # closed after the operation (keep_open_s=0), lock released
    index.upsert(_entry("a"), [1.0, 0.0])
    assert index.get("a") is not None
    index.close()
