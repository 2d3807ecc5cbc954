"""One API call: its id, key, headers, body and model in; its error, metrics and timing out.

`api_call` wraps every API route: a `MicrobatchError` becomes its JSON answer, and every call
is counted and timed. `parse_call` reads what every route needs, in the order that answers
the cheapest mistakes first.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from common import metrics
from common.errors import (
    InvalidBody,
    InvalidRequest,
    MicrobatchError,
    ModelNotFound,
    RateLimited,
    ServiceUnavailable,
)
from common.protocol import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from gateway.auth import check_api_key
from gateway.catalog import ModelEntry
from gateway.services import Services

log = logging.getLogger("microbatch.gateway")
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
MAX_TIMEOUT_MS = 600_000


@dataclass(slots=True)
class Call:
    """One API call's bookkeeping: what its metrics line and its error answer need."""

    route: str
    request_id: str | None = None
    label: str = "unknown"  # the model, once known


def error_response(exc: MicrobatchError, request_id: str | None) -> Response:
    headers = {"X-Request-ID": request_id} if request_id else {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return Response(orjson.dumps(exc.body()), exc.status, headers, media_type="application/json")


async def api_call(
    request: Request, route: str, handle: Callable[[Call], Awaitable[Response]]
) -> Response:
    """Run `handle(call)`; answer a MicrobatchError as its JSON error; count and time it."""
    call = Call(route)
    started = time.perf_counter()
    metrics.inflight_requests.inc()
    status = 500
    try:
        response = await handle(call)
        status = response.status_code
        return response
    except MicrobatchError as exc:
        status = exc.status
        if status >= 500:
            log.warning(
                "request failed: %s",
                exc.message,
                extra={"request_id": call.request_id, "status": status, "code": exc.code},
            )
        return error_response(exc, call.request_id)
    finally:
        metrics.inflight_requests.dec()
        metrics.requests_total.labels(route, call.label, str(status)).inc()
        metrics.request_duration_seconds.labels(route, call.label).observe(
            time.perf_counter() - started
        )


def validation_error(exc: ValidationError | RequestValidationError) -> InvalidBody:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid body", "type": ""}
    if first.get("type") == "json_invalid":
        return InvalidBody(f"body is not valid JSON: {first.get('msg')}")
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    return InvalidBody(f"{where}: {first.get('msg')}", param=where)


def authorize(services: Services, request: Request) -> None:
    """The API key (when keys are set), then its rate limit: 401 or 429 with Retry-After."""
    key = check_api_key(request.headers.get("authorization"), services.settings.api_keys)
    if services.limiter is not None and key is not None:
        wait_s = services.limiter.acquire(key, time.monotonic())
        if wait_s > 0:
            metrics.rejected_total.labels("rate_limited").inc()
            raise RateLimited("rate limit for this API key exceeded", retry_after_s=wait_s)


def request_id_of(request: Request) -> str:
    given = request.headers.get("x-request-id")
    if given is None:
        return os.urandom(12).hex()
    if not REQUEST_ID.match(given):
        raise InvalidRequest("X-Request-ID must be 1-128 characters of [A-Za-z0-9._:-]")
    return given


def timeout_ms_of(request: Request, default_ms: int) -> int:
    raw = request.headers.get("x-microbatch-timeout-ms")
    if raw is None:
        return default_ms
    if not raw.isdigit() or not 0 < int(raw) <= MAX_TIMEOUT_MS:
        raise InvalidRequest(f"X-Microbatch-Timeout-Ms must be an integer in 1..{MAX_TIMEOUT_MS}")
    return int(raw)


def priority_of(request: Request) -> int:
    raw = request.headers.get("x-microbatch-priority", "batch").lower()
    if raw not in ("batch", "interactive"):
        raise InvalidRequest("X-Microbatch-Priority must be 'interactive' or 'batch'")
    return PRIORITY_INTERACTIVE if raw == "interactive" else PRIORITY_BATCH


async def model_entry(services: Services, name: str) -> ModelEntry:
    catalog = services.catalog
    entry = catalog.models.get(name)
    if entry is None:
        await catalog.refresh_soon()
        entry = catalog.models.get(name)
    if entry is None:
        if not catalog.redis_ok:
            raise ServiceUnavailable("the queue (Redis) is unreachable", retry_after_s=1.0)
        raise ModelNotFound(f"model {name!r} is not served here", param="model")
    return entry


def default_name(services: Services, kind: str | None) -> str:
    """The model a call that names none means: the gateway's default model, unless it is of
    another kind and exactly one served model is of this one (TEI's routes name no model)."""
    default = services.settings.served_name
    models = services.catalog.models
    if kind is None or (default in models and models[default].info.kind == kind):
        return default
    of_kind = sorted({e.info.name for e in models.values() if e.info.kind == kind})
    if len(of_kind) > 1:
        raise InvalidRequest(
            f"no model named, and {len(of_kind)} {kind} models are served here "
            f"({', '.join(of_kind)}): name one with `model`",
            param="model",
        )
    return of_kind[0] if of_kind else default


@dataclass(frozen=True, slots=True)
class Parsed:
    """What `parse_call` read: the services, the validated body and the model it names."""

    services: Services
    body: Any
    name: str
    model: ModelEntry


async def parse_call(
    request: Request, call: Call, schema: type[BaseModel], kind: str | None, elsewhere: str = ""
) -> Parsed:
    """Request id, API key and rate limit, body, then the model, which must be of `kind`
    (None: any kind)."""
    services: Services = request.app.state.services
    call.request_id = request_id_of(request)
    authorize(services, request)
    try:
        body = schema.model_validate_json(await request.body())
    except ValidationError as exc:
        raise validation_error(exc) from None
    name = body.model or default_name(services, kind)  # type: ignore[attr-defined]
    model = await model_entry(services, name)
    call.label = name
    if kind is not None and model.info.kind != kind:
        raise InvalidRequest(
            f"model {name!r} is a {model.info.kind} model, not {kind}; use {elsewhere}",
            param="model",
        )
    return Parsed(services, body, name, model)


def check_count(services: Services, count: int, field: str) -> None:
    """A list of inputs is neither empty nor over `max_inputs_per_request`: else a 400."""
    if not count:
        raise InvalidRequest(f"{field} must not be an empty list", param=field)
    limit = services.settings.max_inputs_per_request
    if count > limit:
        raise InvalidRequest(f"{field} has {count} items; the limit is {limit}", param=field)


async def token_lists(
    services: Services,
    model: ModelEntry,
    data: str | list,
    *,
    field: str = "input",
    truncate: bool = False,
    check: bool = True,
    direction: str = "right",
) -> list[np.ndarray]:
    """Token ids per item of an `input` or `prompt`: a string, strings, a token list or token
    lists. `check` refuses an item over the model's limit (a prompt is checked by its caller,
    together with the tokens it asks for)."""
    if isinstance(data, str):
        data = [data]
    check_count(services, len(data), field)
    if isinstance(data[0], str):
        return await services.tokenize.encode(model.tokenizer, data, truncate, check, direction)
    lists = [data] if isinstance(data[0], int) else data
    return model.tokenizer.check_token_lists(lists, truncate, check, direction)
