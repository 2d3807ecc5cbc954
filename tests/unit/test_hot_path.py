"""`GatewayApp`'s direct dispatch of hot POST routes: same answers as FastAPI would give."""

from __future__ import annotations

import asyncio

import httpx
import orjson
from fastapi import Request
from fastapi.responses import Response

from common.errors import InvalidRequest, MicrobatchError
from gateway.hot_path import GatewayApp

LIMIT = 64


def _error(exc: MicrobatchError) -> Response:
    return Response(orjson.dumps(exc.body()), exc.status, media_type="application/json")


def _app() -> GatewayApp:
    app = GatewayApp(max_body_bytes=LIMIT, on_error=_error)

    async def echo(request: Request) -> Response:
        body = await request.body()
        return Response(body, 200, {"X-App": str(request.app is app)})

    async def broken(request: Request) -> Response:
        raise RuntimeError("a bug")

    async def refuses(request: Request) -> Response:
        return _error(InvalidRequest("no"))

    app.add_hot_route("/echo", echo)
    app.add_hot_route("/broken", broken)
    app.add_hot_route("/refuses", refuses)

    @app.middleware("http")
    async def mark(request: Request, call_next):
        response = await call_next(request)
        response.headers["X-Via-FastAPI"] = "1"
        return response

    @app.get("/plain")
    async def plain() -> dict:
        return {"ok": True}

    return app


def _call(method: str, path: str, app: GatewayApp | None = None, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app or _app(), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_a_hot_post_reaches_its_handler_with_the_app_on_the_request() -> None:
    r = _call("POST", "/echo", content=b"hello")
    assert (r.status_code, r.content, r.headers["x-app"]) == (200, b"hello", "True")
    assert "x-via-fastapi" not in r.headers  # none of FastAPI's per-request layers ran


def test_a_bug_in_a_hot_handler_is_a_json_500_not_a_dropped_connection() -> None:
    r = _call("POST", "/broken", content=b"{}")
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"


def test_the_body_limit_guards_hot_routes_by_length_and_while_streaming() -> None:
    declared = _call("POST", "/echo", content=b"x" * (LIMIT + 1))
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == "input_too_long"

    async def chunks():
        for _ in range(4):
            yield b"x" * (LIMIT // 2)

    streamed = _call("POST", "/echo", content=chunks())
    assert streamed.status_code == 413


def test_other_methods_and_routes_still_go_through_fastapi() -> None:
    app = _app()
    assert _call("GET", "/echo", app).status_code == 405
    plain = _call("GET", "/plain", app)
    assert plain.json() == {"ok": True} and plain.headers["x-via-fastapi"] == "1"
    assert _call("POST", "/nowhere", app).status_code == 404
    assert "/echo" in app.openapi()["paths"]


def test_a_mount_point_is_stripped_before_matching() -> None:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=_app(), root_path="/api")
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/api/refuses", content=b"{}")

    r = asyncio.run(go())
    assert r.status_code == 400 and "x-via-fastapi" not in r.headers
