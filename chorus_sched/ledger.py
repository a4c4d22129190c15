"""The Redis adapter: the scheduler's ledger — idempotency claims, request records, hit counters, mutexes.

A request id is claimed once; a redelivered message (after a crash, a rebalance, a producer retry) finds the
claim and is not run twice. A claim starts as a *lease* (``accepted``, owned by one scheduler instance until
``lease_until``) and becomes ``dispatched`` once the work order is on the Celery broker; an instance that
crashed between the two leaves a lease that expires, after which another instance takes the request over.
The dispatch record (prompt, tenant, compatibility key, role, donor) lets whichever instance reads the request's
result index it as a donor. Everything expires after a TTL so the ledger does not grow forever.

Two stores behind this interface (``chorus_sched.ledger_stores.open_ledger`` picks one):

- ``ledger_redis.RedisLedger`` (``redis://…``, production): hashes and Lua scripts, atomic across instances and hosts;
- ``ledger_sqlite.SqliteLedger`` (``sqlite:///path``, the embedded default under ``state_dir``): one SQLite file in WAL
  mode with ``INSERT OR IGNORE`` / ``BEGIN IMMEDIATE`` semantics, safe across processes on one machine.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field

from producer.contract import ReusePolicy
from producer.orders import Role

log = logging.getLogger(__name__)


class RequestState(StrEnum):
    """Where a request stands in the ledger (stored as these strings)."""

    ACCEPTED = "accepted"  # claimed: a lease held by one scheduler instance until its order is on the broker
    DISPATCHED = "dispatched"  # its work order is on the broker; no result yet
    DONE = "done"  # answered with a video (by a worker, or from an identical request's result)
    FAILED = "failed"  # answered without a video
    DEAD_LETTERED = "dead_lettered"  # scheduling failed too often; the message went to the dead-letter topic
    EVICTED = "evicted"  # its donor entry was evicted before it finished
    COALESCED = "coalesced"  # waits for an identical request in flight and is answered from its result


ClaimOutcome = Literal["new", "retry", "resumed", "duplicate", "busy"]
# States a request ends in without a video. A *new* message with the same id is the sender trying again, and is
# claimed afresh; the same message read again (a redelivery) is still a duplicate.
RETRYABLE_STATES = (RequestState.FAILED, RequestState.DEAD_LETTERED)
DEFAULT_TTL_S = 7 * 24 * 3600


class LedgerError(RuntimeError):
    """The ledger could not be used (e.g. a mutex could not be acquired in time)."""


@dataclass(frozen=True)
class Claim:
    """``new``: first time seen; ``retry``: it ended without a video and this is another message asking again;
    ``resumed``: our own earlier lease, or an expired lease of another instance; ``duplicate``: already
    dispatched (or finished), or the very message that was claimed before; ``busy``: another instance holds a
    live lease. ``origin``: for a duplicate, the message the request was claimed from ("" if not recorded), so the
    caller can tell the same message read again from a new one sent with the same id."""

    outcome: ClaimOutcome
    state: RequestState | None = None
    owner: str | None = None
    origin: str = ""

    def resent_by(self, origin: str) -> bool:
        """True if this duplicate is a *new* message with the id (the sender asking again), not the claimed
        message read again. Unknown origins count as the same message (the older, silent answer)."""
        return self.outcome == "duplicate" and bool(origin) and bool(self.origin) and origin != self.origin

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
    reuse: ReusePolicy
    role: Role
    donor_id: str | None = None
    similarity: float | None = None
    planned_steps_saved: float = 0.0
    # The plan came from a verified row (``PlanChoice.verified``): only its donor check teaches the reuse gate.
    verified_plan: bool = False
    scheduler: str = ""
    accepted_at: float = Field(default_factory=time.time)
    # The WorkOrder as sent (JSON), when it was (last) sent, and how many times the watchdog sent it again: what
    # ``chorus_sched.watchdog`` needs to re-send an order whose worker vanished.
    order: str | None = None
    # Where the request was read (topic:partition:offset), so a dead letter about it can say where it is.
    origin: str = ""
    dispatched_at: float | None = None
    redispatches: int = Field(default=0, ge=0)


class Ledger(ABC):
    """The operations the scheduler needs; ``from_url`` picks the store."""

    prefix: str
    ttl_s: int

    # --- claims ----------------------------------------------------------------------------------------------
    def claim(self, request_id: str, state: RequestState = RequestState.ACCEPTED) -> bool:
        """True if this call claimed the id; False if it was claimed before (a duplicate). No lease."""
        claim = self.begin(request_id, owner=f"claim:{state}", lease_s=float(self.ttl_s), state=state)
        return claim.outcome == "new"

    @abstractmethod
    def begin(
        self,
        request_id: str,
        *,
        owner: str,
        lease_s: float,
        state: RequestState = RequestState.ACCEPTED,
        origin: str = "",
    ) -> Claim:
        """Claim a request for scheduling, as a lease of ``lease_s`` seconds held by ``owner``.

        ``origin`` names the message that asks (topic:partition:offset): a request that ended in a
        ``RETRYABLE_STATES`` state is claimed again by a message of another origin.
        """

    @abstractmethod
    def state(self, request_id: str) -> RequestState | None: ...

    @abstractmethod
    def set_state(self, request_id: str, state: RequestState, *, origin: str | None = None) -> None:
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

    # --- values and waiting lists (exact hits) ------------------------------------------------------------------
    @abstractmethod
    def put_value(self, key: str, value: str, *, ttl_s: float | None = None) -> None:
        """Store ``value`` under ``key`` for ``ttl_s`` seconds (default: the ledger's TTL)."""

    @abstractmethod
    def get_value(self, key: str) -> str | None: ...

    @abstractmethod
    def delete_value(self, key: str) -> None: ...

    @abstractmethod
    def add_waiter(self, key: str, value: str) -> None:
        """Append ``value`` to the list under ``key`` (kept for the ledger's TTL)."""

    @abstractmethod
    def take_waiters(self, key: str) -> list[str]:
        """Remove and return the whole list under ``key``, atomically (each value is taken once)."""

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
