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
