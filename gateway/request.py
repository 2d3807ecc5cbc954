"""One API call, read once at the edge: the only place a Starlette `Request` is opened.

`api_call` wraps every API route. It reads every header first (request id, API key and rate
limit, timeout, priority, session), so a malformed header costs no tokenizing; then the
body, validated against the route's schema, and the model it names. What comes out is plain
data: a frozen `Call` (the headers' facts and a `disconnected` awaitable) inside a
`Parsed[T]` (the body, the model), and nothing below the route modules takes a `Request`.
A `MicrobatchError` raised anywhere becomes its JSON answer, and every call is counted and
timed.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.types import Receive

from common import metrics, tracing
from common.errors import (
    InvalidBody,
    InvalidRequest,
    MicrobatchError,
    ModelNotFound,
    PermissionDenied,
    RateLimited,
    ServiceUnavailable,
)
from common.protocol import (
    PRIORITY_BACKGROUND,
    PRIORITY_BATCH,
    PRIORITY_INTERACTIVE,
    ModelKind,
)
from common.tenants import Tenant
from gateway.auth import check_interactive
from gateway.catalog import ModelEntry
from gateway.local_call import LOCAL
from gateway.server_span import describe, trace_exemplar, traced
from gateway.services import Services

log = logging.getLogger("microbatch.gateway")
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
T = TypeVar("T", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Call:
    """One API call's facts, every header checked: what the queue path needs of the client."""

    route: str
    request_id: str
    key: str | None  # the API key that was accepted; None when keys are off
    timeout_ms: int
    priority: int
    session: str | None  # X-Microbatch-Session: pins a conversation to a worker
    disconnected: Callable[[], Awaitable[None]]  # returns once the client has gone
    trace: tracing.TraceContext = tracing.UNTRACED  # what its entries carry
    tenant: str | None = None  # the tenant whose key it is (a tenants file), if any
    terms: Tenant | None = None  # that tenant's entry in the file, as the call was read
    # what the answer carries beyond the route's own headers (its tenant's quota standing),
    # encoded as a response holds them
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Parsed(Generic[T]):
    """A call with its body validated and the model it names found."""

    call: Call
    services: Services
    body: T
    name: str
    model: ModelEntry

    @property
    def entry_trace(self) -> tracing.TraceContext:
        """What its queue entries carry: the call's trace context, where every live worker
        of the model reads it (in a rolling update, old workers do not: `ModelEntry`)."""
        return self.call.trace if self.model.traced_entries else tracing.UNTRACED


@dataclass(slots=True)
class _Tally:
    """What a call's metrics line and its error answer need, known as the call is read."""

    route: str
    request_id: str | None = None
    label: str = "unknown"  # the model, once known
    tenant: str | None = None  # the caller's tenant, once its key is read


def error_response(exc: MicrobatchError, request_id: str | None) -> Response:
    headers = {"X-Request-ID": request_id} if request_id else {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    headers.update(exc.headers)
    return Response(orjson.dumps(exc.body()), exc.status, headers, media_type="application/json")


async def api_call(
    request: Request,
    route: str,
    schema: type[T],
    kind: ModelKind | None,
    handle: Callable[[Parsed[T]], Awaitable[Response]],
    elsewhere: str = "",
) -> Response:
    """Read the call, then run `handle` on it; answer a MicrobatchError as its JSON error;
    count and time it. `kind` is the model kind the route serves (None: any), `elsewhere`
    the route to name when the model is of another kind."""
    services: Services = request.app.state.services
    if services.tracer is None:
        return await _call(request, services, route, schema, kind, handle, elsewhere)
    run = functools.partial(_call, request, services, route, schema, kind, handle, elsewhere)
    return await traced(services.tracer, request.headers, route, run)


async def _call(
    request: Request,
    services: Services,
    route: str,
    schema: type[T],
    kind: ModelKind | None,
    handle: Callable[[Parsed[T]], Awaitable[Response]],
    elsewhere: str,
) -> Response:
    tally = _Tally(route)
    started = time.perf_counter()
    metrics.inflight_requests.inc()
    status = 500
    try:
        call = read_call(request, services, route, tally)
        with tracing.span(services.tracer, "validate"):
            parsed = await read_body(request, call, services, schema, kind, elsewhere)
        tally.label = parsed.name
        if call.trace.traceparent:  # traced and sampled
            describe(call.request_id, parsed.name, call.priority)
        response = await handle(parsed)
        add_headers(response, call.headers)
        status = response.status_code
        return response
    except MicrobatchError as exc:
        status = exc.status
        if status >= 500:
            log.warning(
                "request failed: %s",
                exc.message,
                extra={"request_id": tally.request_id, "status": status, "code": exc.code},
            )
        return error_response(exc, tally.request_id)
    finally:
        metrics.inflight_requests.dec()
        metrics.requests_by(route, tally.label, str(status)).inc()
        if tally.tenant is not None:
            metrics.tenant_requests_total.add((tally.tenant, str(status)))
        metrics.request_durations_by(route, tally.label).observe(
            time.perf_counter() - started, trace_exemplar(services.tracer)
        )


def add_headers(response: Response, headers: Sequence[tuple[bytes, bytes]]) -> None:
    """`response.headers.update(headers)` for headers encoded as a response holds them
    (lower-case names, latin-1), in a fraction of the time: Starlette's setter scans and
    rebuilds the header list for each name, while a new name is simply appended."""
    if not headers:
        return
    raw = response.raw_headers
    present = {name for name, _ in raw}
    names = {name for name, _ in headers}
    if len(names) == len(headers) and present.isdisjoint(names):  # all new (a tenant's quota)
        raw.extend(headers)
        return
    for key, value in headers:
        if key in present:
            response.headers[key.decode("latin-1")] = value.decode("latin-1")
        else:
            raw.append((key, value))
            present.add(key)


def read_call(request: Request, services: Services, route: str, tally: _Tally) -> Call:
    """Every header, the cheapest mistakes first: request id, key and rate limit (401,
    429), then the timeout and priority (400, and 403 for a key that may not ask for
    interactive)."""
    headers = request.headers
    request_id = request_id_of(headers.get("x-request-id"))
    tally.request_id = request_id
    # a batch line (in process) was authorized when its batch was created
    local = request.scope.get(LOCAL, False)
    key, tenant_name = (None, None) if local else authorize(services, headers.get("authorization"))
    receive = request.receive
    settings = services.settings
    tally.tenant = tenant_name
    tenant = services.tenants.by_name.get(tenant_name) if tenant_name else None
    timeout_ms = timeout_ms_of(
        headers.get("x-microbatch-timeout-ms"),
        settings.request_timeout_ms,
        settings.max_request_timeout_ms,
    )
    priority = priority_of(headers.get("x-microbatch-priority"))
    if tenant is not None:
        timeout_ms = tenant_limits(tenant_name, tenant, timeout_ms, priority, headers)
    elif priority == PRIORITY_INTERACTIVE:
        check_interactive(key, settings.interactive_api_keys)
    return Call(
        route=route,
        request_id=request_id,
        key=key,
        timeout_ms=timeout_ms,
        priority=priority,
        session=headers.get("x-microbatch-session"),
        disconnected=lambda: _disconnected(receive),
        trace=tracing.carrier() if services.tracer is not None else tracing.UNTRACED,
        tenant=tenant_name,
        terms=tenant,
    )


def tenant_limits(
    name: str | None, tenant: Tenant, timeout_ms: int, priority: int, headers: Any
) -> int:
    """A tenant's call within what its file allows: its priorities (403) and its longest
    timeout (a longer one asked for is a 400; the default is cut to it)."""
    asked = PRIORITY_NAMES[priority]
    allowed = tenant.priorities or ["batch", "background"]
    if asked not in allowed:
        raise PermissionDenied(
            f"tenant {name!r} may not send X-Microbatch-Priority: {asked} (its priorities: "
            f"{', '.join(allowed)})",
            param="X-Microbatch-Priority",
        )
    longest = tenant.max_timeout_ms
    if longest is not None and timeout_ms > longest:
        if headers.get("x-microbatch-timeout-ms") is not None:
            raise InvalidRequest(
                f"X-Microbatch-Timeout-Ms is {timeout_ms}; tenant {name!r} may wait at most "
                f"{longest} ms (max_timeout_ms)",
                param="X-Microbatch-Timeout-Ms",
            )
        timeout_ms = longest
    return timeout_ms


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def read_body(
    request: Request,
    call: Call,
    services: Services,
    schema: type[T],
    kind: ModelKind | None,
    elsewhere: str,
) -> Parsed[T]:
    """The body against `schema`, then the model it names, which must be of `kind`."""
    try:
        body = schema.model_validate_json(await request.body())
    except ValidationError as exc:
        raise validation_error(exc) from None
    name = getattr(body, "model", None) or default_name(services, kind)
    tenant = call.terms
    if tenant is not None and tenant.models is not None and name not in tenant.models:
        raise PermissionDenied(
            f"tenant {call.tenant!r} may not use model {name!r} (its models: "
            f"{', '.join(tenant.models)})",
            param="model",
        )
    model = await model_entry(services, name)
    if kind is not None and model.info.kind != kind:
        raise InvalidRequest(
            f"model {name!r} is a {model.info.kind} model, not {kind}; use {elsewhere}",
            param="model",
        )
    return Parsed(call, services, body, name, model)


def validation_error(exc: ValidationError | RequestValidationError) -> InvalidBody:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid body", "type": ""}
    if first.get("type") == "json_invalid":
        return InvalidBody(f"body is not valid JSON: {first.get('msg')}")
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    return InvalidBody(f"{where}: {first.get('msg')}", param=where)


def authorize(services: Services, authorization: str | None) -> tuple[str | None, str | None]:
    """The API key (when keys are set) and the tenant that holds it (None: none does), then
    its rate limit: 401 or 429 with Retry-After."""
    key, tenant = services.authenticate(authorization)
    if services.limiter is not None and key is not None:
        wait_s = services.limiter.acquire(key, time.monotonic())
        if wait_s > 0:
            metrics.rejected_total.labels("rate_limited").inc()
            raise RateLimited("rate limit for this API key exceeded", retry_after_s=wait_s)
    return key, tenant


def request_id_of(given: str | None) -> str:
    if given is None:
        return os.urandom(12).hex()
    if not REQUEST_ID.match(given):
        raise InvalidRequest("X-Request-ID must be 1-128 characters of [A-Za-z0-9._:-]")
    return given


def timeout_ms_of(raw: str | None, default_ms: int, longest_ms: int) -> int:
    """The client's deadline, at most the operator's `max_request_timeout_ms`."""
    if raw is None:
        return default_ms
    # ASCII digits only: "²".isdigit() holds, and int("²") raises
    if not (raw.isascii() and raw.isdigit()) or not 0 < int(raw) <= longest_ms:
        raise InvalidRequest(f"X-Microbatch-Timeout-Ms must be an integer in 1..{longest_ms}")
    return int(raw)


PRIORITIES = {
    "interactive": PRIORITY_INTERACTIVE,
    "batch": PRIORITY_BATCH,
    "background": PRIORITY_BACKGROUND,
}
PRIORITY_NAMES = {value: name for name, value in PRIORITIES.items()}


def priority_of(raw: str | None) -> int:
    priority = PRIORITIES.get((raw or "batch").lower())
    if priority is None:
        raise InvalidRequest("X-Microbatch-Priority must be 'interactive', 'batch' or 'background'")
    return priority


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


def default_name(services: Services, kind: ModelKind | None) -> str:
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
