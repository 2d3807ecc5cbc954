"""API-key check: constant-time comparison against the configured keys."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from common.errors import Unauthorized


def check_api_key(authorization: str | None, keys: Sequence[str]) -> str | None:
    """The matching key, None when auth is off; raises Unauthorized otherwise. Never logs keys."""
    if not keys:
        return None
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    matched = None
    for key in keys:  # no early exit: every key is compared
        if hmac.compare_digest(token.strip().encode(), key.encode()):
            matched = key
    if matched is None:
        raise Unauthorized("invalid API key")
    return matched
