"""`Idempotency-Key` on every POST: a retry gets the first attempt's answer, not a second one.

The header Stripe's and OpenAI's clients send (the IETF httpapi draft's): the first request
with a key runs and its answer is kept in Redis (`idempotency_ttl_s`), byte for byte, ids
and streamed events included; a retry with the same key and the same request attaches to
the one in flight or replays the kept answer (`Idempotent-Replayed: true`). The same key on
another request is a 422 (the draft's choice), and a retry still waiting when its own
deadline comes is a 409 with `Retry-After`. Keys are per API key, so tenants never collide.
Only final answers are kept: 2xx and 4xx but 408, 409, 425, 429 and 499, whose retry should run
again, as should a 5xx's; an answer cut short because its client left is not kept either.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from common import metrics
from common.errors import Conflict, InvalidBody, InvalidRequest, MicrobatchError
from common.keys import Keys
from common.store import Store
from gateway.auth import owner_of

ASGI = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
ErrorAnswer = Callable[[MicrobatchError], Any]  # an error as an ASGI response

POLL_S = 0.02  # how often a retry looks whether the attempt it attached to has ended
RUNNING_GRACE_MS = 10_000  # a running record outlives its request's deadline this long
NOT_KEPT = (408, 409, 425, 429, 499)
SKIPPED_HEADERS = (b"date", b"server")
MAX_KEY = 255


@dataclass(frozen=True, slots=True)
class Attempt:
    fingerprint: str
    running: bool
    status: int = 0
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""

    def pack(self) -> bytes:
        packed: bytes = msgpack.packb(
            [
                self.fingerprint,
                self.running,
                self.status,
                [list(h) for h in self.headers],
                self.body,
            ]
        )
        return packed

    @classmethod
    def unpack(cls, raw: bytes) -> Attempt:
        fingerprint, running, status, headers, body = msgpack.unpackb(raw)
        return cls(fingerprint, running, status, tuple(tuple(h) for h in headers), body)


def keepable(status: int) -> bool:
    """Whether a retry should get this answer again rather than run anew."""
    return 200 <= status < 500 and status not in NOT_KEPT


def idempotency_key(raw: bytes) -> str:
    key = raw.decode("latin-1")
    if not 0 < len(key) <= MAX_KEY or not key.isprintable() or not key.isascii():
        raise InvalidRequest(
            f"Idempotency-Key must be 1..{MAX_KEY} printable ASCII characters",
            param="Idempotency-Key",
        )
    return key


class Idempotency:
    """Wraps the app's POST dispatch for requests that carry an `Idempotency-Key`."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        authenticate: Callable[[str | None], tuple[str | None, str | None]],
        ttl_s: int,
        timeout_ms: Callable[[dict[str, Any]], int],
        on_error: ErrorAnswer,
    ) -> None:
        self._store, self._keys, self._authenticate = store, keys, authenticate
        self._ttl_s, self._timeout_ms, self._on_error = ttl_s, timeout_ms, on_error

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any, app: ASGI) -> None:
        headers = dict(scope["headers"])
        try:
            key = idempotency_key(headers[b"idempotency-key"])
            authorization = headers.get(b"authorization", b"").decode("latin-1") or None
            owner = owner_of(self._authenticate(authorization)[0])
        except MicrobatchError as exc:
            if exc.status == 401:
                await app(scope, receive, send)  # the route answers a bad key as always
            else:
                await self._on_error(exc)(scope, receive, send)
            return
        body = await _read_body(receive)
        fingerprint = _fingerprint(scope, body)
        record = self._keys.idempotency(owner, hashlib.sha256(key.encode()).hexdigest()[:32])
        deadline = time.monotonic() + self._timeout_ms(scope) / 1000
        while True:
            running = Attempt(fingerprint, running=True).pack()
            lease_ms = self._timeout_ms(scope) + RUNNING_GRACE_MS
            if await self._store.set(record, running, nx=True, px=lease_ms):
                await self._run(scope, body, receive, send, app, record, fingerprint)
                return
            raw = await self._store.get(record)
            if raw is None:
                continue  # it ended unkept (a 5xx) or expired between the two calls
            found = Attempt.unpack(raw)
            if found.fingerprint != fingerprint:
                metrics.idempotent_requests_total.labels("mismatch").inc()
                error = InvalidBody(
                    "this Idempotency-Key was used with a different request",
                    param="Idempotency-Key",
                    code="idempotency_key_reused",
                )
                await self._on_error(error)(scope, receive, send)
                return
            if not found.running:
                metrics.idempotent_requests_total.labels("replayed").inc()
                await _replay(found, send)
                return
            if time.monotonic() >= deadline:
                metrics.idempotent_requests_total.labels("conflict").inc()
                conflict = Conflict(
                    "a request with this Idempotency-Key is still in progress",
                    retry_after_s=1.0,
                    code="idempotency_key_in_progress",
                )
                await self._on_error(conflict)(scope, receive, send)
                return
            await asyncio.sleep(POLL_S)

    async def _run(
        self,
        scope: dict[str, Any],
        body: bytes,
        receive: Any,
        send: Any,
        app: ASGI,
        record: str,
        fingerprint: str,
    ) -> None:
        """The first attempt: run it, pass its answer on as it comes, then keep it (or let
        the next retry run again)."""
        metrics.idempotent_requests_total.labels("computed").inc()
        status, headers, chunks = 0, [], []
        complete = gone = False
        delivered = False

        async def replayed_receive() -> dict[str, Any]:
            nonlocal delivered, gone
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            message: dict[str, Any] = await receive()
            # after the answer is whole, a server reports every receive as a disconnect
            gone = gone or (message["type"] == "http.disconnect" and not complete)
            return message

        async def capturing_send(message: dict[str, Any]) -> None:
            nonlocal status, headers, complete
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k not in SKIPPED_HEADERS
                ]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                complete = not message.get("more_body", False)
            await send(message)

        kept = False
        try:
            await app(scope, replayed_receive, capturing_send)
            if complete and not gone and keepable(status):
                done = Attempt(fingerprint, False, status, tuple(headers), b"".join(chunks))
                await self._store.set(record, done.pack(), ex=self._ttl_s)
                kept = True
        finally:
            if not kept:
                await self._store.delete(record)


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _fingerprint(scope: dict[str, Any], body: bytes) -> str:
    digest = hashlib.sha256()
    for part in (scope["method"].encode(), scope["path"].encode(), scope.get("query_string", b"")):
        digest.update(part + b"\0")
    digest.update(body)
    return digest.hexdigest()


async def _replay(found: Attempt, send: Any) -> None:
    headers = [*found.headers, (b"idempotent-replayed", b"true")]
    await send({"type": "http.response.start", "status": found.status, "headers": headers})
    await send({"type": "http.response.body", "body": found.body, "more_body": False})
