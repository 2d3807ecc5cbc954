"""`create_app`: the gateway's composition root — services, routes, error handlers, lifespan.

Nothing imports it but the CLI. The request path lives in the routes (`gateway/routes/`),
`request` (reading a call) and `submit` (queueing and waiting); the collaborators they share
are `Services`, on `app.state.services`, started and stopped with the app's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from opentelemetry.trace import Tracer
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.errors import MicrobatchError, error_for_http_status
from common.protocol import ModelKind
from common.settings import Settings
from common.store import Store
from common.tasks import spawn_supervised
from common.tenants import Tenants
from gateway.admin import on_admin_port
from gateway.batch_feeder import BatchFeeder
from gateway.batch_gate import DepthGate
from gateway.batch_run import BatchRun, RunLimits
from gateway.hot_path import GatewayApp
from gateway.idempotency import Idempotency
from gateway.local_call import post_local
from gateway.request import default_name, error_response, timeout_ms_of, validation_error
from gateway.routes import (
    batches,
    chat,
    classify,
    completions,
    embeddings,
    files,
    ops,
    rerank,
    responses,
    tei,
    tokens,
)
from gateway.services import Services
from gateway.tenant_watch import TenantsWatch

# The API's POST routes, served on the hot path: (path, handler, OpenAPI body, summary)
HOT_ROUTES = (
    (
        chat.ROUTE,
        chat.chat_completions,
        chat.SCHEMA,
        "Create chat completions (OpenAI-compatible; the model's chat template)",
    ),
    (
        responses.ROUTE,
        responses.create,
        responses.SCHEMA,
        "Create a model response (OpenAI's Responses API; stored, background, resumable)",
    ),
    (
        completions.ROUTE,
        completions.completions,
        completions.SCHEMA,
        "Create completions (OpenAI-compatible; stream: true for SSE)",
    ),
    (
        embeddings.ROUTE,
        embeddings.embeddings,
        embeddings.SCHEMA,
        "Create embeddings (OpenAI-compatible)",
    ),
    (
        tokens.TOKENIZE,
        tokens.tokenize,
        tokens.TOKENIZE_SCHEMA,
        "Token ids of a prompt or of chat messages (vLLM's shape)",
    ),
    (tokens.DETOKENIZE, tokens.detokenize, tokens.DETOKENIZE_SCHEMA, "Text of token ids"),
    (rerank.V1, rerank.rerank_v1, rerank.SCHEMA, "Rerank documents (Jina's and vLLM's shape)"),
    (rerank.V2, rerank.rerank_v2, rerank.SCHEMA, "Rerank documents (Cohere's v2 shape)"),
    (
        rerank.BOTH,
        rerank.rerank,
        rerank.SCHEMA,
        "Rerank: `documents` in Jina's shape, `texts` in TEI's (answered as TEI answers)",
    ),
    (classify.CLASSIFY, classify.classify, classify.CLASSIFY_SCHEMA, "Classify (vLLM's shape)"),
    (classify.PREDICT, classify.predict, classify.PREDICT_SCHEMA, "Classify (TEI's shape)"),
    (tei.EMBED, tei.embed, tei.EMBED_SCHEMA, "Embeddings (TEI's shape)"),
    (tei.DECODE, tei.decode, tei.DECODE_SCHEMA, "Text of token ids (TEI's shape)"),
    (tei.ROOT, tei.root, tei.EMBED_SCHEMA, "TEI's root: /embed or /predict by the model's kind"),
)


def _install_routes(app: GatewayApp) -> None:
    for path, handler, body, summary in HOT_ROUTES:
        app.add_hot_route(path, handler, openapi_extra=body, summary=summary)
    ops.install(app)
    files.install(app)
    batches.install(app)
    responses.install(app)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_error(exc), request.headers.get("x-request-id"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        err = error_for_http_status(exc.status_code, str(exc.detail))
        return error_response(err, request.headers.get("x-request-id"))

    @app.exception_handler(MicrobatchError)
    async def on_error(request: Request, exc: MicrobatchError) -> Response:
        return error_response(exc, request.headers.get("x-request-id"))


ENDPOINT_KINDS = {
    "/v1/embeddings": ModelKind.EMBEDDING,
    "/v1/chat/completions": ModelKind.CAUSAL_LM,
    "/v1/completions": ModelKind.CAUSAL_LM,
    "/v1/rerank": ModelKind.CLASSIFIER,
}


def _batch_feeder(services: Services, app: GatewayApp) -> BatchFeeder:
    """The Batch API's driver: each line is posted to this very app, in process."""
    settings = services.settings
    limits = RunLimits(
        window=settings.batch_window,
        max_lines=settings.max_batch_lines,
        max_timeout_ms=settings.max_request_timeout_ms,
        output_ttl_s=settings.batch_output_ttl_s,
    )

    def model_name(endpoint: str, name: str | None) -> str:
        return name or default_name(services, ENDPOINT_KINDS[endpoint])

    def model_problem(endpoint: str, name: str | None) -> str | None:
        kind = ENDPOINT_KINDS[endpoint]
        try:
            name = model_name(endpoint, name)
        except MicrobatchError as exc:
            return exc.message
        entry = services.catalog.models.get(name)
        if entry is None:
            return f"model {name!r} is not served here"
        if entry.info.kind != kind:
            return f"model {name!r} is a {entry.info.kind} model; {endpoint} needs a {kind} model"
        return None

    post = functools.partial(post_local, app)  # each line through this very app, in process
    gate = DepthGate(services.store, services.keys, settings.buckets, settings.batch_queue_depth)

    def run(batch_id: str, lost: asyncio.Event) -> BatchRun:
        return BatchRun(
            batch_id,
            services.batch_records,
            services.files,
            post,
            model_problem,
            limits,
            lost,
            gate,
            model_name,
        )

    return BatchFeeder(services.batch_records, run, services.id, settings.batch_lease_ms)


def _timeout_ms(scope: dict[str, Any], settings: Settings) -> int:
    """How long a retry waits for the attempt it attached to: the request's own deadline
    (a malformed one is the route's to refuse; the default stands in for it here)."""
    raw = next((v for k, v in scope["headers"] if k == b"x-microbatch-timeout-ms"), None)
    try:
        return timeout_ms_of(
            None if raw is None else raw.decode("latin-1"),
            settings.request_timeout_ms,
            settings.max_request_timeout_ms,
        )
    except MicrobatchError:
        return settings.request_timeout_ms


def _background(
    services: Services, feeder: BatchFeeder
) -> tuple[asyncio.Task[Any], list[asyncio.Task[Any]]]:
    """The gateway's background tasks, the batch feeder apart (it stops first); the death of
    any one fails /healthz."""
    stop = services.stop
    batches = spawn_supervised(
        "batch-feeder",
        feeder.run(services.batches_stop, services.batches_changed),
        services.on_death_of("batch feeder"),
    )
    return batches, [
        spawn_supervised(
            "reply-reader", services.router.run(stop), services.on_death_of("reply reader")
        ),
        spawn_supervised("catalog", services.catalog.run(stop), services.on_death_of("catalog")),
        *(
            [
                spawn_supervised(
                    "tenants-watch", _watch(services, stop), services.on_death_of("tenants watch")
                )
            ]
            if services.settings.tenants
            else []
        ),
        spawn_supervised(
            "response-finisher",
            services.finisher.run(stop),
            services.on_death_of("response finisher"),
        ),
    ]


async def _watch(services: Services, stop: asyncio.Event) -> None:
    """The tenants file read again on change, into the services every call reads."""
    assert services.settings.tenants is not None

    def changed(tenants: Tenants) -> None:
        services.tenants = tenants

    await TenantsWatch(services.settings.tenants, changed).run(stop)


def create_app(settings: Settings, store: Store, tracer: Tracer | None = None) -> GatewayApp:
    """The gateway app; `tracer` traces every API call (None: tracing off)."""
    services = Services(settings, store, tracer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await services.catalog.refresh()
        batches, tasks = _background(services, app.state.feeder)
        try:
            yield
        finally:
            # the batches first, while the reply reader still runs: their drivers hang up
            # on the lines in flight, which need it to end; then everything else
            services.batches_stop.set()
            services.batches_changed.set()  # the feeder waits on it
            await asyncio.gather(batches, return_exceptions=True)
            services.stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            await services.router.leave()
            services.tokenize.close()

    # API docs show every route and field: with keys set, only where the operator says so
    docs = not (settings.api_keys or settings.tenants) or settings.public_docs
    app = GatewayApp(
        title="microbatch",
        version="0.1.0",
        lifespan=lifespan,
        max_body_bytes=settings.max_body_bytes,
        on_error=lambda exc: error_response(exc, None),
        admin=None
        if settings.admin_port is None
        else lambda scope: on_admin_port(scope, settings.admin_port),
        larger_bodies={files.ROUTE: settings.max_file_bytes + 64 * 1024},  # + multipart framing
        idempotency=Idempotency(
            store,
            services.keys,
            services.authenticate,
            settings.idempotency_ttl_s,
            lambda scope: _timeout_ms(scope, settings),
            lambda exc: error_response(exc, None),
        ),
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.services = services
    app.state.feeder = _batch_feeder(services, app)
    _install_routes(app)
    _install_error_handlers(app)
    return app
