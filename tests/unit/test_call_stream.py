"""A forced call's JSON, fed in any pieces, streams as OpenAI's tool_calls deltas: each call's
id and name first, then argument fragments that join into its arguments exactly."""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from gateway.call_stream import CallStream

ONE = '{"name":"get_weather","arguments":{"city":"Pa\\"ris}","tags":["a",{"b":[1]}]}}'
MANY = (
    '[{"name":"get_time","arguments":{"zone":3}},'
    '{"name":"get_weather","arguments":{"city":"{[x]}"}}]'
)


def joined(pieces: list[str]) -> list[tuple[int, str, str]]:
    """(index, name, arguments) per call, from the deltas the pieces produce."""
    stream, calls = CallStream(), {}
    for piece in pieces:
        for delta in stream.feed(piece):
            if "id" in delta:
                assert delta["id"].startswith("call_") and delta["type"] == "function"
                calls[delta["index"]] = [delta["function"]["name"], ""]
            calls[delta["index"]][1] += delta["function"]["arguments"]
    return [(i, name, args) for i, (name, args) in sorted(calls.items())]


def cut(text: str, points: list[int]) -> list[str]:
    edges = [0, *sorted({p % (len(text) + 1) for p in points}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


@given(st.lists(st.integers(0, 10_000), max_size=12), st.sampled_from([ONE, MANY]))
def test_any_cut_of_the_text_streams_the_same_calls(points: list[int], text: str) -> None:
    calls = joined(cut(text, points))
    value = json.loads(text)
    expected = value if isinstance(value, list) else [value]
    assert [(name, json.loads(args)) for _, name, args in calls] == [
        (c["name"], c["arguments"]) for c in expected
    ]
    assert [i for i, _, _ in calls] == list(range(len(expected)))


def test_arguments_stream_as_they_grow_and_the_name_comes_first() -> None:
    stream = CallStream()
    assert stream.feed('{"name":"get_wea') == []  # the name is not whole yet
    header, fragment = stream.feed('ther","arguments":{"ci')
    assert header["function"] == {"name": "get_weather", "arguments": ""}
    # the same feed's arguments so far follow in a fragment of their own
    assert fragment == {"index": 0, "function": {"arguments": '{"ci'}}
    assert stream.feed('ty":"P') == [{"index": 0, "function": {"arguments": 'ty":"P'}}]
    assert stream.feed('aris"}}') == [{"index": 0, "function": {"arguments": 'aris"}'}}]
    assert stream.calls == 1


def test_a_text_cut_short_streams_what_it_had() -> None:
    calls = joined(['{"name":"f","arguments":{"a":"unfin'])
    assert calls == [(0, "f", '{"a":"unfin')]
