"""One POST through the gateway's own app, in process: how a batch line runs.

A line is the very request a client would send online (the same route, validation,
tokenizing, admission, queue entry and answer), so its result is the one it would get
online, and nothing travels on the network. The call carries the `LOCAL` scope key, which
no client can set: it was authorized when its batch was created, so it asks for no API key.
Setting `gone` is the client hanging up: the route cancels what it queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LOCAL = "microbatch.local"  # scope key: a call made inside this process


@dataclass(frozen=True, slots=True)
class LocalAnswer:
    status: int
    body: bytes


async def post_local(
    app: Any, path: str, body: bytes, headers: Mapping[str, str], gone: asyncio.Event
) -> LocalAnswer:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        + [(b"content-length", str(len(body)).encode())],
        "client": None,
        "server": None,
        "state": {},
        LOCAL: True,
    }
    delivered = False
    status = 500
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return LocalAnswer(status, b"".join(chunks))
