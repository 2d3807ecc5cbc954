"""Items in and out: a turn's input as stored items, items as chat messages, answers as output
items, and the `Response` object itself. Pure: no Redis, no HTTP.

Ids are derived from the response's own id and the item's place, never drawn at random: every
gateway that rebuilds a response from its chunks names its items alike, so a stream resumed
elsewhere continues the same items.
"""

from __future__ import annotations

from typing import Any

from gateway.responses.schema import CreateResponse, ResponseMessageItem
from gateway.tool_calls import Call

_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def new_response_id(entropy: bytes) -> str:
    return "resp_" + entropy.hex()


def _stem(response_id: str) -> str:
    return response_id.removeprefix("resp_")


def input_items(body: CreateResponse, response_id: str) -> list[dict[str, Any]]:
    """This turn's input as stored items (OpenAI's item resources), each with an id."""
    given = (
        [ResponseMessageItem(role="user", content=body.input)]
        if isinstance(body.input, str)
        else body.input
    )
    out = []
    for n, item in enumerate(given):
        item_id = item.id or f"{_PREFIX[item.type]}_{_stem(response_id)}_in{n}"
        if isinstance(item, ResponseMessageItem):
            out.append(_message(item, item_id))
        elif item.type == "function_call":
            out.append({**item.model_dump(exclude_none=True), "id": item_id, "status": "completed"})
        else:
            output = item.text()
            out.append(
                {
                    "type": "function_call_output",
                    "id": item_id,
                    "call_id": item.call_id,
                    "output": output,
                    "status": "completed",
                }
            )
    return out


def _message(item: ResponseMessageItem, item_id: str) -> dict[str, Any]:
    text = item.text()
    if item.role == "assistant":
        return output_message(item_id, text)
    part = {"type": "input_text", "text": text}
    return {
        "type": "message",
        "id": item_id,
        "role": item.role,
        "content": [part],
        "status": "completed",
    }


def output_message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [] if status == "in_progress" else [text_part(text)],
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call(
    item_id: str, call_id: str, call: Call, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def output_items(
    response_id: str, text: str | None, calls: list[Call], status: str
) -> list[dict[str, Any]]:
    """What the model said: a message where it wrote text (or nothing else), then a
    `function_call` item per call."""
    stem, out = _stem(response_id), []
    if text or not calls:
        out.append(output_message(f"msg_{stem}", text or "", status))
    for n, call in enumerate(calls):
        out.append(function_call(f"fc_{stem}_{n}", f"call_{stem}_{n}", call, status))
    return out


def as_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation's items as chat messages: consecutive calls join one assistant
    message (after its text, where it wrote any); each call's output is a `tool` message."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(part.get("text", "") for part in item["content"])
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append(
                {"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]}
            )
    return messages


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def echo(body: CreateResponse, model: str) -> dict[str, Any]:
    """What a `Response` repeats of its request, with OpenAI's defaults filled in."""
    choice: Any = body.tool_choice or "auto"
    if not isinstance(choice, str):
        choice = choice.model_dump()
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else None
    echoed = {
        "model": model,
        "instructions": body.instructions,
        "tools": [
            {**t.model_dump(exclude_none=True), "parameters": t.parameters, "strict": t.strict}
            for t in body.tools or []
        ],
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "metadata": body.metadata or {},
        "store": body.stored,
        "background": bool(body.background),
        "text": text or {"format": {"type": "text"}},
        "truncation": "disabled",
        "reasoning": None,
        "service_tier": "default",
    }
    return echoed if body.user is None else {**echoed, "user": body.user}


def response_object(
    response_id: str,
    created_at: int,
    request: dict[str, Any],
    status: str,
    *,
    output: list[dict[str, Any]] | None = None,
    usage: dict[str, Any] | None = None,
    error: dict[str, str] | None = None,
    completed_at: int | None = None,
) -> dict[str, Any]:
    """OpenAI's `Response`: `request` is `echo`'s; `incomplete` when max_output_tokens cut
    the answer."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": completed_at,
        "error": error,
        "incomplete_details": incomplete,
        **request,
        "output": output or [],
        **({} if usage is None else {"usage": usage}),
    }
