"""`/v1/responses` through the `openai` client: a turn answered, stored and read back, its
conversation continued by `previous_response_id`, streamed as OpenAI's typed events, run in
the background and read from Redis (polled, streamed, resumed past a sequence number,
cancelled), tools forced and read; every answer and event validates against OpenAI's
published schema; what cannot be honoured is a 4xx naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from common.settings import Settings
from tests.conftest import RedisServer, free_port, wait_until
from tests.integration.in_process import InProcess
from tests.integration.weather_agent import run_agent
from tests.openai import schema_errors

PREFIX = "mbresp"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}


class Forecast(BaseModel):
    """An agent's structured answer, bounded so a random model's closes within max_tokens."""

    summary: str = Field(max_length=12)


@pytest.fixture(scope="module")
def gateways(module_redis: RedisServer, long_tiny: Path) -> Iterator[list[str]]:
    """Two gateways over one Redis and one worker: what one stores, the other serves."""
    deployment = InProcess()
    common = {"redis_url": module_redis.url, "prefix": PREFIX, "read_block_ms": 100}
    try:
        urls = []
        for _ in range(2):
            port = free_port()
            urls.append(
                deployment.start_gateway(Settings(**common, port=port, gateway_id=f"g-{port}"))
            )
        deployment.start_worker(
            Settings(**common, model=str(long_tiny), served_model_name=["tiny"])
        )
        for url in urls:
            wait_until(
                lambda url=url: httpx.get(f"{url}/readyz/tiny").status_code,
                120,
                "the tiny Llama served",
                until=lambda status: status == 200,
            )
        yield urls
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def clients(gateways: list[str]) -> Iterator[list[openai.OpenAI]]:
    made = [openai.OpenAI(base_url=f"{u}/v1", api_key="none", max_retries=0) for u in gateways]
    yield made
    for client in made:
        client.close()


def _valid(name: str, body: dict) -> None:
    assert schema_errors(name, body) == [], body


def _response(client: openai.OpenAI, **params) -> dict:
    made = client.responses.create(model="tiny", **params)
    body = made.model_dump(exclude_unset=True)
    _valid("Response", body)
    return body


def test_a_turn_is_answered_stored_and_read_back_from_another_gateway(clients) -> None:
    first, second = clients
    body = _response(first, input="Hello there", max_output_tokens=12, temperature=0)
    assert body["status"] in ("completed", "incomplete")
    message = body["output"][0]
    assert message["type"] == "message" and message["role"] == "assistant"
    text = message["content"][0]["text"]
    assert text and body["usage"]["output_tokens"] <= 12
    assert body["usage"]["input_tokens"] > 0
    again = second.responses.retrieve(body["id"]).model_dump(exclude_unset=True)
    _valid("Response", again)
    assert again == body
    listed = second.responses.input_items.list(body["id"])
    assert [i.content[0].text for i in listed.data] == ["Hello there"]
    _valid("ResponseItemList", listed.model_dump(exclude_unset=True))


def test_greedy_turns_equal_chat_completions_on_the_same_messages(clients) -> None:
    """A turn is a chat completion underneath: the same prompt, the same greedy text."""
    client = clients[0]
    body = _response(
        client, input="Count to five", instructions="Be brief", max_output_tokens=10, temperature=0
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "Be brief"},
            {"role": "user", "content": "Count to five"},
        ],
        max_tokens=10,
        temperature=0,
    )
    assert body["output"][0]["content"][0]["text"] == chat.choices[0].message.content
    assert body["usage"]["input_tokens"] == chat.usage.prompt_tokens


def test_previous_response_id_continues_the_conversation(clients) -> None:
    first, second = clients
    one = _response(first, input="My name is Ada", max_output_tokens=8, temperature=0)
    two = _response(
        second,
        input="What is my name?",
        previous_response_id=one["id"],
        max_output_tokens=8,
        temperature=0,
    )
    assert two["previous_response_id"] == one["id"]
    chat = first.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "user", "content": "My name is Ada"},
            {"role": "assistant", "content": one["output"][0]["content"][0]["text"]},
            {"role": "user", "content": "What is my name?"},
        ],
        max_tokens=8,
        temperature=0,
    )
    assert two["output"][0]["content"][0]["text"] == chat.choices[0].message.content
    assert two["usage"]["input_tokens"] == chat.usage.prompt_tokens
    items = first.responses.input_items.list(two["id"], order="asc").data
    assert [i.type for i in items] == ["message", "message", "message"]


def test_store_false_is_not_kept(clients) -> None:
    body = _response(clients[0], input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        clients[1].responses.retrieve(body["id"])


def test_streamed_events_are_openais_and_end_in_the_stored_response(clients) -> None:
    client = clients[0]
    events = list(
        client.responses.create(
            model="tiny", input="Tell a story", max_output_tokens=16, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        kinds[-1],
    ] and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for event in events:
        _valid("ResponseStreamEvent", event.model_dump(exclude_unset=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output[0].content[0].text == text
    assert clients[1].responses.retrieve(final.id).output_text == text


def test_the_openai_stream_helper_reads_it(clients) -> None:
    """`responses.stream` accumulates the deltas into the final response it is given (a
    random-weight model is cut by max_output_tokens: `response.incomplete`, which the
    helper's `get_final_response` does not accept, so its last event is read instead)."""
    with clients[0].responses.stream(model="tiny", input="Hi", max_output_tokens=6) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == "".join(deltas)


def test_background_runs_are_polled_from_any_gateway(clients) -> None:
    first, second = clients
    made = _response(first, input="Write", max_output_tokens=24, background=True, temperature=0)
    assert made["status"] == "queued" and made["background"] is True
    done = wait_until(
        lambda: second.responses.retrieve(made["id"]),
        60,
        "the background response finished",
        until=lambda r: r.status in ("completed", "incomplete"),
    )
    _valid("Response", done.model_dump(exclude_unset=True))
    foreground = _response(first, input="Write", max_output_tokens=24, temperature=0)
    assert done.output_text == foreground["output"][0]["content"][0]["text"]


def test_a_background_stream_resumes_past_a_sequence_number_on_another_gateway(clients) -> None:
    first, second = clients
    stream = first.responses.create(
        model="tiny", input="Tell me more", max_output_tokens=32, background=True, stream=True
    )
    events = []
    for event in stream:
        events.append(event)
        if len(events) == 6:
            break
    stream.close()
    resumed = list(
        second.responses.retrieve(
            events[0].response.id, stream=True, starting_after=events[-1].sequence_number
        )
    )
    whole = events + resumed
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    assert whole[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in whole if e.type == "response.output_text.delta")
    assert whole[-1].response.output_text == text
    for event in resumed:
        _valid("ResponseStreamEvent", event.model_dump(exclude_unset=True))


def test_forced_tool_calls_are_function_call_items(clients) -> None:
    client = clients[0]
    body = _response(
        client,
        input="Weather in Paris?",
        tools=[TOOL],
        tool_choice="required",
        # one call, which the grammar then ends: with parallel calls allowed, the random
        # model sampled call after call (six once) until max_output_tokens, `incomplete`
        parallel_tool_calls=False,
        max_output_tokens=512,
    )
    calls = [i for i in body["output"] if i["type"] == "function_call"]
    assert calls and body["status"] == "completed"
    for call in calls:
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    follow = _response(
        client,
        previous_response_id=body["id"],
        input=[
            {"type": "function_call_output", "call_id": c["call_id"], "output": "21 C"}
            for c in calls
        ],
        tools=[TOOL],
        max_output_tokens=8,
    )
    assert follow["status"] in ("completed", "incomplete")


def test_streamed_forced_calls_give_arguments_events(clients) -> None:
    events = list(
        clients[0].responses.create(
            model="tiny",
            input="Weather?",
            tools=[TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=512,
            stream=True,
        )
    )
    for event in events:
        _valid("ResponseStreamEvent", event.model_dump(exclude_unset=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].name == "get_weather"
    jsonschema.validate(json.loads(done[0].arguments), WEATHER)
    assert events[-1].type == "response.completed"


def test_cancel_and_delete(clients) -> None:
    first, second = clients
    made = _response(first, input="Go on", max_output_tokens=2000, background=True)
    cancelled = second.responses.cancel(made["id"])
    assert cancelled.status in ("cancelled", "completed", "incomplete")
    _valid("Response", cancelled.model_dump(exclude_unset=True))
    assert first.responses.retrieve(made["id"]).status == cancelled.status
    second.responses.delete(made["id"])
    with pytest.raises(openai.NotFoundError):
        first.responses.retrieve(made["id"])


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True, "store": False}, "background"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
    ],
)
def test_what_cannot_be_honoured_is_refused(gateways, params, field) -> None:
    reply = httpx.post(
        f"{gateways[0]}/v1/responses", json={"model": "tiny", "input": "hi", **params}
    )
    assert 400 <= reply.status_code < 500, reply.text
    assert field in reply.text, reply.text


def test_an_openai_agents_sdk_agent_runs_on_the_responses_api(gateways) -> None:
    """The Agents SDK's default model (`OpenAIResponsesModel`, streaming the Responses
    API), unchanged: the first turn must call the tool, the SDK runs it and sends its output
    back as a `function_call_output` item, and the run ends with a message."""
    # the SDK fails a turn that ends `incomplete`: the last answer is structured output
    # (`text.format`), so even a random model's ends, where its free text would not
    result, calls = run_agent(gateways[0], "OpenAIResponsesModel", output_type=Forecast)
    assert len(calls) == 1 and all(isinstance(v, str) for v in calls[0])
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, Forecast)


def test_a_background_run_nobody_reads_is_finished_by_the_gateways(
    clients, module_redis: RedisServer
) -> None:
    """No client polls or streams it: the gateways' finisher writes its end into the record
    on its own (before its chunks' time to live could run out), and drops it from the
    running list."""
    import redis

    from common.keys import Keys

    made = _response(clients[0], input="Alone", max_output_tokens=16, background=True)
    keys, store = Keys(PREFIX), redis.Redis.from_url(module_redis.url)
    status = wait_until(
        lambda: store.hget(keys.response(made["id"]), "status"),
        60,
        "the finisher wrote the run's end",
        until=lambda s: s in (b"completed", b"incomplete"),
    )
    assert status in (b"completed", b"incomplete")
    # off the running list only after its end is written (the other order could lose a run
    # to a Redis error between the two), so a moment later
    wait_until(
        lambda: store.zscore(keys.active_responses, made["id"]) is None,
        10,
        "the run dropped from the running list",
    )
    assert store.ttl(keys.response_events(made["id"])) <= 3600  # kept an hour, then gone
    final = json.loads(store.hget(keys.response(made["id"]), "object"))
    _valid("Response", final)
    assert store.hget(keys.response(made["id"]), "worker")  # names who answered it
    store.close()


def test_a_background_run_is_bounded_by_the_chunks_its_stream_keeps(
    gateways, module_redis: RedisServer, closing
) -> None:
    """A background run's stream keeps every chunk until it ends (`reply_maxlen`): with no
    `max_output_tokens` its output stops there instead of running to the context; asked for
    more, it is a 400 naming the field."""
    deployment = InProcess()
    port = free_port()
    common = {"redis_url": module_redis.url, "prefix": PREFIX, "read_block_ms": 100}
    try:
        url = deployment.start_gateway(
            Settings(**common, port=port, gateway_id=f"b-{port}", reply_maxlen=24)
        )
        client = closing.enter_context(
            openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        )
        made = client.responses.create(model="tiny", input="Go on", background=True)
        done = wait_until(
            lambda: client.responses.retrieve(made.id),
            60,
            "the bounded run finished",
            until=lambda r: r.status in ("completed", "incomplete", "failed"),
        )
        assert done.status in ("completed", "incomplete") and done.usage.output_tokens <= 24
        with pytest.raises(openai.BadRequestError, match="max_output_tokens"):
            client.responses.create(
                model="tiny", input="Go on", background=True, max_output_tokens=25
            )
        client.close()
    finally:
        deployment.close()
