"""Every answer fits OpenAI's published OpenAPI schema, checked with a JSON-schema validator:
generation (whole and streamed), embeddings, the model list and every error body. Only where
OpenAI's own API answers outside its schema is an answer changed before the check, and only
there: `finish_reason` null in stream chunks before the last (tests/openai/README.md); with
`echo`, null as the first prompt token's log probability and alternatives (nothing predicts
it; OpenAI's legacy API and vLLM answer so); and a base64 embedding, a string where the
schema has floats (OpenAI's `encoding_format: base64`)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import Processes, RedisServer, wait_ready
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


def _as_openai_answers(answer: dict, stream: bool = False) -> dict:
    """What OpenAI's own API answers outside its schema, set to what the schema says; every
    other field is left as it came. A null `finish_reason` is laundered only in a stream's
    chunks: in a whole answer it is a defect."""
    choices = []
    for choice in answer["choices"]:
        choice = dict(choice)
        if stream and choice.get("finish_reason", "") is None:  # mid-stream
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
    answers = [c for c in chunks if c["choices"]]
    assert answers and answers[-1]["choices"][-1]["finish_reason"] in ("stop", "length")
    for chunk in answers:
        # a legacy stream's chunks are completion objects (OpenAI sends no other type)
        fixed = _as_openai_answers(chunk, stream=True)
        assert schema_errors("CreateCompletionResponse", fixed) == [], chunk


@pytest.mark.parametrize("body", CHATS)
def test_chat_answers_fit_create_chat_completion_response(base: str, body: dict) -> None:
    answer = _whole(base, "/v1/chat/completions", body)
    assert schema_errors("CreateChatCompletionResponse", answer) == []


@pytest.mark.parametrize("body", CHATS)
def test_chat_stream_chunks_fit_the_stream_schema(base: str, body: dict) -> None:
    chunks = _chunks(base, "/v1/chat/completions", body)
    finished = [c for c in chunks for choice in c["choices"] if choice["finish_reason"]]
    assert len(finished) == body.get("n", 1) and len(chunks) > len(finished)  # chunks, then ends
    for chunk in chunks:
        assert schema_errors("CreateChatCompletionStreamResponse", chunk) == [], chunk


def test_the_model_list_and_one_model_fit_their_schemas(base: str) -> None:
    listed = httpx.get(f"{base}/v1/models", timeout=30)
    assert listed.status_code == 200
    assert schema_errors("ListModelsResponse", listed.json()) == []
    assert listed.json()["data"], "no model listed: the check above checked no Model"
    name = listed.json()["data"][0]["id"]
    one = httpx.get(f"{base}/v1/models/{name}", timeout=30)
    assert one.status_code == 200 and schema_errors("Model", one.json()) == []


BAD_CALLS = [
    ("/v1/completions", {"prompt": [5] * 1020, "max_tokens": 10}, 400),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 422),
    ("/v1/chat/completions", {"messages": []}, 422),
    ("/v1/embeddings", {"input": "x"}, 400),  # a causal LM serves no embeddings
    ("/v1/no-such-route", {}, 404),
]


@pytest.mark.parametrize(("route", "body", "status"), BAD_CALLS)
def test_every_error_body_fits_the_error_schema(
    base: str, route: str, body: dict, status: int
) -> None:
    response = httpx.post(f"{base}{route}", json=body, timeout=30)
    assert response.status_code == status, response.text
    assert schema_errors("ErrorResponse", response.json()) == []


def test_the_checker_catches_what_the_answers_must_not_do() -> None:
    """The validator, and the laundering, can fail: each answer below breaks the schema."""
    whole = {
        "id": "c", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}],
    }  # fmt: skip
    assert schema_errors("CreateCompletionResponse", _as_openai_answers(whole)) != []
    assert schema_errors("CreateCompletionResponse", _as_openai_answers(whole, True)) == []
    assert schema_errors("ErrorResponse", {"error": {"message": "m", "type": "t"}}) != []
    assert schema_errors("ListModelsResponse", {"object": "list", "data": [{"id": 1}]}) != []


@pytest.fixture(scope="module")
def encoder(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory):
    """A gateway and a `noop` embedding worker, under their own key prefix."""
    processes = Processes(tmp_path_factory.mktemp("embedding-schemas"))
    settings = {"redis_url": redis_server.url, "model": "noop", "prefix": "mbembschema"}
    try:
        processes.start("worker", **settings)
        gateway = processes.start("gateway", **settings)
        wait_ready(gateway)
        yield gateway.base_url
    finally:
        processes.stop_all()


@pytest.mark.parametrize(
    "body",
    [
        {"input": "one text"},
        {"input": ["two", "texts"], "user": "someone"},
        {"input": [[101, 7592, 102]]},
        {"input": ["a", "b", "c"], "encoding_format": "base64"},
    ],
)
def test_embeddings_fit_create_embedding_response(encoder: str, body: dict) -> None:
    response = httpx.post(f"{encoder}/v1/embeddings", json=body, timeout=30)
    assert response.status_code == 200, response.text
    answer = response.json()
    if body.get("encoding_format") == "base64":  # a string where the schema has floats
        for item in answer["data"]:
            vector = np.frombuffer(base64.b64decode(item["embedding"]), "<f4")
            item["embedding"] = vector.tolist()
    assert len(answer["data"]) == (1 if isinstance(body["input"], str) else len(body["input"]))
    assert schema_errors("CreateEmbeddingResponse", answer) == []


def test_an_embedding_error_fits_the_error_schema(encoder: str) -> None:
    response = httpx.post(f"{encoder}/v1/embeddings", json={"input": []}, timeout=30)
    assert response.status_code == 400
    assert schema_errors("ErrorResponse", response.json()) == []
    bad = {"data": [{"index": 0, "embedding": "AAAA", "object": "embedding"}]}
    assert schema_errors("CreateEmbeddingResponse", bad) != []  # the check can fail
