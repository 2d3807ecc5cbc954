"""The Lua scripts a gateway runs, run as the least-privilege Redis user docs/operations.md
documents: Redis checks each call inside a script against the caller's rights, so a command
the line lacks fails only there, at run time (a quota then fails open, a batch loses its
lease). Each script must succeed, not merely not crash."""

from __future__ import annotations

import asyncio
import re

import pytest
import redis
import redis.asyncio as aredis

from common.clock import wall_ms
from common.keys import Keys
from common.tenants import Tenant
from gateway.backlog_store import Backlogs
from gateway.batch_records import BatchRecords
from gateway.quota_store import Quotas
from gateway.responses.store import ResponseStore
from tests.conftest import ROOT, RedisServer


@pytest.fixture
def limited(module_redis: RedisServer) -> str:
    """A URL for the documented user on a real redis-server."""
    docs = (ROOT / "docs" / "operations.md").read_text()
    line = re.search(r"^ACL SETUSER microbatch .*$", docs, re.M)
    assert line is not None, "docs/operations.md lost its ACL line"
    admin = redis.Redis.from_url(module_redis.url)
    admin.execute_command(*line.group(0).split())
    admin.close()
    return f"redis://microbatch:password@127.0.0.1:{module_redis.port}/0"


def test_every_gateway_script_runs_as_the_documented_user(limited: str) -> None:
    async def scripts() -> None:
        store = aredis.Redis.from_url(limited)
        keys = Keys("mb")
        try:
            # closed: a script the user may not run is a 503 here, not a silent admit
            quotas = Quotas(store, keys, "closed")
            paced = Tenant(api_keys=["k"], requests_per_minute=600, tokens_per_minute=6000)
            charge = await quotas.charge("acme", paced, tokens=100)
            assert charge is not None
            await quotas._refund(keys.quota("acme", "tokens"), 50, charge.tokens)
            held, queued = await Backlogs(store, keys).reserve(
                "acme", "lm", "r1", wall_ms() + 10_000, 100, 300
            )
            assert held is not None and held.request_id == "r1" and queued == 0  # not fail-open
            await Backlogs(store, keys)._release(held)
            records = BatchRecords(store, keys)
            assert await records.take_lease("batch_x", "g1", 5_000)
            assert await records.renew_lease("batch_x", "g1", 5_000)
            await records.release_lease("batch_x", "g1")
            responses = ResponseStore(store, keys)
            await responses.put("resp_x", {"status": "in_progress"}, 60)
            assert await responses.finish("resp_x", "completed", {"id": "resp_x"}, 60, 60)
        finally:
            await store.aclose()

    asyncio.run(scripts())
