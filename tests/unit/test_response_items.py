"""A response's items in OpenAI's shapes: a turn's input stored as item resources, the
answer as output items, a conversation as chat messages, and the `Response` object with what
it echoes of its request and its usage."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.responses import items
from gateway.responses.schema import CreateResponse
from gateway.tool_calls import Call

RID = "resp_abc"
WEATHER = Call("weather", '{"city":"Oslo"}')
TIME = Call("time", "{}")


def _stored(*given: Any) -> list[dict[str, Any]]:
    """`given`: one string, or items."""
    body = CreateResponse.model_validate(
        {"input": given[0] if isinstance(given[0], str) else list(given)}
    )
    return items.input_items(body, RID)


def _said(text: str, item_id: str = "msg_abc", status: str = "completed") -> dict[str, Any]:
    """An assistant message as OpenAI writes it: one output_text part."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def test_a_response_id_is_resp_and_its_entropy_in_hex() -> None:
    assert items.new_response_id(bytes([0, 255, 16])) == "resp_00ff10"


# ---- a turn's input, stored as items ------------------------------------------------------


def test_a_string_input_is_one_user_message_of_input_text() -> None:
    assert _stored("hi there") == [
        {
            "type": "message",
            "id": "msg_abc_in0",
            "role": "user",
            "content": [{"type": "input_text", "text": "hi there"}],
            "status": "completed",
        }
    ]


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        (
            {
                "role": "system",
                "content": [
                    {"type": "input_text", "text": "be "},
                    {"type": "input_text", "text": "brief"},
                ],
            },
            {
                "type": "message",
                "id": "msg_abc_in0",
                "role": "system",
                "content": [{"type": "input_text", "text": "be brief"}],
                "status": "completed",
            },
        ),
        ({"role": "assistant", "content": "it rains"}, _said("it rains", "msg_abc_in0")),
        (
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {
                "type": "function_call",
                "id": "fc_abc_in0",
                "call_id": "c1",
                "name": "weather",
                "arguments": "{}",
                "status": "completed",
            },
        ),
        (
            {
                "type": "function_call_output",
                "id": "mine",
                "call_id": "c1",
                "output": [
                    {"type": "input_text", "text": "su"},
                    {"type": "input_text", "text": "n"},
                ],
            },
            {
                "type": "function_call_output",
                "id": "mine",
                "call_id": "c1",
                "output": "sun",
                "status": "completed",
            },
        ),
    ],
    ids=["parts-joined", "assistant-as-output", "function-call", "call-output-keeps-its-id"],
)
def test_each_input_item_is_stored_whole_and_completed(given: dict, stored: dict) -> None:
    assert _stored(given, {"role": "user", "content": "next"})[0] == stored


# ---- the answer, as output items ----------------------------------------------------------


def test_an_output_message_opens_empty_and_ends_with_its_text_part() -> None:
    assert items.output_message("m", "ignored", "in_progress") == {
        "type": "message",
        "id": "m",
        "role": "assistant",
        "status": "in_progress",
        "content": [],
    }
    assert items.output_message("m", "hi") == _said("hi", "m")
    assert items.output_message("m", "cut", "incomplete") == _said("cut", "m", "incomplete")


def test_a_function_call_item_is_completed_unless_told() -> None:
    assert items.function_call("fc_1", "call_1", WEATHER) == {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "weather",
        "arguments": '{"city":"Oslo"}',
        "status": "completed",
    }
    assert items.function_call("fc_1", "call_1", WEATHER, "incomplete")["status"] == "incomplete"


def _call(n: int, call: Call, status: str) -> dict[str, Any]:
    return items.function_call(f"fc_abc_{n}", f"call_abc_{n}", call, status)


@pytest.mark.parametrize(
    ("text", "calls", "expected"),
    [
        ("hello", [], [_said("hello")]),
        (None, [], [_said("")]),  # nothing at all is still an (empty) message
        ("", [WEATHER, TIME], [_call(0, WEATHER, "completed"), _call(1, TIME, "completed")]),
        ("let me see", [WEATHER], [_said("let me see"), _call(0, WEATHER, "completed")]),
    ],
    ids=["text", "nothing", "calls-only", "text-then-call"],
)
def test_output_items_are_a_message_where_text_was_written_then_one_item_per_call(
    text: str | None, calls: list[Call], expected: list[dict]
) -> None:
    assert items.output_items(RID, text, calls, "completed") == expected


def test_output_items_carry_the_responses_status() -> None:
    out = items.output_items(RID, "so", [WEATHER], "incomplete")
    assert [i["status"] for i in out] == ["incomplete", "incomplete"]


# ---- a conversation, as chat messages ------------------------------------------------------


def test_a_conversation_becomes_whole_chat_messages() -> None:
    stored = [
        *_stored(
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sun"},
        ),
        *items.output_items(RID, "Checking the time too.", [TIME], "completed"),
    ]
    assert items.as_messages("be brief", stored) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "sun", "tool_call_id": "c1"},
        {
            "role": "assistant",
            "content": "Checking the time too.",  # its text, then the call it made
            "tool_calls": [
                {
                    "id": "call_abc_0",
                    "type": "function",
                    "function": {"name": "time", "arguments": "{}"},
                }
            ],
        },
    ]


def test_a_conversation_may_open_with_a_call_and_no_instructions() -> None:
    stored = _stored({"type": "function_call", "call_id": "c1", "name": "time", "arguments": "{}"})
    assert items.as_messages(None, stored) == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "time", "arguments": "{}"}}
            ],
        }
    ]


def test_a_messages_text_is_its_parts_text_joined_and_a_part_without_text_adds_none() -> None:
    message = {
        "type": "message",
        "role": "assistant",
        "content": [
            {"type": "output_text", "text": "Hello, "},
            {"type": "refusal", "refusal": "no"},
            {"type": "output_text", "text": "world"},
        ],
    }
    assert items.as_messages(None, [message]) == [{"role": "assistant", "content": "Hello, world"}]


# ---- the Response object -------------------------------------------------------------------


def test_usage_counts_input_output_and_their_total() -> None:
    assert items.usage(input_tokens=7, output_tokens=3, cached_tokens=4) == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 10,
    }


def test_a_bare_request_is_echoed_with_openais_defaults() -> None:
    assert items.echo(CreateResponse(input="hi"), "m") == {
        "model": "m",
        "instructions": None,
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "max_output_tokens": None,
        "previous_response_id": None,
        "metadata": {},
        "store": True,
        "background": False,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "reasoning": None,
        "service_tier": "default",
    }


def test_a_full_request_is_echoed_as_it_was_asked() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    body = CreateResponse.model_validate(
        {
            "input": "hi",
            "instructions": "be brief",
            "tools": [{"type": "function", "name": "weather"}],
            "tool_choice": {"type": "function", "name": "weather"},
            "parallel_tool_calls": False,
            "temperature": 0.5,
            "top_p": 0.9,
            "max_output_tokens": 64,
            "previous_response_id": "resp_before",
            "metadata": {"k": "v"},
            "background": True,
            "text": {"format": {"type": "json_schema", "name": "place", "schema": schema}},
            "user": "u-1",
        }
    )
    assert items.echo(body, "m") == {
        "model": "m",
        "instructions": "be brief",
        "tools": [{"type": "function", "name": "weather", "parameters": None, "strict": None}],
        "tool_choice": {"type": "function", "name": "weather"},
        "parallel_tool_calls": False,
        "temperature": 0.5,
        "top_p": 0.9,
        "max_output_tokens": 64,
        "previous_response_id": "resp_before",
        "metadata": {"k": "v"},
        "store": True,
        "background": True,
        "text": {"format": {"type": "json_schema", "name": "place", "schema": schema}},
        "truncation": "disabled",
        "reasoning": None,
        "service_tier": "default",
        "user": "u-1",
    }


def test_a_request_that_said_no_store_and_a_sampling_of_zero_is_echoed_so() -> None:
    body = CreateResponse(input="hi", store=False, temperature=0.0, parallel_tool_calls=True)
    echoed = items.echo(body, "m")
    assert (echoed["store"], echoed["temperature"], echoed["parallel_tool_calls"]) == (
        False,
        0.0,
        True,
    )


def test_the_response_object_is_whole_and_reports_usage_only_when_given() -> None:
    request = {"model": "m"}
    done = items.response_object(
        RID,
        100,
        request,
        "completed",
        output=[_said("hi")],
        usage={"total_tokens": 1},
        completed_at=101,
    )
    assert done == {
        "id": RID,
        "object": "response",
        "created_at": 100,
        "status": "completed",
        "completed_at": 101,
        "error": None,
        "incomplete_details": None,
        "model": "m",
        "output": [_said("hi")],
        "usage": {"total_tokens": 1},
    }
    failed = items.response_object(
        RID, 100, request, "failed", error={"code": "server_error", "message": "x"}
    )
    assert failed["error"] == {"code": "server_error", "message": "x"}
    assert failed["output"] == [] and "usage" not in failed and failed["incomplete_details"] is None
