"""The Redis adapter: the scheduler's ledger — idempotency claims, request records, hit counters, mutexes.

A request id is claimed once; a redelivered message (after a crash, a rebalance, a producer retry) finds the
claim and is not run twice. A claim starts as a *lease* (``accepted``, owned by one scheduler instance until
``lease_until``) and becomes ``dispatched`` once the work order is on the Celery broker; an instance that
crashed between the two leaves a lease that expires, after which another instance takes the request over.
The dispatch record (prompt, tenant, compatibility key, role, donor) lets whichever instance reads the request's
result index it as a donor. Everything expires after a TTL so the ledger does not grow forever.

Two stores behind one interface:

- ``RedisLedger`` (``redis://…``, production): hashes and Lua scripts, atomic across instances and hosts;
- ``SqliteLedger`` (``sqlite:///path``, the embedded default under ``state_dir``): one SQLite file in WAL
  mode with ``INSERT OR IGNORE`` / ``BEGIN IMMEDIATE`` semantics, safe across processes on one machine.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import redis
from pydantic import BaseModel, Field

log = logging.getLogger(__name__)

ClaimOutcome = Literal["new", "retry", "resumed", "duplicate", "busy"]
# States a request ends in without a video. A *new* message with the same id is the sender trying again, and is
# claimed afresh; the same message read again (a redelivery) is still a duplicate.
RETRYABLE_STATES = ("failed", "dead_lettered")
DEFAULT_TTL_S = 7 * 24 * 3600


class LedgerError(RuntimeError):
    """The ledger could not be used (e.g. a mutex could not be acquired in time)."""


@dataclass(frozen=True)
class Claim:
    """``new``: first time seen; ``retry``: it ended without a video and this is another message asking again;
    ``resumed``: our own earlier lease, or an expired lease of another instance; ``duplicate``: already
    dispatched (or finished), or the very message that was claimed before; ``busy``: another instance holds a
    live lease."""

    outcome: ClaimOutcome
    state: str | None = None
    owner: str | None = None

    @property
    def ours(self) -> bool:
        return self.outcome in ("new", "retry", "resumed")


class RequestRecord(BaseModel):
    """What the scheduler decided for one request, kept so any instance can process its result."""

    request_id: str
    tenant: str
    prompt: str
    model: str
    compat_key: str
    num_steps: int
    reuse: str
    role: str
    donor_id: str | None = None
    similarity: float | None = None
    planned_steps_saved: float = 0.0
    scheduler: str = ""
    accepted_at: float = Field(default_factory=time.time)
    # The WorkOrder as sent (JSON), when it was (last) sent, and how many times the watchdog sent it again: what
    # ``chorus_sched.watchdog`` needs to re-send an order whose worker vanished.
    order: str | None = None
    dispatched_at: float | None = None
    redispatches: int = Field(default=0, ge=0)


class Ledger(ABC):
    """The operations the scheduler needs; ``from_url`` picks the store."""

    prefix: str
    ttl_s: int

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "chorus:", ttl_s: int = DEFAULT_TTL_S) -> Ledger:
        """``redis://…`` / ``rediss://…`` / ``unix://…`` → Redis; ``sqlite:///path/to/file`` → embedded SQLite."""
        if url.startswith("sqlite:///"):
            # SQLAlchemy's convention: sqlite:///relative/path, sqlite:////absolute/path
            return SqliteLedger(Path(url[len("sqlite:///") :]), prefix=prefix, ttl_s=ttl_s)
        if url.startswith(("redis://", "rediss://", "unix://")):
            return RedisLedger(redis.Redis.from_url(url, decode_responses=True), prefix=prefix, ttl_s=ttl_s)
        raise ValueError(f"unsupported ledger URL {url!r} (redis://…, rediss://…, unix://… or sqlite:///…)")

    # --- claims ----------------------------------------------------------------------------------------------
    def claim(self, request_id: str, state: str = "accepted") -> bool:
        """True if this call claimed the id; False if it was claimed before (a duplicate). No lease."""
        claim = self.begin(request_id, owner=f"claim:{state}", lease_s=float(self.ttl_s), state=state)
        return claim.outcome == "new"

    @abstractmethod
    def begin(
        self, request_id: str, *, owner: str, lease_s: float, state: str = "accepted", origin: str = ""
    ) -> Claim:
        """Claim a request for scheduling, as a lease of ``lease_s`` seconds held by ``owner``.

        ``origin`` names the message that asks (topic:partition:offset): a request that ended in a
        ``RETRYABLE_STATES`` state is claimed again by a message of another origin.
        """

    @abstractmethod
    def state(self, request_id: str) -> str | None: ...

    @abstractmethod
    def set_state(self, request_id: str, state: str, *, origin: str | None = None) -> None:
        """Set the request's state (creating the entry if needed); ``origin`` also records which message it
        concerns, so that a redelivery of that message is still recognised (see ``begin``)."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Forget a claim, so that a message whose dispatch failed is accepted when it comes again."""

    @abstractmethod
    def record_dispatch(self, record: RequestRecord) -> None:
        """Mark the request ``dispatched`` and keep what was decided for it."""

    @abstractmethod
    def record(self, request_id: str) -> RequestRecord | None: ...

    @abstractmethod
    def dispatched_records(self, limit: int = 1000) -> list[RequestRecord]:
        """Records of requests still ``dispatched`` (no result yet), at most ``limit``."""

    # --- once-only marks, counters -----------------------------------------------------------------------------
    @abstractmethod
    def mark_once(self, key: str) -> bool:
        """True the first time ``key`` is marked (within the TTL), False afterwards."""

    @abstractmethod
    def is_marked(self, key: str) -> bool: ...

    @abstractmethod
    def add_hit(self, donor_id: str, steps_saved: float) -> tuple[int, float]:
        """Count one hit on a donor, atomically; returns the donor's totals (hits, steps saved)."""

    # --- evictions waiting for their order to be sent -----------------------------------------------------------
    @abstractmethod
    def add_pending_evictions(self, request_ids: Sequence[str], reason: str) -> None: ...

    @abstractmethod
    def pending_evictions(self) -> dict[str, str]:
        """request id → reason of every eviction whose ``EvictOrder`` is not yet on the broker."""

    @abstractmethod
    def remove_pending_evictions(self, request_ids: Sequence[str]) -> None: ...

    # --- mutual exclusion between instances ---------------------------------------------------------------------
    @abstractmethod
    def try_lock(self, name: str, token: str, ttl_s: float) -> bool: ...

    @abstractmethod
    def unlock(self, name: str, token: str) -> None: ...

    @abstractmethod
    def renew_lock(self, name: str, token: str, ttl_s: float) -> bool:
        """Extend a lock we hold by ``ttl_s`` from now; False if it is no longer ours."""

    @abstractmethod
    def lock_holder(self, name: str) -> str | None:
        """The token of whoever holds the lock now (it starts with the holder's owner id), or None."""

    @contextmanager
    def mutex(
        self, name: str, *, ttl_s: float = 10.0, wait_s: float = 120.0, owner: str = ""
    ) -> Iterator[None]:
        """Exclusive across every instance sharing the ledger.

        The lock is a short lease (``ttl_s``) that a background thread renews while the block runs, so a holder
        that dies (SIGKILL, power loss) blocks the others for at most ``ttl_s``, however long the block takes
        for a live holder. A wait longer than a few seconds is logged with the holder's identity.
        """
        token = f"{owner or 'anonymous'}:{uuid.uuid4().hex}"
        self._acquire(name, token, ttl_s, wait_s)
        stop = threading.Event()
        renewer = threading.Thread(
            target=self._keep_lock, args=(name, token, ttl_s, stop), name=f"mutex-{name}", daemon=True
        )
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join()
            self.unlock(name, token)

    def _acquire(self, name: str, token: str, ttl_s: float, wait_s: float) -> None:
        start = time.monotonic()
        deadline, next_report = start + wait_s, start + 2.0
        pause = 0.005
        while not self.try_lock(name, token, ttl_s):
            now = time.monotonic()
            if now > deadline:
                raise LedgerError(
                    f"mutex {name!r} not acquired within {wait_s:.0f} s (held by {self.lock_holder(name)})"
                )
            if now >= next_report:
                log.warning(
                    "waiting for a mutex another instance holds",
                    extra={
                        "mutex": name,
                        "holder": self.lock_holder(name),
                        "waited_s": round(now - start, 1),
                    },
                )
                next_report = now + 10.0
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def _keep_lock(self, name: str, token: str, ttl_s: float, stop: threading.Event) -> None:
        while not stop.wait(ttl_s / 3):
            try:
                if not self.renew_lock(name, token, ttl_s):
                    log.error("lost a mutex while holding it", extra={"mutex": name})
                    return
            except Exception as exc:  # the ledger is down: the next renewal may succeed before the lease ends
                log.warning("could not renew a mutex", extra={"mutex": name, "error": repr(exc)})

    def purge_expired(self) -> int:
        """Drop expired rows (stores whose entries do not expire by themselves); returns how many."""
        return 0

    @abstractmethod
    def close(self) -> None: ...


# --------------------------------------------------------------------------------------------------------------
# Redis

_BEGIN = """
local key = KEYS[1]
local owner, lease_until, now, ttl, state0 = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local origin = ARGV[6]
local state = redis.call('HGET', key, 'state')
if not state then
  redis.call('HSET', key, 'state', state0, 'owner', owner, 'lease_until', lease_until, 'origin', origin)
  redis.call('EXPIRE', key, ttl)
  return {'new', state0, owner}
end
if (state == 'failed' or state == 'dead_lettered') and origin ~= ''
    and origin ~= (redis.call('HGET', key, 'origin') or '') then
  redis.call('DEL', key)
  redis.call('HSET', key, 'state', state0, 'owner', owner, 'lease_until', lease_until, 'origin', origin)
  redis.call('EXPIRE', key, ttl)
  return {'retry', state, owner}
end
local holder = redis.call('HGET', key, 'owner') or ''
if state == 'accepted' then
  local until_ = tonumber(redis.call('HGET', key, 'lease_until') or '0')
  if holder == owner or until_ < now then
    redis.call('HSET', key, 'owner', owner, 'lease_until', lease_until)
    redis.call('EXPIRE', key, ttl)
    return {'resumed', state, holder}
  end
  return {'busy', state, holder}
end
return {'duplicate', state, holder}
"""

_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class RedisLedger(Ledger):
    def __init__(self, client: redis.Redis, *, prefix: str = "chorus:", ttl_s: int = DEFAULT_TTL_S) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._begin = client.register_script(_BEGIN)
        self._unlock = client.register_script(_UNLOCK)
        self._renew = client.register_script(_RENEW)

    def _req(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def begin(
        self, request_id: str, *, owner: str, lease_s: float, state: str = "accepted", origin: str = ""
    ) -> Claim:
        now = time.time()
        outcome, current, holder = self._begin(
            keys=[self._req(request_id)],
            args=[owner, repr(now + lease_s), repr(now), self.ttl_s, state, origin],
        )
        return Claim(outcome=outcome, state=current, owner=holder or None)

    def state(self, request_id: str) -> str | None:
        value = self.client.hget(self._req(request_id), "state")
        return None if value is None else str(value)

    def set_state(self, request_id: str, state: str, *, origin: str | None = None) -> None:
        key = self._req(request_id)
        with self.client.pipeline() as pipe:
            pipe.hset(key, mapping={"state": state} if origin is None else {"state": state, "origin": origin})
            pipe.expire(key, self.ttl_s)
            pipe.execute()

    def release(self, request_id: str) -> None:
        self.client.delete(self._req(request_id))
        self.client.srem(self._dispatched, request_id)

    def record_dispatch(self, record: RequestRecord) -> None:
        key = self._req(record.request_id)
        with self.client.pipeline() as pipe:
            pipe.hset(key, mapping={"state": "dispatched", "record": record.model_dump_json()})
            pipe.hdel(key, "lease_until")
            pipe.expire(key, self.ttl_s)
            pipe.sadd(self._dispatched, record.request_id)
            pipe.execute()

    @property
    def _dispatched(self) -> str:
        return f"{self.prefix}dispatched"

    def dispatched_records(self, limit: int = 1000) -> list[RequestRecord]:
        ids = [str(i) for i in self.client.srandmember(self._dispatched, limit) or []]
        if not ids:
            return []
        with self.client.pipeline() as pipe:
            for rid in ids:
                pipe.hmget(self._req(rid), "state", "record")
            rows = pipe.execute()
        out, gone = [], []
        for rid, (state, raw) in zip(ids, rows, strict=True):
            if state == "dispatched" and raw is not None:
                out.append(RequestRecord.model_validate_json(str(raw)))
            else:
                gone.append(rid)  # answered, expired or retried since: no longer watched
        if gone:
            self.client.srem(self._dispatched, *gone)
        return out

    def record(self, request_id: str) -> RequestRecord | None:
        raw = self.client.hget(self._req(request_id), "record")
        return None if raw is None else RequestRecord.model_validate_json(str(raw))

    def mark_once(self, key: str) -> bool:
        return bool(self.client.set(f"{self.prefix}mark:{key}", "1", nx=True, ex=self.ttl_s))

    def is_marked(self, key: str) -> bool:
        return bool(self.client.exists(f"{self.prefix}mark:{key}"))

    def add_hit(self, donor_id: str, steps_saved: float) -> tuple[int, float]:
        key = f"{self.prefix}hits:{donor_id}"
        with self.client.pipeline() as pipe:
            pipe.hincrby(key, "hits", 1)
            pipe.hincrbyfloat(key, "steps_saved", float(steps_saved))
            pipe.expire(key, self.ttl_s)
            hits, saved, _ = pipe.execute()
        return int(hits), float(saved)

    def add_pending_evictions(self, request_ids: Sequence[str], reason: str) -> None:
        if request_ids:
            self.client.hset(f"{self.prefix}evict:pending", mapping=dict.fromkeys(request_ids, reason))

    def pending_evictions(self) -> dict[str, str]:
        raw: dict[Any, Any] = self.client.hgetall(f"{self.prefix}evict:pending")
        return {str(k): str(v) for k, v in raw.items()}

    def remove_pending_evictions(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            self.client.hdel(f"{self.prefix}evict:pending", *request_ids)

    def try_lock(self, name: str, token: str, ttl_s: float) -> bool:
        return bool(self.client.set(f"{self.prefix}lock:{name}", token, nx=True, px=int(ttl_s * 1000)))

    def unlock(self, name: str, token: str) -> None:
        self._unlock(keys=[f"{self.prefix}lock:{name}"], args=[token])

    def renew_lock(self, name: str, token: str, ttl_s: float) -> bool:
        return bool(self._renew(keys=[f"{self.prefix}lock:{name}"], args=[token, int(ttl_s * 1000)]))

    def lock_holder(self, name: str) -> str | None:
        value = self.client.get(f"{self.prefix}lock:{name}")
        return None if value is None else str(value)

    def close(self) -> None:
        self.client.close()


# --------------------------------------------------------------------------------------------------------------
# SQLite (embedded)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
  request_id TEXT PRIMARY KEY, state TEXT NOT NULL, owner TEXT, lease_until REAL,
  record TEXT, expires_at REAL NOT NULL, origin TEXT);
CREATE TABLE IF NOT EXISTS marks (key TEXT PRIMARY KEY, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS hits (
  donor_id TEXT PRIMARY KEY, hits INTEGER NOT NULL, steps_saved REAL NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS pending_evictions (request_id TEXT PRIMARY KEY, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS locks (name TEXT PRIMARY KEY, token TEXT NOT NULL, until REAL NOT NULL);
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
        self, request_id: str, *, owner: str, lease_s: float, state: str = "accepted", origin: str = ""
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
                return Claim("new", state, owner) if row is None else Claim("retry", str(row[0]), owner)
            current, holder, lease_until = row[0], row[1], row[2]
            if current == "accepted":
                if holder == owner or (lease_until or 0.0) < now:
                    db.execute(
                        "UPDATE requests SET owner = ?, lease_until = ?, expires_at = ? WHERE request_id = ?",
                        (owner, now + lease_s, self._expires(), key),
                    )
                    return Claim("resumed", current, holder)
                return Claim("busy", current, holder)
            return Claim("duplicate", current, holder)

    def _row(self, request_id: str) -> tuple[Any, ...] | None:
        with self._lock:
            row: tuple[Any, ...] | None = self._db.execute(
                "SELECT state, record FROM requests WHERE request_id = ? AND expires_at >= ?",
                (self._key(request_id), time.time()),
            ).fetchone()
        return row

    def state(self, request_id: str) -> str | None:
        row = self._row(request_id)
        return None if row is None else str(row[0])

    def set_state(self, request_id: str, state: str, *, origin: str | None = None) -> None:
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
                "INSERT INTO requests (request_id, state, record, expires_at) VALUES (?, 'dispatched', ?, ?) "
                "ON CONFLICT(request_id) DO UPDATE SET state = 'dispatched', record = excluded.record, "
                "lease_until = NULL, expires_at = excluded.expires_at",
                (self._key(record.request_id), record.model_dump_json(), self._expires()),
            )

    def record(self, request_id: str) -> RequestRecord | None:
        row = self._row(request_id)
        if row is None or row[1] is None:
            return None
        return RequestRecord.model_validate_json(row[1])

    def dispatched_records(self, limit: int = 1000) -> list[RequestRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT record FROM requests WHERE state = 'dispatched' AND record IS NOT NULL "
                "AND expires_at >= ? AND substr(request_id, 1, ?) = ? LIMIT ?",
                (time.time(), len(self.prefix), self.prefix, limit),
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
                for table in ("requests", "marks", "hits")
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()


def open_ledger(
    redis_url: str, *, state_dir: Path, prefix: str = "chorus:", ttl_s: int = DEFAULT_TTL_S
) -> Ledger:
    """Redis when ``redis_url`` is set; otherwise the embedded SQLite ledger at ``state_dir/ledger.sqlite3``."""
    if redis_url:
        return Ledger.from_url(redis_url, prefix=prefix, ttl_s=ttl_s)
    return SqliteLedger(Path(state_dir) / "ledger.sqlite3", prefix=prefix, ttl_s=ttl_s)
