"""`GatewayApp`: FastAPI, except that the API's POST routes skip its per-request machinery.

Under load the gateway is CPU-bound, and FastAPI's generic path — routing over every route,
dependency solving (which parses the query string for a handler that takes only the
request), telemetry, two exception layers and two exit stacks — took about a third of the
gateway's CPU per embedding request (py-spy under wrk, `noop` worker). The hot handlers
already take a plain `Request` and return a `Response`, so they need none of it: a POST to
one of their paths goes straight to the handler, behind the same body limit. FastAPI still
registers the routes (the OpenAPI schema, other methods' 405s) and serves everything else.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from common.errors import InternalError, MicrobatchError, RouteNotFound
from gateway.admin import ADMIN_PATHS
from gateway.limits import BodyLimitMiddleware, BodyTooLarge

log = logging.getLogger("microbatch.gateway")

Handler = Callable[[Request], Awaitable[Response]]
INTERNAL_ERROR = "internal error; the gateway log has the details"


class _HandlerApp:
    """One handler as a bare ASGI app; a bug in it is a JSON 500, as everywhere else."""

    def __init__(self, handler: Handler, on_error: Callable[[MicrobatchError], Response]) -> None:
        self.handler = handler
        self.on_error = on_error

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            response = await self.handler(Request(scope, receive, send))
        except BodyTooLarge:
            raise  # the body limit around us answers it
        except Exception:
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            response = self.on_error(InternalError(INTERNAL_ERROR))
        await response(scope, receive, send)


class GatewayApp(FastAPI):
    def __init__(
        self,
        *args: Any,
        max_body_bytes: int,
        on_error: Callable[[MicrobatchError], Response],
        admin: Callable[[dict], bool] | None = None,
        larger_bodies: dict[str, int] | None = None,
        idempotency: Idempotent | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._max_body_bytes = max_body_bytes
        self._on_error = on_error
        self._admin = admin  # whether a connection came in on the admin port; None: no port
        self._hot: dict[str, Any] = {}
        self.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, larger=larger_bodies)
        # a POST with an Idempotency-Key: its body read (within the same limits) to tell a
        # retry from another request, then dispatched as any other
        self._idempotent = (
            None
            if idempotency is None
            else BodyLimitMiddleware(
                _Idempotent(idempotency, self._dispatch), max_body_bytes, larger_bodies
            )
        )

    def openapi(self) -> dict[str, Any]:
        """FastAPI's document, with each hot route's body definitions (`$defs`, which a
        pydantic schema carries inside itself) moved to `components/schemas`, where a
        `$ref` in an OpenAPI document resolves: clients and fuzzers read the bodies whole."""
        if self.openapi_schema is None:
            spec = super().openapi()
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            for operations in spec.get("paths", {}).values():
                for operation in operations.values():
                    body = operation.get("requestBody", {}).get("content", {})
                    for media in body.values():
                        _merge(schemas, media.get("schema", {}).pop("$defs", {}))
            self.openapi_schema = _components_refs(spec)
        return self.openapi_schema

    def add_hot_route(self, path: str, handler: Handler, **route_kwargs: Any) -> None:
        """A POST route served straight from `__call__`; FastAPI keeps it for its schema."""
        self.add_api_route(path, handler, methods=["POST"], **route_kwargs)
        app = _HandlerApp(handler, self._on_error)
        self._hot[path] = BodyLimitMiddleware(app, max_bytes=self._max_body_bytes)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        admin = self._admin
        if admin is not None and scope["type"] == "http" and admin(scope):
            if scope["path"] in ADMIN_PATHS:
                await super().__call__(scope, receive, send)
                return
            error = RouteNotFound("the admin port serves /metrics, /healthz and /readyz only")
            await self._on_error(error)(scope, receive, send)
            return
        if (
            self._idempotent is not None
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and any(name == b"idempotency-key" for name, _ in scope["headers"])
        ):
            await self._idempotent(scope, receive, send)
            return
        await self._dispatch(scope, receive, send)

    async def _dispatch(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self._hot.get(_route_path(scope))
            if route is not None:
                scope["app"] = self
                await route(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


Idempotent = Callable[
    [dict, Any, Any, Callable[[dict, Any, Any], Awaitable[None]]], Awaitable[None]
]


class _Idempotent:
    """The idempotency layer as an ASGI app around the dispatch."""

    def __init__(self, layer: Idempotent, dispatch: Callable[..., Awaitable[None]]) -> None:
        self.layer, self.dispatch = layer, dispatch

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.layer(scope, receive, send, self.dispatch)


def _merge(schemas: dict[str, Any], definitions: dict[str, Any]) -> None:
    """Body definitions into the document's one namespace: two bodies that name different
    models alike would point each other's references at the wrong one (a Responses
    `FunctionTool` once replaced chat's), so that fails here, at the first `/openapi.json`."""
    for name, definition in definitions.items():
        if schemas.setdefault(name, definition) != definition:
            raise RuntimeError(f"two request bodies define different schemas named {name!r}")


def _components_refs(node: Any, in_mapping: bool = False) -> Any:
    """Every `#/$defs/X` reference as `#/components/schemas/X`: a `$ref`, and each value of
    a discriminator's `mapping` (a tagged union's members)."""
    if isinstance(node, dict):
        return {
            key: value.replace("#/$defs/", "#/components/schemas/", 1)
            if (key == "$ref" or in_mapping) and isinstance(value, str)
            else _components_refs(value, key == "mapping")
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_components_refs(item) for item in node]
    return node


def _route_path(scope: dict) -> str:
    """The path below the app's mount point, as Starlette's router matches it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path
