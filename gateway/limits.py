"""Request-body limit enforced while the body streams in, chunked bodies included."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from common.errors import InputTooLong

ASGIApp = Any


class BodyLimitMiddleware:
    """413 before a byte past the limit is buffered: Content-Length first, then a running count.
    `larger` gives paths their own limit (a file upload's is a file's, not a request's)."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, larger: Mapping[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = dict(larger or {})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.larger.get(scope["path"], self.max_bytes) if self.larger else self.max_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await self._reject(send, int(value), limit)
                return
        seen = 0
        started = False

        async def counting_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(seen)
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as exc:
            if not started:
                await self._reject(send, exc.seen, limit)

    async def _reject(self, send: Any, size: int, limit: int) -> None:
        error = InputTooLong(f"request body of {size}+ bytes exceeds the limit of {limit} bytes")
        body = orjson.dumps(error.body())
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class BodyTooLarge(Exception):
    """Raised out of `receive` past the limit; the middleware answers it with a 413."""

    def __init__(self, seen: int) -> None:
        self.seen = seen
