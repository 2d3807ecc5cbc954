"""Tenants' quotas held in Redis, so N gateways enforce one limit, not N.

One script per check charges a tenant's requests and tokens paces together (both or
neither), on Redis's own clock, so gateways whose clocks disagree still agree on the pace.
A generation request is charged its prompt and `max_tokens` at admission and settled with
what it used when its answer ends: the unused tokens are handed back. If Redis cannot
answer a check, `quota_on_redis_error` says whether the request goes (`open`, counted) or is
refused (`closed`, 503).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from common import metrics
from common.errors import InvalidRequest, RateLimited, ServiceUnavailable
from common.keys import Keys
from common.store import SCRIPT_CLOCK, Store, run_script
from common.tasks import only_logged, spawn_supervised
from common.tenants import Tenant
from gateway.quota import (
    MINUTE_US,
    Allowance,
    Pace,
    RawHeaders,
    Verdict,
    lease_size,
    too_large,
)

log = logging.getLogger("microbatch.gateway")
CHECK_TIMEOUT_S = 1.0  # a check that takes longer counts as Redis not answering
LEASED = ("admitted_leased",)

# KEYS: the tenant's requests pace, its tokens pace. ARGV per pace (5 each): interval_us (a
# fraction above 60M a minute; 0: no such quota), burst, cost, lease, units handed back of an
# earlier lease; then a minute in us, then the clock (`SCRIPT_CLOCK`). A pace's value is its
# theoretical arrival time (TAT, us, to the nanosecond), never handed back below now; a
# charge fits when it leaves the TAT at most max(burst, charge) units ahead of now. The
# request is charged with each pace's lease if that fits, else alone. Reply: admitted,
# retry_after_us, refused_by (1, 2), leased, then per pace the units left this minute and the
# us until it is rested.
_CHARGE = (
    SCRIPT_CLOCK
    + """
local now = now_us()
local tat = {}
for i = 1, 2 do
  local interval = tonumber(ARGV[5 * i - 4])
  if interval > 0 then
    local stored = tonumber(redis.call('GET', KEYS[i]) or '0')
    tat[i] = math.max(stored - tonumber(ARGV[5 * i]) * interval, now)
  end
end
local function charged(lease)
  local retry, refused, after = 0, 0, {}
  for i = 1, 2 do
    local interval = tonumber(ARGV[5 * i - 4])
    if interval > 0 then
      local cost = tonumber(ARGV[5 * i - 2]) + lease * tonumber(ARGV[5 * i - 1])
      after[i] = tat[i] + cost * interval
      local over = after[i] - now - math.max(tonumber(ARGV[5 * i - 3]), cost) * interval
      if over > retry then retry, refused = over, i end
    end
  end
  return retry, refused, after
end
local leased = 1
local retry, refused, after = charged(1)
if retry > 0 then
  leased = 0
  retry, refused, after = charged(0)
end
local out = {retry > 0 and 0 or 1, retry, refused, leased}
for i = 1, 2 do
  local interval = tonumber(ARGV[5 * i - 4])
  if interval > 0 then
    local at = after[i]
    if retry > 0 then at = tat[i] end
    if retry == 0 or tonumber(ARGV[5 * i]) > 0 then  -- charged, or a lease handed back
      local ttl = math.ceil((at - now) / 1000) + 1000
      redis.call('SET', KEYS[i], string.format('%.3f', at), 'PX', ttl)
    end
    out[#out + 1] = math.floor((tonumber(ARGV[11]) - (at - now)) / interval)
    out[#out + 1] = at - now
  else
    out[#out + 1] = 0
    out[#out + 1] = 0
  end
end
return out
"""
)

# KEYS: a tokens pace. ARGV: units handed back, interval_us, the clock. Never rests it below
# now: an answer that used less than it was charged gives back what it did not use, no more.
_REFUND = (
    SCRIPT_CLOCK
    + """
local now = now_us()
local stored = tonumber(redis.call('GET', KEYS[1]) or '0')
if stored <= now then return 0 end
local at = math.max(now, stored - tonumber(ARGV[1]) * tonumber(ARGV[2]))
redis.call('SET', KEYS[1], string.format('%.3f', at), 'PX', math.ceil((at - now) / 1000) + 1000)
return 1
"""
)


@dataclass(frozen=True, slots=True)
class Charge:
    """What one request was charged, to settle when its answer ends."""

    tenant: str
    tokens: Pace
    headers: RawHeaders  # the tenant's standing, as OpenAI's rate-limit headers

    def fields(self) -> list[str | int | None]:
        """What a stored background run keeps, so whichever gateway ends it settles it."""
        return [self.tenant, self.tokens.per_minute, self.tokens.cost]

    @classmethod
    def of_fields(cls, fields: list[Any]) -> Charge:
        tenant, per_minute, cost = fields
        return cls(tenant, Pace(per_minute, cost), ())


def _leases(tenant: Tenant) -> bool:
    """Whether a tenant's requests are charged with a lease (a quota large enough)."""
    paces = Pace(tenant.requests_per_minute, 1), Pace(tenant.tokens_per_minute, 1)
    return any(pace.lease_cap for pace in paces)


def _refusal(name: str, verdict: Verdict, asked: Pace, costs: Pace) -> RateLimited:
    """A 429 over a quota, counted: OpenAI's headers, and when to try again."""
    metrics.quota_checks_total.add(("refused",))
    metrics.tenant_refusals_total.add((name, verdict.refused_by))
    limit = asked.per_minute if verdict.refused_by == "requests" else costs.per_minute
    wait_s = verdict.retry_after_us / 1e6
    return RateLimited(
        f"tenant {name!r} is over its {verdict.refused_by}_per_minute of {limit}: "
        f"try again in {wait_s:.2f} s",
        retry_after_s=wait_s,
        code="rate_limit_exceeded",
        headers=verdict.headers(),
    )


class Quotas:
    def __init__(self, store: Store, keys: Keys, on_redis_error: str) -> None:
        self._store, self._keys = store, keys
        self._fail_closed = on_redis_error == "closed"
        self._allowances: dict[str, Allowance] = {}  # per tenant: leased ahead, spent here
        # per tenant, a charge on its way to Redis that takes a lease: the tenant's other
        # requests meanwhile wait for it rather than each ask Redis (all of a gateway's
        # concurrent requests did, each time a lease ran out: a lease of floor size each)
        self._renewing: dict[str, asyncio.Future[bool]] = {}  # done: whether a lease came

    async def charge(
        self, name: str, tenant: Tenant, tokens: int, requests: int = 1
    ) -> Charge | None:
        """Charge one request (`requests` 0: a further part of one already charged) and
        `tokens`; None when the tenant has no quota (or Redis did not answer, fail-open).
        Raises 429 with OpenAI's headers over a quota, 400 for a request no quota can hold."""
        if tenant.requests_per_minute is None and tenant.tokens_per_minute is None:
            return None
        costs = Pace(tenant.tokens_per_minute, tokens)
        while (leased := self._leased(name, costs, requests)) is None:
            renewing = self._renewing.get(name)
            if renewing is None:
                break
            if not await asyncio.shield(renewing):  # no lease came of it (a 429, Redis down)
                return await self._checked(name, tenant, costs, requests)
        if leased is not None:
            return leased
        if not requests or not _leases(tenant):  # no lease to wait for: ask Redis now
            return await self._checked(name, tenant, costs, requests)
        self._renewing[name] = renewed = asyncio.get_running_loop().create_future()
        try:
            return await self._checked(name, tenant, costs, requests)
        finally:
            del self._renewing[name]
            renewed.set_result(name in self._allowances)

    def _leased(self, name: str, costs: Pace, requests: int) -> Charge | None:
        """The charge spent from this gateway's lease, if it holds it (a lease never holds
        a request too large)."""
        allowance = self._allowances.get(name)
        if allowance is None or not allowance.take(requests, costs.cost, time.monotonic()):
            return None
        metrics.quota_checks_total.add(LEASED)
        return Charge(name, costs, allowance.headers)

    async def _checked(
        self, name: str, tenant: Tenant, costs: Pace, requests: int
    ) -> Charge | None:
        """The charge as Redis makes it, a lease taken with it and the last one's rest
        handed back."""
        problem = too_large(costs)  # never leased: a lease holds a quarter burst at most
        if problem is not None:
            raise InvalidRequest(problem, param="max_tokens", code="request_too_large")
        now_s = time.monotonic()
        asked = Pace(tenant.requests_per_minute if requests else None, requests)
        keys = [self._keys.quota(name, "requests"), self._keys.quota(name, "tokens")]
        # a whole request leases ahead and hands back the rest of the last lease (taken off
        # first: should the reply be lost, it is never handed back twice)
        earlier = self._allowances.pop(name, None) if requests else None
        used, back = (0, 0), (0, 0)
        if earlier is not None:
            used, back = earlier.used(), earlier.unspent(asked, costs)
        leases = (lease_size(asked, used[0]), lease_size(costs, used[1])) if requests else (0, 0)
        args = [*asked.args(leases[0], back[0]), *costs.args(leases[1], back[1]), MINUTE_US]
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                reply = await run_script(self._store, _CHARGE, keys, args, clock=True)
        except (RedisError, TimeoutError) as exc:
            self._unchecked(name, exc)
            return None
        verdict = Verdict.of(reply, asked, costs)
        if not verdict.admitted:
            raise _refusal(name, verdict, asked, costs)
        metrics.quota_checks_total.add(("admitted",))
        headers = verdict.raw_headers()
        if verdict.leased and any(leases):  # a whole request's charge: its lease is spendable
            lease = Allowance.of(headers, asked, costs, now_s, leases)
            raced = self._allowances.get(name)  # another request's lease, taken meanwhile
            self._allowances[name] = lease if raced is None else raced.merged(lease)
        return Charge(name, costs, headers)

    def settle(self, charge: Charge | None, used_tokens: int) -> None:
        """Hand back what an ended answer did not use of its tokens charge (in the
        background: the answer does not wait on it)."""
        if charge is None or charge.tokens.per_minute is None:
            return
        unused = charge.tokens.cost - used_tokens
        if unused > 0:
            key = self._keys.quota(charge.tenant, "tokens")
            spawn_supervised("quota refund", self._refund(key, unused, charge.tokens), only_logged)

    async def _refund(self, key: str, unused: int, pace: Pace) -> None:
        try:
            await run_script(self._store, _REFUND, [key], [unused, pace.interval_us], clock=True)
        except RedisError as exc:  # the tenant is charged its max_tokens: never over-admits
            log.warning("a quota refund was lost (Redis did not answer): %s", exc)

    def _unchecked(self, name: str, exc: BaseException) -> None:
        if self._fail_closed:
            metrics.quota_checks_total.add(("unchecked_refused",))
            raise ServiceUnavailable(
                f"tenant {name!r}'s quota could not be checked (Redis did not answer) and "
                "quota_on_redis_error is closed",
                retry_after_s=1.0,
            ) from exc
        metrics.quota_checks_total.add(("unchecked_admitted",))
        log.warning("a quota check for tenant %r failed, admitted (fail open): %s", name, exc)
