"""`create_app`: the HTTP gateway — validate, tokenize, admit, queue, await the reply.

No module globals: the catalog, the reply router, the enqueuer and the tokenizer pool live
on `app.state` and start and stop with the app's lifespan.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common import metrics, streams
from common.buckets import bucket_for
from common.errors import (
    InvalidRequest,
    MicrobatchError,
    ModelNotFound,
    Overloaded,
    RateLimited,
    ServiceUnavailable,
)
from common.protocol import (
    PRIORITY_BATCH,
    PRIORITY_INTERACTIVE,
    EmbeddingResult,
    ErrorReply,
    RequestEntry,
    encode,
    pack_tokens,
)
from common.settings import Settings
from common.store import Store
from common.tasks import spawn_supervised
from gateway import admission
from gateway.auth import RateLimiter, check_api_key
from gateway.catalog import Catalog, ModelEntry
from gateway.enqueue import Enqueuer
from gateway.hot_path import GatewayApp
from gateway.replies import ReplyRouter
from gateway.schemas import EmbeddingRequest
from gateway.tokenize import TokenizePool
from gateway.waiting import Canceller, ClientGone, await_replies

log = logging.getLogger("microbatch.gateway")
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
MAX_TIMEOUT_MS = 600_000
EMBEDDINGS_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": EmbeddingRequest.model_json_schema()}},
    }
}


class Gateway:
    """The request path's collaborators, built once per app."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.id = settings.process_id("gateway")
        self.keys = streams.Keys(settings.prefix)
        self.catalog = Catalog(store, settings)
        self.router = ReplyRouter(
            store,
            self.keys.reply(self.id),
            block_ms=settings.read_block_ms,
            maxlen=settings.reply_maxlen,
            ttl_s=max(60, 2 * settings.request_timeout_ms // 1000),
        )
        self.enqueuer = Enqueuer(store)
        self.canceller = Canceller(store, self.keys)
        self.tokenize = TokenizePool(settings.inline_tokenize_chars)
        self.limiter = (
            RateLimiter(settings.rate_limit_per_key, settings.rate_limit_burst)
            if settings.rate_limit_per_key > 0
            else None
        )
        self.stop = asyncio.Event()
        self.alive = True
        self._nonce = os.urandom(4).hex()
        self._counter = itertools.count()

    def next_id(self) -> str:
        return f"{self._nonce}{next(self._counter):x}"

    def on_task_death(self, exc: BaseException | None) -> None:
        if not self.stop.is_set():
            self.alive = False
            self.router.fail_all(ServiceUnavailable("gateway reply reader died", retry_after_s=1.0))


def authorize(gw: Gateway, request: Request) -> None:
    """The API key (when keys are set), then its rate limit: 401 or 429 with Retry-After."""
    key = check_api_key(request.headers.get("authorization"), gw.settings.api_keys)
    if gw.limiter is not None and key is not None:
        wait_s = gw.limiter.acquire(key, time.monotonic())
        if wait_s > 0:
            metrics.rejected_total.labels("rate_limited").inc()
            raise RateLimited("rate limit for this API key exceeded", retry_after_s=wait_s)


def error_response(exc: MicrobatchError, request_id: str | None) -> Response:
    headers = {"X-Request-ID": request_id} if request_id else {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return Response(orjson.dumps(exc.body()), exc.status, headers, media_type="application/json")


def validation_error(exc: ValidationError | RequestValidationError) -> InvalidRequest:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid body", "type": ""}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        err = InvalidRequest(f"body is not valid JSON: {first.get('msg')}")
    else:
        where = ".".join(loc) or "body"
        err = InvalidRequest(f"{where}: {first.get('msg')}", param=where)
    err.status = 422
    return err


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


async def model_entry(gw: Gateway, name: str) -> ModelEntry:
    entry = gw.catalog.models.get(name)
    if entry is None:
        await gw.catalog.refresh_soon()
        entry = gw.catalog.models.get(name)
    if entry is None:
        if not gw.catalog.redis_ok:
            raise ServiceUnavailable("the queue (Redis) is unreachable", retry_after_s=1.0)
        raise ModelNotFound(f"model {name!r} is not served here", param="model")
    return entry


async def token_lists(
    gw: Gateway,
    model: ModelEntry,
    data: str | list,
    *,
    field: str = "input",
    truncate: bool = False,
    check: bool = True,
) -> list[np.ndarray]:
    """Token ids per item of an `input` or `prompt`: a string, strings, a token list or token
    lists. `check` refuses an item over the model's limit (a prompt is checked by its caller,
    together with the tokens it asks for)."""
    if isinstance(data, str):
        data = [data]
    if not data:
        raise InvalidRequest(f"{field} must not be an empty list", param=field)
    if len(data) > gw.settings.max_inputs_per_request:
        raise InvalidRequest(
            f"{field} has {len(data)} items; the limit is {gw.settings.max_inputs_per_request}",
            param=field,
        )
    if isinstance(data[0], str):
        return await gw.tokenize.encode(model.tokenizer, data, truncate, check)
    lists = [data] if isinstance(data[0], int) else data
    return model.tokenizer.check_token_lists(lists, truncate, check)


def admit_or_refuse(gw: Gateway, model: ModelEntry, n_inputs: int, timeout_ms: int) -> None:
    """Raise Overloaded (503, Retry-After) unless `n_inputs` more entries may be queued."""
    decision = admission.admit(
        # XLEN is up to a refresh old; this gateway's own waiters are counted live.
        admission.QueueState(
            max(model.depth, gw.router.waiting), model.live_workers, model.service_rate_per_s
        ),
        n_inputs,
        gw.settings.max_queue_depth,
        timeout_ms,
    )
    if isinstance(decision, admission.Rejected):
        metrics.rejected_total.labels(decision.reason).inc()
        refused = Overloaded(decision.message, retry_after_s=decision.retry_after_s)
        refused.code = decision.code
        raise refused


async def _submit(
    gw: Gateway,
    request: Request,
    model: ModelEntry,
    inputs: list[np.ndarray],
    timeout_ms: int,
    priority: int,
    request_id: str,
) -> list[EmbeddingResult]:
    admit_or_refuse(gw, model, len(inputs), timeout_ms)
    now_ms = int(time.time() * 1000)
    base = gw.next_id()
    reply_to = gw.router.stream
    items, ids = [], []
    for i, ids_array in enumerate(inputs):
        entry = RequestEntry(
            id=f"{base}.{i}",
            request_id=request_id,
            model=model.info.name,
            kind="embed",
            tokens=pack_tokens(ids_array),
            deadline_ms=now_ms + timeout_ms,
            priority=priority,
            reply_to=reply_to,
            enqueued_ms=now_ms,
        )
        bucket = bucket_for(len(ids_array), gw.settings.buckets) or gw.settings.buckets[-1]
        items.append((gw.keys.request(model.info.name, bucket), encode(entry)))
        ids.append(entry.id)
    futures = [gw.router.expect(i) for i in ids]
    try:
        await gw.enqueuer.add(items)
        replies = await await_replies(request, futures, timeout_ms)
    except ClientGone:
        gw.canceller.cancel(model.info.name, ids, now_ms + timeout_ms)
        raise
    finally:
        gw.router.forget(ids)
    for reply in replies:
        if isinstance(reply, ErrorReply):
            err = MicrobatchError(reply.message)
            err.status, err.type, err.code = reply.status, reply.type, reply.code
            raise err
    return replies


def _embedding_body(req: EmbeddingRequest, model: str, replies: list[EmbeddingResult]) -> bytes:
    data = []
    for i, reply in enumerate(replies):
        vector = reply.vector()
        value = (
            base64.b64encode(reply.embedding).decode()
            if req.encoding_format == "base64"
            else vector
        )
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(r.n_tokens for r in replies)
    body = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _tuning_headers(request_id: str, replies: list[EmbeddingResult]) -> dict[str, str]:
    return {
        "X-Request-ID": request_id,
        "X-Microbatch-Batch-Size": str(max(r.batch_size for r in replies)),
        "X-Microbatch-Bucket": str(max(r.bucket for r in replies)),
        "X-Microbatch-Queue-Ms": f"{max(r.queue_ms for r in replies):.2f}",
        "X-Microbatch-Compute-Ms": f"{sum(r.compute_ms for r in replies):.2f}",
        "X-Microbatch-Worker": ",".join(sorted({r.worker for r in replies})),
        "X-Microbatch-Batch-Id": ",".join(dict.fromkeys(r.batch_id for r in replies)),
    }


@dataclass(slots=True)
class Call:
    """One API call's bookkeeping: what its metrics line and its error answer need."""

    route: str
    request_id: str | None = None
    label: str = "unknown"  # the model, once known


async def api_call(request: Request, route: str, handle) -> Response:
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


async def parse_call(request: Request, call: Call, schema: type, kind: str, elsewhere: str):
    """Request id, API key and rate limit, body, then the model, which must be of `kind`:
    (gateway, body, model name, model entry)."""
    gw: Gateway = request.app.state.gateway
    call.request_id = request_id_of(request)
    authorize(gw, request)
    try:
        req = schema.model_validate_json(await request.body())
    except ValidationError as exc:
        raise validation_error(exc) from None
    name = req.model or gw.settings.model
    model = await model_entry(gw, name)
    call.label = name
    if model.info.kind != kind:
        raise InvalidRequest(
            f"model {name!r} is a {model.info.kind} model, not {kind}; use {elsewhere}",
            param="model",
        )
    return gw, req, name, model


async def embeddings(request: Request) -> Response:
    return await api_call(request, "/v1/embeddings", lambda call: _embed(request, call))


async def _embed(request: Request, call: Call) -> Response:
    gw, req, name, model = await parse_call(
        request, call, EmbeddingRequest, "embedding", "/v1/completions"
    )
    if req.dimensions is not None and req.dimensions != model.info.dim:
        raise InvalidRequest(
            f"dimensions {req.dimensions} is not supported; {name} gives {model.info.dim}",
            param="dimensions",
        )
    request_id = call.request_id
    timeout_ms = timeout_ms_of(request, gw.settings.request_timeout_ms)
    inputs = await token_lists(gw, model, req.input, truncate=req.truncate)
    replies = await _submit(
        gw, request, model, inputs, timeout_ms, priority_of(request), request_id
    )
    body = _embedding_body(req, name, replies)
    return Response(body, 200, _tuning_headers(request_id, replies), media_type="application/json")


def _models_body(gw: Gateway) -> dict:
    data = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "microbatch",
            "kind": entry.info.kind,
            "dim": entry.info.dim,
            "max_tokens": entry.info.max_tokens,
            "workers": entry.live_workers,
            "queue_depth": entry.depth,
        }
        for name, entry in sorted(gw.catalog.models.items())
        if entry.live_workers > 0
    ]
    return {"object": "list", "data": data}


def _install_routes(app: GatewayApp) -> None:
    from gateway.chat import chat_completions
    from gateway.completions import COMPLETIONS_SCHEMA, completions
    from gateway.schemas import ChatCompletionRequest

    app.add_hot_route(
        "/v1/chat/completions",
        chat_completions,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": ChatCompletionRequest.model_json_schema()}
                },
            }
        },
        summary="Create chat completions (OpenAI-compatible; the model's chat template)",
    )

    app.add_hot_route(
        "/v1/completions",
        completions,
        openapi_extra=COMPLETIONS_SCHEMA,
        summary="Create completions (OpenAI-compatible; stream: true for SSE)",
    )
    app.add_hot_route(
        "/v1/embeddings",
        embeddings,
        openapi_extra=EMBEDDINGS_SCHEMA,
        summary="Create embeddings (OpenAI-compatible)",
    )

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        try:
            check_api_key(request.headers.get("authorization"), gw.settings.api_keys)
        except MicrobatchError as exc:
            return error_response(exc, None)
        return Response(orjson.dumps(_models_body(gw)), media_type="application/json")

    @app.get("/healthz")
    async def healthz(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        status = 200 if gw.alive else 503
        return Response(
            orjson.dumps({"status": "ok" if gw.alive else "failed"}),
            status,
            media_type="application/json",
        )

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        await gw.catalog.refresh()
        models = {name: e.live_workers for name, e in gw.catalog.models.items()}
        ready = gw.alive and gw.catalog.redis_ok and bool(models) and all(models.values())
        body = {
            "ready": ready,
            "redis": gw.catalog.redis_ok,
            "reply_reader": gw.alive,
            "models": {n: {"live_workers": w} for n, w in models.items()},
        }
        return Response(orjson.dumps(body), 200 if ready else 503, media_type="application/json")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_error(exc), request.headers.get("x-request-id"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        err = InvalidRequest(str(exc.detail))
        err.status = exc.status_code
        err.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(err, request.headers.get("x-request-id"))

    @app.exception_handler(MicrobatchError)
    async def on_error(request: Request, exc: MicrobatchError) -> Response:
        return error_response(exc, request.headers.get("x-request-id"))


def create_app(settings: Settings, store: Store) -> GatewayApp:
    gateway = Gateway(settings, store)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.catalog.refresh()
        tasks = [
            spawn_supervised(
                "reply-reader", gateway.router.run(gateway.stop), gateway.on_task_death
            ),
            spawn_supervised("catalog", gateway.catalog.run(gateway.stop), gateway.on_task_death),
        ]
        try:
            yield
        finally:
            gateway.stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            gateway.tokenize.close()

    app = GatewayApp(
        title="microbatch",
        version="0.1.0",
        lifespan=lifespan,
        max_body_bytes=settings.max_body_bytes,
        on_error=lambda exc: error_response(exc, None),
    )
    app.state.gateway = gateway
    _install_routes(app)
    _install_error_handlers(app)
    return app
