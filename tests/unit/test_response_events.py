"""A response's stream, event by event, as OpenAI's Responses API writes it: the opening, text
as deltas, the message closed, a held answer given item by item, the ending each status
names, and every event numbered in order."""

from __future__ import annotations

from typing import Any

import pytest

from common.protocol import ErrorReply, GenerationChunk, pack_tokens
from gateway.responses import items
from gateway.responses.events import Events, Identity
from gateway.responses.schema import CreateResponse
from gateway.tool_calls import ToolUse

RID = "resp_abc"
ECHO = items.echo(CreateResponse(input="hi"), "m")
FREE_TEXT_TOOLS = ToolUse(frozenset({"time"}), forced=False, parallel=True)
AT = {"item_id": "msg_abc", "output_index": 0, "content_index": 0}  # the streamed text's place
DEADLINE = {"code": "server_error", "message": "the deadline passed"}


def chunk(text: str, index: int, finish: str = "") -> GenerationChunk:
    return GenerationChunk(
        id="e.0",
        attempt="a",
        index=index,
        text=text,
        tokens=pack_tokens([1]),
        finish_reason=finish,
        prompt_tokens=5,
        completion_tokens=index + 1,
        cached_tokens=3,
        queue_ms=0.0,
        worker="w",
    )


def _events(tools: ToolUse | None = None, background: bool = False) -> Events:
    return Events(Identity(RID, 100, ECHO, tools, background))


def _response(status: str, **answer: Any) -> dict[str, Any]:
    return items.response_object(RID, 100, ECHO, status, **answer)


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": "msg_abc",
        "role": "assistant",
        "status": status,
        "content": [_part(text)],
    }


def _numbered(first: int, *events: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**event, "sequence_number": first + n} for n, event in enumerate(events)]


OPENED = {**_message(""), "status": "in_progress", "content": []}


# ---- a text answer, streamed ----------------------------------------------------------------


def test_a_text_answer_streams_as_openais_events_in_order() -> None:
    events = _events()
    out = events.opening()
    out += events.feed(chunk("Hello ", 0), 150)
    out += events.feed(chunk("world", 1, finish="stop"), 200)
    said = _message("Hello world")
    done = _response("completed", output=[said], usage=items.usage(5, 2, 3), completed_at=200)
    assert out == _numbered(
        0,
        {"type": "response.created", "response": _response("in_progress")},
        {"type": "response.in_progress", "response": _response("in_progress")},
        {"type": "response.output_item.added", "output_index": 0, "item": OPENED},
        {"type": "response.content_part.added", **AT, "part": _part("")},
        {"type": "response.output_text.delta", **AT, "delta": "Hello ", "logprobs": []},
        {"type": "response.output_text.delta", **AT, "delta": "world", "logprobs": []},
        {"type": "response.output_text.done", **AT, "text": "Hello world", "logprobs": []},
        {"type": "response.content_part.done", **AT, "part": _part("Hello world")},
        {"type": "response.output_item.done", "output_index": 0, "item": said},
        {"type": "response.completed", "response": done},
    )
    assert events.final == done
    assert events.feed(chunk("more", 2), 300) == []  # nothing after the end


def test_a_background_response_is_created_queued_then_in_progress() -> None:
    opening = _events(background=True).opening()
    assert opening[:2] == _numbered(
        0,
        {"type": "response.created", "response": _response("queued")},
        {"type": "response.in_progress", "response": _response("in_progress")},
    )


def test_a_failure_from_outside_closes_the_text_said_so_far_as_incomplete() -> None:
    events = _events()
    events.opening()
    events.feed(chunk("so", 0), 150)
    partial = _message("so", "incomplete")
    assert events.failed("the deadline passed") == _numbered(
        5,
        {"type": "response.output_text.done", **AT, "text": "so", "logprobs": []},
        {"type": "response.content_part.done", **AT, "part": _part("so")},
        {"type": "response.output_item.done", "output_index": 0, "item": partial},
        {
            "type": "response.failed",
            "response": _response("failed", output=[partial], error=DEADLINE),
        },
    )


def _empty_closed(error: dict) -> list[dict]:
    """The message opened at the start, closed empty, then the failure: every item a stream
    adds is done, so a client never holds an item that never ends."""
    empty = _message("", "incomplete")
    return _numbered(
        4,
        {"type": "response.output_text.done", **AT, "text": "", "logprobs": []},
        {"type": "response.content_part.done", **AT, "part": _part("")},
        {"type": "response.output_item.done", "output_index": 0, "item": empty},
        {"type": "response.failed", "response": _response("failed", output=[empty], error=error)},
    )


def test_a_failure_before_any_text_closes_the_opened_message_empty() -> None:
    events = _events()
    events.opening()
    assert events.failed("the deadline passed") == _empty_closed(DEADLINE)


def test_a_workers_error_reply_fails_the_response_with_its_message() -> None:
    events = _events()
    events.opening()
    reply = ErrorReply(id="e.0", status=500, type="t", code="c", message="boom", worker="w")
    assert events.feed(reply, 150) == _empty_closed({"code": "server_error", "message": "boom"})


# ---- an answer read for calls, held and given item by item ---------------------------------


def test_a_held_answer_gives_its_text_then_each_call_as_whole_items() -> None:
    events = _events(FREE_TEXT_TOOLS)
    events.opening()
    text = 'Let me check. <tool_call>{"name": "time", "arguments": {"zone": 3}}</tool_call>'
    assert events.feed(chunk(text[:20], 0), 150) == []  # held: a call is known only at the end
    out = events.feed(chunk(text[20:], 1, finish="stop"), 200)
    said = _message("Let me check.")
    call = {
        "type": "function_call",
        "id": "fc_abc_0",
        "call_id": "call_abc_0",
        "name": "time",
        "arguments": '{"zone": 3}',
        "status": "completed",
    }
    at_call = {"item_id": "fc_abc_0", "output_index": 1}
    done = _response("completed", output=[said, call], usage=items.usage(5, 2, 3), completed_at=200)
    assert out == _numbered(
        2,
        {"type": "response.output_item.added", "output_index": 0, "item": OPENED},
        {"type": "response.content_part.added", **AT, "part": _part("")},
        {"type": "response.output_text.delta", **AT, "delta": "Let me check.", "logprobs": []},
        {"type": "response.output_text.done", **AT, "text": "Let me check.", "logprobs": []},
        {"type": "response.content_part.done", **AT, "part": _part("Let me check.")},
        {"type": "response.output_item.done", "output_index": 0, "item": said},
        {
            "type": "response.output_item.added",
            "output_index": 1,
            "item": {**call, "arguments": "", "status": "in_progress"},
        },
        {"type": "response.function_call_arguments.delta", **at_call, "delta": '{"zone": 3}'},
        {
            "type": "response.function_call_arguments.done",
            **at_call,
            "name": "time",
            "arguments": '{"zone": 3}',
        },
        {"type": "response.output_item.done", "output_index": 1, "item": call},
        {"type": "response.completed", "response": done},
    )


def test_an_answer_cut_by_max_output_tokens_is_not_read_for_free_text_calls() -> None:
    """Cut short, free text may hold half a call: it is given as the text it is."""
    events = _events(FREE_TEXT_TOOLS)
    events.opening()
    text = '<tool_call>{"name": "time", "arguments": {}}</tool_call> and'
    out = events.feed(chunk(text, 0, finish="length"), 200)
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["output"] == [_message(text, "incomplete")]


# ---- an end read from the record -------------------------------------------------------------


@pytest.mark.parametrize("status", ["completed", "incomplete", "failed"])
def test_an_end_from_the_record_is_the_next_event_and_the_streams_end(status: str) -> None:
    events = _events()
    events.opening()
    final = _response(status)
    assert events.end_with(final) == _numbered(4, {"type": f"response.{status}", "response": final})
    assert events.final is final
    assert events.failed("late") == []  # ended once


@pytest.mark.parametrize("status", ["failed", "cancelled"])
def test_an_end_from_the_record_closes_the_message_the_stream_opened(status: str) -> None:
    """A resumed stream ended by the record (its deadline, a cancel): the text said so far
    is done before the last event; a cancel has no last event of its own."""
    events = _events()
    events.opening()
    events.feed(chunk("so", 0), 150)
    partial = _message("so", "incomplete")
    final = _response(status, output=[partial])
    closed = [
        {"type": "response.output_text.done", **AT, "text": "so", "logprobs": []},
        {"type": "response.content_part.done", **AT, "part": _part("so")},
        {"type": "response.output_item.done", "output_index": 0, "item": partial},
    ]
    last = [] if status == "cancelled" else [{"type": "response.failed", "response": final}]
    assert events.end_with(final) == _numbered(5, *closed, *last)


def test_a_held_answer_failing_before_any_text_ends_with_no_output() -> None:
    """A held answer adds no item until it ends: failed with nothing said, it has none to
    close, and its response lists no output."""
    events = _events(FREE_TEXT_TOOLS)
    events.opening()
    failed = _response("failed", output=[], error=DEADLINE)
    assert events.failed("the deadline passed") == _numbered(
        2, {"type": "response.failed", "response": failed}
    )
