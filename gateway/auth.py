"""API-key check: constant-time comparison against the configured keys."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence

from common.errors import PermissionDenied, Unauthorized


def check_api_key(
    authorization: str | None,
    keys: Sequence[str],
    held: Callable[[str], bool] | None = None,
) -> str | None:
    """The matching key, None when auth is off; raises Unauthorized otherwise. Never logs keys.
    `held` says whether a tenant holds a key (by its digest); with it, auth is on."""
    if not keys and held is None:
        return None
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    matched = None
    for key in keys:  # no early exit: every key is compared
        if hmac.compare_digest(token.strip().encode(), key.encode()):
            matched = key
    if matched is None and held is not None and held(token.strip()):
        matched = token.strip()
    if matched is None:
        raise Unauthorized("invalid API key")
    return matched


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
