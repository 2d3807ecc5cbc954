"""Reading a model's text for tool calls: forced JSON, or free text in its family's format
(Hermes `<tool_call>` blocks, Llama 3's JSON, Mistral's `[TOOL_CALLS]`); anything that is not
a whole call to a known tool stays text."""

from __future__ import annotations

import json

import pytest

from gateway.tool_calls import (
    COMPACT,
    Call,
    ToolUse,
    as_text,
    closed,
    default_prompt,
    family_of,
    forced_schema,
    read_by,
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


# ---- the output families of `auto` calls, chosen from the model's template ------------------

LLAMA = ToolUse(NAMES, forced=False, parallel=False, family="llama3_json")
MISTRAL = ToolUse(NAMES, forced=False, parallel=False, family="mistral")
PARIS = Call("get_weather", '{"city": "Paris"}')
UTC = Call("get_time", '{"zone": "UTC"}')


@pytest.mark.parametrize(
    "text",
    [
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',  # the tag was special
        '  {"name": "get_weather", "arguments": {"city": "Paris"}}\n',
    ],
)
def test_llama3_json_reads_a_call_with_or_without_its_python_tag(text: str) -> None:
    assert LLAMA.calls(text) == (None, [PARIS])


def test_llama3_json_reads_several_calls_joined_by_semicolons() -> None:
    text = (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    )
    assert LLAMA.calls(text) == (None, [PARIS, UTC])


@pytest.mark.parametrize(
    "text",
    [
        "It is sunny in Paris.",
        '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some prose',
        '{"name": "launch_missiles", "parameters": {}}',  # not an offered tool
        '{"name": "get_weather", "parameters": {"city": ',  # cut by max_tokens
        '{"city": "Paris"}',  # JSON, not a call
    ],
)
def test_llama3_json_leaves_what_is_not_whole_calls_to_known_tools_as_text(text: str) -> None:
    assert LLAMA.calls(text) is None


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None),
        ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None),  # marker skipped
        (
            'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            "Checking.",
        ),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None),  # v11 tokenizers
        ('get_weather{"city": "Paris"}', None),  # v11, both markers skipped
    ],
)
def test_mistral_reads_its_list_and_its_v11_form(text: str, content: str | None) -> None:
    assert MISTRAL.calls(text) == (content, [PARIS])


def test_mistral_reads_several_calls_in_either_form() -> None:
    listed = (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}}]'
    )
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'
    assert MISTRAL.calls(listed) == (None, [PARIS, UTC])
    assert MISTRAL.calls(v11) == (None, [PARIS, UTC])


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        '[TOOL_CALLS][{"name": "launch_missiles", "arguments": {}}]',
        '[TOOL_CALLS]launch_missiles[ARGS]{"now": true}',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
        "[TOOL_CALLS][]",
    ],
)
def test_mistral_leaves_what_is_not_whole_calls_to_known_tools_as_text(text: str) -> None:
    assert MISTRAL.calls(text) is None


@pytest.mark.parametrize(
    ("template", "setting", "family"),
    [
        # excerpts of the real templates' tool parts
        ("{%- if tools %}<tool_call>\n{{ tool_call | tojson }}</tool_call>", "auto", "hermes"),
        ("{%- if tools %}<|python_tag|>{{ tool_call.arguments | tojson }}", "auto", "llama3_json"),
        (
            '{%- if tools %}Environment: ipython\n{"name": function name, "parameters"',
            "auto",
            "llama3_json",
        ),
        (
            "{%- if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]",
            "auto",
            "mistral",
        ),
        ("{{ messages[0].content }}", "auto", "hermes"),  # no tools: the default prompt
        (None, "auto", "hermes"),
        ("{%- if tools %}<tool_call>", "mistral", "mistral"),  # the setting overrides
    ],
)
def test_the_family_is_read_from_the_template_unless_the_setting_names_one(
    template: str | None, setting: str, family: str
) -> None:
    assert family_of(template, setting) == family
    assert read_by(AUTO, template, setting) == ToolUse(NAMES, False, False, family)
    assert read_by(None, template, setting) is None


def test_a_forced_call_is_read_as_json_whatever_the_family() -> None:
    forced = ToolUse(NAMES, forced=True, parallel=False, family="mistral")
    assert forced.calls('{"name": "get_weather", "arguments": {"city": "Paris"}}') == (
        None,
        [PARIS],
    )


def test_a_stored_response_keeps_its_family_and_one_stored_before_it_reads_hermes() -> None:
    """A background run is finished by whichever gateway looks: its record says how its
    calls are read, so every gateway reads them alike."""
    import orjson

    from gateway.responses.events import Identity
    from gateway.responses.finisher import identity_fields, identity_of

    who = Identity("resp_1", 100, {"model": "m"}, MISTRAL)
    record = {"identity": orjson.dumps(identity_fields(who)).decode(), "created_at": "100"}
    assert identity_of("resp_1", record).tools == MISTRAL
    older = orjson.loads(record["identity"])
    del older["tools"]["family"]
    record["identity"] = orjson.dumps(older).decode()
    assert identity_of("resp_1", record).tools == ToolUse(NAMES, False, False, "hermes")


def test_a_chat_answer_is_read_by_its_models_family() -> None:
    """The chat route's answer shape carries the family its model's template names."""
    from types import SimpleNamespace

    from gateway.routes.generation import _shape

    info = SimpleNamespace(chat_template="{%- if tools %}[TOOL_CALLS]{{ tools }}")
    model = SimpleNamespace(info=info, tokenizer=None)
    req = SimpleNamespace(
        return_token_ids=False, shown_logprobs=None, n=1, candidates=1, tool_use=AUTO
    )
    prompts = SimpleNamespace(texts=None, ids=[[1]])
    assert _shape(model, req, prompts, "auto").tools == MISTRAL  # type: ignore[arg-type]
    assert _shape(model, req, prompts, "hermes").tools == AUTO  # type: ignore[arg-type]
