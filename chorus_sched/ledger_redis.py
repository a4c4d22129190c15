"""The Redis adapter of the scheduler's ledger (``chorus_sched.ledger``): hashes and Lua scripts, atomic across
instances and hosts. The only module that talks to Redis for the scheduler."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis

from chorus_sched.ledger import DEFAULT_TTL_S, RETRYABLE_STATES, Claim, Ledger, RequestRecord, RequestState

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
if (@RETRYABLE@) and origin ~= ''
    and origin ~= (redis.call('HGET', key, 'origin') or '') then
  redis.call('DEL', key)
  redis.call('HSET', key, 'state', state0, 'owner', owner, 'lease_until', lease_until, 'origin', origin)
  redis.call('EXPIRE', key, ttl)
  return {'retry', state, owner}
end
local holder = redis.call('HGET', key, 'owner') or ''
if state == '@ACCEPTED@' then
  local until_ = tonumber(redis.call('HGET', key, 'lease_until') or '0')
  if holder == owner or until_ < now then
    redis.call('HSET', key, 'owner', owner, 'lease_until', lease_until)
    redis.call('EXPIRE', key, ttl)
    return {'resumed', state, holder}
  end
  return {'busy', state, holder}
end
return {'duplicate', state, holder, redis.call('HGET', key, 'origin') or ''}
""".replace("@RETRYABLE@", " or ".join(f"state == '{state}'" for state in RETRYABLE_STATES)).replace(
    "@ACCEPTED@", RequestState.ACCEPTED
)

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
        self,
        request_id: str,
        *,
        owner: str,
        lease_s: float,
        state: RequestState = RequestState.ACCEPTED,
        origin: str = "",
    ) -> Claim:
        now = time.time()
        outcome, current, holder, *claimed_from = self._begin(
            keys=[self._req(request_id)],
            args=[owner, repr(now + lease_s), repr(now), self.ttl_s, state, origin],
        )
        return Claim(
            outcome=outcome,
            state=RequestState(current),
            owner=holder or None,
            origin=claimed_from[0] if claimed_from else "",
        )

    def state(self, request_id: str) -> RequestState | None:
        value = self.client.hget(self._req(request_id), "state")
        return None if value is None else RequestState(str(value))

    def set_state(self, request_id: str, state: RequestState, *, origin: str | None = None) -> None:
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
            pipe.hset(key, mapping={"state": RequestState.DISPATCHED, "record": record.model_dump_json()})
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
            if state == RequestState.DISPATCHED and raw is not None:
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

    def put_value(self, key: str, value: str, *, ttl_s: float | None = None) -> None:
        self.client.set(f"{self.prefix}value:{key}", value, px=int((ttl_s or self.ttl_s) * 1000))

    def get_value(self, key: str) -> str | None:
        value = self.client.get(f"{self.prefix}value:{key}")
        return None if value is None else str(value)

    def delete_value(self, key: str) -> None:
        self.client.delete(f"{self.prefix}value:{key}")

    def add_waiter(self, key: str, value: str) -> None:
        with self.client.pipeline() as pipe:
            pipe.rpush(f"{self.prefix}waiters:{key}", value)
            pipe.expire(f"{self.prefix}waiters:{key}", self.ttl_s)
            pipe.execute()

    def take_waiters(self, key: str) -> list[str]:
        with self.client.pipeline() as pipe:  # MULTI/EXEC: nobody appends between the read and the delete
            pipe.lrange(f"{self.prefix}waiters:{key}", 0, -1)
            pipe.delete(f"{self.prefix}waiters:{key}")
            values, _ = pipe.execute()
        return [str(v) for v in values]

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
