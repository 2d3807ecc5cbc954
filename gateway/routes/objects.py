"""What the stored-object routes (files, batches) share: the caller's identity, JSON answers
with errors in OpenAI's shape, and OpenAI's cursor pagination."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from common.errors import InvalidRequest, MicrobatchError
from gateway.auth import owner_of
from gateway.request import authorize, error_response
from gateway.services import Services

Handler = Callable[[Request], Awaitable[Response]]


def json_response(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


def answers_errors(handler: Handler) -> Handler:
    """A route whose MicrobatchError, raised anywhere in it, is its JSON error answer."""

    @functools.wraps(handler)
    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except MicrobatchError as exc:
            return error_response(exc, None)

    return route


def caller(request: Request) -> tuple[Services, str]:
    """The services and the owner a call acts for (401, 429 as on every API route)."""
    services: Services = request.app.state.services
    key, _ = authorize(services, request.headers.get("authorization"))
    return services, owner_of(key)


def query_int(raw: str | None, default: int, most: int, name: str) -> int:
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= most:
        raise InvalidRequest(f"{name} must be an integer in 1..{most}", param=name)
    return int(raw)


def after_cursor(ids: list[str], after: str | None, limit: int) -> tuple[list[str], bool]:
    """OpenAI's cursor pagination: the `limit` ids past `after` (from the start without
    one; an unknown cursor is a 400), and whether more follow."""
    start = 0
    if after is not None:
        if after not in ids:
            raise InvalidRequest(f"after: no object {after!r} in this list", param="after")
        start = ids.index(after) + 1
    return ids[start : start + limit], start + limit < len(ids)


def page(data: list[dict[str, Any]], more: bool) -> Response:
    """One page of a list, as OpenAI lists objects."""
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    body = {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}
    return json_response(body)
