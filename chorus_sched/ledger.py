"""The Redis adapter: the scheduler's idempotency ledger.

A request id is claimed once; a redelivered message (after a crash, a rebalance, a producer retry) finds
the claim and is not run twice. Claims expire after a TTL so the ledger does not grow forever.
"""

from __future__ import annotations

import logging

import redis

log = logging.getLogger(__name__)


class Ledger:
    def __init__(
        self, client: redis.Redis, *, prefix: str = "chorus:req:", ttl_s: int = 7 * 24 * 3600
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "chorus:req:", ttl_s: int = 7 * 24 * 3600) -> Ledger:
        return cls(redis.Redis.from_url(url, decode_responses=True), prefix=prefix, ttl_s=ttl_s)

    def claim(self, request_id: str, state: str = "accepted") -> bool:
        """True if this call claimed the id; False if it was claimed before (a duplicate)."""
        return bool(self.client.set(self.prefix + request_id, state, nx=True, ex=self.ttl_s))

    def state(self, request_id: str) -> str | None:
        value = self.client.get(self.prefix + request_id)
        return None if value is None else str(value)

    def set_state(self, request_id: str, state: str) -> None:
        self.client.set(self.prefix + request_id, state, ex=self.ttl_s)

    def release(self, request_id: str) -> None:
        """Forget a claim, so that a message whose dispatch failed is accepted when it comes again."""
        self.client.delete(self.prefix + request_id)
