"""`Idempotency-Key` on a real gateway over a real redis-server: a hundred concurrent retries
are one computation and one answer, byte for byte; a stream replays its events; the same key
on another request is a 422; keys are per API key."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.settings import Settings
from tests.conftest import RedisServer, free_port, wait_until
from tests.integration.in_process import InProcess
from tests.integration.test_observability import sample

PREFIX = "mbidem"
KEY, OTHER_KEY = "key-a", "key-b"


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer, tiny_model: Path) -> Iterator[str]:
    """A gateway, a slow noop embedder (each batch takes 300 ms, so retries overlap the
    first attempt) and the tiny Llama for streams."""
    deployment = InProcess()
    common = {"redis_url": redis_server.url, "prefix": PREFIX, "read_block_ms": 100}
    try:
        port = free_port()
        url = deployment.start_gateway(
            Settings(**common, api_keys=[KEY, OTHER_KEY], port=port, gateway_id=f"g-{port}")
        )
        headers = {"authorization": f"Bearer {KEY}"}
        for n, settings in enumerate(
            (
                Settings(**common, model="noop", noop_compute_ms=300, worker_id="noop"),
                Settings(
                    **common, model=str(tiny_model), served_model_name=["tiny"], worker_id="llama"
                ),
            ),
            start=1,
        ):
            deployment.start_worker(settings)
            wait_until(
                lambda n=n: (
                    deployment.failures
                    or len(httpx.get(f"{url}/v1/models", headers=headers).json()["data"]) == n
                ),
                120,
                f"{n} models served",
            )
        assert not deployment.failures
        yield url
    finally:
        deployment.close()


def headers(idempotency_key: str, key: str = KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "idempotency-key": idempotency_key}


def metric(url: str, outcome: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    try:
        return sample(text, "microbatch_idempotent_requests_total", outcome=outcome)
    except AssertionError:
        return 0.0


def test_a_hundred_concurrent_retries_are_one_computation_and_one_answer(gateway: str) -> None:
    computed = metric(gateway, "computed")
    body = {"model": "noop", "input": ["retried", "twice", "or more"]}

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(f"{gateway}/v1/embeddings", json=body, headers=headers("k-100"))
                    for _ in range(100)
                )
            )

    answers = asyncio.run(fire())
    assert {a.status_code for a in answers} == {200}
    assert len({a.content for a in answers}) == 1  # ids and all, byte for byte
    assert len({a.headers["x-request-id"] for a in answers}) == 1
    assert metric(gateway, "computed") == computed + 1
    later = httpx.post(f"{gateway}/v1/embeddings", json=body, headers=headers("k-100"))
    assert later.content == answers[0].content
    assert later.headers["idempotent-replayed"] == "true"


def test_the_same_key_on_another_request_is_a_422_naming_the_key(gateway: str) -> None:
    first = httpx.post(
        f"{gateway}/v1/embeddings", json={"model": "noop", "input": "a"}, headers=headers("k-x")
    )
    assert first.status_code == 200
    other = httpx.post(
        f"{gateway}/v1/embeddings", json={"model": "noop", "input": "b"}, headers=headers("k-x")
    )
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert other.json()["error"]["param"] == "Idempotency-Key"


def test_keys_belong_to_their_api_key(gateway: str) -> None:
    body = {"model": "noop", "input": "mine"}
    mine = httpx.post(f"{gateway}/v1/embeddings", json=body, headers=headers("k-shared"))
    theirs = httpx.post(
        f"{gateway}/v1/embeddings",
        json={"model": "noop", "input": "theirs"},
        headers=headers("k-shared", OTHER_KEY),
    )
    assert mine.status_code == theirs.status_code == 200  # no 422 across API keys
    assert mine.headers["x-request-id"] != theirs.headers["x-request-id"]


def test_a_streamed_answer_replays_its_events(gateway: str) -> None:
    body = {
        "model": "tiny",
        "prompt": "kalo mine",
        "max_tokens": 12,
        "temperature": 0.9,  # sampled: a second computation would differ
        "stream": True,
    }
    first = httpx.post(f"{gateway}/v1/completions", json=body, headers=headers("k-stream"))
    again = httpx.post(f"{gateway}/v1/completions", json=body, headers=headers("k-stream"))
    assert first.status_code == again.status_code == 200
    assert first.text.count("data: ") > 3 and first.text.rstrip().endswith("data: [DONE]")
    assert again.content == first.content
    assert again.headers["content-type"].startswith("text/event-stream")


def test_a_4xx_that_is_the_requests_own_fault_is_kept(gateway: str) -> None:
    """The retry would fail the same way, so it gets the same answer (which statuses are
    not kept, a 429 or a 5xx among them: tests/unit/test_idempotency.py)."""
    bad = {"model": "noop", "input": []}
    first = httpx.post(f"{gateway}/v1/embeddings", json=bad, headers=headers("k-bad"))
    again = httpx.post(f"{gateway}/v1/embeddings", json=bad, headers=headers("k-bad"))
    assert first.status_code == 400 and again.headers.get("idempotent-replayed") == "true"
    assert again.content == first.content
    missing = {"model": "no-such-model", "input": "x"}
    for _ in range(2):
        answer = httpx.post(f"{gateway}/v1/embeddings", json=missing, headers=headers("k-404"))
        assert answer.status_code == 404  # kept too: the model is not served


def test_a_malformed_key_is_a_400(gateway: str) -> None:
    answer = httpx.post(
        f"{gateway}/v1/embeddings",
        json={"model": "noop", "input": "x"},
        headers=headers("x" * 300),
    )
    assert answer.status_code == 400 and "Idempotency-Key" in answer.json()["error"]["message"]


def test_a_retry_still_waiting_at_its_own_deadline_is_a_409(gateway: str) -> None:
    """The first attempt takes a 300 ms batch; a retry allowed 50 ms gives up with a 409
    and Retry-After, and the first attempt still gets its answer."""
    body = {"model": "noop", "input": "slow"}

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            first = asyncio.ensure_future(
                client.post(f"{gateway}/v1/embeddings", json=body, headers=headers("k-409"))
            )
            await asyncio.sleep(0.1)
            impatient = {**headers("k-409"), "x-microbatch-timeout-ms": "50"}
            retry = await client.post(f"{gateway}/v1/embeddings", json=body, headers=impatient)
            return [await first, retry]

    first, retry = asyncio.run(both())
    assert first.status_code == 200
    assert retry.status_code == 409 and retry.headers["retry-after"] == "1"
    assert retry.json()["error"]["code"] == "idempotency_key_in_progress"


def test_an_answer_that_is_not_final_is_let_go_and_the_retry_runs_anew(gateway: str) -> None:
    """A 504 (the 300 ms batch outlasts a 50 ms deadline) is not the request's own fault: the
    key is let go, so the retry with time to spare runs and is answered, and that answer is
    the one kept."""
    body = {"model": "noop", "input": "slow to answer"}
    url = f"{gateway}/v1/embeddings"
    hurried = {**headers("k-504"), "x-microbatch-timeout-ms": "50"}
    assert httpx.post(url, json=body, headers=hurried).status_code == 504
    retry = httpx.post(url, json=body, headers=headers("k-504"), timeout=30)
    assert retry.status_code == 200 and "idempotent-replayed" not in retry.headers
    again = httpx.post(url, json=body, headers=headers("k-504"), timeout=30)
    assert again.headers.get("idempotent-replayed") == "true" and again.content == retry.content
