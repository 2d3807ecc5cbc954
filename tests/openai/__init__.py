"""OpenAI's published OpenAPI schemas (vendored from openai/openai-openapi, MIT: see LICENSE
and README.md here), and `schema_errors` to check an answer against one of them."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from jsonschema import Draft202012Validator

SPEC = Path(__file__).with_name("openapi-subset.json")


@cache
def _spec() -> dict:
    return _nullable(json.loads(SPEC.read_text()))


def _nullable(node: object) -> object:
    """The spec still marks some schemas OpenAPI 3.0's way, `nullable: true`, which JSON
    Schema 2020-12 ignores: spell each as the 3.1 way, null added to its type and enum."""
    if isinstance(node, list):
        return [_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _nullable(value) for key, value in node.items()}
    if out.get("nullable") is True:
        del out["nullable"]
        if isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
        if "enum" in out and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
    return out


def schema_errors(name: str, instance: object) -> list[str]:
    """Every way `instance` breaks `#/components/schemas/<name>` (JSON Schema 2020-12)."""
    validator = Draft202012Validator({**_spec(), "$ref": f"#/components/schemas/{name}"})
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '.'}: {error.message}"
        for error in validator.iter_errors(instance)
    ]
