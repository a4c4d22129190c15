"""Write-ahead logging for the donor index's local-mode files: a commit per point without three syncs each.

Qdrant local mode keeps each collection's points in one SQLite file and commits every point it writes on its
own, in SQLite's default rollback-journal mode: each commit writes and syncs a journal, the database and the
journal's deletion. The scheduler writes a point when it dispatches a group leader and again when the result
comes back, inside the index's hold (``chorus bench sched``'s profile on the development machine: 2.1 ms per
commit). In write-ahead-log mode a commit appends to one log and syncs it once (0.9 ms there). The mode is a
property of the file, so switching it through a connection of our own reaches the connection Qdrant keeps open
too; the data, and their durability when a process crashes, are unchanged.

The file's place is Qdrant local mode's layout (``<folder>/collection/<name>/storage.sqlite``), not its API: where
it is not found the index works as before and logs a warning.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

log = logging.getLogger(__name__)

WAL = "wal"


def storage_file(folder: Path, collection: str) -> Path:
    """Where Qdrant local mode keeps ``collection``'s points."""
    return folder / "collection" / collection / "storage.sqlite"


def journal_mode(path: Path) -> str:
    """The file's journal mode (``wal``, ``delete``, ...)."""
    db = sqlite3.connect(path, timeout=10.0)
    try:
        return str(db.execute("PRAGMA journal_mode").fetchone()[0]).lower()
    finally:
        db.close()


def use_write_ahead_log(folder: Path, collection: str) -> bool:
    """Switch ``collection``'s file in a local-mode folder to write-ahead logging; True if it is (or already was).

    Call with the folder held (``DonorIndex.hold``): no other process writes it then, and Qdrant's own
    connection is between transactions, which is when SQLite lets the mode change."""
    path = storage_file(folder, collection)
    if not path.is_file():
        log.warning(
            "donor index file not where Qdrant local mode kept it; each point's commit stays synced three times",
            extra={"expected": str(path)},
        )
        return False
    db = sqlite3.connect(path, timeout=10.0)
    try:
        mode = str(db.execute("PRAGMA journal_mode").fetchone()[0]).lower()
        if mode == WAL:
            return True
        mode = str(db.execute(f"PRAGMA journal_mode = {WAL}").fetchone()[0]).lower()
    except sqlite3.Error as exc:
        log.warning(
            "donor index file kept in its journal mode", extra={"path": str(path), "error": repr(exc)}
        )
        return False
    finally:
        db.close()
    if mode != WAL:
        log.warning("donor index file refused write-ahead logging", extra={"path": str(path), "mode": mode})
        return False
    log.info("donor index file switched to write-ahead logging", extra={"path": str(path)})
    return True
