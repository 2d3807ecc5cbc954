"""A batch through a worker's SIGKILL and the SIGKILL of the gateway that accepted it, with
real processes: every line is answered exactly once, each answer the one the same request
gets online (embeddings within 1e-5, greedy chat token for token)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
from openai import OpenAI

from tests.conftest import Processes, RedisServer, wait_ready, wait_until, wait_workers
from tests.integration.batch_client import outputs, upload

# 800 lines in the suite (the suite's slowest test; both kills still land mid-batch, each
# after a quarter and a half of it); the figure is the same test at 5,000:
# CHAOS_LINES=5000 pytest tests/integration/test_batch_chaos.py
LINES = int(os.environ.get("CHAOS_LINES", "800"))
CHATS = 40
PREFIX = "mbchaos"


# thousands of lines on real models through two kills and a restart: longer than one scenario
@pytest.mark.timeout(240)
def test_a_batch_survives_a_killed_worker_and_a_killed_gateway(
    processes: Processes, redis_server: RedisServer, tiny_model: Path, closing
) -> None:
    common = {"redis_url": redis_server.url, "prefix": PREFIX, "claim_idle_ms": 2000}
    gateway_settings = {**common, "batch_lease_ms": 2000}
    doomed = processes.start("worker", worker_id="doomed", **common)
    processes.start("worker", worker_id="survivor", **common)
    processes.start("worker", model=tiny_model, served_model_name="tiny", **common)
    gateway = processes.start("gateway", **gateway_settings)
    wait_ready(gateway, models=2)
    wait_workers(gateway, "all-MiniLM-L6-v2", 2)
    client = closing.enter_context(
        OpenAI(base_url=f"{gateway.base_url}/v1", api_key="none", max_retries=0)
    )

    texts = [f"line {i}: " + "some words " * (i % 30) for i in range(LINES)]
    embed_lines = [
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": t}}
        for i, t in enumerate(texts)
    ]
    chats = [
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"q {i}"}],
            "max_tokens": 12,
            "temperature": 0,
        }
        for i in range(CHATS)
    ]
    chat_lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i, body in enumerate(chats)
    ]
    embed_batch = client.batches.create(
        input_file_id=upload(client, embed_lines),
        endpoint="/v1/embeddings",
        completion_window="24h",
    ).id
    chat_batch = client.batches.create(
        input_file_id=upload(client, chat_lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    ).id

    def done() -> int:
        return client.batches.retrieve(embed_batch).request_counts.completed

    wait_until(done, 60, "a quarter of the lines answered", until=lambda n: n >= LINES // 4)
    doomed.signal(signal.SIGKILL)
    answered = wait_until(
        done, 60, "lines answered after the kill", until=lambda n: n >= LINES // 2
    )
    assert answered < LINES  # the gateway dies mid-batch
    gateway.signal(signal.SIGKILL)  # the gateway that accepted and drove both batches
    gateway.wait(10)
    gateway = processes.start("gateway", **gateway_settings)
    wait_ready(gateway, models=2)
    client = closing.enter_context(
        OpenAI(base_url=f"{gateway.base_url}/v1", api_key="none", max_retries=0)
    )
    for batch_id, total in ((embed_batch, LINES), (chat_batch, CHATS)):
        batch = wait_until(
            lambda b=batch_id: client.batches.retrieve(b),
            150,
            f"batch {batch_id} completed",
            until=lambda b: b.status in ("completed", "failed", "expired", "cancelled"),
            interval_s=0.5,
        )
        assert batch.status == "completed", batch
        assert batch.request_counts.model_dump() == {
            "total": total,
            "completed": total,
            "failed": 0,
        }

    embedded = outputs(client, embed_batch)
    assert sorted(embedded) == sorted(line["custom_id"] for line in embed_lines)
    for start in range(0, LINES, 500):
        online = client.embeddings.create(
            model="all-MiniLM-L6-v2", input=texts[start : start + 500]
        ).data
        for offset, expected in enumerate(online):
            body = embedded[f"e{start + offset}"]["response"]["body"]
            got = np.array(body["data"][0]["embedding"])
            np.testing.assert_allclose(got, np.array(expected.embedding), atol=1e-5)

    answered = outputs(client, chat_batch)
    assert sorted(answered) == sorted(line["custom_id"] for line in chat_lines)
    for i, body in enumerate(chats):
        online = client.chat.completions.create(**body).choices[0].message.content
        batch_answer = answered[f"c{i}"]["response"]["body"]["choices"][0]["message"]["content"]
        assert batch_answer == online
