"""The operational routes: `/v1/models`, `/healthz`, `/readyz` and Prometheus `/metrics`."""

from __future__ import annotations

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import REGISTRY
from prometheus_client.exposition import choose_encoder

from common.errors import MicrobatchError, ModelNotFound, RouteNotFound
from common.protocol import ModelKind
from gateway.admin import on_admin_port
from gateway.catalog import ModelEntry
from gateway.request import error_response
from gateway.services import Services

READY_FRESH_S = 1.0  # a probe's news is at most this old (the kubelet's period is 10 s)


def _model_object(name: str, entry: ModelEntry) -> dict:
    info = entry.info
    extra: dict = {}
    if info.kind == ModelKind.CLASSIFIER:
        extra = {"labels": info.labels}
    elif info.kind == ModelKind.EMBEDDING:
        extra = {"matryoshka": info.matryoshka, "prompts": sorted(info.prompts)}
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "microbatch",
        "kind": entry.info.kind,
        "dim": entry.info.dim,
        "max_tokens": entry.info.max_tokens,
        "workers": entry.live_workers,
        "queue_depth": entry.depth,
        **extra,
    }


def _served(services: Services) -> dict[str, ModelEntry]:
    """The models a live worker serves now."""
    return {n: e for n, e in sorted(services.catalog.models.items()) if e.live_workers > 0}


async def models(request: Request) -> Response:
    services: Services = request.app.state.services
    try:
        services.authenticate(request.headers.get("authorization"))
    except MicrobatchError as exc:
        return error_response(exc, None)
    data = [_model_object(name, entry) for name, entry in _served(services).items()]
    body = orjson.dumps({"object": "list", "data": data})
    return Response(body, media_type="application/json")


async def model(request: Request) -> Response:
    """`GET /v1/models/{id}`: one served model, or 404 model_not_found."""
    services: Services = request.app.state.services
    name = request.path_params["model_id"]
    try:
        services.authenticate(request.headers.get("authorization"))
        entry = _served(services).get(name)
        if entry is None:
            raise ModelNotFound(f"model {name!r} is not served here", param="model")
    except MicrobatchError as exc:
        return error_response(exc, None)
    return Response(orjson.dumps(_model_object(name, entry)), media_type="application/json")


async def healthz(request: Request) -> Response:
    """Alive while every background task is: a dead reply reader fails it, for a restart."""
    alive = request.app.state.services.alive
    body = orjson.dumps({"status": "ok" if alive else "failed"})
    return Response(body, 200 if alive else 503, media_type="application/json")


async def readyz(request: Request) -> Response:
    """Ready when this gateway can take requests: Redis answers, its background tasks live,
    and some model is known. A model with no live worker does not make it unready: it may
    have scaled to zero, and its requests wake a worker (scale from zero); each model's own
    readiness is in the body, and at `/readyz/{model}`. The catalog is read as it stands,
    refreshed (single flight) only when older than `READY_FRESH_S`, so a burst of probes
    costs Redis one read and a probe never waits behind a queue of refreshes."""
    services: Services = request.app.state.services
    catalog = services.catalog
    await catalog.refresh_soon(READY_FRESH_S)
    workers = {name: e.live_workers for name, e in catalog.models.items()}
    ready = services.alive and catalog.redis_ok and bool(workers)
    body = {
        "ready": ready,
        "redis": catalog.redis_ok,
        "reply_reader": services.alive,
        "models": {n: {"live_workers": w, "ready": w > 0} for n, w in workers.items()},
    }
    return Response(orjson.dumps(body), 200 if ready else 503, media_type="application/json")


async def model_readyz(request: Request) -> Response:
    """One model's readiness: 200 while a live worker serves it (404 for a model never
    registered); what a load balancer per model, or a script waiting for workers, asks."""
    services: Services = request.app.state.services
    catalog = services.catalog
    await catalog.refresh_soon(READY_FRESH_S)
    name = request.path_params["model_id"]
    entry = catalog.models.get(name)
    if entry is None:
        return error_response(ModelNotFound(f"model {name!r} is not known here"), None)
    ready = services.alive and catalog.redis_ok and entry.live_workers > 0
    body = {"model": name, "ready": ready, "live_workers": entry.live_workers}
    return Response(orjson.dumps(body), 200 if ready else 503, media_type="application/json")


async def prometheus(request: Request) -> Response:
    """With an admin port, only there (open: reach it only from inside); else on the API
    port, behind the API key when keys are set (Prometheus sends it as a bearer token)."""
    services: Services = request.app.state.services
    settings = services.settings
    try:
        if settings.admin_port is not None:
            if not on_admin_port(request.scope, settings.admin_port):
                raise RouteNotFound(f"/metrics is served on the admin port {settings.admin_port}")
        else:
            services.authenticate(request.headers.get("authorization"))
    except MicrobatchError as exc:
        return error_response(exc, None)
    # OpenMetrics when the scraper asks for it: the format that carries exemplars
    encoder, content_type = choose_encoder(request.headers.get("accept"))
    return Response(encoder(REGISTRY), headers={"Content-Type": content_type})


def install(app: FastAPI) -> None:
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route("/readyz", readyz, methods=["GET"])
    app.add_api_route("/readyz/{model_id:path}", model_readyz, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
