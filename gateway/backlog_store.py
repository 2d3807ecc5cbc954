"""Tenants' backlogs held in Redis: the tokens each tenant has queued for a model, so its
`max_queued_tokens` is one cap across the fleet, not one per gateway.

A generation request reserves its prompt and `max_tokens` at admission, under its id and
until its deadline, in one script that first drops reservations past their deadlines (a
gateway that died holding some leaves nothing behind for longer than a request may live),
then admits it only if the tenant's total stays within its cap. Its answer's end releases
it. If Redis cannot answer, the request goes (the model's own limits still bound it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from redis.exceptions import RedisError

from common.clock import wall_ms
from common.keys import Keys
from common.store import Store, pipeline, run_script
from common.tasks import only_logged, spawn_supervised

log = logging.getLogger("microbatch.gateway")

# KEYS: deadlines (zset: id -> deadline ms), tokens (hash: id -> tokens). ARGV: now ms, id,
# deadline ms, tokens, cap. Reply: admitted (1/0), the tenant's tokens queued before it.
# Only commands the least-privilege Redis user may run (docs/operations.md), as a script's
# calls are checked against the caller's rights: HGETALL and EXPIRE, not HVALS or PEXPIREAT.
_RESERVE = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if #expired > 0 then
  redis.call('HDEL', KEYS[2], unpack(expired))
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
end
local total = 0
local held = redis.call('HGETALL', KEYS[2])
for i = 2, #held, 2 do total = total + tonumber(held[i]) end
if total + tonumber(ARGV[4]) > tonumber(ARGV[5]) then return {0, total} end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[4])
local last = tonumber(redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2])
local ttl = math.ceil((last - tonumber(ARGV[1])) / 1000) + 1
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
return {1, total}
"""


@dataclass(frozen=True, slots=True)
class Reservation:
    """One request's tokens held in its tenant's backlog until its answer ends."""

    keys: tuple[str, str]
    request_id: str

    def fields(self) -> list[str]:
        """What a stored background response keeps, so any gateway that finishes it can
        release it (`of_fields`)."""
        return [*self.keys, self.request_id]

    @classmethod
    def of_fields(cls, fields: list[str]) -> Reservation:
        deadlines, tokens, request_id = fields
        return cls((deadlines, tokens), request_id)


class Backlogs:
    def __init__(self, store: Store, keys: Keys) -> None:
        self._store, self._keys = store, keys

    async def reserve(
        self, tenant: str, model: str, request_id: str, deadline_ms: int, tokens: int, cap: int
    ) -> tuple[Reservation | None, int]:
        """Hold `tokens` for the request: (its reservation, or None when over the cap; the
        tokens the tenant had queued). Redis not answering admits it unreserved."""
        deadlines = self._keys.backlog(tenant, model)
        keys = (deadlines, f"{deadlines}:tokens")
        try:
            args = [wall_ms(), request_id, deadline_ms, tokens, cap]
            admitted, queued = await run_script(self._store, _RESERVE, list(keys), args)
        except RedisError as exc:
            log.warning("tenant %r's backlog could not be checked, admitted: %s", tenant, exc)
            return Reservation(keys, ""), 0
        return (Reservation(keys, request_id) if admitted else None), int(queued)

    def release(self, reservation: Reservation | None) -> None:
        """Hand the tokens back once the answer has ended (in the background)."""
        if reservation is not None and reservation.request_id:
            spawn_supervised("backlog release", self._release(reservation), only_logged)

    async def _release(self, reservation: Reservation) -> None:
        deadlines, tokens = reservation.keys
        try:
            pipe = pipeline(self._store)
            pipe.zrem(deadlines, reservation.request_id)
            pipe.hdel(tokens, reservation.request_id)
            await pipe.execute()
        except RedisError as exc:  # held until its deadline instead: never over-admits
            log.warning("a backlog release was lost (Redis did not answer): %s", exc)
