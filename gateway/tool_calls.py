"""Tool calling's pure parts: the JSON schema a forced call is generated under, the default
tool prompt, and the parsers that turn a model's text into OpenAI's `tool_calls`.

Why a forced call (`tool_choice` `required` or a named function) is generated as JSON under a
schema rather than in the model's own call syntax: the grammar engine the worker already runs
for `response_format` then guarantees that the name is one of the tools and the arguments
validate against its parameters, whatever the model, and no model-specific parser is needed
(vLLM forces calls the same way). `auto` lets the model write, and its text is read by the
parser of the model's output family, as vLLM's tool parsers do: Hermes/Qwen
(`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, also what the default prompt asks
for), Llama 3's JSON (`<|python_tag|>{"name": ..., "parameters": ...}`, several joined by `;`)
or Mistral's (`[TOOL_CALLS][{"name": ..., "arguments": ...}]`, or `[TOOL_CALLS]name[ARGS]{...}`
from v11 tokenizers). The family is read from the model's chat template (`family_of`); the
`tool_call_parser` setting overrides it. Markers that are special tokens never reach the text
(the worker skips special tokens), so each parser also reads the calls without them. Text that
does not parse as calls to known tools is returned as text, never as a broken call.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# llguidance's options for a forced call: compact JSON, so a model cannot spend its tokens
# on whitespace between the fields (the arguments are re-serialized anyway)
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True, slots=True)
class Call:
    """One function call: its name and its arguments as a JSON object's text."""

    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """As OpenAI's `tool_calls` item (with `index` in a stream's delta)."""
        item: dict[str, Any] = {
            "id": call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return item if index is None else {"index": index, **item}


FAMILIES = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How one request's answers are read for calls: forced JSON, or free text parsed."""

    names: frozenset[str]
    forced: bool  # `required` or a named function: the text is the schema's JSON
    parallel: bool  # a forced answer is a list of calls (`parallel_tool_calls`)
    family: str = "hermes"  # the parser of free text (`auto`): one of FAMILIES

    def calls(self, text: str) -> tuple[str | None, list[Call]] | None:
        """(content left, calls) when `text` holds calls to known tools; None otherwise."""
        if self.forced:
            calls = _forced(text, self.parallel)
            return None if calls is None or not self._known(calls) else (None, calls)
        found = _PARSERS[self.family](text, self.names)
        return None if found is None or not self._known(found[1]) else found

    def _known(self, calls: list[Call]) -> bool:
        return bool(calls) and all(c.name in self.names for c in calls)


def read_by(tools: ToolUse | None, template: str | None, setting: str) -> ToolUse | None:
    """A request's tool use, its free text read by the model's family (`family_of`)."""
    return None if tools is None else replace(tools, family=family_of(template, setting))


def family_of(template: str | None, setting: str = "auto") -> str:
    """The output family of a model's calls: the setting where it names one; else read from
    the chat template (a template that does not take tools gets the default prompt, which
    asks for Hermes)."""
    if setting != "auto":
        return setting
    if not template or "tools" not in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" not in template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3_json"
    return "hermes"


def call_id() -> str:
    """A call's id, shaped as OpenAI's (`call_` and 24 characters)."""
    return "call_" + secrets.token_urlsafe(18)


def forced_schema(tools: list[dict[str, Any]], named: str | None, parallel: bool) -> dict[str, Any]:
    """The schema a forced answer follows: one call of `named`, or of any tool; a list of one
    or more calls where `parallel` (and no name is forced)."""
    chosen = [t for t in tools if named is None or t["name"] == named]
    one = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                "arguments": closed(t.get("parameters") or ANY_OBJECT),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    call = one[0] if len(one) == 1 else {"anyOf": one}
    if parallel and named is None:
        return {"type": "array", "items": call, "minItems": 1, "x-guidance": COMPACT}
    return {**call, "x-guidance": COMPACT}


def closed(schema: Any) -> Any:
    """`schema` with every object that does not say otherwise closed to the properties it
    names (`additionalProperties: false`), as xgrammar's strict mode reads schemas in vLLM: a
    weak model given room invents fields until its token budget ends."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed_member(key, value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _closed_member(key: str, value: Any) -> Any:
    if key in ("properties", "$defs", "definitions", "patternProperties"):
        return (
            {name: closed(sub) for name, sub in value.items()} if isinstance(value, dict) else value
        )
    if key in ("items", "anyOf", "oneOf", "allOf", "not", "prefixItems"):
        return closed(value)
    return value


def default_prompt(tools: list[dict[str, Any]]) -> str:
    """The system text that offers `tools` to a model whose template does not take them:
    the Hermes format, which `ToolUse` parses."""
    listed = "\n".join(json.dumps({"type": "function", "function": t}) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions "
        f"are described in JSON Schema within <tools></tools> tags:\n<tools>\n{listed}\n"
        "</tools>\nFor each function call, return a JSON object with the function name and "
        "its arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def as_text(name: str, arguments: str) -> str:
    """A past call written back into a history as the default prompt asks for it."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def _forced(text: str, parallel: bool) -> list[Call] | None:
    try:
        value = json.loads(text)
    except ValueError:  # cut short by max_tokens: a list keeps the calls that closed
        value = _closed_items(text) if parallel else None
        if not value:
            return None
    items = value if parallel and isinstance(value, list) else [value]
    calls = [_call(item) for item in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _closed_items(text: str) -> list[Any]:
    """The whole items at the head of a JSON list cut short (a weak model under the grammar
    may go on listing calls until `max_tokens`)."""
    decoder, items = json.JSONDecoder(), []
    at = text.find("[") + 1
    while 0 < at < len(text):
        while at < len(text) and text[at] in ", \n\t":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        items.append(item)
    return items


def _hermes(text: str, names: frozenset[str]) -> tuple[str | None, list[Call]] | None:
    blocks = TOOL_CALL.findall(text)
    if not blocks:
        return None
    calls = []
    for block in blocks:
        try:
            call = _call(json.loads(block))
        except ValueError:
            return None
        if call is None or call.name not in names:
            return None
        calls.append(call)
    content = TOOL_CALL.sub("", text).strip()
    return (content or None), calls


def _llama3_json(text: str, names: frozenset[str]) -> tuple[str | None, list[Call]] | None:
    """Llama 3's calls: the whole answer is one or more JSON objects (`;` between them),
    after `<|python_tag|>` where the tokenizer kept it."""
    body = text.strip().removeprefix("<|python_tag|>").lstrip()
    if not body.startswith("{"):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return None
        call = _call(value)
        if call is None:
            return None
        calls.append(call)
        while at < len(body) and body[at] in "; \n\t":
            at += 1
    return None, calls


MISTRAL_V11 = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[ARGS\])?\s*(\{)")


def _mistral(text: str, names: frozenset[str]) -> tuple[str | None, list[Call]] | None:
    """Mistral's calls, after `[TOOL_CALLS]` (its content before it): a JSON list of
    `{"name", "arguments"}`, or v11's `name[ARGS]{...}`, repeated."""
    marker = text.find("[TOOL_CALLS]")
    content, body = (text[:marker], text[marker:]) if marker >= 0 else ("", text)
    parts = [p.strip() for p in body.split("[TOOL_CALLS]") if p.strip()]
    if not parts:
        return None
    calls: list[Call] = []
    for part in parts:
        found = _mistral_list(part) if part.startswith("[") else _mistral_v11(part, names)
        if found is None:
            return None
        calls += found
    return (content.strip() or None), calls


def _mistral_list(part: str) -> list[Call] | None:
    try:
        value, _ = json.JSONDecoder().raw_decode(part)
    except ValueError:
        return None
    if not isinstance(value, list) or not value:
        return None
    calls = [_call(item) for item in value]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _mistral_v11(part: str, names: frozenset[str]) -> list[Call] | None:
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(part):
        head = MISTRAL_V11.match(part, at)
        if head is None or head.group(1) not in names:
            return None
        try:
            arguments, at = decoder.raw_decode(part, head.start(2))
        except ValueError:
            return None
        call = _call({"name": head.group(1), "arguments": arguments})
        if call is None:
            return None
        calls.append(call)
        while at < len(part) and part[at] in " \n\t":
            at += 1
    return calls


_PARSERS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}


def _call(value: Any) -> Call | None:
    """A call from `{"name": ..., "arguments": {...}}`; None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(value["name"], json.dumps(arguments, ensure_ascii=False))
