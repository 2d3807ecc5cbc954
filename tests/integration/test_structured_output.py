"""Structured output (`response_format`) end to end: every answer parses and follows its
schema, constrained and free sequences share a batch without changing each other, and a
schema that cannot be enforced is a 400 before anything is queued.

Real redis-server, gateway and worker serving the tiny random-weight Llama, whose free text
is gibberish: whatever JSON comes out is the grammar's doing, token by token.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.conftest import Processes, RedisServer
from tests.integration.test_generation import serve_tiny

pytestmark = pytest.mark.process  # a module-scoped deployment of processes

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
STRICT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "strict": True, "schema": PERSON},
}
MESSAGES = [{"role": "user", "content": "who are you?"}]


@pytest.fixture(scope="module")
def base(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    processes = Processes(tmp_path_factory.mktemp("structured"))
    try:
        url, _, _ = serve_tiny(processes, redis_server.url, tiny_model, "mbjson")
        yield url
    finally:
        processes.stop_all()


async def _chats(base: str, bodies: list[dict]) -> list[dict]:
    """Every answer, in order. The deadline is the client's own (120 s): constrained answers
    of 400 tokens are slow on a loaded 2-core host, and a default 30 s deadline lets
    admission refuse a burst as infeasible (503 deadline_infeasible), which is not what
    these tests are about (test_admission_deadline.py is)."""
    headers = {"X-Microbatch-Timeout-Ms": "120000"}
    async with httpx.AsyncClient(base_url=base, timeout=120, headers=headers) as client:
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=b) for b in bodies)
        )
    for answer in answers:
        assert answer.status_code == 200, answer.text
    return [a.json() for a in answers]


def test_json_schema_answers_validate_in_100_of_100_seeded_runs(base: str) -> None:
    bodies = [
        {
            "messages": MESSAGES,
            "max_tokens": 400,
            "temperature": 1.0,
            "seed": seed * 10,
            "n": 10,
            "response_format": STRICT,
        }
        for seed in range(10)
    ]
    choices = [c for answer in asyncio.run(_chats(base, bodies)) for c in answer["choices"]]
    assert len(choices) == 100
    for choice in choices:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    assert len({c["message"]["content"] for c in choices}) > 50  # sampled, not one answer


def test_json_object_answers_are_json_objects(base: str) -> None:
    """Any object: the random model may write one key until max_tokens (a real model closes
    its strings), so only those that end are parsed; every one starts as an object."""
    body = {"prompt": "kalo", "max_tokens": 300, "temperature": 0.7, "seed": 4, "n": 16}
    answer = httpx.post(
        f"{base}/v1/completions",
        json={**body, "response_format": {"type": "json_object"}},
        # the server's deadline is the client's: after the previous test's heavy requests,
        # admission's measured rate could otherwise refuse this one on a slow host
        headers={"X-Microbatch-Timeout-Ms": "120000"},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    ended = [c for c in choices if c["finish_reason"] == "stop"]
    assert len(ended) >= len(choices) // 2, choices
    for choice in ended:
        assert isinstance(json.loads(choice["text"]), dict)
    assert all(c["text"].lstrip().startswith("{") for c in choices)


def test_a_streamed_structured_answer_adds_up_to_valid_json(base: str) -> None:
    body = {"messages": MESSAGES, "max_tokens": 400, "seed": 3, "response_format": STRICT}
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    jsonschema.validate(json.loads(text), PERSON)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_free_sequences_beside_constrained_ones_are_unchanged(base: str) -> None:
    free = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    alone = asyncio.run(_chats(base, [free]))[0]["choices"][0]["message"]["content"]
    constrained = [  # room to finish: the shortest valid answer is 53 tokens here
        {**free, "ignore_eos": False, "max_tokens": 400, "response_format": STRICT, "seed": s}
        for s in range(6)
    ]
    mixed = asyncio.run(_chats(base, [*constrained, free, *constrained]))
    assert mixed[6]["choices"][0]["message"]["content"] == alone
    for answer in mixed[:6] + mixed[7:]:  # each one checked (at 40 tokens none ever was)
        assert answer["choices"][0]["finish_reason"] == "stop", answer
        jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), PERSON)


@pytest.mark.parametrize(
    ("response_format", "extra", "status", "says"),
    [
        ({"type": "json_schema"}, {}, 422, "json_schema"),
        ({"type": "xml"}, {}, 422, "response_format"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
            {},
            400,
            "objectx",
        ),
        ({"type": "json_object"}, {"ignore_eos": True}, 400, "ignore_eos"),
        ({"type": "json_object"}, {"min_tokens": 3}, 400, "min_tokens"),
    ],
)
def test_formats_that_cannot_be_enforced_get_a_clear_4xx(
    base: str, response_format: dict, extra: dict, status: int, says: str
) -> None:
    body = {"messages": MESSAGES, "response_format": response_format, **extra}
    answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert says in error["message"] or says == error.get("param"), error


def test_openais_client_parses_a_pydantic_model_out_of_the_answer(base: str, closing) -> None:
    from typing import Annotated, Literal

    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: Annotated[str, Field(max_length=12)]
        age: Annotated[int, Field(ge=0, le=150)]
        role: Literal["admin", "user", "guest"]

    client = closing.enter_context(OpenAI(base_url=f"{base}/v1", api_key="unused"))
    model = client.models.list().data[0].id
    completion = client.chat.completions.parse(
        model=model, messages=MESSAGES, response_format=Person, max_tokens=300, seed=5
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 150
    assert completion.system_fingerprint and completion.system_fingerprint.startswith("fp_")
