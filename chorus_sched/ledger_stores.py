"""Opening the scheduler's ledger: Redis when a URL is configured, else the embedded SQLite file."""

from __future__ import annotations

from pathlib import Path

import redis

from chorus_sched.ledger import DEFAULT_TTL_S, Ledger
from chorus_sched.ledger_redis import RedisLedger
from chorus_sched.ledger_sqlite import SqliteLedger
from producer.settings import UnusableSetting


def ledger_from_url(url: str, *, prefix: str = "chorus:", ttl_s: int = DEFAULT_TTL_S) -> Ledger:
    """``redis://…`` / ``rediss://…`` / ``unix://…`` → Redis; ``sqlite:///path/to/file`` → embedded SQLite."""
    if url.startswith("sqlite:///"):
        # SQLAlchemy's convention: sqlite:///relative/path, sqlite:////absolute/path
        return SqliteLedger(Path(url[len("sqlite:///") :]), prefix=prefix, ttl_s=ttl_s)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisLedger(redis.Redis.from_url(url, decode_responses=True), prefix=prefix, ttl_s=ttl_s)
    # Named by its scheme only: the URL may hold a password.
    scheme = repr(url.split("://", 1)[0] + "://") if "://" in url else "a URL without a scheme"
    raise UnusableSetting(
        f"CHORUS_REDIS_URL: no ledger store for {scheme}; use redis://, rediss://, unix:// or sqlite:///, "
        "or leave it empty for the embedded one"
    )


def open_ledger(
    redis_url: str, *, state_dir: Path, prefix: str = "chorus:", ttl_s: int = DEFAULT_TTL_S
) -> Ledger:
    """Redis when ``redis_url`` is set; otherwise the embedded SQLite ledger at ``state_dir/ledger.sqlite3``."""
    if redis_url:
        return ledger_from_url(redis_url, prefix=prefix, ttl_s=ttl_s)
    return SqliteLedger(Path(state_dir) / "ledger.sqlite3", prefix=prefix, ttl_s=ttl_s)
