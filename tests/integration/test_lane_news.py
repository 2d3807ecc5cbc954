"""A new tenant's first request is not held up by an idle worker's blocking read: the
gateway that starts the lane writes to the model's lane news, which that read watches, so
the worker looks at the registry at once. Before, the request waited out the read
(`read_block_ms`) and the worker's next look at the registry."""

from __future__ import annotations

import json
import time

import pytest
import redis

from common.keys import Keys
from common.settings import Settings
from common.streams import GROUP
from tests.conftest import RedisServer, free_port, wait_until
from tests.integration.in_process import InProcess
from tests.integration.test_fair_shares import embed_as

PREFIX = "mbnews"
TENANTS = {"tenants": {"first": {"api_keys": ["sk-first"]}, "new": {"api_keys": ["sk-new"]}}}
BLOCK_MS = 5000  # an idle worker's read: long, so waiting it out cannot pass for speed


@pytest.fixture(scope="module")
def served(module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("news") / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    deployment = InProcess()
    common = {
        "redis_url": module_redis.url,
        "prefix": PREFIX,
        "read_block_ms": BLOCK_MS,
        "redis_socket_timeout_s": 10,
    }
    try:
        port = free_port()
        url = deployment.start_gateway(
            Settings(**common, port=port, gateway_id=f"n-{port}", tenants=path)
        )
        deployment.start_worker(Settings(**common, model="noop", worker_id="n-noop"))
        wait_until(
            lambda: embed_as(url, "sk-first").status_code,
            60,
            "noop served",
            until=lambda s: s == 200,
        )
        yield url, module_redis.url
    finally:
        deployment.close()


def test_a_new_tenants_first_request_wakes_an_idle_worker(served) -> None:
    url, redis_url = served
    assert embed_as(url, "sk-first").status_code == 200  # answered: the worker reads again
    time.sleep(0.3)  # ... and now blocks, up to 5 s, on the streams it knows
    started = time.monotonic()
    first = embed_as(url, "sk-new")
    waited = time.monotonic() - started
    assert first.status_code == 200, first.text
    assert waited < 1.5, f"the new tenant's first request waited {waited:.2f} s"
    store, keys = redis.Redis.from_url(redis_url), Keys(PREFIX)
    news = keys.lane_news("noop")
    assert store.xlen(news) >= 1  # the lane was started by a gateway's news
    assert store.xpending(news, GROUP)["pending"] == 0  # acked, never taken for a request
    assert store.xlen(keys.dead("noop")) == 0
