"""A response format becomes a grammar once: checked, compiled, remembered."""

from __future__ import annotations


def test_a_response_format_is_compiled_once_however_often_it_is_sent() -> None:
    """Compiling a schema takes up to tens of ms: a gateway remembers each one it checked
    (issue 34: it compiled every request's on the event loop)."""
    from common.response_format import grammar_problem

    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}}'
    grammar_problem.cache_clear()
    assert grammar_problem("json_schema", schema) is None
    assert grammar_problem("json_schema", schema) is None
    assert grammar_problem.cache_info().hits == 1 and grammar_problem.cache_info().misses == 1
    assert grammar_problem("json_schema", '{"type": "nonsense"}') is not None


def test_a_schemas_own_llguidance_options_replace_the_whitespace_default() -> None:
    """Forced tool calls ask for compact JSON through `x-guidance`; llguidance would let the
    default whitespace pattern win over `whitespace_flexible: false`, so none is added."""
    import json

    from common.response_format import WHITESPACE, grammar

    plain = json.loads(grammar("json_schema", '{"type": "object"}'))
    assert plain["grammars"][0]["json_schema"]["x-guidance"]["whitespace_pattern"] == WHITESPACE
    compact = {"type": "object", "x-guidance": {"whitespace_flexible": False}}
    own = json.loads(grammar("json_schema", json.dumps(compact)))
    assert own["grammars"][0]["json_schema"]["x-guidance"] == {"whitespace_flexible": False}
