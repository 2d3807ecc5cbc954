"""Structured output: a `response_format` as the grammar llguidance enforces token by token.

llguidance (MIT, no dependencies) was chosen after measuring it against xgrammar and
outlines-core on this CPU (docs/api.md): it builds from the tokenizer.json text alone,
compiles a schema in about a millisecond, and its matchers never raise mid-generation. The
gateway checks a schema here (a 400 before anything is queued); the worker compiles it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from llguidance import LLMatcher

JSON_OBJECT = "json_object"
JSON_SCHEMA = "json_schema"
# JSON as models write it (newlines and indentation between tokens), each run bounded so
# that a model cannot stall in whitespace forever. A default: a schema's own `x-guidance`
# options (llguidance's extension; tool calls ask for compact JSON) take precedence.
WHITESPACE = r"[\n\t ]{0,16}"


class StructureError(ValueError):
    """A schema llguidance cannot enforce; the message says why."""


def enforced_schema(kind: str, schema_text: str) -> dict[str, Any]:
    """The JSON schema a response format enforces, with its whitespace rule in its own
    `x-guidance` options, so any llguidance (ours, or vLLM's `guidance` backend) builds the
    same grammar from it."""
    schema: Any = {"type": "object"} if kind == JSON_OBJECT else json.loads(schema_text)
    if not isinstance(schema, dict):
        raise StructureError("the schema must be a JSON object")
    # llguidance lets a whitespace pattern win over `whitespace_flexible`: none beside a
    # schema's own options
    if "x-guidance" in schema:
        return schema
    return schema | {"x-guidance": {"whitespace_pattern": WHITESPACE}}


def grammar(kind: str, schema_text: str) -> str:
    """The llguidance grammar of a response format: any JSON object, or one schema."""
    text = LLMatcher.grammar_from_json_schema(enforced_schema(kind, schema_text))
    error = LLMatcher.validate_grammar(text)
    if error:
        raise StructureError(error)
    return text


@functools.lru_cache(maxsize=512)
def grammar_problem(kind: str, schema_text: str) -> str | None:
    """Why a response format cannot be enforced, or None. Remembered: a client sends the
    same schema with request after request, and compiling one takes up to tens of ms."""
    try:
        grammar(kind, schema_text)
    except StructureError as exc:
        return str(exc)
    return None
