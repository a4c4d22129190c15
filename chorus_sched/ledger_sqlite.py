"""The embedded ledger (``chorus_sched.ledger``) in one SQLite file in WAL mode, shared by every scheduler process
of one machine: ``BEGIN IMMEDIATE`` transactions make each operation atomic across processes."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from chorus_sched.ledger import DEFAULT_TTL_S, RETRYABLE_STATES, Claim, Ledger, RequestRecord, RequestState

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
  request_id TEXT PRIMARY KEY, state TEXT NOT NULL, owner TEXT, lease_until REAL,
  record TEXT, expires_at REAL NOT NULL, origin TEXT);
CREATE TABLE IF NOT EXISTS marks (key TEXT PRIMARY KEY, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS hits (
  donor_id TEXT PRIMARY KEY, hits INTEGER NOT NULL, steps_saved REAL NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS pending_evictions (request_id TEXT PRIMARY KEY, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS locks (name TEXT PRIMARY KEY, token TEXT NOT NULL, until REAL NOT NULL);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS waiters (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, value TEXT NOT NULL, expires_at REAL NOT NULL);
"""


class SqliteLedger(Ledger):
    """The embedded ledger: one SQLite file, shared by every scheduler process of the machine."""

    def __init__(self, path: Path, *, prefix: str = "chorus:", ttl_s: int = DEFAULT_TTL_S) -> None:
        self.path = Path(path)
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA busy_timeout = 30000")
        # Switching to WAL needs a moment alone with the file, and SQLite does not wait for it (no busy handler):
        # another process opening or writing the ledger at that instant makes it fail at once. Try again.
        deadline = time.monotonic() + 30.0
        while True:
            try:
                self._db.execute("PRAGMA journal_mode = WAL")
                break
            except sqlite3.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._db.execute("PRAGMA synchronous = NORMAL")
        with self._tx():
            for statement in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
                self._db.execute(statement)
            # A ledger file written by an earlier release has no origin column yet.
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(requests)")}
            if "origin" not in columns:
                self._db.execute("ALTER TABLE requests ADD COLUMN origin TEXT")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken at once (BEGIN IMMEDIATE): atomic across processes."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _expires(self) -> float:
        return time.time() + self.ttl_s

    def begin(
        self,
        request_id: str,
        *,
        owner: str,
        lease_s: float,
        state: RequestState = RequestState.ACCEPTED,
        origin: str = "",
    ) -> Claim:
        now = time.time()
        key = self._key(request_id)
        with self._tx() as db:
            db.execute("DELETE FROM requests WHERE request_id = ? AND expires_at < ?", (key, now))
            row = db.execute(
                "SELECT state, owner, lease_until, origin FROM requests WHERE request_id = ?", (key,)
            ).fetchone()
            if row is not None and row[0] in RETRYABLE_STATES and origin and origin != (row[3] or ""):
                db.execute("DELETE FROM requests WHERE request_id = ?", (key,))
            inserted = db.execute(
                "INSERT OR IGNORE INTO requests (request_id, state, owner, lease_until, expires_at, origin) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (key, state, owner, now + lease_s, self._expires(), origin),
            ).rowcount
            if inserted:
                return (
                    Claim("new", state, owner) if row is None else Claim("retry", RequestState(row[0]), owner)
                )
            current, holder, lease_until = RequestState(row[0]), row[1], row[2]
            if current == RequestState.ACCEPTED:
                if holder == owner or (lease_until or 0.0) < now:
                    db.execute(
                        "UPDATE requests SET owner = ?, lease_until = ?, expires_at = ? WHERE request_id = ?",
                        (owner, now + lease_s, self._expires(), key),
                    )
                    return Claim("resumed", current, holder)
                return Claim("busy", current, holder)
            return Claim("duplicate", current, holder, row[3] or "")

    def _row(self, request_id: str) -> tuple[Any, ...] | None:
        with self._lock:
            row: tuple[Any, ...] | None = self._db.execute(
                "SELECT state, record FROM requests WHERE request_id = ? AND expires_at >= ?",
                (self._key(request_id), time.time()),
            ).fetchone()
        return row

    def state(self, request_id: str) -> RequestState | None:
        row = self._row(request_id)
        return None if row is None else RequestState(row[0])

    def set_state(self, request_id: str, state: RequestState, *, origin: str | None = None) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO requests (request_id, state, expires_at, origin) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(request_id) DO UPDATE SET state = excluded.state, expires_at = excluded.expires_at, "
                "origin = COALESCE(excluded.origin, origin)",
                (self._key(request_id), state, self._expires(), origin),
            )

    def release(self, request_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM requests WHERE request_id = ?", (self._key(request_id),))

    def record_dispatch(self, record: RequestRecord) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO requests (request_id, state, record, expires_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(request_id) DO UPDATE SET state = excluded.state, record = excluded.record, "
                "lease_until = NULL, expires_at = excluded.expires_at",
                (
                    self._key(record.request_id),
                    RequestState.DISPATCHED,
                    record.model_dump_json(),
                    self._expires(),
                ),
            )

    def record(self, request_id: str) -> RequestRecord | None:
        row = self._row(request_id)
        if row is None or row[1] is None:
            return None
        return RequestRecord.model_validate_json(row[1])

    def dispatched_records(self, limit: int = 1000) -> list[RequestRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT record FROM requests WHERE state = ? AND record IS NOT NULL "
                "AND expires_at >= ? AND substr(request_id, 1, ?) = ? LIMIT ?",
                (RequestState.DISPATCHED, time.time(), len(self.prefix), self.prefix, limit),
            ).fetchall()
        return [RequestRecord.model_validate_json(r[0]) for r in rows]

    def mark_once(self, key: str) -> bool:
        now = time.time()
        with self._tx() as db:
            db.execute("DELETE FROM marks WHERE key = ? AND expires_at < ?", (self._key(key), now))
            return bool(
                db.execute(
                    "INSERT OR IGNORE INTO marks (key, expires_at) VALUES (?, ?)",
                    (self._key(key), self._expires()),
                ).rowcount
            )

    def is_marked(self, key: str) -> bool:
        with self._lock:
            return (
                self._db.execute(
                    "SELECT 1 FROM marks WHERE key = ? AND expires_at >= ?", (self._key(key), time.time())
                ).fetchone()
                is not None
            )

    def add_hit(self, donor_id: str, steps_saved: float) -> tuple[int, float]:
        with self._tx() as db:
            db.execute(
                "INSERT INTO hits (donor_id, hits, steps_saved, expires_at) VALUES (?, 1, ?, ?) "
                "ON CONFLICT(donor_id) DO UPDATE SET hits = hits + 1, "
                "steps_saved = steps_saved + excluded.steps_saved, expires_at = excluded.expires_at",
                (self._key(donor_id), float(steps_saved), self._expires()),
            )
            hits, saved = db.execute(
                "SELECT hits, steps_saved FROM hits WHERE donor_id = ?", (self._key(donor_id),)
            ).fetchone()
        return int(hits), float(saved)

    def put_value(self, key: str, value: str, *, ttl_s: float | None = None) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO kv (key, value, expires_at) VALUES (?, ?, ?)",
                (self._key(key), value, time.time() + (ttl_s or self.ttl_s)),
            )

    def get_value(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute(
                "SELECT value FROM kv WHERE key = ? AND expires_at >= ?", (self._key(key), time.time())
            ).fetchone()
        return None if row is None else str(row[0])

    def delete_value(self, key: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM kv WHERE key = ?", (self._key(key),))

    def add_waiter(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO waiters (key, value, expires_at) VALUES (?, ?, ?)",
                (self._key(key), value, self._expires()),
            )

    def take_waiters(self, key: str) -> list[str]:
        with self._tx() as db:
            rows = db.execute(
                "SELECT value FROM waiters WHERE key = ? AND expires_at >= ? ORDER BY seq",
                (self._key(key), time.time()),
            ).fetchall()
            db.execute("DELETE FROM waiters WHERE key = ?", (self._key(key),))
        return [str(r[0]) for r in rows]

    def add_pending_evictions(self, request_ids: Sequence[str], reason: str) -> None:
        with self._tx() as db:
            db.executemany(
                "INSERT OR REPLACE INTO pending_evictions (request_id, reason) VALUES (?, ?)",
                [(self._key(r), reason) for r in request_ids],
            )

    def pending_evictions(self) -> dict[str, str]:
        with self._lock:
            rows = self._db.execute("SELECT request_id, reason FROM pending_evictions").fetchall()
        n = len(self.prefix)
        return {str(k)[n:]: str(v) for k, v in rows if str(k).startswith(self.prefix)}

    def remove_pending_evictions(self, request_ids: Sequence[str]) -> None:
        with self._tx() as db:
            db.executemany(
                "DELETE FROM pending_evictions WHERE request_id = ?", [(self._key(r),) for r in request_ids]
            )

    def try_lock(self, name: str, token: str, ttl_s: float) -> bool:
        now = time.time()
        with self._tx() as db:
            db.execute("DELETE FROM locks WHERE name = ? AND until < ?", (self._key(name), now))
            return bool(
                db.execute(
                    "INSERT OR IGNORE INTO locks (name, token, until) VALUES (?, ?, ?)",
                    (self._key(name), token, now + ttl_s),
                ).rowcount
            )

    def unlock(self, name: str, token: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM locks WHERE name = ? AND token = ?", (self._key(name), token))

    def renew_lock(self, name: str, token: str, ttl_s: float) -> bool:
        with self._tx() as db:
            return bool(
                db.execute(
                    "UPDATE locks SET until = ? WHERE name = ? AND token = ? AND until >= ?",
                    (time.time() + ttl_s, self._key(name), token, time.time()),
                ).rowcount
            )

    def lock_holder(self, name: str) -> str | None:
        with self._lock:
            row = self._db.execute(
                "SELECT token FROM locks WHERE name = ? AND until >= ?", (self._key(name), time.time())
            ).fetchone()
        return None if row is None else str(row[0])

    def purge_expired(self) -> int:
        now = time.time()
        with self._tx() as db:
            return sum(
                db.execute(f"DELETE FROM {table} WHERE expires_at < ?", (now,)).rowcount
                for table in ("requests", "marks", "hits", "kv", "waiters")
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()
