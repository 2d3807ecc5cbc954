"""Tool calling on /v1/chat/completions through the `openai` client: a forced call always
parses and validates against its function's schema, even from a random-weight model, whole
or streamed; a history with calls and tool results is accepted; what cannot be honoured is a
400 naming the field. Every answer validates against OpenAI's published schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import orjson
import pytest
import redis

from common.settings import Settings
from tests.conftest import RedisServer, free_port, wait_until
from tests.integration.in_process import InProcess
from tests.integration.weather_agent import run_agent
from tests.openai import schema_errors

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base(redis_server: RedisServer, long_tiny: Path) -> Iterator[str]:
    deployment = InProcess()
    common = {"redis_url": redis_server.url, "prefix": "mbtools", "read_block_ms": 100}
    try:
        port = free_port()
        url = deployment.start_gateway(Settings(**common, port=port, gateway_id=f"g-{port}"))
        deployment.start_worker(
            Settings(**common, model=str(long_tiny), served_model_name=["tiny"])
        )
        wait_until(
            lambda: httpx.get(f"{url}/readyz/tiny").status_code,
            120,
            "the tiny Llama served",
            until=lambda status: status == 200,
        )
        yield url
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def client(base: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0) as client:
        yield client


def valid_calls(message, allowed: set[str]) -> list[str]:
    """The names of a message's calls, each asserted to name an allowed tool and carry
    arguments that validate against that tool's schema."""
    assert message.tool_calls, message
    names = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.append(call.function.name)
    return names


def test_required_calls_parse_and_validate_in_200_of_200_sampled_choices(client) -> None:
    seen: set[str] = set()
    for seed in range(0, 200, 10):  # choice c draws from seed + c: 200 distinct seeds
        answer = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            n=10,
            temperature=1.0,
            seed=seed,
            max_tokens=512,
        )
        assert (
            schema_errors("CreateChatCompletionResponse", answer.model_dump(exclude_unset=True))
            == []
        )
        for choice in answer.choices:
            assert choice.finish_reason == "tool_calls", choice.message.content
            names = valid_calls(choice.message, set(SCHEMAS))
            assert len(names) == 1
            seen.update(names)
    assert seen == set(SCHEMAS)  # the grammar allows either tool, and sampling finds both


def test_parallel_required_calls_are_a_list_of_valid_calls(client) -> None:
    counts = []
    for seed in (1000, 1010):
        answer = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", n=10,
            temperature=1.0, seed=seed, max_tokens=512,
        )  # fmt: skip
        for choice in answer.choices:
            assert choice.finish_reason in ("tool_calls", "length")  # a cut list keeps calls
            counts.append(len(valid_calls(choice.message, set(SCHEMAS))))
    assert min(counts) >= 1 and max(counts) > 1


def test_a_named_tool_choice_calls_that_function_once(client) -> None:
    for seed in range(10):
        answer = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            temperature=1.0,
            seed=seed,
            max_tokens=512,
        )
        assert valid_calls(answer.choices[0].message, {"get_time"}) == ["get_time"]


def test_a_streamed_forced_call_arrives_as_tool_call_deltas(client) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        seed=3,
        max_tokens=512,
        stream=True,
    )
    chunks = list(stream)
    for chunk in chunks:
        body = chunk.model_dump(exclude_unset=True)
        assert schema_errors("CreateChatCompletionStreamResponse", body) == []
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    # the id and name first, then the arguments in fragments as they are generated
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:]) and len(deltas) > 3
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_streamed_auto_text_that_is_no_call_arrives_as_content(client) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=6, stream=True
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


def test_a_history_with_calls_and_tool_results_is_accepted(client) -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    answer = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    message = answer.choices[0].message
    # a random model writes no call: auto returns its text as text, never a broken call
    assert message.tool_calls is None and isinstance(message.content, str)
    assert answer.choices[0].finish_reason in ("stop", "length")
    # the tools, the call and its result are all in the prompt
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens + 100
    assert (
        schema_errors("CreateChatCompletionResponse", answer.model_dump(exclude_unset=True)) == []
    )


@pytest.mark.parametrize(
    ("extra", "status", "says"),
    [  # the body's own contradictions are 422s, as every schema error; the rest 400s
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, 422, "not among"),
        ({"tool_choice": "required", "tools": None}, 422, "needs tools"),
        ({"logprobs": True}, 422, "cannot be combined with tools"),
        ({"return_token_ids": True}, 422, "return_token_ids cannot be combined with tools"),
        (
            {
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "objectx"}},
                    }
                ],
            },
            400,
            "tools: the schema cannot be enforced",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, 422, "share a name"),
    ],
)
def test_tool_options_that_cannot_be_honoured_are_4xx(
    base: str, extra: dict, status: int, says: str
) -> None:
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 8, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == status, answer.text
    assert says in answer.json()["error"]["message"]


def test_an_openai_agents_sdk_agent_calls_its_tool_and_finishes(base: str) -> None:
    """The Agents SDK, unchanged, on chat completions: the first turn must call the tool
    (`tool_choice` required), the SDK runs it and feeds the result back, and the run ends
    with an answer. A random-weight model's answer is noise; a trained model's use of the
    result is measured by benchmarks/agent_run.py."""
    result, calls = run_agent(base, "OpenAIChatCompletionsModel")
    assert len(calls) == 1 and all(isinstance(v, str) for v in calls[0])
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert (
        kinds[:2] == ["tool_call_item", "tool_call_output_item"]
        and kinds[-1] == "message_output_item"
    )


def test_a_langchain_chat_model_binds_tools_and_gets_calls(base: str) -> None:
    """LangChain's `ChatOpenAI(...).bind_tools(...)`, unchanged: a forced call comes back as
    its `tool_calls` (parsed arguments), whole and streamed."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model="tiny", base_url=f"{base}/v1", api_key="none", max_retries=0, max_tokens=200
    )
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    bound = chat.bind_tools([weather], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER)
    whole = None
    for piece in bound.stream("And in Rome?"):
        whole = piece if whole is None else whole + piece
    assert whole is not None and [c["name"] for c in whole.tool_calls] == ["get_weather"]
    jsonschema.validate(whole.tool_calls[0]["args"], WEATHER)


def test_a_forced_call_with_a_response_format_is_the_call(client) -> None:
    """The format shapes a text answer; a forced turn answers a call, under its schema."""
    answer = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        response_format={"type": "json_object"},
        max_tokens=200,
    )
    calls = answer.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0].function.arguments), CLOCK)


def test_a_stored_turns_calls_are_read_by_the_models_family_or_the_one_the_setting_names(
    base: str, redis_server: RedisServer, closing
) -> None:
    """A Responses turn's record says how its `auto` calls are read, so whichever gateway
    finishes it reads them alike: from the tiny model's template (it does not take tools:
    the default prompt's Hermes), or as `tool_call_parser` names."""
    deployment = InProcess()
    port = free_port()
    common = {"redis_url": redis_server.url, "prefix": "mbtools", "read_block_ms": 100}
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    store = redis.Redis.from_url(redis_server.url)
    try:
        named = deployment.start_gateway(
            Settings(**common, port=port, gateway_id=f"p-{port}", tool_call_parser="mistral")
        )
        families = []
        for url in (base, named):
            client = closing.enter_context(
                openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            )
            made = client.responses.create(
                model="tiny", input="Weather?", tools=tools, max_output_tokens=4
            )
            identity = orjson.loads(store.hget(f"mbtools:{{{made.id}}}:response", "identity"))
            families.append(identity["tools"]["family"])
        assert families == ["hermes", "mistral"]
    finally:
        deployment.close()
