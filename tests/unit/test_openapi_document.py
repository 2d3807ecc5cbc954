"""The gateway's /openapi.json is a document clients and fuzzers can read whole: every
`$ref` resolves inside it (a pydantic body schema's own `$defs` do not, in OpenAPI)."""

from __future__ import annotations

import json

from common.settings import Settings
from gateway.app import create_app


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for item in node for r in _refs(item)]
    return []


def test_every_reference_in_the_openapi_document_resolves() -> None:
    spec = create_app(Settings(model="noop"), None).openapi()  # type: ignore[arg-type]
    refs = _refs(spec)
    assert any(ref.endswith("/ChatMessage") or "Chat" in ref for ref in refs), refs[:5]
    schemas = spec["components"]["schemas"]
    for ref in refs:
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.rsplit("/", 1)[1] in schemas, ref
    assert "$defs" not in json.dumps(spec["paths"])


def test_two_bodies_naming_different_models_alike_fail_the_document() -> None:
    """Every body's definitions share one namespace: a name defined twice differently would
    point one route's references at the other's model (the Responses API's `FunctionTool`
    once replaced chat's, and the fuzz drew only invalid chat bodies)."""
    import pytest

    from gateway.hot_path import _merge

    schemas = {"FunctionTool": {"type": "object", "required": ["name"]}}
    _merge(schemas, {"FunctionTool": {"type": "object", "required": ["name"]}})  # the same
    with pytest.raises(RuntimeError, match="FunctionTool"):
        _merge(schemas, {"FunctionTool": {"type": "object", "required": ["type", "name"]}})
