"""A request's own mistakes are its answer even when the queue would refuse it: a 4xx before
admission's 503. Otherwise a client told "try again later" retries a request that can never
succeed (on a loaded CI host, the structured-output tests saw exactly that)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from common.settings import Settings
from tests.conftest import RedisServer, free_port, wait_until
from tests.integration.in_process import InProcess

PREFIX = "refusals"


@pytest.fixture(scope="module")
def refusing(redis_server: RedisServer, tiny_model: Path) -> Iterator[str]:
    """A gateway that knows the tiny Llama but has no live worker for it and no measured
    cold start: admission refuses every request 503 `no_workers`."""
    deployment = InProcess()
    common = {"redis_url": redis_server.url, "prefix": PREFIX, "read_block_ms": 100}
    try:
        port = free_port()
        url = deployment.start_gateway(Settings(**common, port=port, gateway_id=f"g-{port}"))
        worker = Settings(**common, model=str(tiny_model), served_model_name=["tiny"])
        deployment.start_worker(worker)

        def ready() -> int:
            return httpx.get(f"{url}/readyz/tiny").status_code

        wait_until(ready, 120, "the tiny Llama served", until=lambda status: status == 200)
        deployment.stop_worker()
        redis.Redis.from_url(redis_server.url).delete(f"{PREFIX}:{{tiny}}:cold_start")
        wait_until(ready, 30, "no worker live", until=lambda status: status == 503)
        yield url
    finally:
        deployment.close()


UNENFORCEABLE = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"response_format": UNENFORCEABLE}, "objectx"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"logit_bias": {"999999999": 1}}, "logit_bias"),
        ({"stop": ["x" * 1000]}, "stop"),
    ],
)
def test_a_request_that_can_never_run_is_a_400_even_where_admission_refuses(
    refusing: str, extra: dict, says: str
) -> None:
    answer = httpx.post(f"{refusing}/v1/chat/completions", json=CHAT | extra, timeout=30)
    assert answer.status_code == 400, answer.text
    assert says in answer.text


def test_the_same_request_done_right_is_the_503(refusing: str) -> None:
    answer = httpx.post(f"{refusing}/v1/chat/completions", json=CHAT, timeout=30)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_workers"
