"""Stored responses across keys and gateways (`/v1/responses`): a response belongs to the
API key that made it, and an agent's conversation continued by `previous_response_id`
through gateways, one restarted, is served from the prefix cache of the worker that answered
its last turn (issue 37's multi-turn goal)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from common.settings import Settings
from tests.conftest import RedisServer, free_port, wait_until
from tests.integration.in_process import InProcess


def test_another_key_reads_nothing(module_redis: RedisServer, long_tiny: Path) -> None:
    """Stored responses belong to the API key that made them."""
    deployment = InProcess()
    common = {"redis_url": module_redis.url, "prefix": "mbresp-keys", "read_block_ms": 100}
    try:
        port = free_port()
        url = deployment.start_gateway(
            Settings(**common, port=port, gateway_id=f"k-{port}", api_keys=["alpha", "beta"])
        )
        deployment.start_worker(
            Settings(**common, model=str(long_tiny), served_model_name=["tiny"])
        )
        wait_until(
            lambda: httpx.get(f"{url}/readyz/tiny").status_code,
            120,
            "the tiny Llama served",
            until=lambda status: status == 200,
        )
        alpha = openai.OpenAI(base_url=f"{url}/v1", api_key="alpha", max_retries=0)
        beta = openai.OpenAI(base_url=f"{url}/v1", api_key="beta", max_retries=0)
        with alpha, beta:
            made = alpha.responses.create(model="tiny", input="secret", max_output_tokens=4)
            assert alpha.responses.retrieve(made.id).id == made.id
            with pytest.raises(openai.NotFoundError):
                beta.responses.retrieve(made.id)
            with pytest.raises(openai.NotFoundError):
                beta.responses.create(model="tiny", input="x", previous_response_id=made.id)
    finally:
        deployment.close()


def test_six_turns_are_served_from_the_prefix_cache_across_a_gateway_restart(
    module_redis: RedisServer, long_tiny: Path
) -> None:
    """An agent's conversation: its instructions sent every turn, each turn continuing the
    last by `previous_response_id` through alternating gateways, the one that stored turn 1
    restarted before turn 2. Each turn is rebuilt from the store and routed to the worker
    that answered the previous one (the record names it, whichever gateway asks), so at
    least 80% of its prompt comes from that worker's prefix cache; and each equals the chat
    completion of the same conversation."""
    deployment = InProcess()
    common = {"redis_url": module_redis.url, "prefix": "mbresp-turns", "read_block_ms": 100}
    rules = "You are a terse assistant for a shipping company. " * 8
    try:
        urls = [_gateway(deployment, common) for _ in range(2)]
        for n in range(2):  # one at a time: transformers' loading is not thread-safe
            deployment.start_worker(
                Settings(
                    **common, model=str(long_tiny), served_model_name=["tiny"], worker_id=f"w{n}"
                )
            )
            for url in urls:
                wait_until(
                    lambda url=url: httpx.get(f"{url}/readyz/tiny").json().get("live_workers"),
                    120,
                    f"{n + 1} workers serving the tiny Llama",
                    until=lambda live, n=n: live == n + 1,
                )
        usages, previous, history = [], None, [{"role": "system", "content": rules}]
        for n in range(6):
            if n == 1:  # the gateway that stored turn 1 restarts
                deployment.stop_gateway(urls[0])
                urls[0] = _gateway(deployment, common)
            client = openai.OpenAI(base_url=f"{urls[n % 2]}/v1", api_key="none", max_retries=0)
            said = f"Where is parcel {n * 7}?"
            made = client.responses.create(
                model="tiny",
                instructions=rules,
                input=said,
                previous_response_id=previous,
                max_output_tokens=8,
                temperature=0,
            )
            history.append({"role": "user", "content": said})
            chat = client.chat.completions.create(
                model="tiny", messages=history, max_tokens=8, temperature=0
            )
            assert made.output_text == chat.choices[0].message.content
            history.append({"role": "assistant", "content": made.output_text})
            usages.append(made.usage)
            previous = made.id
            client.close()
        shares = [u.input_tokens_details.cached_tokens / u.input_tokens for u in usages[1:]]
        assert min(shares) >= 0.8, [(u.input_tokens, u.input_tokens_details) for u in usages]
    finally:
        deployment.close()


def _gateway(deployment: InProcess, common: dict) -> str:
    port = free_port()
    return deployment.start_gateway(Settings(**common, port=port, gateway_id=f"t-{port}"))
