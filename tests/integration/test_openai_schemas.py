"""Every generation answer fits OpenAI's published OpenAPI schema, checked with a JSON-schema
validator, except where OpenAI's own API answers the same way: `finish_reason` null in stream
chunks before the last (tests/openai/README.md), and, with `echo`, null as the first prompt
token's log probability and alternatives (nothing predicts it; OpenAI's legacy API and vLLM
answer so, while the schema's arrays hold numbers and objects only)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import Processes, RedisServer
from tests.integration.test_generation import serve_tiny
from tests.openai import schema_errors

pytestmark = pytest.mark.process  # a module-scoped deployment of processes

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "kalo mine?"}]
COMPLETIONS = [
    {"prompt": "kalo mine", "max_tokens": 5},
    {"prompt": ["kalo", "ru sa"], "max_tokens": 4, "n": 2, "temperature": 0.9, "seed": 1},
    {"prompt": [5, 9, 30], "max_tokens": 3, "logprobs": 2, "echo": True},
    {"prompt": "kalo mine", "max_tokens": 0, "logprobs": 1, "echo": True},
    {"prompt": "kalo", "max_tokens": 4, "best_of": 3, "n": 2, "temperature": 1.0},
    {"prompt": "kalo", "max_tokens": 4, "stop": ["a"], "return_token_ids": True},
]
CHATS = [
    {"messages": CHAT, "max_tokens": 5},
    {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 3},
    {"messages": CHAT, "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 2},
]


@pytest.fixture(scope="module")
def base(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    processes = Processes(tmp_path_factory.mktemp("schemas"))
    try:
        url, _, _ = serve_tiny(processes, redis_server.url, tiny_model, "mbschema")
        yield url
    finally:
        processes.stop_all()


def _whole(base: str, route: str, body: dict) -> dict:
    response = httpx.post(f"{base}{route}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _chunks(base: str, route: str, body: dict) -> list[dict]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}{route}", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    return [json.loads(line) for line in lines]


def _as_openai_answers(answer: dict) -> dict:
    """What OpenAI's own API answers outside its schema, set to what the schema says; every
    other field is left as it came."""
    choices = []
    for choice in answer["choices"]:
        choice = dict(choice)
        if choice.get("finish_reason", "") is None:  # mid-stream
            choice["finish_reason"] = "stop"
        logprobs = choice.get("logprobs")
        if logprobs and "token_logprobs" in logprobs and logprobs["token_logprobs"][:1] == [None]:
            assert logprobs["top_logprobs"][0] is None  # the echoed prompt's first token only
            logprobs = {
                **logprobs,
                "token_logprobs": [0.0, *logprobs["token_logprobs"][1:]],
                "top_logprobs": [{}, *logprobs["top_logprobs"][1:]],
            }
            choice["logprobs"] = logprobs
        choices.append(choice)
    return {**answer, "choices": choices}


@pytest.mark.parametrize("body", COMPLETIONS)
def test_completions_fit_create_completion_response(base: str, body: dict) -> None:
    answer = _as_openai_answers(_whole(base, "/v1/completions", body))
    assert schema_errors("CreateCompletionResponse", answer) == []


@pytest.mark.parametrize("body", [b for b in COMPLETIONS if "best_of" not in b])
def test_completion_stream_chunks_fit_the_same_schema(base: str, body: dict) -> None:
    chunks = _chunks(base, "/v1/completions", body)
    usage = [c for c in chunks if not c["choices"]]
    assert len(usage) == 1 and schema_errors("CompletionUsage", usage[0]["usage"]) == []
    for chunk in chunks:
        if chunk["choices"]:
            # a legacy stream's chunks are completion objects (OpenAI sends no other type)
            fixed = _as_openai_answers(chunk)
            assert schema_errors("CreateCompletionResponse", fixed) == [], chunk


@pytest.mark.parametrize("body", CHATS)
def test_chat_answers_fit_create_chat_completion_response(base: str, body: dict) -> None:
    answer = _whole(base, "/v1/chat/completions", body)
    assert schema_errors("CreateChatCompletionResponse", answer) == []


@pytest.mark.parametrize("body", CHATS)
def test_chat_stream_chunks_fit_the_stream_schema(base: str, body: dict) -> None:
    for chunk in _chunks(base, "/v1/chat/completions", body):
        assert schema_errors("CreateChatCompletionStreamResponse", chunk) == [], chunk
