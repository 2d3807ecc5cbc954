"""API-key check: constant-time comparison against the configured keys."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from common.errors import PermissionDenied, Unauthorized
from common.tenants import Tenants


def bearer_token(authorization: str | None) -> str:
    """The key an `Authorization: Bearer <key>` header presents; 401 without one."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    return token


def _plain_key(token: str, keys: Sequence[str]) -> str:
    """The configured key the token is; 401 when none is. Never logs keys."""
    matched = None
    for key in keys:  # no early exit: every key is compared
        if hmac.compare_digest(token.encode(), key.encode()):
            matched = key
    if matched is None:
        raise Unauthorized("invalid API key")
    return matched


def check_api_key(authorization: str | None, keys: Sequence[str]) -> str | None:
    """The matching plain key, None when auth is off (no keys); raises Unauthorized
    otherwise."""
    return _plain_key(bearer_token(authorization), keys) if keys else None


def authenticate(
    authorization: str | None, keys: Sequence[str], tenants: Tenants | None
) -> tuple[str | None, str | None]:
    """The matching key and the tenant that holds it (None: a plain `api_keys` entry, or auth
    off). Auth is on when keys are set or a tenants file is (`tenants`, even with no tenant
    in it); raises Unauthorized otherwise. A tenant's key is found by its digest (one hash);
    any other is compared with every plain key."""
    if tenants is None:
        return check_api_key(authorization, keys), None
    token = bearer_token(authorization)
    owner = tenants.of_key(token)
    return (token, owner) if owner is not None else (_plain_key(token, keys), None)


def check_interactive(key: str | None, allowed: Sequence[str]) -> None:
    """Interactive priority jumps every batch request's queue, so with API keys set only the
    keys the operator lists may ask for it (`*`: every key). With no keys there is no one to
    tell apart: a gateway listens beyond loopback that way only by explicit choice."""
    if key is None or "*" in allowed:
        return
    # every listed key compared, as check_api_key does: the time says nothing about the list
    if not any([hmac.compare_digest(key.encode(), k.encode()) for k in allowed]):
        raise PermissionDenied(
            "this API key may not send X-Microbatch-Priority: interactive (interactive_api_keys)",
            param="X-Microbatch-Priority",
        )


class RateLimiter:
    """A token bucket per API key: `rate_per_s` sustained, `burst` at once. Pure: the caller
    passes the clock, so the rule is tested without sleeping."""

    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill time)

    def acquire(self, key: str, now_s: float) -> float:
        """0 when the request may go; otherwise the seconds until a token is available."""
        tokens, last = self._buckets.get(key, (float(self.burst), now_s))
        tokens = min(float(self.burst), tokens + (now_s - last) * self.rate_per_s)
        if tokens >= 1:
            self._buckets[key] = (tokens - 1, now_s)
            return 0.0
        self._buckets[key] = (tokens, now_s)
        return (1 - tokens) / self.rate_per_s


def owner_of(key: str | None) -> str:
    """Who owns a stored file or batch: a digest of the API key (never the key itself, which
    Redis must not hold), or "-" when keys are off."""
    return "-" if key is None else hashlib.sha256(key.encode()).hexdigest()[:32]
