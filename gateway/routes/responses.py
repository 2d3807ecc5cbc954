"""`/v1/responses`: OpenAI's Responses API, its conversations and background runs in Redis.

A turn is a chat completion underneath: the conversation (the previous response's, rebuilt
from the store, then this input) is rendered with the model's chat template and queued as
one generation entry, tools and `text.format` enforced as chat enforces them. Sampling is
always seeded (a drawn seed where `temperature` > 0), so a worker that dies mid-answer is
replaced by one that says the same again, and the answer continues where it was
(`gateway/responses/fold.py`).

In the foreground the answer comes back as chat's does; with `background` the worker writes
its chunks into the response's own stream in Redis, so the run and its events outlive the
gateway that queued it: any gateway answers `GET`, streams it (`starting_after`), cancels it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from common.errors import InvalidRequest, MicrobatchError, ObjectNotFound
from common.protocol import ModelKind
from gateway.auth import owner_of
from gateway.catalog import ModelEntry
from gateway.request import Parsed, api_call, validation_error
from gateway.responses import items
from gateway.responses.events import Events, Identity
from gateway.responses.finisher import identity_fields, identity_of, replay
from gateway.responses.schema import CreateResponse
from gateway.responses.store import TERMINAL
from gateway.routes import response_stream as relay
from gateway.routes.answers import hand_back
from gateway.routes.chat import chat_prompt
from gateway.routes.generation import Prompts, finished, queued
from gateway.routes.objects import (
    after_cursor,
    answers_errors,
    caller,
    json_response,
    page,
    query_int,
)
from gateway.schemas import ChatCompletionRequest, openapi_body
from gateway.services import Services
from gateway.submit import enqueue_within
from gateway.tool_calls import read_by

ROUTE = "/v1/responses"
SCHEMA = openapi_body(CreateResponse)


async def create(request: Request) -> Response:
    return await api_call(
        request, ROUTE, CreateResponse, ModelKind.CAUSAL_LM, _create, "/v1/embeddings"
    )


@dataclass(frozen=True, slots=True)
class _Turn:
    """One turn, read: what it is, what its record holds, how it runs."""

    who: Identity
    record: dict[str, Any]
    chat: ChatCompletionRequest
    known: str | None  # the worker that answered the previous turn: it caches its prefix


async def _create(parsed: Parsed[CreateResponse]) -> Response:
    services, body = parsed.services, parsed.body
    turn = await _turn(parsed)
    if body.background:
        return await _background(parsed, turn)
    sub = await queued(parsed, turn.chat, chat_prompt, known=turn.known)
    events = Events(turn.who)

    async def store_end(events: Events) -> None:
        final = events.final
        if body.stored and final is not None:
            ended = {"status": final["status"], "object": final, "worker": events.fold.worker}
            await _store(services, turn.who.response_id, {**turn.record, **ended})

    if body.stream:
        return relay.live(services, events, sub, store_end)
    events.opening()
    for chunk in await finished(parsed, sub, 1):
        events.feed(chunk, int(time.time()))
    assert events.final is not None  # a final chunk ends its fold
    await store_end(events)
    return json_response(events.final)


async def _turn(parsed: Parsed[CreateResponse]) -> _Turn:
    """The turn's conversation (the previous response's, then this input), the chat
    request it runs as, and its record."""
    services, body = parsed.services, parsed.body
    owner = owner_of(parsed.call.key)
    response_id = items.new_response_id(os.urandom(16))
    earlier, known = await _history(services, owner, body.previous_response_id)
    conversation = earlier + items.input_items(body, response_id)
    if (
        body.stored
        and len(orjson.dumps(conversation)) > services.settings.max_stored_response_bytes
    ):
        raise InvalidRequest(
            "this conversation is larger than a stored response may be "
            "(max_stored_response_bytes); send store: false, or start a new one",
            param="input",
        )
    chat = _as_chat(body, conversation, parsed.name)
    echoed = items.echo(body, parsed.name)
    parser = services.settings.tool_call_parser
    tools = read_by(chat.tool_use, parsed.model.info.chat_template, parser)
    who = Identity(response_id, int(time.time()), echoed, tools, bool(body.background))
    record = {
        "owner": owner,
        "created_at": str(who.created_at),
        "identity": identity_fields(who),
        "items": conversation,
        "model": parsed.name,
        "background": "1" if body.background else "0",
    }
    return _Turn(who, record, chat, known)


async def _background(parsed: Parsed[CreateResponse], turn: _Turn) -> Response:
    """Queue the run with its chunks bound for the response's own stream; the record first,
    so a gateway asked about it finds it however fast the worker is."""
    services, who = parsed.services, turn.who
    limit = services.settings.reply_maxlen

    async def bounded(services: Services, model: ModelEntry, req: Any) -> Prompts:
        """A run keeps every chunk until it ends: its output is at most `reply_maxlen`
        tokens (the default, up to the context, cut to it; more, asked for, refused)."""
        prompts = await chat_prompt(services, model, req)
        if prompts.new_tokens[0] > limit and parsed.body.max_output_tokens is None:
            return dataclasses.replace(prompts, new_tokens=[limit])
        if prompts.new_tokens[0] > limit:
            raise InvalidRequest(
                f"a background response keeps every chunk until it ends: at most {limit} "
                f"output tokens (reply_maxlen), and max_output_tokens is {prompts.new_tokens[0]}",
                param="max_output_tokens",
            )
        return prompts

    stream = services.responses.events_stream(who.response_id)
    sub = await queued(parsed, turn.chat, bounded, reply_to=stream, known=turn.known)
    entries = sub.entries
    running = {"status": "queued", "entry": sub.ids[0], "deadline_ms": entries.deadline_ms}
    if sub.reserved is not None:  # released by whichever gateway finishes the run
        running["reserved"] = orjson.dumps(sub.reserved.fields()).decode()
    if sub.charge is not None:  # settled by it too
        charged = {"charge": sub.charge.fields(), "prompt_tokens": sum(sub.prompt_tokens)}
        running["charged"] = orjson.dumps(charged).decode()
    await _store(services, who.response_id, {**turn.record, **running})
    try:
        await enqueue_within(services, entries.items, entries.deadline_ms, entries.timeout_ms)
    except MicrobatchError:
        services.canceller.cancel(entries.model, sub.ids, entries.deadline_ms)
        await services.responses.delete(who.response_id)
        hand_back(services, sub, sum(sub.prompt_tokens))  # never queued: nobody else will
        raise
    finally:
        services.routes_answered(entries.model, sub.owners)
    if parsed.body.stream:
        return relay.stored(services.responses, Events(who), -1, services.finisher.finished)
    return json_response(who.object("queued"))


async def _store(services: Services, response_id: str, record: dict[str, Any]) -> None:
    await services.responses.put(response_id, record, services.settings.response_ttl_s)


async def _history(
    services: Services, owner: str, previous: str | None
) -> tuple[list[dict], str | None]:
    """The conversation so far (the previous response's items and what it answered), and
    the worker that answered it."""
    if previous is None:
        return [], None
    record = await _owned(services, owner, previous, "previous_response_id")
    if record.get("status") not in ("completed", "incomplete"):
        raise InvalidRequest(
            f"response {previous!r} is {record.get('status')}: only a finished response "
            "can be continued",
            param="previous_response_id",
        )
    answer = orjson.loads(record["object"])["output"]
    return [*orjson.loads(record["items"]), *answer], record.get("worker") or None


def _as_chat(body: CreateResponse, conversation: list[dict], model: str) -> ChatCompletionRequest:
    """The turn as the chat request it runs as: same template, tools, format and limits."""
    seeded = body.temperature is None or body.temperature > 0
    chat: dict[str, Any] = {
        "model": model,
        "messages": items.as_messages(body.instructions, conversation),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "seed": int.from_bytes(os.urandom(7)) if seeded else None,
        "stream": bool(body.stream or body.background),
        "user": body.prompt_cache_key or body.user,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
    }
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        named = not isinstance(choice, str)
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}} if named else choice
        )  # type: ignore[union-attr]
    text_format = body.text.format if body.text else None
    if text_format is not None and text_format.type != "text":
        schema = text_format.as_json_schema()
        chat["response_format"] = {"type": text_format.type} | (
            {"json_schema": schema.model_dump(by_alias=True, exclude_none=True)} if schema else {}
        )
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def _owned(services: Services, owner: str, response_id: str, param: str) -> dict[str, str]:
    record = await services.responses.get(response_id)
    if record is None or record["owner"] != owner:
        raise ObjectNotFound(f"no response {response_id!r}", param=param)
    return record


async def _current(services: Services, response_id: str, record: dict[str, str]) -> dict:
    """The response as it stands: its stored end, or a background run read up to now."""
    if record.get("status") in TERMINAL:
        return orjson.loads(record["object"])
    who = identity_of(response_id, record)
    events = await replay(services.responses, who)
    if events.final is not None:
        await services.finisher.finished(events)
        return events.final
    return who.object("in_progress" if events.fold.attempts else "queued")


async def _requested(request: Request) -> tuple[Services, str, dict[str, str]]:
    """The response a `/v1/responses/{id}` route names, if the caller's key owns it."""
    services, owner = caller(request)
    response_id = request.path_params["response_id"]
    return services, response_id, await _owned(services, owner, response_id, "response_id")


@answers_errors
async def retrieve(request: Request) -> Response:
    services, response_id, record = await _requested(request)
    query = request.query_params
    if query.get("stream") not in (None, "false"):
        if record.get("background") != "1":
            raise InvalidRequest("only a background response can be streamed again", param="stream")
        who = identity_of(response_id, record)
        after = _starting_after(query.get("starting_after"))
        return relay.stored(services.responses, Events(who), after, services.finisher.finished)
    return json_response(await _current(services, response_id, record))


def _starting_after(raw: str | None) -> int:
    """The sequence number a resumed stream starts after; -1: from its first event."""
    if raw is None:
        return -1
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise InvalidRequest("starting_after must be a sequence number", param="starting_after")
    return int(raw)


@answers_errors
async def delete(request: Request) -> Response:
    services, response_id, record = await _requested(request)
    if record.get("status") not in TERMINAL and record.get("entry"):
        services.canceller.cancel(record["model"], [record["entry"]], int(record["deadline_ms"]))
    await services.responses.delete(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


@answers_errors
async def cancel(request: Request) -> Response:
    services, response_id, record = await _requested(request)
    if record.get("background") != "1":
        raise InvalidRequest("only a background response can be cancelled", param="response_id")
    if record.get("status") in TERMINAL:
        return json_response(orjson.loads(record["object"]))
    services.canceller.cancel(record["model"], [record["entry"]], int(record["deadline_ms"]))
    who = identity_of(response_id, record)
    events = await replay(services.responses, who)
    said = events.fold.said
    output = items.output_items(response_id, said, [], "incomplete") if said else []
    await services.responses.finish(
        response_id,
        "cancelled",
        who.object("cancelled", output=output),
        services.settings.response_ttl_s,
        services.settings.response_events_ttl_s,
    )
    _, _, record = await _requested(request)  # its end, whoever wrote it first
    return json_response(orjson.loads(record["object"]))


@answers_errors
async def input_items(request: Request) -> Response:
    _, _, record = await _requested(request)
    query = request.query_params
    limit = query_int(query.get("limit"), 20, 100, "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc", param="order")
    listed = orjson.loads(record["items"])
    if order == "desc":
        listed.reverse()
    by_id = {item["id"]: item for item in listed}
    shown, more = after_cursor(list(by_id), query.get("after"), limit)
    return page([by_id[i] for i in shown], more)


def install(app: FastAPI) -> None:
    one = ROUTE + "/{response_id}"
    app.add_api_route(one, retrieve, methods=["GET"], summary="A stored response")
    app.add_api_route(one, delete, methods=["DELETE"], summary="Delete a stored response")
    app.add_api_route(
        one + "/cancel", cancel, methods=["POST"], summary="Cancel a background response"
    )
    app.add_api_route(
        one + "/input_items", input_items, methods=["GET"], summary="A response's input items"
    )
