"""A gateway's quota leases against a real Redis: sized to what the gateway uses, the rest
handed back with its next charge (a refused one too), and one lease asked for at a time
by a gateway's concurrent requests of one tenant."""

from __future__ import annotations

import asyncio

import pytest
from redis import asyncio as aredis

from common.errors import RateLimited
from common.keys import Keys
from common.tenants import Tenant
from gateway import quota_store
from tests.conftest import RedisServer


def test_a_lease_holds_only_what_its_gateway_uses_and_hands_back_the_rest(
    module_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway leases a few requests' worth ahead, then twice what it used of its last
    lease, and hands back what a lease left unspent with its next charge: the tenant's pace
    in Redis runs ahead by what its requests cost and the open lease, not by a quarter
    burst per lease (750 units here, the most a lease may hold)."""

    clock, asked = [1_000.0], []
    checked = quota_store.run_script

    async def counted(*args: object, **kwargs: object) -> object:
        asked.append(args[3])  # the script's ARGV
        return await checked(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(quota_store.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(quota_store, "run_script", counted)
    tenant = Tenant(api_keys=["k"], tokens_per_minute=60_000)  # a unit each ms, burst 3,000

    async def ahead_after_charges() -> float:
        store = aredis.Redis.from_url(module_redis.url)
        keys = Keys("mblease")
        quotas = quota_store.Quotas(store, keys, "closed")
        try:
            # 10 and a first lease of 80, spent by the next 8; then 10 and a lease of 160
            for _ in range(10):
                assert await quotas.charge("roomy", tenant, tokens=10) is not None
            clock[0] += 1.5  # that lease expired unspent: all 160 handed back, 80 leased
            assert await quotas.charge("roomy", tenant, tokens=10) is not None
            pace = float(await store.get(keys.quota("roomy", "tokens")))
            seconds, micros = await store.time()
            return pace - (seconds * 1_000_000 + micros)
        finally:
            await store.aclose()

    ahead_us = asyncio.run(ahead_after_charges())
    # (lease, handed back) per charge that asked Redis: the rest were spent from a lease
    assert [(a[8], a[9]) for a in asked] == [(80, 0), (160, 0), (80, 160)]
    # 11 requests of 10 and a lease of 80 open: 190 units, less the time the test took;
    # without the hand-back 350, with quarter-burst leases 1,520
    assert 0 < ahead_us <= 190 * 1_000, ahead_us


def test_concurrent_requests_wait_for_the_lease_one_of_them_is_taking(
    module_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 requests of a tenant at once on one gateway: one asks Redis and the rest wait for
    its lease (each lease twice the last), so Redis is asked a handful of times, not 64."""

    asked = []
    checked = quota_store.run_script

    async def counted(*args: object, **kwargs: object) -> object:
        asked.append(args[3])
        return await checked(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(quota_store, "run_script", counted)
    tenant = Tenant(api_keys=["k"], requests_per_minute=6_000_000)

    async def at_once() -> list[object]:
        store = aredis.Redis.from_url(module_redis.url)
        quotas = quota_store.Quotas(store, Keys("mbherd"), "closed")
        try:
            return await asyncio.gather(*(quotas.charge("herd", tenant, 0) for _ in range(64)))
        finally:
            await store.aclose()

    charges = asyncio.run(at_once())
    assert all(c is not None for c in charges)
    # leases of 8, 16, 32 and 64 requests (each its request and the lease): 4 asks
    assert [a[3] for a in asked] == [8, 16, 32, 64], asked


def test_a_refused_charge_still_hands_back_the_last_lease(
    module_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant another gateway pushed over its pace meanwhile: the charge is a 429, and the
    rest of this gateway's expired lease still goes back (it would otherwise hold the pace
    ahead until it passed)."""

    clock = [1_000.0]
    monkeypatch.setattr(quota_store.time, "monotonic", lambda: clock[0])
    tenant = Tenant(api_keys=["k"], tokens_per_minute=60_000)  # a unit each ms, burst 3,000
    keys = Keys("mbrefused")
    pace = keys.quota("pushed", "tokens")

    async def refused_then_ahead() -> tuple[float, float]:
        store = aredis.Redis.from_url(module_redis.url)
        quotas = quota_store.Quotas(store, keys, "closed")
        try:
            assert await quotas.charge("pushed", tenant, tokens=10) is not None  # lease: 80
            seconds, micros = await store.time()
            crowded = seconds * 1_000_000 + micros + 3_500 * 1_000  # past the burst
            await store.set(pace, f"{crowded:.3f}", px=60_000)
            clock[0] += 1.5  # the lease expired unspent
            with pytest.raises(RateLimited):
                await quotas.charge("pushed", tenant, tokens=10)
            return crowded, float(await store.get(pace))
        finally:
            await store.aclose()

    crowded, after = asyncio.run(refused_then_ahead())
    assert after == pytest.approx(crowded - 80 * 1_000, abs=1)  # the 80 handed back
