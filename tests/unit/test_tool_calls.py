"""Reading a model's text for tool calls: forced JSON, or Hermes `<tool_call>` blocks in free
text; anything that is not a whole call to a known tool stays text."""

from __future__ import annotations

import json

import pytest

from gateway.tool_calls import (
    COMPACT,
    ToolUse,
    as_text,
    closed,
    default_prompt,
    forced_schema,
)

NAMES = frozenset({"get_weather", "get_time"})
AUTO = ToolUse(NAMES, forced=False, parallel=False)
TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object"}},
    {"name": "get_time", "description": "the time", "parameters": {"type": "object"}},
]


def test_auto_reads_hermes_blocks_and_keeps_the_text_around_them() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": 1}"}</tool_call>'
    )
    found = AUTO.calls(text)
    assert found is not None
    content, calls = found
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": 1}),  # arguments written as a JSON string are read too
    ]


@pytest.mark.parametrize(
    "text",
    [
        "Just an answer, no call.",
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # unknown tool
        '<tool_call>{"name": "get_time", "arguments": [1, 2]}</tool_call>',  # not an object
        '<tool_call>["get_time"]</tool_call>',
        '<tool_call>{"name": "get_time"}</tool_call> <tool_call>{"oops"}</tool_call>',
    ],
)
def test_auto_returns_anything_but_whole_calls_to_known_tools_as_text(text: str) -> None:
    assert AUTO.calls(text) is None


def test_a_call_without_arguments_has_an_empty_object() -> None:
    found = AUTO.calls('<tool_call>{"name": "get_time"}</tool_call>')
    assert found is not None and found[1][0].arguments == "{}"


def test_forced_answers_are_one_call_or_a_list_of_them() -> None:
    one = ToolUse(NAMES, forced=True, parallel=False)
    found = one.calls('{"name":"get_time","arguments":{"zone":3}}')
    assert found is not None and found[0] is None and found[1][0].name == "get_time"
    many = ToolUse(NAMES, forced=True, parallel=True)
    found = many.calls('[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":{}}]')
    assert found is not None and [c.name for c in found[1]] == ["get_time", "get_weather"]
    assert one.calls('{"name":"get_time","arguments":{"zo') is None  # cut by max_tokens
    assert many.calls("[]") is None
    cut = many.calls('[{"name":"get_time","arguments":{}},{"name":"get_weather","argum')
    assert cut is not None and [c.name for c in cut[1]] == ["get_time"]  # the calls that closed
    assert many.calls('[{"name":"get_time","argum') is None


def test_the_forced_schema_pins_the_name_and_the_parameters() -> None:
    named = forced_schema(TOOLS, "get_time", parallel=True)
    assert named["properties"]["name"] == {"const": "get_time"}
    assert named["x-guidance"] == COMPACT and named["required"] == ["name", "arguments"]
    either = forced_schema(TOOLS, None, parallel=False)
    assert [b["properties"]["name"]["const"] for b in either["anyOf"]] == [
        "get_weather",
        "get_time",
    ]
    listed = forced_schema(TOOLS, None, parallel=True)
    assert listed["type"] == "array" and listed["minItems"] == 1
    assert forced_schema([{"name": "f"}], None, False)["properties"]["arguments"] == {
        "type": "object"
    }


def test_the_default_prompt_lists_each_tool_and_the_format_it_parses() -> None:
    prompt = default_prompt(TOOLS)
    assert prompt.count('"type": "function"') == 2 and '"description": "the time"' in prompt
    assert "<tool_call>" in prompt
    written = as_text("get_time", '{"zone": 2}')
    found = AUTO.calls(written)  # a past call is written as the parser reads one
    assert found is not None and json.loads(found[1][0].arguments) == {"zone": 2}


def test_objects_that_do_not_say_otherwise_are_closed_to_their_properties() -> None:
    schema = {
        "type": "object",
        "properties": {
            "where": {"type": "object", "properties": {"city": {"type": "string"}}},
            "tags": {"type": "array", "items": {"properties": {"k": {}}}},
            "either": {"anyOf": [{"properties": {"a": {}}}, {"type": "string"}]},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
        },
        "$defs": {"d": {"properties": {"x": {}}}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["where"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["either"]["anyOf"][1] == {"type": "string"}
    assert props["open"]["additionalProperties"] is True  # said otherwise: kept
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the tool's own schema is not changed
    args = forced_schema([{"name": "f", "parameters": schema}], "f", False)
    assert args["properties"]["arguments"]["additionalProperties"] is False
