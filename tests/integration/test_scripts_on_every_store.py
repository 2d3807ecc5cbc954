"""The Lua scripts behind tenants' quotas, tenants' backlogs and stored responses, run on
each store a deployment may have: a redis-server, and the embedded store `microbatch serve`
uses without one (it takes only strings and bytes as arguments, and has no TIME). Before
`common.store.run_script`, every request of a tenant with a quota was a 500 there."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from common.errors import RateLimited
from common.keys import Keys
from common.settings import Settings
from common.store import Store, close_store, open_store
from common.tenants import Tenant
from gateway.backlog_store import Backlogs
from gateway.quota_store import Quotas
from gateway.responses.store import ResponseStore

KEYS = Keys("mb")


@pytest.fixture(params=["server", "embedded"])
def url(request: pytest.FixtureRequest) -> str | None:
    """A redis-server's, or None: the embedded store."""
    return request.getfixturevalue("redis_url") if request.param == "server" else None


def on(url: str | None, body: Callable[[Store], Awaitable[Any]]) -> Any:
    async def run() -> Any:
        store = open_store(Settings(model="noop", redis_url=url))
        try:
            return await body(store)
        finally:
            await close_store(store)

    return asyncio.run(run())


def test_a_quota_admits_its_burst_then_refuses_with_openai_s_headers(url: str | None) -> None:
    # quotas too small for a gateway to lease ahead: every charge runs the script
    tenant = Tenant(api_keys=["k"], requests_per_minute=40, tokens_per_minute=1000)

    async def run(store: Store) -> tuple[list[dict[str, str]], RateLimited]:
        quotas = Quotas(store, KEYS, "closed")  # a script that failed: a 503, not a pass
        answers = []
        try:
            for _ in range(10):
                charge = await quotas.charge("acme", tenant, 10)
                assert charge is not None
                answers.append({k.decode(): v.decode() for k, v in charge.headers})
        except RateLimited as refused:
            return answers, refused
        raise AssertionError("never refused")

    answers, refused = on(url, run)
    assert len(answers) == 2  # a burst of 40 / 20 requests, on Redis's clock or the caller's
    assert answers[0]["x-ratelimit-remaining-requests"] == "39"
    assert answers[1]["x-ratelimit-remaining-requests"] == "38"
    assert answers[1]["x-ratelimit-remaining-tokens"] == "980"
    assert refused.headers["x-ratelimit-limit-requests"] == "40"
    assert 1 <= int(refused.headers["Retry-After"]) <= 2  # 1.5 s until the pace has room


def test_a_refund_gives_back_what_an_answer_did_not_use(url: str | None) -> None:
    tenant = Tenant(api_keys=["k"], tokens_per_minute=1000)  # no lease: 60 ms a token

    async def run(store: Store) -> tuple[str, str]:
        quotas = Quotas(store, KEYS, "closed")
        first = await quotas.charge("acme", tenant, 50)
        assert first is not None
        await quotas._refund(KEYS.quota("acme", "tokens"), 30, first.tokens)
        second = await quotas.charge("acme", tenant, 1)
        assert second is not None
        remaining = dict(second.headers)[b"x-ratelimit-remaining-tokens"].decode()
        return dict(first.headers)[b"x-ratelimit-remaining-tokens"].decode(), remaining

    before, after = on(url, run)
    assert int(before) == 950
    assert 979 <= int(after) <= 980  # 30 back, 1 more (and a token earned if 60 ms passed)


def test_a_tenant_s_backlog_holds_tokens_up_to_its_cap(url: str | None) -> None:
    async def run(store: Store) -> list[tuple[bool, int]]:
        backlogs = Backlogs(store, KEYS)
        out = []
        for request_id in ("r1", "r2"):
            deadline_ms = 2**41  # far ahead
            held, queued = await backlogs.reserve("acme", "m", request_id, deadline_ms, 60, 100)
            out.append((held is not None, queued))
        return out

    assert on(url, run) == [(True, 0), (False, 60)]


def test_a_stored_response_ends_once(url: str | None) -> None:
    async def run(store: Store) -> tuple[bool, bool, str]:
        responses = ResponseStore(store, KEYS)
        await responses.put("resp_1", {"status": "in_progress"}, ttl_s=60)
        first = await responses.finish("resp_1", "completed", {"id": "resp_1"}, 60, 60)
        again = await responses.finish("resp_1", "failed", {"id": "resp_1"}, 60, 60)
        record = await responses.get("resp_1")
        assert record is not None
        return first, again, record["status"]

    assert on(url, run) == (True, False, "completed")
