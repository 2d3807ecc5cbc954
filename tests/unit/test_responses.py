"""The Responses API's pure parts: a response's text folded across attempts (a restarted
worker's repeat is not said twice; a duplicate, a gap or a contradiction is caught), its
events numbered alike by whoever derives them, conversations as chat messages, and the body's
refusals."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from common.protocol import ErrorReply, GenerationChunk, pack_tokens
from gateway.responses import items
from gateway.responses.events import Events, Identity
from gateway.responses.fold import Fold
from gateway.responses.schema import CreateResponse
from gateway.tool_calls import ToolUse

RID = "resp_abc"
TEXT = "The quick brown fox jumps over the lazy dog."


def chunk(text: str, index: int, attempt: str = "a", finish: str = "", done: int = 0):
    return GenerationChunk(
        id="e.0",
        attempt=attempt,
        index=index,
        text=text,
        tokens=pack_tokens([1]),
        finish_reason=finish,
        prompt_tokens=5,
        completion_tokens=done or index + 1,
        cached_tokens=2,
        queue_ms=0.0,
        worker=attempt,
    )


def pieces(text: str, cuts: list[int], attempt: str) -> list[GenerationChunk]:
    points = sorted({0, *[c % (len(text) + 1) for c in cuts], len(text)})
    parts = [text[a:b] for a, b in itertools.pairwise(points)]
    last = len(parts) - 1
    return [
        chunk(p, i, attempt, "stop" if i == last else "", done=i + 1) for i, p in enumerate(parts)
    ]


@given(
    st.lists(st.integers(0, 60), max_size=8),
    st.lists(st.integers(0, 60), max_size=8),
    st.integers(0, 8),
)
def test_a_restart_says_only_what_goes_past_the_dead_attempt(first, second, sent) -> None:
    """However the two attempts cut the text, and wherever the first one died, what is said
    is the text once."""
    dead = pieces(TEXT, first, "a")[:-1][:sent]
    fold, said = Fold(), ""
    for reply in dead + pieces(TEXT, second, "b"):
        said += fold.feed(reply)
    assert said == TEXT and fold.finish_reason == "stop" and fold.error is None


def test_interleaved_attempts_and_redeliveries_are_said_once() -> None:
    a, b = pieces(TEXT, [5, 10, 20], "a"), pieces(TEXT, [7, 30], "b")
    order = [a[0], b[0], a[0], a[1], b[1], a[2], b[1], b[2]]
    fold = Fold()
    said = "".join(fold.feed(r) for r in order)
    assert said == TEXT and fold.restarts == 1


def test_the_worker_named_is_the_newest_attempts_not_a_dead_ones_late_repeat() -> None:
    """The finisher passes `fold.worker` on (the next turn is routed to it): a chunk the dead
    attempt sent late, repeating text its successor already said, must not name the dead."""
    fold = Fold()
    for reply in (chunk("a", 0, "dead"), *(chunk(t, i, "live") for i, t in enumerate("abc"))):
        fold.feed(reply)
    assert fold.feed(chunk("b", 1, "dead")) == "" and fold.worker == "live"
    assert fold.said == "abc"


def test_an_attempt_that_says_something_else_fails_the_response() -> None:
    fold = Fold()
    fold.feed(chunk("The quick", 0, "a"))
    assert fold.feed(chunk("A slow", 0, "b")) == ""
    assert fold.error == {
        "code": "server_error",
        "message": "a worker restarted this response after 9 characters and generated "
        "different text",
    }
    assert fold.feed(chunk(" more", 1, "a")) == ""  # nothing after the end


@pytest.mark.parametrize(("late", "gap"), [(2, "1..1"), (4, "1..3")])
def test_a_missing_chunk_fails_the_response_naming_the_gap(late: int, gap: str) -> None:
    fold = Fold()
    assert fold.feed(chunk("a", 0)) == "a"
    assert fold.feed(chunk("c", late)) == ""
    assert fold.error == {"code": "server_error", "message": f"chunks {gap} never arrived"}


def test_an_error_reply_ends_it_failed_and_says_nothing() -> None:
    fold = Fold()
    reply = ErrorReply(id="e.0", status=500, type="t", code="c", message="boom", worker="w")
    assert fold.feed(reply) == ""
    assert fold.done and fold.error == {"code": "server_error", "message": "boom"}


def test_what_was_generated_is_counted_before_the_end_and_a_restart_does_not_lower_it() -> None:
    """A stream cut short settles its tenant's charge by what was generated so far; the
    restarted attempt re-saying the start reports fewer tokens, which must not undo that."""
    fold = Fold()
    fold.feed(chunk("The ", 0, "a"))
    fold.feed(chunk("quick", 1, "a"))
    assert (fold.completion_tokens, fold.prompt_tokens, fold.cached_tokens) == (2, 5, 2)
    fold.feed(chunk("The ", 0, "b"))
    assert fold.completion_tokens == 2 and fold.worker == "b" and not fold.done
    fold.feed(chunk("quick brown", 1, "b", finish="stop", done=3))
    assert fold.said == "The quick brown" and fold.completion_tokens == 3


def _events(tools: ToolUse | None = None, background: bool = False) -> Events:
    body = CreateResponse(input="hi")
    return Events(Identity(RID, 100, items.echo(body, "m"), tools, background))


def _run(events: Events, replies: list) -> list[dict]:
    out = events.opening()
    for reply in replies:
        out += events.feed(reply, 200)
    return out


def test_events_are_numbered_from_zero_and_the_same_on_every_derivation() -> None:
    replies = pieces(TEXT, [3, 9, 17], "a")
    one, two = _run(_events(), replies), _run(_events(), replies)
    assert one == two
    assert [e["sequence_number"] for e in one] == list(range(len(one)))
    assert one[0]["type"] == "response.created" and one[-1]["type"] == "response.completed"
    deltas = "".join(e["delta"] for e in one if e["type"] == "response.output_text.delta")
    assert deltas == TEXT == one[-1]["response"]["output"][0]["content"][0]["text"]
    assert one[-1]["response"]["completed_at"] == 200
    assert one[-1]["response"]["usage"]["input_tokens"] == 5


def test_a_background_response_is_created_queued() -> None:
    assert _events(background=True).opening()[0]["response"]["status"] == "queued"


def test_max_output_tokens_makes_it_incomplete() -> None:
    out = _run(_events(), [chunk("cut", 0, finish="length")])
    final = out[-1]["response"]
    assert out[-1]["type"] == "response.incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}


def test_calls_are_held_and_given_as_items_when_the_answer_ends() -> None:
    tools = ToolUse(frozenset({"get_time"}), forced=True, parallel=False)
    text = '{"name":"get_time","arguments":{"zone":3}}'
    out = _run(_events(tools), pieces(text, [10, 20], "a"))
    kinds = [e["type"] for e in out]
    assert "response.output_text.delta" not in kinds
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    call = out[-1]["response"]["output"][0]
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"zone": 3}
    assert call["call_id"] == "call_abc_0"


def test_a_failure_from_outside_ends_the_stream_once() -> None:
    events = _events()
    events.opening()
    events.feed(chunk("so", 0), 1)
    ending = events.failed("the deadline passed")
    assert ending[-1]["type"] == "response.failed"
    assert ending[-1]["response"]["output"][0]["status"] == "incomplete"
    assert events.failed("again") == []


def test_a_conversation_becomes_chat_messages() -> None:
    body = CreateResponse.model_validate(
        {
            "input": [
                {"role": "user", "content": "weather?"},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sun"},
                {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            ]
        }
    )
    stored = items.input_items(body, RID)
    assert [i["id"] for i in stored] == [
        "msg_abc_in0",
        "fc_abc_in1",
        "fc_abc_in2",
        "fco_abc_in3",
        "msg_abc_in4",
    ]
    messages = items.as_messages("be brief", stored)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "content": "sun", "tool_call_id": "c1"}


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"tools": [{"type": "file_search"}]}, "only function tools"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True, "store": False}, "background needs store"),
        ({"tool_choice": {"type": "function", "name": "x"}}, "not among the tools"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "reasoning"),
        ({"text": {"format": {"type": "json_schema"}}}, "name and schema"),
    ],
)
def test_what_is_not_served_is_refused_by_name(extra: dict, why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        CreateResponse.model_validate({"input": "hi", **extra})


def test_an_end_read_from_the_record_is_announced_by_its_status() -> None:
    """A stream resumed after the run's chunks expired ends with the stored response, under
    the event its status names (not as a failure); a cancel ends it with no event."""
    events = _events()
    final = {**events.who.object("completed"), "output": []}
    assert [e["type"] for e in events.end_with(final)] == ["response.completed"]
    assert _events().end_with({**final, "status": "failed"})[0]["type"] == "response.failed"
    assert _events().end_with({**final, "status": "cancelled"}) == []
